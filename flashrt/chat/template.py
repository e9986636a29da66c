"""Chat templates: a checkpoint's own jinja template, rendered exactly as transformers'
`apply_chat_template` renders it, and the message preparation an agent's tool loop needs.

Rendering (ChatTemplate.render) reproduces transformers (checked against prompts it rendered, in
tests/golden/chat/): a sandboxed jinja environment with trim_blocks and lstrip_blocks, the
loopcontrols extension and a `{% generation %}` tag, its `tojson` (non-ASCII kept, indent /
separators / sort_keys accepted), `raise_exception`, `strftime_now`, `dict` and a `namespace`
that refuses underscore names; message keys whose value is None dropped; `reasoning_content`
filled from `reasoning` or `thinking`; the tokenizer's named special tokens (bos_token, ...) and
the caller's template kwargs passed as variables, with `messages`, `tools`, `documents` and
`add_generation_prompt`. A checkpoint with several named templates uses "tool_use" when tools
are given, else "default".

A checkpoint without a template gets the PLAIN one, one line per message and an open
assistant line ("system: You are terse.\\nuser: Hi\\nassistant: "); it cannot render tools.

prepare_messages turns what OpenAI clients send back in a tool loop into what the released
templates need, so that rendering an agent's next step repeats the tokens of the last one
(prefix-stable): assistant `content: null` -> "", `arguments` JSON strings -> objects (the
model wrote them with json.dumps spacing, which `tojson` repeats), Qwen3.5's top-level
true/false/null -> the strings "true"/"false"/"null" (its template writes other values with
`| string`, which would give Python's True/None), and for LFM2, whose template reads only
`content`, the calls written back into content as the model writes them. Reasoning stays under
`reasoning_content`, where the Qwen templates read it. Two renders stay unstable whatever is
sent (tests/test_chat_template.py): a client that drops the reasoning of an earlier call gets
that assistant message rendered without its thought, so a session keeps the prompt up to where
that message's generated text began and prefills its call and the tool results again; and
Qwen3's template writes the empty think block of `enable_thinking=false` only in the generation
prompt, never for an earlier message, so each step is prefilled again from that block.

Reasoning effort (template_kwargs): OpenAI's `reasoning_effort` maps to the `enable_thinking`
switch the Qwen templates read, as vLLM / llama.cpp users set it through `chat_template_kwargs`:
"none" and "minimal" turn thinking off, "low", "medium", "high" and "xhigh" turn it on; the
value itself is passed on as `reasoning_effort` (templates with effort levels read it). An
explicit `chat_template_kwargs.enable_thinking` that disagrees is refused.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from .formats import PLAIN as PLAIN_FORMAT
from .formats import detect_format

PLAIN = "plain"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")   # transformers' named special tokens, passed to every template
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")   # the first is what templates read
RESERVED_KWARGS = ("messages", "tools", "documents", "add_generation_prompt")
EFFORT_THINKING = {"none": False, "minimal": False, "low": True, "medium": True, "high": True,
                   "xhigh": True}
ROLES = ("system", "developer", "user", "assistant", "tool")
FAMILIES = ("qwen3", "qwen3_5", "lfm2", "plain")     # formats.py's ChatFormat names


class ChatTemplate:
    """The chat template of the checkpoint in model_dir (chat_template.jinja and
    chat_templates/*.jinja, else tokenizer_config.json's "chat_template"), or PLAIN.
    kind: "checkpoint" or "plain"; format: the ChatFormat its source writes (formats.py)."""

    def __init__(self, model_dir):
        d = Path(model_dir)
        tc = d / "tokenizer_config.json"
        cfg = json.loads(tc.read_text()) if tc.exists() else {}
        sources = {}
        if (d / "chat_template.jinja").exists():
            sources["default"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
        for p in sorted((d / "chat_templates").glob("*.jinja")) if (d / "chat_templates").is_dir() else ():
            sources[p.stem] = p.read_text(encoding="utf-8")
        if not sources:
            src = cfg.get("chat_template")
            if isinstance(src, list):          # [{name, template}], as tokenizer_config stores several
                sources = {t["name"]: t["template"] for t in src}
            elif isinstance(src, str):
                sources = {"default": src}
        self._setup(sources, {k: _token_text(cfg.get(k)) for k in SPECIAL_TOKENS})

    @classmethod
    def from_source(cls, source: str | None, special_tokens: dict | None = None) -> "ChatTemplate":
        """A template from its source text (None: PLAIN); special_tokens: {"bos_token": ...}."""
        self = cls.__new__(cls)
        self._setup({"default": source} if source is not None else {}, dict(special_tokens or {}))
        return self

    def _setup(self, sources: dict, special: dict) -> None:
        self.kind = "checkpoint" if sources else PLAIN
        self.special_tokens = {k: v for k, v in special.items() if v is not None}
        env = _environment() if sources else None
        self._compiled = {name: env.from_string(src) for name, src in sources.items()}
        main = sources.get("default", next(iter(sources.values()), None))
        self.format = detect_format(main) if main is not None else PLAIN_FORMAT

    @property
    def family(self) -> str:
        """The name prepare_messages takes: "qwen3", "qwen3_5", "lfm2" or "plain"."""
        return self.format.name

    def render(self, messages: list[dict], add_generation_prompt: bool = True, *,
               tools: list | None = None, documents: list | None = None,
               template_kwargs: dict | None = None) -> str:
        """messages (prepared: see prepare_messages) -> prompt text. Raises ValueError when the
        template refuses them, naming what it said."""
        if self.kind == PLAIN:
            if tools:
                raise ValueError("this checkpoint has no chat template, so it cannot be given tools")
            out = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
            return out + ("assistant: " if add_generation_prompt else "")
        name = "tool_use" if tools is not None and "tool_use" in self._compiled else "default"
        if name not in self._compiled:
            raise ValueError(f"this checkpoint has several chat templates and none named 'default': "
                             f"{sorted(self._compiled)}")
        kwargs = {**self.special_tokens, **(template_kwargs or {})}
        bad = [k for k in RESERVED_KWARGS if k in kwargs]
        if bad:
            raise ValueError(f"template kwargs may not set {bad}: they are given by the request itself")
        from jinja2.exceptions import TemplateError
        try:
            return self._compiled[name].render(messages=_as_transformers_sees(messages), tools=tools,
                                               documents=documents,
                                               add_generation_prompt=add_generation_prompt, **kwargs)
        except (TemplateError, TypeError) as e:     # TypeError: a filter given the wrong type (|items)
            raise ValueError(f"chat template refused the messages: {e}") from None


def _token_text(t):
    return t.get("content") if isinstance(t, dict) else t


def _as_transformers_sees(messages: list[dict]) -> list[dict]:
    """Keys whose value is None dropped; reasoning under every name templates read."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _environment():
    """The jinja environment of transformers' chat templates (utils/chat_template_utils.py)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text; it renders as its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):              # jinja's signature trick: `namespace(self=...)` works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore name {name!r}")

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=TemplateDict(), namespace=Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def template_kwargs(chat_template_kwargs: dict | None, reasoning_effort: str | None = None) -> dict:
    """The variables a request passes to its template: chat_template_kwargs, plus
    enable_thinking and reasoning_effort from reasoning_effort (see the module docstring)."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be an object, got {type(chat_template_kwargs).__name__}")
    kwargs = dict(chat_template_kwargs or {})
    bad = [k for k in kwargs if not isinstance(k, str) or k in RESERVED_KWARGS]
    if bad:
        raise ValueError(f"chat_template_kwargs may not set {bad}: they are given by the request itself")
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise ValueError(f"chat_template_kwargs.enable_thinking must be true or false, got "
                         f"{kwargs['enable_thinking']!r}")
    if reasoning_effort is None:
        return kwargs
    if reasoning_effort not in EFFORT_THINKING:
        raise ValueError(f"reasoning_effort must be one of {list(EFFORT_THINKING)}, got {reasoning_effort!r}")
    thinking = EFFORT_THINKING[reasoning_effort]
    if kwargs.get("enable_thinking", thinking) != thinking:
        raise ValueError(f"reasoning_effort={reasoning_effort!r} turns thinking {'on' if thinking else 'off'} "
                         f"but chat_template_kwargs.enable_thinking is {kwargs['enable_thinking']}")
    return {"enable_thinking": thinking, "reasoning_effort": reasoning_effort, **kwargs}


def prepare_messages(messages: list[dict], family: str) -> list[dict]:
    """OpenAI chat messages -> the messages `family`'s template (one of FAMILIES, as
    ChatTemplate.family names it) renders prefix-stably; see the module docstring. New dicts; the
    input is not changed. A field that cannot be prepared raises ValueError naming messages[i]
    and the field."""
    if family not in FAMILIES:
        raise ValueError(f"prepare_messages: family must be one of {FAMILIES}, got {family!r}")
    return [_prepare(i, m, family) for i, m in enumerate(messages)]


def _prepare(i: int, m: dict, family: str) -> dict:
    at = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ValueError(f"{at} must be an object, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise ValueError(f"{at}.role must be one of {list(ROLES)}, got {role!r}")
    out = dict(m)
    if role == "developer":            # OpenAI's newer name for system; no released template knows it
        out["role"] = "system"
    out["content"] = _text(m.get("content"), f"{at}.content")
    for k in REASONING_FIELDS:
        if m.get(k) is not None and not isinstance(m[k], str):
            raise ValueError(f"{at}.{k} must be a string, got {type(m[k]).__name__}")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise ValueError(f"{at}.tool_calls: only an assistant message carries tool calls")
        if not isinstance(calls, list):
            raise ValueError(f"{at}.tool_calls must be a list, got {type(calls).__name__}")
        out["tool_calls"] = [_call(f"{at}.tool_calls[{j}]", c, family) for j, c in enumerate(calls)]
        if family == "lfm2" and calls:     # LFM2's template renders content only
            out["content"] = _lfm2_calls(out["tool_calls"]) + out["content"]
    if m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
        raise ValueError(f"{at}.tool_call_id must be a string, got {type(m['tool_call_id']).__name__}")
    return out


def _text(content: Any, at: str) -> str:
    """A message's content as text: None -> "", text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        bad = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content
               if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)]
        if bad:
            raise ValueError(f"{at}: only text parts are supported, got {bad}")
        return "".join(p["text"] for p in content)
    raise ValueError(f"{at} must be a string, a list of text parts or null, got {type(content).__name__}")


def _call(at: str, call: Any, family: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{at}.function must be an object with a string name")
    args = fn.get("arguments")
    if isinstance(args, str):
        if not args.strip():
            args = {}                    # a call without arguments, as some clients send it
        else:
            try:
                args = json.loads(args)
            except ValueError as e:
                raise ValueError(f"{at}.function.arguments is not JSON ({e}): {args[:80]!r}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{at}.function.arguments must be a JSON object, got {type(args).__name__}")
    if family == "qwen3_5":             # its template writes top-level values with `| string`
        args = {k: _json_literal(v) for k, v in args.items()}
    return {**call, "function": {**fn, "arguments": args}}


def _json_literal(v: Any) -> Any:
    """true/false/null as the text JSON writes (`| string` would write Python's True/None)."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    return v


def _lfm2_calls(calls: list[dict]) -> str:
    """`<|tool_call_start|>[f(a="x", b=1)]<|tool_call_end|>`: the calls as LFM2 writes them."""
    one = [f["name"] + "(" + ", ".join(f"{k}={_py(v)}" for k, v in f["arguments"].items()) + ")"
           for f in (c["function"] for c in calls)]
    return "<|tool_call_start|>[" + ", ".join(one) + "]<|tool_call_end|>"


def _py(v: Any) -> str:
    """A JSON value as a Python literal (strings double-quoted, True/False/None)."""
    if v is None or isinstance(v, bool):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_py(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_py(x)}" for k, x in v.items()) + "}"
    return json.dumps(v, ensure_ascii=False)

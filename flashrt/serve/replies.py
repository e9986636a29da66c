"""Chat replies beyond plain text: what a chat request asks of its reply (tools, structured
output, reasoning, logprobs), and one choice's reply in OpenAI's shapes.

  plan(req, template, prompt)   -> Plan: the format the parser reads (the template's family),
                                   the tools it accepts, how the reply may begin (inside a think
                                   block the prompt opened, ...), the grammar
  completion_plan(req)          -> Plan of a completion or session turn: response_format only
  decoding(req, plan, vocab)    -> engine.Decoding: grammar, logit_bias, logprobs for the worker
  ReplyStream(plan)             one choice: the text the worker streamed (stop strings already
                                   cut) in, OpenAI delta fields and the final message out
  logprobs_content(tok, items)  -> OpenAI's `choices[].logprobs.content` entries

One parser per choice (flashrt.chat.ReplyParser; ThinkThenJSON under a JSON grammar) serves the
stream and the whole response, so the two cannot disagree. Tools are rendered into the prompt whatever tool_choice says (prefix-stable
across a loop, as vLLM does); under tool_choice "none" no call is read (call text is content).

Grammar (flashrt.lm.Grammar), from where the prompt ends, after the reasoning block:
- tool_choice required or named, or auto with a tool marked `strict`: the family's tool-call
  structural tag (Qwen3: "qwen_3", Qwen3.5: "qwen_3_5"); parallel_tool_calls false: one call.
  Other families have none: required / named there is a 400, auto is read after the fact.
- else response_format json_schema (strict as asked) / json_object: JSON. Offered tools under
  auto may be called instead, so JSON is not enforced then.
- reasoning: the prompt ends in an open think tag: "enabled" (the block's rest first); in a
  closed one (thinking off): "disabled"; a format with think tags: "auto"; else "disabled".
Without a grammar a malformed call is content, and parallel_tool_calls false keeps the first call.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashrt.chat import PLAIN, ChatFormat, Content, Reasoning, ReplyParser, ToolCallArguments, ToolCallStart
from flashrt.lm import Grammar

from .chat_wire import NamedToolChoice
from .engine import Decoding
from .wire import APIError

TOOL_GRAMMARS = {"qwen3": "qwen_3", "qwen3_5": "qwen_3_5"}   # chat family -> xgrammar's tag
MIN_LOGPROB = -9999.0     # what OpenAI reports for a token of no probability (JSON has no -inf)
# whitespace a grammar allows in a row: pretty-printed JSON fits, a model stuck on blanks ends
MAX_WHITESPACE = 16


@dataclass(frozen=True)
class Plan:
    """format: the template's ChatFormat; tools: those a call may name (OpenAI dicts; empty
    under tool_choice none); mode: how the reply may begin (reasoning_mode: "enabled" = inside
    a think block the prompt opened); parallel: parallel_tool_calls; grammar: a
    flashrt.lm.Grammar, or None."""
    format: ChatFormat
    tools: tuple = ()
    mode: str = "disabled"
    parallel: bool = True
    grammar: object = None


def _choice(req):
    """tool_choice as the grammar takes it (OpenAI's default: auto with tools, else none)."""
    c = req.tool_choice
    if isinstance(c, NamedToolChoice):
        return {"type": "function", "function": {"name": c.function.name}}
    return c if c is not None else ("auto" if req.tools else "none")


def reasoning_mode(fmt: ChatFormat, prompt: str) -> str:
    """How the grammar treats a leading think block (see the module docstring)."""
    if fmt.think is None:
        return "disabled"
    end = prompt.rstrip()
    if end.endswith(fmt.think[0]):
        return "enabled"
    return "disabled" if end.endswith(fmt.think[1]) else "auto"


def plan(req, template, prompt: str) -> Plan:
    """The plan of a chat request whose messages rendered to `prompt` under `template`; a 400
    naming the parameter when its grammar cannot be made (a schema keyword it cannot enforce)."""
    fmt, choice = template.format, _choice(req)
    tools = tuple(req.tools or ()) if choice != "none" else ()
    mode = reasoning_mode(fmt, prompt)
    grammar = None
    if tools and (choice != "auto" or any(t["function"].get("strict") for t in tools)):
        tag = TOOL_GRAMMARS.get(fmt.name)
        if tag is None and choice != "auto":
            raise APIError(400, f"tool_choice {choice!r} needs constrained decoding, and this model's "
                           f"chat format ({fmt.name}) has no tool-call grammar: use 'auto'",
                           param="tool_choice")
        if tag is not None:
            grammar = _grammar(lambda G: G.tool_calls(list(tools), choice, req.parallel_tool_calls, tag, mode,
                                                      MAX_WHITESPACE), "tools")
    elif not tools:
        grammar = _format_grammar(req.response_format, mode)
    return Plan(fmt, tools, mode, req.parallel_tool_calls, grammar)


def completion_plan(req) -> Plan | None:
    """The plan of a completion (/v1/completions, a session turn): its response_format's
    grammar from where the prompt ends, without a reasoning block (no template says one is
    open); None without one."""
    grammar = _format_grammar(req.response_format, "disabled")
    return None if grammar is None else Plan(PLAIN, grammar=grammar)


def _format_grammar(fmt, mode: str):
    """response_format json_object / json_schema as a grammar; None for text or none."""
    if fmt is None or fmt.type == "text":
        return None
    spec = fmt.json_schema
    if spec is None or spec.schema_ is None:
        return _grammar(lambda G: G.json_object(mode, MAX_WHITESPACE), "response_format")
    return _grammar(lambda G: G.json_schema(spec.schema_, bool(spec.strict), mode, MAX_WHITESPACE),
                    "response_format.json_schema.schema")


def _grammar(make, param: str):
    try:
        return make(Grammar)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="unsupported_schema") from None


def decoding(req, plan_: Plan | None, vocab: int) -> Decoding:
    """What the worker applies to this request's tokens (completions and session turns: the
    logit bias only)."""
    logprobs = None
    if getattr(req, "logprobs", None):
        logprobs = req.top_logprobs or 0
    return Decoding(grammar=plan_.grammar if plan_ is not None else None,
                    bias=tuple(req.bias(vocab).items()), logprobs=logprobs)


class ReplyStream:
    """One choice's reply. feed(text) / finish() -> (content or None, other delta fields:
    reasoning_content, tool_calls as OpenAI streams them: the first delta of a call carries
    index, id, type and function.name, later ones function.arguments fragments); message()
    is the fold a non-streamed response carries. A format without call or think tags: text
    is content. Under a JSON grammar the reply is [think block] + JSON (ThinkThenJSON)."""

    def __init__(self, plan_: Plan | None):
        fmt = plan_.format if plan_ is not None else None
        json_grammar = plan_ is not None and plan_.grammar is not None and plan_.grammar.kind != "tool_calls"
        self._parser = None
        if json_grammar and fmt.think is not None:
            self._parser = ThinkThenJSON(fmt.think, plan_.mode)
        elif not json_grammar and fmt is not None and (fmt.tool_syntax != "none" or fmt.think is not None):
            self._parser = ReplyParser(fmt, list(plan_.tools), reasoning=plan_.mode == "enabled")
        self._parallel = plan_.parallel if plan_ is not None else True
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[list] = []        # [id, name, arguments] per call kept
        self._kept: dict[int, int] = {}     # the parser's call index -> the reply's

    def feed(self, text: str) -> tuple:
        if self._parser is None:
            self._content.append(text)
            return text, {}
        return self._delta(self._parser.feed(text))

    def finish(self) -> tuple:
        return self._delta(self._parser.finish()) if self._parser is not None else (None, {})

    def _delta(self, events) -> tuple:
        content, reasoning, calls = [], [], {}
        for e in events:
            if isinstance(e, Content):
                content.append(e.text)
            elif isinstance(e, Reasoning):
                reasoning.append(e.text)
            elif isinstance(e, ToolCallStart):
                if not self._parallel and self._calls:      # parallel_tool_calls false: the first
                    continue
                i = self._kept[e.index] = len(self._calls)
                self._calls.append([e.id, e.name, ""])
                calls[i] = {"index": i, "id": e.id, "type": "function",
                            "function": {"name": e.name, "arguments": ""}}
            elif isinstance(e, ToolCallArguments) and e.index in self._kept:
                i = self._kept[e.index]
                self._calls[i][2] += e.fragment
                entry = calls.setdefault(i, {"index": i, "function": {"arguments": ""}})
                entry["function"]["arguments"] += e.fragment
        text = "".join(content)
        self._content.append(text)
        self._reasoning.extend(reasoning)
        fields = {}
        if reasoning:
            fields["reasoning_content"] = "".join(reasoning)
        if calls:
            fields["tool_calls"] = list(calls.values())
        return (text or None), fields

    def finish_reason(self, reason: str) -> str:
        """"tool_calls" when the reply made calls and ended by itself."""
        return "tool_calls" if self._calls and reason == "stop" else reason

    def message(self) -> dict:
        text, m = "".join(self._content), {"role": "assistant"}
        m["content"] = text if text or not self._calls else None
        if self._reasoning:
            m["reasoning_content"] = "".join(self._reasoning)
        if self._calls:
            m["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                               for i, n, a in self._calls]
        return m


def logprobs_content(tokenizer, items) -> list:
    """Delta.logprobs items ((id, logprob, ((top id, logprob), ...)), ...) -> OpenAI's
    `logprobs.content` entries: token text, logprob, its bytes, top_logprobs."""
    def one(tid, lp):
        text, raw = token_text(tokenizer, tid)
        return {"token": text, "logprob": max(lp, MIN_LOGPROB), "bytes": raw}
    return [{**one(t, lp), "top_logprobs": [one(u, v) for u, v in top]} for t, lp, top in items]


def token_text(tokenizer, tid: int) -> tuple[str, list]:
    """One token's (text, bytes). flashrt's byte-level tokenizer: the byte itself; otherwise the
    UTF-8 of its decoded text (a token holding part of a character decodes to U+FFFD)."""
    text = tokenizer.decode([tid])
    if getattr(tokenizer, "kind", None) == "bytes" and tid < 256:
        return text, [tid]
    return text, list(text.encode("utf-8"))


class ThinkThenJSON:
    """A reply a JSON grammar shapes: the rest of the think block the prompt opened (mode
    "enabled"), an optional one ("auto") or none, then JSON, given verbatim: a tag inside a JSON
    string is text, which a ReplyParser would take for a tag. As the parser does, whitespace
    next to the tags is dropped and a partial close tag held back. Same feed / finish events."""

    def __init__(self, think: tuple[str, str], mode: str):
        self._open, self._close = think
        self._state = {"enabled": "reasoning", "auto": "start"}.get(mode, "content")
        self._buf, self._pending = "", ""       # text not yet decided; reasoning's trailing blanks
        self._lead = True                       # drop blanks until the channel's first text

    def feed(self, text: str) -> list:
        self._buf += text
        return self._scan(final=False)

    def finish(self) -> list:
        return self._scan(final=True)

    def _scan(self, final: bool) -> list:
        out = []
        if self._state == "start":
            s = self._buf.lstrip()
            if not final and self._open.startswith(s):          # may still become the open tag
                return out
            self._state = "reasoning" if s.startswith(self._open) else "content"
            self._buf = s[len(self._open):] if self._state == "reasoning" else s
        if self._state == "reasoning":
            at = self._buf.find(self._close)
            if at < 0:
                keep = 0 if final else next((k for k in range(min(len(self._buf), len(self._close) - 1), 0, -1)
                                             if self._close.startswith(self._buf[-k:])), 0)
                self._reason(out, self._buf[:len(self._buf) - keep], closed=final)
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            self._reason(out, self._buf[:at], closed=True)
            self._buf, self._state, self._lead = self._buf[at + len(self._close):], "content", True
        text, self._buf = self._buf, ""
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        if text:
            out.append(Content(text))
        return out

    def _reason(self, out: list, text: str, closed: bool) -> None:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        body = text.rstrip()
        if body:
            out.append(Reasoning(self._pending + body))
            self._pending = ""
        self._pending = "" if closed else self._pending + text[len(body):]


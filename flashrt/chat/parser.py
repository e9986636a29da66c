"""One incremental parser per reply: text deltas in, reasoning / content / tool-call events out.

Streaming feeds each decoded delta; a whole reply is `parse_reply`, which is the same parser fed
once, so the two cannot disagree. The rules, for every format:

- Text that may still become a tag (`<think>`, `</think>`, the call's open tag) is held back
  until it is or is not one; a partial tag that turns out to be text is released as text.
- Whitespace next to a tag belongs to the tag (the templates write `\\n` around them and trim
  what they render): it is dropped on both sides, and held back meanwhile.
- Reasoning is what stands inside the think block; a call written there stays reasoning.
- Calls get indices 0, 1, ... in order; ids come from `call_id()`.
- Text that is not a well-formed call (bad JSON or literals, an unknown structure, a tool name
  not offered, no close tag at finish) comes back verbatim as Content, never an exception.

When arguments stream. A Hermes (Qwen3) or LFM2 call is held until its close tag and then given
in one ToolCallArguments: its text can still turn out malformed, and an event sent cannot be
taken back. A Qwen3.5 XML call starts once `<function=NAME>` names an offered tool; each
parameter is sent as a JSON piece when its `</parameter>` arrives (a repeated name keeps its
first value), and the pieces concatenate to the final arguments string. From its header on an
XML call is committed: text inside it that is not a parameter is skipped, and at finish an
unclosed call is closed with the parameters it completed.
"""
from __future__ import annotations

import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from .formats import ChatFormat, hermes_call, pythonic_calls, to_json, xml_value


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


Event = Reasoning | Content | ToolCallStart | ToolCallArguments | ToolCallEnd


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str          # a JSON object, as formats.to_json spells it


@dataclass(frozen=True)
class Reply:
    """The fold of a reply's events: what a non-streaming response carries."""
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    @classmethod
    def fold(cls, events: Iterable[Event]) -> "Reply":
        reasoning, content, calls = [], [], []
        for e in events:
            if isinstance(e, Reasoning):
                reasoning.append(e.text)
            elif isinstance(e, Content):
                content.append(e.text)
            elif isinstance(e, ToolCallStart):
                if e.index != len(calls):
                    raise ValueError(f"Reply.fold: call index {e.index} starts after {len(calls)} calls")
                calls.append([e.id, e.name, ""])
            elif isinstance(e, ToolCallArguments):
                if not 0 <= e.index < len(calls):
                    raise ValueError(f"Reply.fold: arguments for call {e.index}, which has not started")
                calls[e.index][2] += e.fragment
            elif not isinstance(e, ToolCallEnd):
                raise TypeError(f"Reply.fold: not a parser event: {e!r}")
        return cls("".join(reasoning), "".join(content), tuple(ToolCall(*c) for c in calls))


_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """`call_` + 24 random letters and digits (from `secrets`)."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def tool_parameters(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict]:
    """OpenAI-shaped tools (`{"type": "function", "function": {"name", "parameters"}}`) ->
    {name: parameters schema}."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(f"tools: expected a list of tool objects, got {type(tools).__name__}")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(fn, Mapping):
            raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}")
        name, params = fn.get("name"), fn.get("parameters") or {}
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise ValueError(f"tools[{i}].function.name: expected 1-64 of [A-Za-z0-9_.-], got {name!r}")
        if name in out:
            raise ValueError(f"tools[{i}].function.name: {name!r} is offered twice")
        if not isinstance(params, Mapping):
            raise ValueError(f"tools[{i}].function.parameters: expected a JSON schema object")
        out[name] = dict(params)
    return out


_CONTENT, _REASONING, _CALL = "content", "reasoning", "call"
_LONGEST_NAME = 256     # a `<function=` / `<parameter=` name still open past this is not one
_NAME_CHARS = re.compile(r"[^>\n<]*")


@dataclass
class _Call:
    """The call being read. raw: its open tag and the whitespace before it (given back verbatim
    if the call is rejected); step: block (whole-block syntaxes), or head, body, param, tail."""
    raw: str
    step: str
    index: int = -1
    name: str = ""
    key: str = ""
    keys: set = field(default_factory=set)


class ReplyParser:
    """feed(delta) -> events, then finish() -> the rest. See the module docstring for the rules.

    tools: the offered tools (OpenAI shape); a call naming another tool is content. None
    accepts any well-formed name. reasoning: thinking was on when the prompt was rendered; with
    a format whose generation prompt opens the think block, the reply starts inside it. A think
    block the model opens itself is read as reasoning either way (a format with think tags).
    call_id: makes each call's id (default `new_call_id`; inject one to make ids deterministic)."""

    def __init__(self, fmt: ChatFormat, tools: Sequence[Mapping[str, Any]] | None = None,
                 reasoning: bool = False, call_id: Callable[[], str] = new_call_id):
        if not isinstance(fmt, ChatFormat):
            raise TypeError(f"ReplyParser: fmt must be a ChatFormat, got {type(fmt).__name__}")
        self._fmt = fmt
        self._schemas = None if tools is None else tool_parameters(tools)
        self._call_id = call_id
        think = fmt.think or ()
        self._tags = {_CONTENT: (*think, *(fmt.call_tags or ())[:1]), _REASONING: think[1:]}
        self._mode = _REASONING if reasoning and fmt.think_in_prompt else _CONTENT
        self._lead = self._mode == _REASONING   # drop whitespace until the first text
        self._buf = ""                          # text not yet decided
        self._pending = ""                      # trailing whitespace of the text channel, held
        self._call: _Call | None = None
        self._calls = 0
        self._finished = False

    def feed(self, text: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("ReplyParser.feed: the reply was already finished")
        if not isinstance(text, str):
            raise TypeError(f"ReplyParser.feed: expected str, got {type(text).__name__}")
        self._buf += text
        return self._scan(final=False)

    def finish(self) -> list[Event]:
        """The end of the reply: held text is released, an open call resolved."""
        if self._finished:
            raise RuntimeError("ReplyParser.finish: the reply was already finished")
        out = self._scan(final=True)
        self._finished = True
        return out

    # ---- text channels -------------------------------------------------------------------------
    def _scan(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._call_step(out, final) if self._mode == _CALL else self._text_step(out, final):
            pass
        return out

    def _text_step(self, out: list, final: bool) -> bool:
        tags, buf = self._tags[self._mode], self._buf
        found = [(buf.find(t), t) for t in tags if t in buf]
        if not found:
            keep = 0 if final else _partial_tag(buf, tags)
            self._say(out, buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            if final and self._pending:
                self._emit(out, self._pending)
                self._pending = ""
            return False
        at, tag = min(found)
        self._say(out, buf[:at])
        self._buf = buf[at + len(tag):]
        held, self._pending = self._pending, ""
        if self._fmt.call_tags and tag == self._fmt.call_tags[0]:
            first = "head" if self._fmt.tool_syntax == "xml" else "block"
            self._call, self._mode = _Call(raw=held + tag, step=first), _CALL
        else:                                   # a think tag: open, close, or a stray close
            self._mode = _REASONING if tag == self._fmt.think[0] else _CONTENT
            self._lead = True
        return True

    def _say(self, out: list, text: str) -> None:
        """Text of the current channel, with whitespace that may yet touch a tag held back."""
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        body = text.rstrip()
        if not body:
            self._pending += text
            return
        self._emit(out, self._pending + body)
        self._pending = text[len(body):]

    def _emit(self, out: list, text: str) -> None:
        kind = Reasoning if self._mode == _REASONING else Content
        if out and type(out[-1]) is kind:
            out[-1] = kind(out[-1].text + text)
        else:
            out.append(kind(text))

    # ---- calls ---------------------------------------------------------------------------------
    def _call_step(self, out: list, final: bool) -> bool:
        return getattr(self, f"_{self._call.step}")(out, final)     # _block, _head, _body, ...

    def _known(self, name: str) -> bool:
        return name in self._schemas if self._schemas is not None else bool(_TOOL_NAME.fullmatch(name))

    def _reject(self, out: list, rest: str, verbatim: str = "") -> bool:
        """Not a call: its open tag (and `verbatim`) is content as written; `rest` is read again."""
        raw, self._call, self._mode, self._lead = self._call.raw, None, _CONTENT, False
        self._emit(out, raw + verbatim)
        self._buf = rest
        return True

    def _start(self, out: list, name: str) -> None:
        self._call.index, self._call.name = self._calls, name
        self._calls += 1
        out.append(ToolCallStart(self._call.index, self._call_id(), name))

    def _end(self, out: list, rest: str) -> bool:
        """The end of an XML call: close its arguments object."""
        call = self._call
        out.append(ToolCallArguments(call.index, "}" if call.keys else "{}"))
        out.append(ToolCallEnd(call.index))
        return self._close(rest)

    def _close(self, rest: str) -> bool:
        self._call, self._mode, self._lead, self._buf = None, _CONTENT, True, rest
        return True

    def _block(self, out: list, final: bool) -> bool:
        """A call read whole at its close tag: Hermes JSON, LFM2 Python syntax."""
        body, close = self._buf, self._fmt.call_tags[1]
        opener = "[" if self._fmt.tool_syntax == "pythonic" else "{"
        lead = body.lstrip()
        if lead and not lead.startswith(opener):
            return self._reject(out, body)
        at = body.find(close)
        if at < 0:
            return self._reject(out, "", verbatim=body) if final else False
        text, rest = body[:at], body[at + len(close):]
        calls = pythonic_calls(text) if opener == "[" else hermes_call(text)
        if calls is None or not all(self._known(name) for name, _ in calls):
            return self._reject(out, rest, verbatim=text + close)
        for name, arguments in calls:
            self._start(out, name)
            out.append(ToolCallArguments(self._call.index, to_json(arguments)))
            out.append(ToolCallEnd(self._call.index))
        return self._close(rest)

    def _head(self, out: list, final: bool) -> bool:
        """After the open tag of an XML call: `<function=NAME>` (or Hermes JSON, read whole)."""
        s = self._buf.lstrip()
        if s.startswith("{"):
            self._call.step = "block"
            return True
        state, name, rest = _named_tag(s, "<function=")
        if state == "wait":
            return self._reject(out, "", verbatim=self._buf) if final else False
        if state == "bad" or not self._known(name):
            return self._reject(out, self._buf)
        self._start(out, name)
        self._call.step, self._buf = "body", rest
        return True

    def _body(self, out: list, final: bool) -> bool:
        """Between parameters: the next `<parameter=K>`, or the call's end."""
        s = self._buf.lstrip()
        close = self._fmt.call_tags[1]
        if s.startswith("</function>"):
            self._call.step, self._buf = "tail", s[len("</function>"):]
            return True
        if s.startswith(close):
            return self._end(out, s[len(close):])
        state, key, rest = _named_tag(s, "<parameter=")
        if state == "ok":
            self._call.step, self._call.key, self._buf = "param", key, rest
            return True
        if state == "wait" or "</function>".startswith(s) or close.startswith(s):
            self._buf = s
            return self._end(out, "") if final else False
        nxt = s.find("<", 1)                    # not a parameter: skip to the next tag
        self._buf = s[nxt:] if nxt > 0 else ""
        return True

    def _param(self, out: list, final: bool) -> bool:
        """A parameter's value runs to `</parameter>` (or to the end of the function)."""
        buf, call = self._buf, self._call
        ends = [(buf.find(t), t) for t in ("</parameter>", "</function>", self._fmt.call_tags[1]) if t in buf]
        if not ends:
            return self._end(out, "") if final else False
        at, tag = min(ends)
        raw = buf[:at]
        raw = raw[1:] if raw.startswith("\n") else raw      # the template writes `>\nV\n</`
        raw = raw[:-1] if raw.endswith("\n") else raw
        self._buf = buf[at + len(tag):] if tag == "</parameter>" else buf[at:]
        call.step = "body"
        if call.key not in call.keys:           # a repeated name keeps its first value
            props = (self._schemas or {}).get(call.name, {}).get("properties")
            schema = props.get(call.key) if isinstance(props, Mapping) else None
            value = xml_value(raw, schema)
            piece = ("{" if not call.keys else ", ") + to_json(call.key) + ": " + to_json(value)
            call.keys.add(call.key)
            out.append(ToolCallArguments(call.index, piece))
        return True

    def _tail(self, out: list, final: bool) -> bool:
        """After `</function>`: the close tag; anything else ends the call and is read again."""
        s, close = self._buf.lstrip(), self._fmt.call_tags[1]
        if s.startswith(close):
            return self._end(out, s[len(close):])
        if not s or close.startswith(s):
            self._buf = s
            return self._end(out, "") if final else False
        return self._end(out, s)


def _partial_tag(buf: str, tags: Sequence[str]) -> int:
    """Length of the longest end of buf that is the start of a tag."""
    for k in range(min(len(buf), max(map(len, tags), default=1) - 1), 0, -1):
        if any(t.startswith(buf[-k:]) for t in tags):
            return k
    return 0


def _named_tag(s: str, prefix: str) -> tuple[str, str, str]:
    """`<prefix NAME>` at the start of s -> ("ok", name, rest), ("wait", "", "") while it may
    still become one, or ("bad", "", "")."""
    if not s.startswith(prefix):
        return ("wait", "", "") if prefix.startswith(s) else ("bad", "", "")
    end = _NAME_CHARS.match(s, len(prefix)).end()
    if end - len(prefix) > _LONGEST_NAME:
        return "bad", "", ""
    if end == len(s):
        return "wait", "", ""
    if s[end] != ">" or end == len(prefix):
        return "bad", "", ""
    return "ok", s[len(prefix):end], s[end + 1:]


def parse_reply(fmt: ChatFormat, text: str, tools: Sequence[Mapping[str, Any]] | None = None,
                reasoning: bool = False, call_id: Callable[[], str] = new_call_id) -> Reply:
    """A whole reply: exactly ReplyParser.feed(text) + finish(), folded."""
    parser = ReplyParser(fmt, tools, reasoning=reasoning, call_id=call_id)
    return Reply.fold(parser.feed(text) + parser.finish())

"""Responses requests: POST /v1/responses' body (the subset the openai client and the Agents SDK
send), checked here and mapped onto a chat_wire.ChatRequest, so a response is a chat reply
(parser, grammar, tool calls) under another wire shape. Every refusal is a 400 naming the
parameter (`input[2].call_id`, `tools[0].name`); a field this server does not read is refused
by name. The response objects and stream events: responses.py.
"""
from __future__ import annotations

import json
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from . import chat_wire
from .wire import APIError, _echo

ROLES = ("user", "system", "developer", "assistant")


class TextFormat(BaseModel):
    """text.format: "text", "json_object", or "json_schema" with its fields flat (Responses'
    shape; chat's response_format nests them under json_schema)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None     # accepted, not used


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None   # accepted: the text is given whole
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class FlashrtOptions(BaseModel):
    """`flashrt`: this server's extensions. single_use: continued once (serve/single_use.py)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    single_use: bool = False


class ResponsesRequest(BaseModel):
    """`input` and `tools` keep the client's own JSON (checked by chat_request(), which names
    `input[i]` / `tools[i]`); `seed` is an extension (as chat's), for reproducible forks."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = ""
    input: Union[str, list]
    instructions: str | None = None
    tools: list | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    # accepted and not used: what the SDKs send by default
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    stream_options: dict | None = None
    flashrt: FlashrtOptions | None = None

    @model_validator(mode="after")
    def _input(self):
        if isinstance(self.input, str) and not self.input or isinstance(self.input, list) and not self.input:
            raise APIError(400, "input is empty: give a string or at least one item", param="input")
        return self

    def chat_tools(self) -> list | None:
        """tools as chat's ({"type": "function", "function": {...}}), each checked."""
        if self.tools is None:
            return None
        out = []
        for i, t in enumerate(self.tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                got = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise APIError(400, f"tools[{i}].type must be 'function' (the only tool this server runs), "
                               f"got {_echo(got)}", param=f"tools[{i}].type")
            fn = {k: v for k, v in t.items() if k != "type"}
            chat_wire._sub(chat_wire.FunctionDef, fn, f"tools[{i}]")
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self):
        c = self.tool_choice
        if isinstance(c, dict):
            if c.get("type") != "function" or set(c) != {"type", "name"} or not isinstance(c["name"], str):
                raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or "
                               f'{{"type": "function", "name": ...}}, got {_echo(c)}', param="tool_choice")
            return {"type": "function", "function": {"name": c["name"]}}
        return c

    def response_format(self) -> dict | None:
        f = self.text.format if self.text is not None else None
        if f is None or f.type != "json_schema":
            return None if f is None else {"type": f.type}
        if f.schema_ is None or f.name is None:
            raise APIError(400, "text.format of type json_schema needs name and schema",
                           param="text.format")
        spec = {"name": f.name, "schema": f.schema_}
        if f.strict is not None:
            spec["strict"] = f.strict
        return {"type": "json_schema", "json_schema": spec}

    def messages(self, with_instructions: bool = True) -> list[dict]:
        """input (and instructions, as a leading system message) as chat messages."""
        msgs = [{"role": "system", "content": self.instructions}] if self.instructions and with_instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        return msgs + input_messages(items)

    def chat_request(self, messages: list[dict]) -> chat_wire.ChatRequest:
        """The chat request this response runs as (messages: those to render)."""
        body = {"model": self.model, "messages": messages, "tools": self.chat_tools(),
                "tool_choice": self.chat_tool_choice(), "parallel_tool_calls": self.parallel_tool_calls,
                "response_format": self.response_format(), "max_completion_tokens": self.max_output_tokens,
                "seed": self.seed, "stream": self.stream,
                "stream_options": {"include_usage": True} if self.stream else None}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        try:
            return chat_wire.ChatRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            param = _CHAT_NAMES.get(str(err["loc"][0]) if err["loc"] else "", "input")
            raise APIError(400, f"invalid {param}: {err['msg']}", param=param) from None


# a chat field a failed check names -> the Responses parameter it came from
_CHAT_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort", "tools": "tools", "tool_choice": "tool_choice",
               "temperature": "temperature", "top_p": "top_p", "seed": "seed"}


def input_messages(items: list) -> list[dict]:
    """Responses input items -> chat messages: a message item as itself (its text parts joined);
    function_call items join the assistant message before them (or start one) as tool_calls;
    function_call_output -> a tool message; a reasoning item's text -> the next assistant
    message's reasoning_content. Every refusal names input[i] and the field."""
    out, reasoning = [], None
    for i, it in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(it, dict):
            raise APIError(400, f"{at} must be an object, got {type(it).__name__}", param=at)
        kind = it.get("type", "message")
        if kind == "message":
            _fields(it, at, {"type", "role", "content", "id", "status"})
            role = it.get("role")
            if role not in ROLES:
                raise APIError(400, f"{at}.role must be one of {list(ROLES)}, got {_echo(role)}",
                               param=f"{at}.role")
            m = {"role": role, "content": _text(it.get("content"), f"{at}.content")}
            if role == "assistant" and reasoning is not None:
                m["reasoning_content"], reasoning = reasoning, None
            out.append(m)
        elif kind == "function_call":
            _fields(it, at, {"type", "call_id", "name", "arguments", "id", "status"})
            for k in ("call_id", "name", "arguments"):
                if not isinstance(it.get(k), str):
                    raise APIError(400, f"{at}.{k} must be a string, got {_echo(it.get(k))}", param=f"{at}.{k}")
            try:
                args = json.loads(it["arguments"]) if it["arguments"].strip() else {}
            except (ValueError, RecursionError) as e:
                raise APIError(400, f"{at}.arguments is not JSON ({e}): {_echo(it['arguments'])}",
                               param=f"{at}.arguments") from None
            if not isinstance(args, dict):
                raise APIError(400, f"{at}.arguments must be a JSON object", param=f"{at}.arguments")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                out.append(last)
            if reasoning is not None:
                last["reasoning_content"], reasoning = reasoning, None
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            _fields(it, at, {"type", "call_id", "output", "id", "status"})
            if not isinstance(it.get("call_id"), str):
                raise APIError(400, f"{at}.call_id must be a string (the call it answers), got "
                               f"{_echo(it.get('call_id'))}", param=f"{at}.call_id")
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": _text(it.get("output"), f"{at}.output")})
        elif kind == "reasoning":
            _fields(it, at, {"type", "id", "summary", "content", "encrypted_content", "status"})
            parts = (it.get("content") or []) + (it.get("summary") or [])
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict)) or None
        else:
            raise APIError(400, f"{at}.type must be message, function_call, function_call_output or "
                           f"reasoning, got {_echo(kind)}", param=f"{at}.type")
    return out


def _fields(it: dict, at: str, known: set) -> None:
    extra = sorted(set(it) - known)
    if extra:
        raise APIError(400, f"{at}.{extra[0]} is not a field this server reads in a "
                       f"{it.get('type', 'message')} item", param=f"{at}.{extra[0]}")


def _text(content, at: str) -> str:
    """A message's content: a string, or parts of type input_text / output_text (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{at} must be a string or a list of text parts, got {_echo(content)}", param=at)
    texts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(p.get("text"), str):
            raise APIError(400, f"{at}[{j}] must be a text part (input_text or output_text with text); "
                           f"images, files and audio are not read by this server", param=f"{at}[{j}]")
        texts.append(p["text"])
    return "".join(texts)

"""Chat requests: POST /v1/chat/completions' body with its messages (tool calls, tool results,
reasoning), tools, tool_choice, response_format, reasoning switches, logprobs (what replies.py
makes of them). Every refusal is a 400 naming the parameter as OpenAI does (`messages[1].
tool_calls[0].function.arguments`); a message field this server does not read is refused by
name, never dropped. The common sampling fields, parse() and errors: wire.py.
"""
from __future__ import annotations

import json
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .wire import APIError, ResponseFormat, _Common, _echo, _invalid


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str            # a JSON object, as the server sent it (re-serialized by some clients)

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, v):
        if v.strip():
            try:
                obj = json.loads(v)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"not JSON ({e}): {_echo(v)}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"must be a JSON object, got {_echo(v)}")
        return v


class MessageToolCall(BaseModel):
    """A call of an earlier assistant turn, sent back in a tool loop."""
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
    index: int | None = None      # echoed from a stream by some clients: its place in the list


class ChatMessage(BaseModel):
    """An OpenAI chat message; a field this server does not read is refused by name. `name`
    goes to the template (which may ignore it); null fields OpenAI's SDK echoes back
    (refusal, audio, function_call, annotations) count as absent."""
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None     # assistant
    tool_call_id: str | None = None                     # tool
    reasoning_content: str | None = None                # assistant

    @model_validator(mode="before")
    @classmethod
    def _echoed_nulls(cls, data):
        if isinstance(data, dict) and any(data.get(k, 0) in (None, []) for k in _ECHOED_NULLS):
            data = {k: v for k, v in data.items() if not (k in _ECHOED_NULLS and v in (None, []))}
        return data


_ECHOED_NULLS = ("refusal", "audio", "function_call", "annotations")
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None        # a JSON schema of type "object" (absent: no arguments)
    strict: bool | None = None            # OpenAI's strict: arguments follow the schema exactly

    @field_validator("parameters")
    @classmethod
    def _object(cls, v):
        if v is not None and v and v.get("type") != "object":
            raise ValueError(f'must be a JSON schema with "type": "object", got type {_echo(v.get("type"))}')
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Common):
    """Tools, structured output and reasoning (serve/replies.py reads them): `tools` and
    `response_format` keep the client's own dicts (a template renders them with key order);
    every check names the parameter, messages by `messages[i].field`."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[dict] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # template variables (vLLM / SGLang / llama.cpp): enable_thinking switches Qwen's reasoning
    chat_template_kwargs: dict | None = None
    # OpenAI's effort as the templates' switch (chat/template.py): none, minimal -> off;
    # low, medium, high, xhigh -> on (no budget: the effort does not bound the thinking's length)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        names = set()
        for i, t in enumerate(v or ()):
            tool = _sub(Tool, t, f"tools[{i}]")
            name = tool.function.name
            if name in names:
                raise APIError(400, f"tools[{i}].function.name {name!r} is offered twice: names must be "
                               "unique", param=f"tools[{i}].function.name")
            names.add(name)
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        if v is not None and not isinstance(v.get("enable_thinking", False), bool):
            raise APIError(400, f"chat_template_kwargs.enable_thinking must be true or false, got "
                           f"{_echo(v['enable_thinking'])}", param="chat_template_kwargs.enable_thinking")
        return v

    @model_validator(mode="after")
    def _tool_choice(self):
        names = [t["function"]["name"] for t in self.tools or ()]
        choice = self.tool_choice
        if choice == "required" and not names:
            raise APIError(400, "tool_choice 'required' needs tools: none were given", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {_echo(choice.function.name)}, which is "
                           f"not among the tools ({_echo(', '.join(names)) or 'none given'})",
                           param="tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        for i, m in enumerate(self.messages):
            wrong = [k for k, roles in _ROLE_FIELDS.items() if getattr(m, k) is not None and m.role not in roles]
            if wrong:
                raise APIError(400, f"messages[{i}].{wrong[0]} is not a field of a {m.role} message "
                               f"(only {' or '.join(_ROLE_FIELDS[wrong[0]])})", param=f"messages[{i}].{wrong[0]}")
            if m.role == "tool" and m.tool_call_id is None:
                raise APIError(400, f"messages[{i}].tool_call_id is required in a tool message (the id of "
                               "the call it answers)", param=f"messages[{i}].tool_call_id")
        return self

    def limit(self) -> int | None:
        v = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if v is not None and v < 1:
            raise APIError(400, f"max_completion_tokens must be >= 1, got {v}", param="max_completion_tokens")
        return v

    def limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


_ROLE_FIELDS = {"tool_calls": ("assistant",), "reasoning_content": ("assistant",), "tool_call_id": ("tool",)}


def _sub(model_cls, value, at: str):
    """value checked as model_cls inside another field; an APIError naming `at` + its path
    (pydantic hands an APIError raised in a validator through unchanged)."""
    try:
        return model_cls.model_validate(value)
    except ValidationError as e:
        raise _invalid(e.errors()[0], at) from None

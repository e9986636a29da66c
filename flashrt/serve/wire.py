"""Wire protocol: request models (validated), response builders, OpenAI-shaped errors.

Requests are parsed here and nowhere else: a bad field becomes an APIError naming it, so the
routes stay thin and the engine only ever sees checked values.
"""
from __future__ import annotations

import json
import secrets
import time
from types import MappingProxyType
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# fields the OpenAI API defines that this server does not implement: refused by name unless
# they carry their no-op default (clients often send e.g. presence_penalty=0). Chat's tools,
# response_format, logprobs, ... are fields of ChatRequest; /v1/completions' integer
# `logprobs` (the legacy shape) is not implemented.
UNSUPPORTED = MappingProxyType({
    "logprobs": (None, False), "functions": (None, []), "function_call": (None, "none"),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "web_search_options": (None,)})
# accepted and ignored: bookkeeping fields with no effect on generation
IGNORED = frozenset({"user", "metadata", "store", "service_tier"})
MAX_STOP = 4
MAX_STOP_CHARS = 256      # per stop string (a partial match is held back, so it bounds the hold)
MAX_SALT_CHARS = 256
MAX_ECHO = 120            # characters of a refused value quoted back in an error message


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def check_text(text: str, param: str) -> str:
    """text, or a 400 naming param when it holds a lone surrogate (valid JSON, no UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"invalid {param}: a lone surrogate ({text[e.start]!r}) at character "
                       f"{e.start} is not text", param=param, code="invalid_text") from None
    return text


def _salt(v):
    if v is not None:
        if not v or len(v) > MAX_SALT_CHARS:
            raise ValueError(f"must be 1 to {MAX_SALT_CHARS} characters")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("holds a lone surrogate: not text") from None
    return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """Sampling fields shared by chat, completions and session turns."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: str = ""
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    n: int = Field(1, ge=1, le=16)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False          # extension (as vLLM): generate max_tokens whatever comes
    # flashrt extension: keep the capsule of this many leading prompt tokens (or, for chat,
    # "system": of the leading system messages) pinned in the store, never evicted
    pin_prefix: Union[int, Literal["system"], None] = None
    # extension (as vLLM): reuse only prompts sent with the same salt (and API key)
    cache_salt: str | None = None
    # token id (as a decimal string) -> a bias in [-100, 100] added to its logit before sampling
    logit_bias: dict[str, float] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise ValueError(f"up to {MAX_STOP} non-empty strings, got {_echo(stops)}")
        long = [len(s) for s in stops if len(s) > MAX_STOP_CHARS]
        if long:
            raise ValueError(f"a stop string may hold up to {MAX_STOP_CHARS} characters, got one of {long[0]}")
        return stops

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt(cls, v):
        return _salt(v)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for k, b in (v or {}).items():
            if not (k.isascii() and k.isdigit() and len(k) <= 10):
                raise ValueError(f"keys are token ids as decimal strings, got {_echo(k)}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"a bias is in [-100, 100], got {b!r} for token {k}")
        return v

    def bias(self, vocab: int) -> dict[int, float]:
        """logit_bias as {token id: bias}; a 400 naming logit_bias for an id outside the vocabulary."""
        out = {int(k): float(b) for k, b in (self.logit_bias or {}).items()}
        bad = next((t for t in out if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})",
                           param="logit_bias")
        return out

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def limit(self) -> int | None:
        return self.max_tokens

    def limit_field(self) -> str:
        return "max_tokens"


class JSONSchemaFormat(BaseModel):
    """response_format.json_schema (chat, completions and session turns)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")     # None: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("json_schema is given exactly with type 'json_schema'")
        return self


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    response_format: ResponseFormat | None = None     # json_object / json_schema (replies.py)

    def prompt_one(self, empty_ok: bool = False) -> Union[str, list[int]]:
        """The one prompt; empty is a 400 unless empty_ok (a session turn that continues)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"batched prompts ({len(p)}) are not supported: send one "
                               "prompt per request (use n for several completions)", param="prompt")
            p = p[0]
        if (isinstance(p, list) and not p or p == "") and not empty_ok:
            raise APIError(400, "prompt is empty: need at least one token", param="prompt")
        return p


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = ""
    prompt: Union[str, list[int], None] = None
    cache_salt: str | None = None           # the session's turns reuse only under this salt

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt(cls, v):
        return _salt(v)


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    position: int = Field(ge=0)


class RestoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    snapshot_id: str


class NameRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$")


class SaveRequest(NameRequest):
    overwrite: bool = False


class LoadRequest(NameRequest):
    cache_salt: str | None = None           # of the new session

    @field_validator("cache_salt")
    @classmethod
    def _cache_salt(cls, v):
        return _salt(v)


class CancelRequest(BaseModel):
    """What the client actually delivered (spoke): tokens, or characters of the streamed text."""
    model_config = ConfigDict(extra="forbid", strict=True)
    delivered_tokens: int | list[int] | None = None
    delivered_chars: int | list[int] | None = None

    def per_choice(self, n: int) -> tuple[str, list[int] | None]:
        if self.delivered_tokens is not None and self.delivered_chars is not None:
            raise APIError(400, "give delivered_tokens or delivered_chars, not both")
        kind = "chars" if self.delivered_chars is not None else "tokens"
        v = self.delivered_chars if kind == "chars" else self.delivered_tokens
        if v is None:
            return kind, None
        vals = [v] * n if isinstance(v, int) else list(v)
        if len(vals) != n or any(x < 0 for x in vals):
            raise APIError(400, f"delivered_{kind} must be a non-negative int or one per choice "
                           f"({n}), got {v!r}", param=f"delivered_{kind}")
        return kind, vals


def parse(model_cls, body: bytes):
    """Bytes -> validated request, or an APIError naming what is wrong."""
    try:
        data = json.loads(body)
    except ValueError as e:     # JSONDecodeError, UnicodeDecodeError, an int past Python's digit limit
        raise APIError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "invalid JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        req = model_cls.model_validate(data)
    except RecursionError:
        raise APIError(400, "invalid body: nested too deeply", code="invalid_json") from None
    except ValidationError as e:
        raise _invalid(e.errors()[0]) from None
    extra = set(getattr(req, "model_extra", None) or {})
    bad = sorted(k for k in extra if k not in IGNORED
                 and not (k in UNSUPPORTED and data[k] in UNSUPPORTED[k]))
    if bad:
        known = [k for k in bad if k in UNSUPPORTED]
        raise APIError(400, f"unsupported parameter(s): {_echo(', '.join(bad), 400)}"
                       + (" (not implemented by flashrt serve)" if known else " (unknown)"),
                       param=_echo(bad[0], 200), code="unsupported_parameter")
    return req


_TYPE_TAGS = frozenset(("str", "int", "float", "bool", "dict", "list", "none"))


def _path(loc, at: str = "") -> str:
    """A pydantic error location as OpenAI names a parameter: `messages[0].content`. It ends
    at a union branch's tag (`list[int]`, `str`, a model's name), which is no field."""
    out = at
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif isinstance(x, str) and x.isidentifier() and x.islower() and x not in _TYPE_TAGS:
            out += f".{x}" if out else x
        else:
            break
    return out


def _invalid(err: dict, at: str = "") -> APIError:
    """The APIError of pydantic's first error, naming the field as OpenAI does in its message
    and param (`at`: where the value sits in the body); an unknown nested field is refused."""
    param = _path(err["loc"], at)
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unsupported parameter {_echo(param, 200)}: not a field flashrt serve "
                        "reads here", param=_echo(param, 200), code="unsupported_parameter")
    return APIError(400, f"invalid {_echo(param, 200) or 'body'}: {err['msg']}"
                    + (f" (got {_echo(err['input'])})" if "input" in err and param else ""),
                    param=_echo(param, 200) if param else None)


def _echo(v, limit: int = MAX_ECHO) -> str:
    """A short printable rendering of a client's value for an error message: repr (so lone
    surrogates and control characters are escaped), cut to `limit` characters."""
    try:
        r = v if isinstance(v, str) and v.isprintable() and v.isascii() else repr(v)
    except RecursionError:
        r = f"<{type(v).__name__} nested too deeply>"
    return r if len(r) <= limit else r[:limit] + "..."


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_urlsafe(18)}"


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def response(kind: str, rid: str, model: str, choices: list, use: dict, created: int) -> dict:
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": use, "system_fingerprint": "flashrt"}


def choice(kind: str, index: int, text: str, finish: str, token_ids: list, message: dict | None = None,
           logprobs: dict | None = None) -> dict:
    """message: a chat reply's fields (replies.ReplyStream.message), else content = text."""
    c = {"index": index, "finish_reason": finish, "logprobs": logprobs, "token_ids": token_ids}
    if kind == "chat":
        c["message"] = message if message is not None else {"role": "assistant", "content": text}
    else:
        c["text"] = text
    return c


def chunk(kind: str, rid: str, model: str, created: int, index: int, text: str | None,
          finish: str | None, token_index: int | None, token_ids: list, first: bool,
          fields: dict | None = None, logprobs: dict | None = None) -> dict:
    """One SSE chunk, one per generated token (extensions: token_ids, the ids generated since
    the previous chunk; token_index, the index of the last token whose text is wholly inside
    the text streamed so far: text lags the ids by a partial UTF-8 character or a held-back
    stop-string prefix; with a chat format's parser, the text handed to it, which may hold a
    partial tag back). Barge-in: delivered_tokens = ids received, or delivered_chars.
    fields: a chat delta's other fields (reasoning_content, tool_calls)."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text is not None else {})
        delta.update(fields or {})
        c = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        c = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    c["token_index"], c["token_ids"] = token_index, token_ids
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [c],
            "system_fingerprint": "flashrt"}


def now() -> int:
    return int(time.time())

"""What the engine's worker posts to a request's queue, in this order: per choice its Delta
events and one Finished, then exactly one final event (FINAL: Done, Cancelled or Failed).

The worker (turns.py, engine.py) makes them; the routes (app.py) read them by field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .wire import APIError


@dataclass(frozen=True)
class Delta:
    """Text of choice `index` that may be shown now, and the ids generated since its last event."""
    index: int
    text: str                     # "" while a partial character or stop-string prefix is held
    token_index: int              # the last token whose text is wholly inside the text sent so far
    token_ids: tuple[int, ...]
    # when logprobs were asked: per id of token_ids, (id, logprob, ((top id, logprob), ...))
    logprobs: tuple = ()


@dataclass(frozen=True)
class Finished:
    """Choice `index` ended: reason is "stop", "length" or "cancelled"; token_ids are all its ids."""
    index: int
    reason: str
    token_index: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Done:
    """The response is complete (every choice Finished); the counts of its usage."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Cancelled:
    """Cancelled while queued: nothing ran."""


@dataclass(frozen=True)
class Failed:
    """The request failed; error is what the client is answered."""
    error: APIError


Event = Union[Delta, Finished, Done, Cancelled, Failed]
FINAL = (Done, Cancelled, Failed)

"""/v1/sessions: named conversations the client steers (a documented flashrt extension).

A session is its exact token history. Its model state lives in capsules: every turn end is
stored (see turn_store.py), so the next turn, a restore or a fork starts from the capsule of that
history (set_context: restore the longest stored prefix, roll back past a divergence, prefill
the rest), and a rollback to a position is exact, recurrent state included. Ids are
unguessable (secrets.token_urlsafe) and a session is reachable only through its id (and the
API key when one is set). One turn at a time per session: a second is a 409. Idle sessions
expire (ConversationTable). In the code a session is a Conversation: its token list.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict

from .wire import APIError

MAX_CONVERSATIONS = 4096
MAX_SNAPSHOTS = 64         # per session


class Conversation:
    def __init__(self, tokens: list):
        self.id = "sess-" + secrets.token_urlsafe(18)
        self.tokens = list(tokens)
        self.snapshots: dict[str, list] = {}
        self.busy = False
        self._lock = threading.Lock()

    def begin_turn(self) -> list:
        with self._lock:
            if self.busy:
                raise APIError(409, f"session {self.id} already has a turn in progress", code="session_busy")
            self.busy = True
            return list(self.tokens)

    def end_turn(self, tokens) -> None:
        """The turn's outcome (prompt + delivered tokens), or None: keep the old history."""
        with self._lock:
            if tokens is not None:
                self.tokens = list(tokens)
            self.busy = False

    def replace_if(self, expected, tokens) -> bool:
        """Rewrite the history to tokens if the session is idle and its history is exactly
        `expected` (a late barge-in cancel of its last turn); False otherwise."""
        with self._lock:
            if self.busy or expected is None or self.tokens != list(expected):
                return False
            self.tokens = list(tokens)
            return True

    def _idle(self):
        if self.busy:
            raise APIError(409, f"session {self.id} has a turn in progress", code="session_busy")

    def snapshot(self) -> str:
        with self._lock:
            self._idle()
            if len(self.snapshots) >= MAX_SNAPSHOTS:
                self.snapshots.pop(next(iter(self.snapshots)))
            sid = "snap-" + secrets.token_urlsafe(12)
            self.snapshots[sid] = list(self.tokens)
            return sid

    def restore(self, sid: str) -> None:
        with self._lock:
            self._idle()
            if sid not in self.snapshots:
                raise APIError(404, f"session {self.id} has no snapshot {sid!r}", param="snapshot_id",
                               code="snapshot_not_found")
            self.tokens = list(self.snapshots[sid])

    def rollback(self, position: int) -> None:
        with self._lock:
            self._idle()
            if not 0 <= position <= len(self.tokens):
                raise APIError(400, f"position {position} is outside the session's history "
                               f"[0, {len(self.tokens)}]", param="position")
            del self.tokens[position:]

    def info(self) -> dict:
        with self._lock:
            return {"id": self.id, "object": "session", "position": len(self.tokens),
                    "tokens": list(self.tokens), "snapshots": list(self.snapshots), "busy": self.busy}


class ConversationTable:
    """Conversations by id, least recently used first. One idle for idle_s seconds expires; when
    the table is full, a new one takes the place of the least recently used idle one."""

    def __init__(self, limit: int = MAX_CONVERSATIONS, idle_s: float = 3600.0, clock=time.monotonic):
        self._s: OrderedDict[str, Conversation] = OrderedDict()
        self._used: dict[str, float] = {}
        self._limit, self.idle_s, self._clock = limit, idle_s, clock
        self._lock = threading.Lock()

    def _make_room(self) -> None:
        now = self._clock()
        for sid in [k for k in self._s if now - self._used[k] >= self.idle_s]:
            if not self._s[sid].busy:
                self._drop(sid)
        if len(self._s) >= self._limit:
            idle = next((k for k, v in self._s.items() if not v.busy), None)
            if idle is None:
                raise APIError(429, f"too many sessions ({self._limit}), every one with a turn "
                               "in progress: retry later", type="rate_limit_error",
                               headers={"Retry-After": "1"})
            self._drop(idle)

    def _drop(self, sid: str) -> None:
        del self._s[sid], self._used[sid]

    def create(self, tokens=()) -> Conversation:
        with self._lock:
            self._make_room()
            s = Conversation(tokens)
            self._s[s.id], self._used[s.id] = s, self._clock()
            return s

    def get(self, sid: str) -> Conversation:
        with self._lock:
            s = self._s.get(sid)
            if s is not None and self._clock() - self._used[sid] >= self.idle_s and not s.busy:
                self._drop(sid)                  # expired
                s = None
            if s is not None:
                self._s.move_to_end(sid)
                self._used[sid] = self._clock()
        if s is None:
            raise APIError(404, f"unknown session id {sid!r} (never made, deleted, or idle "
                           f"longer than {self.idle_s:g} s)", param="session_id",
                           code="session_not_found")
        return s

    def delete(self, sid: str) -> None:
        s = self.get(sid)
        with self._lock:
            s._idle()
            if sid in self._s:
                self._drop(sid)

"""/v1/sessions: named conversations the client steers (a documented flashrt extension).

A session is its exact token history. Its model state lives in capsules: every turn end is
stored (see tiers.py), so the next turn, a restore or a fork starts from the capsule of that
history (set_context: restore the longest stored prefix, roll back past a divergence, prefill
the rest), and a rollback to a position is exact, recurrent state included. Ids are
unguessable (secrets.token_urlsafe) and a session is reachable only through its id (and the
API key when one is set). One turn at a time per session: a second is a 409.
"""
from __future__ import annotations

import secrets
import threading

from .protocol import APIError

MAX_SESSIONS = 4096
MAX_SNAPSHOTS = 64         # per session


class Session:
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


class SessionTable:
    def __init__(self, limit: int = MAX_SESSIONS):
        self._s: dict[str, Session] = {}
        self._limit = limit
        self._lock = threading.Lock()

    def create(self, tokens=()) -> Session:
        with self._lock:
            if len(self._s) >= self._limit:
                raise APIError(429, f"too many sessions ({self._limit}): delete some first",
                               type="rate_limit_error", headers={"Retry-After": "1"})
            s = Session(tokens)
            self._s[s.id] = s
            return s

    def get(self, sid: str) -> Session:
        with self._lock:
            s = self._s.get(sid)
        if s is None:
            raise APIError(404, f"unknown session id {sid!r}", param="session_id", code="session_not_found")
        return s

    def delete(self, sid: str) -> None:
        s = self.get(sid)
        with self._lock:
            s._idle()
            self._s.pop(sid, None)

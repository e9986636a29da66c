"""/v1/sessions: named conversations the client steers (a documented flashrt extension).

A session is its exact token history. Its model state lives in capsules: every turn end is
stored (see turn_store.py), so the next turn, a restore or a fork starts from the capsule of that
history (set_context: restore the longest stored prefix, roll back past a divergence, prefill
the rest), and a rollback to a position is exact, recurrent state included. Its grammar
state (a turn's response_format cut short by a barge-in, max_tokens or a rollback) goes with
the history: snapshots, restores, forks and rollbacks carry it, and a turn that appends
nothing under the same grammar continues it. Ids are
unguessable (secrets.token_urlsafe) and a session is reachable only through its id, by the
tenant (API key) that made it: to another it does not exist. One turn at a time per session:
a second is a 409. Idle sessions expire (ConversationTable). In the code a session is a
Conversation: its token history, an immutable tuple that snapshots and forks share.

Limits, per tenant: `per_key` sessions and `tokens_per_key` tokens held by its sessions and
their snapshots (a history shared by a snapshot or fork counts once per session), so one
client can neither take the table nor memory from the others. A new session takes the place
of its own tenant's least recently used idle one, never another tenant's; an empty new session
only ever replaces an empty one, so sessions holding nothing never push out sessions that do.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict

from .wire import APIError

MAX_CONVERSATIONS = 4096
MAX_SNAPSHOTS = 64         # per session


def _quota(message: str) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="session_quota",
                    headers={"Retry-After": "1"})


class Conversation:
    def __init__(self, tokens, tenant: str = "", ns: str = "", table=None, grammar: dict | None = None):
        self.id = "sess-" + secrets.token_urlsafe(18)
        self.tenant, self.ns = tenant, ns       # owner; the namespace its turns reuse in
        self.tokens: tuple = tuple(tokens)
        # the grammar state at the history's end: a flashrt.lm Constraint.record() (its ids
        # the history's last tokens), or None; per snapshot too
        self.grammar = grammar
        self.snapshots: dict[str, tuple] = {}
        self._snapshot_grammar: dict[str, dict | None] = {}
        self.busy = False
        self.held = 0                            # tokens of its distinct histories
        self._table = table
        self._lock = threading.Lock()
        self._set(self.tokens, self.snapshots)

    def _set(self, tokens: tuple, snapshots: dict, grow: bool = False) -> None:
        """Make (tokens, snapshots) the session's state, recounting what it holds (each
        distinct history once). grow: a client's request, refused (429, nothing changed) past
        the tenant's token quota; a turn's outcome is never refused."""
        seen = {id(tokens): tokens, **{id(t): t for t in snapshots.values()}}
        held = sum(len(t) for t in seen.values())
        if self._table is not None:
            self._table._charge(self.tenant, held - self.held, grow=grow)
        self.tokens, self.snapshots, self.held = tokens, snapshots, held

    def begin_turn(self) -> tuple:
        """(history as a list, grammar state at its end); the session is busy until end_turn."""
        with self._lock:
            if self.busy:
                raise APIError(409, f"session {self.id} already has a turn in progress", code="session_busy")
            self.busy = True
            return list(self.tokens), self.grammar

    def end_turn(self, tokens, grammar: dict | None = None) -> None:
        """The turn's outcome (prompt + delivered tokens, and the grammar state there), or
        None: keep the old history."""
        with self._lock:
            if tokens is not None:
                self._set(tuple(tokens), self.snapshots)
                self.grammar = grammar
            self.busy = False

    def replace_if(self, expected, tokens) -> bool:
        """Rewrite the history to tokens if the session is idle and its history is exactly
        `expected` (a late barge-in cancel of its last turn); False otherwise."""
        with self._lock:
            if self.busy or expected is None or self.tokens != tuple(expected):
                return False
            self._set(tuple(tokens), self.snapshots)
            self.grammar = _cut(self.grammar, len(tokens))
            return True

    def _idle(self):
        if self.busy:
            raise APIError(409, f"session {self.id} has a turn in progress", code="session_busy")

    def snapshot(self) -> str:
        """A snapshot shares the history (no copy, no tokens counted twice)."""
        with self._lock:
            self._idle()
            snaps = dict(self.snapshots)
            if len(snaps) >= MAX_SNAPSHOTS:
                oldest = next(iter(snaps))
                snaps.pop(oldest)
                self._snapshot_grammar.pop(oldest, None)
            sid = "snap-" + secrets.token_urlsafe(12)
            snaps[sid] = self.tokens
            self._set(self.tokens, snaps)
            self._snapshot_grammar[sid] = self.grammar
            return sid

    def restore(self, sid: str) -> None:
        with self._lock:
            self._idle()
            if sid not in self.snapshots:
                raise APIError(404, f"session {self.id} has no snapshot {sid!r}", param="snapshot_id",
                               code="snapshot_not_found")
            self._set(self.snapshots[sid], self.snapshots)
            self.grammar = self._snapshot_grammar.get(sid)

    def rollback(self, position: int) -> None:
        with self._lock:
            self._idle()
            if not 0 <= position <= len(self.tokens):
                raise APIError(400, f"position {position} is outside the session's history "
                               f"[0, {len(self.tokens)}]", param="position")
            if position < len(self.tokens):       # a new history: counted (snapshots keep the old)
                self._set(self.tokens[:position], self.snapshots, grow=True)
                self.grammar = _cut(self.grammar, position)

    def history(self) -> tuple:
        with self._lock:
            return self.tokens

    def state(self) -> tuple:
        """(history, grammar state at its end), read together."""
        with self._lock:
            return self.tokens, self.grammar

    def info(self) -> dict:
        with self._lock:
            return {"id": self.id, "object": "session", "position": len(self.tokens),
                    "tokens": list(self.tokens), "snapshots": list(self.snapshots), "busy": self.busy}


def _cut(grammar: dict | None, position: int) -> dict | None:
    """A grammar state of a history cut to `position`: the ids past it dropped; None when the
    cut is before the grammar's start."""
    if grammar is None or position < grammar["start"]:
        return None
    return {**grammar, "ids": grammar["ids"][: position - grammar["start"]]}


class ConversationTable:
    """Conversations by id, least recently used first. One idle for idle_s seconds expires; when
    the table (or the tenant's share of it) is full, a new one takes the place of the tenant's
    least recently used idle one (see the module docstring)."""

    def __init__(self, limit: int = MAX_CONVERSATIONS, idle_s: float = 3600.0, clock=time.monotonic,
                 per_key: int | None = None, tokens_per_key: int | None = None):
        self._s: OrderedDict[str, Conversation] = OrderedDict()
        self._used: dict[str, float] = {}
        self._limit, self.idle_s, self._clock = limit, idle_s, clock
        self.per_key = min(per_key, limit) if per_key is not None else limit
        self.tokens_per_key = tokens_per_key
        self._count: dict[str, int] = {}          # tenant -> sessions
        self._held: dict[str, int] = {}           # tenant -> tokens held
        self._lock = threading.Lock()
        self._acct = threading.Lock()

    # ---- accounting -----------------------------------------------------------------------
    def _charge(self, tenant: str, delta: int, grow: bool = False) -> None:
        with self._acct:
            now = self._held.get(tenant, 0) + delta
            if grow and delta > 0 and self.tokens_per_key is not None and now > self.tokens_per_key:
                raise _quota(f"this API key's sessions would hold {now} tokens, past the limit of "
                             f"{self.tokens_per_key} (--session-tokens-per-key): delete sessions "
                             "or snapshots")
            self._held[tenant] = now

    def held_tokens(self, tenant: str = "") -> int:
        with self._acct:
            return self._held.get(tenant, 0)

    # ---- table ----------------------------------------------------------------------------
    def _victim(self, tenant: str, holds: bool):
        """The tenant's least recently used idle session that may make room for a new one:
        an empty one first; one holding tokens only for a new one that holds tokens too."""
        idle = [k for k, v in self._s.items() if v.tenant == tenant and not v.busy]
        return next((k for k in idle if not self._s[k].tokens), None) or (
            idle[0] if holds and idle else None)

    def _make_room(self, tenant: str, holds: bool) -> None:
        now = self._clock()
        for sid in [k for k in self._s if now - self._used[k] >= self.idle_s]:
            if not self._s[sid].busy:
                self._drop(sid)
        for full, what in ((self._count.get(tenant, 0) >= self.per_key,
                            f"this API key holds {self.per_key} sessions (--max-sessions-per-key)"),
                           (len(self._s) >= self._limit, f"too many sessions ({self._limit})")):
            if not full:
                continue
            victim = self._victim(tenant, holds)
            if victim is None:
                mine = [v for v in self._s.values() if v.tenant == tenant]
                if not mine:
                    raise _quota(f"{what}: retry later")
                if all(v.busy for v in mine):
                    raise _quota(f"{what}, every one with a turn in progress: retry later")
                raise _quota(f"{what}: an empty session replaces only an empty one; delete one first")
            self._drop(victim)

    def _drop(self, sid: str) -> None:
        s = self._s.pop(sid)
        del self._used[sid]
        self._count[s.tenant] -= 1
        with s._lock:                   # (lock order: table, then session) a late cancel's
            self._charge(s.tenant, -s.held)   # rewrite of a dropped session counts nowhere
            s._table = None

    def create(self, tokens=(), tenant: str = "", ns: str = "", grammar: dict | None = None) -> Conversation:
        """A session holding tokens (and the grammar state at their end: a fork's)."""
        tokens = tokens if isinstance(tokens, tuple) else tuple(tokens)
        with self._lock:
            self._make_room(tenant, holds=bool(tokens))
            self._charge(tenant, len(tokens), grow=True)       # refused here: nothing made
            s = Conversation((), tenant, ns, table=self, grammar=grammar)
            s.tokens, s.held = tokens, len(tokens)
            self._s[s.id], self._used[s.id] = s, self._clock()
            self._count[tenant] = self._count.get(tenant, 0) + 1
            return s

    def get(self, sid: str, tenant: str | None = None) -> Conversation:
        """The session `sid` (of `tenant`, when given: another tenant's does not exist)."""
        with self._lock:
            s = self._s.get(sid)
            if s is not None and tenant is not None and s.tenant != tenant:
                s = None
            elif s is not None and self._clock() - self._used[sid] >= self.idle_s and not s.busy:
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

    def delete(self, sid: str, tenant: str | None = None) -> None:
        s = self.get(sid, tenant)
        with self._lock:
            s._idle()
            if sid in self._s:
                self._drop(sid)

    def __len__(self) -> int:
        return len(self._s)

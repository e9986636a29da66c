"""Forks that take turns in one arena and its captured graphs.

A CUDA graph bakes in buffer addresses, so a fork with an arena of its own must capture every
step body again (seconds). Forks that share a SharedArena instead cost one state copy: the member
that runs holds the arena; each other member's state waits in a capsule on the same device.
"""
from __future__ import annotations

import threading
import weakref

from flashrt.capsules.types import Capsule
from flashrt.core.session import Session

_SPARE_ROWS = 256     # a parked buffer holds its rows rounded up to this: it serves a few turns
_MAX_SPARES = 2       # freed parked buffers kept for reuse (the largest, when more are freed)


class SharedArena:
    """A Session and its graph bodies, shared by its members. One member is resident (its
    state is the arena's); the others are parked (Session.park) or hold a capsule still to be
    restored. A member dropped without leave() lets go of its parked state with it."""

    def __init__(self, session: Session, first=None):
        self.session = session
        self.graphs = None                 # the layer above's step bodies over this arena
        self.lock = threading.RLock()      # members share the buffers: one steps at a time
        self._resident = weakref.ref(first) if first is not None else None
        self._away = weakref.WeakKeyDictionary()   # member -> (Parked, rows) | Capsule (to restore)
        # parked buffers an unpark freed, (capsule, rows): a switch copies into one of them,
        # since a fresh buffer costs page faults worth 10-40 state copies on CPU
        self._spares: list = []

    def resident(self, member) -> bool:
        return self._resident is not None and self._resident() is member

    def join(self, member, cap: Capsule) -> None:
        """A new member whose state is cap: checked now, restored when it first enters."""
        self.session.check(cap)
        with self.lock:
            self._away[member] = cap

    def enter(self, member) -> None:
        """Make member's state the arena's: the resident is parked (one copy of its state),
        then member's comes back (another). Byte-exact both ways: see Session.park."""
        with self.lock:
            if self.resident(member):
                return
            old = self._resident() if self._resident is not None else None
            if old is not None:
                self._away[old] = self._park()
            state = self._away.pop(member, None)
            if isinstance(state, tuple):
                self.session.unpark(state[0])
                self._keep_spare(state)
            elif state is not None:
                self.session.restore(state)
            else:                             # a member that never held state: empty
                self.session.reset()
            self._resident = weakref.ref(member)

    def _park(self) -> tuple:
        """The resident's state into a spare buffer that holds its rows (or a new one)."""
        s = self.session
        fits = [i for i, (_, rows) in enumerate(self._spares) if rows >= s.position]
        if fits:
            buf, rows = self._spares.pop(fits[0])
        else:
            rows = min(s.max_seq_len, -(-(s.position + 1) // _SPARE_ROWS) * _SPARE_ROWS)
            buf = s.empty_capsule(rows)
        return s.park(into=buf), rows

    def _keep_spare(self, away: tuple) -> None:
        self._spares.append((away[0].capsule, away[1]))
        self._spares.sort(key=lambda sp: -sp[1])
        del self._spares[_MAX_SPARES:]

    def take(self, member) -> Session:
        """The session, holding member's state (its turn taken if another member held it)."""
        r = self._resident                # inline resident(): this runs on every call of a member
        if r is None or r() is not member:
            self.enter(member)
        return self.session

    def position(self, member) -> int:
        """member's committed positions, without bringing it in."""
        with self.lock:
            if self.resident(member):
                return self.session.position
            state = self._away.get(member)
            return 0 if state is None else state[0].position if isinstance(state, tuple) \
                else state.position

    def leave(self, member) -> None:
        """member is done: its parked state is dropped; the arena is free for the next."""
        with self.lock:
            state = self._away.pop(member, None)
            if isinstance(state, tuple):
                self._keep_spare(state)
            if self.resident(member):
                self._resident = None

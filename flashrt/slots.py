"""Forks that take turns in one arena and its captured graphs.

A CUDA graph bakes in buffer addresses, so a fork with an arena of its own must capture every
step body again (seconds). Forks that share a Slot instead cost one state copy: the member
that runs holds the arena; each other member's state waits in a capsule on the same device.
"""
from __future__ import annotations

import threading
import weakref

from flashrt.capsules.types import Capsule
from flashrt.session import Parked, Session


class Slot:
    """A Session and its graph bodies, shared by its members. One member is resident (its
    state is the arena's); the others are parked (Session.park) or hold a capsule still to be
    restored. A member dropped without leave() lets go of its parked state with it."""

    def __init__(self, session: Session, first=None):
        self.session = session
        self.graphs = None                 # the layer above's captured bodies over this arena
        self.lock = threading.RLock()      # members share the buffers: one steps at a time
        self._resident = weakref.ref(first) if first is not None else None
        self._away = weakref.WeakKeyDictionary()   # member -> Parked | Capsule (to restore)

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
                self._away[old] = self.session.park()
            state = self._away.pop(member, None)
            if isinstance(state, Parked):
                self.session.unpark(state)
            elif state is not None:
                self.session.restore(state)
            else:                             # a member that never held state: empty
                self.session.reset()
            self._resident = weakref.ref(member)

    def take(self, member) -> Session:
        """The session, holding member's state (its turn taken if another member held it)."""
        r = self._resident                # inline resident(): this runs on every call of a member
        if r is None or r() is not member:
            self.enter(member)
        return self.session

    def graphs_for(self, member):
        """The graph bodies, to run on member's state."""
        self.take(member)
        return self.graphs

    def position(self, member) -> int:
        """member's committed positions, without bringing it in."""
        with self.lock:
            if self.resident(member):
                return self.session.position
            state = self._away.get(member)
            return 0 if state is None else state.position

    def leave(self, member) -> None:
        """member is done: its parked state is dropped; the arena is free for the next."""
        with self.lock:
            self._away.pop(member, None)
            if self.resident(member):
                self._resident = None

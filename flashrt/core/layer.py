"""What every layer on one Session shares (a policy, a VAD stream, a transcriber): the capsule
face (snapshot, restore, empty_capsule, save, load), reset and layout, each under the layer's lock.
A subclass sets `self.session`, `self.arena` and `self._lock`, and adds its stepping and fork()."""
from __future__ import annotations

from flashrt.capsules import load_capsule, save_capsule
from flashrt.capsules.types import Capsule


class SessionLayer:
    fingerprint = property(lambda self: self.session.fingerprint)

    def layout(self) -> str:
        return self.arena.table()

    def reset(self) -> None:
        """A fresh stream or episode: the session's state zeroed (rng-kind buffers continue), position 0."""
        with self._lock:
            self.session.reset()

    def snapshot(self, into: Capsule | None = None, single_use: bool = False) -> Capsule:
        """Copy the whole state (every named buffer of the arena) into a capsule."""
        with self._lock:
            return self.session.snapshot(into, single_use)

    def restore(self, cap: Capsule, on_validated=None) -> None:
        """Make the state the capsule's; refused, state untouched, unless it fits (model, config,
        weights, dtype, layout). on_validated: see Session.restore (a store's claim)."""
        with self._lock:
            self.session.restore(cap, on_validated=on_validated)

    def empty_capsule(self) -> Capsule:
        """A preallocated capsule buffer for snapshot(into=)."""
        return self.session.empty_capsule()

    def save(self, path) -> None:
        """Write the state to a capsule file (flashrt.capsules.save_capsule, atomic)."""
        save_capsule(self.snapshot(), path)

    def load(self, path) -> None:
        """Restore the state from a capsule file; refused, state untouched, unless it fits."""
        self.restore(load_capsule(path, device=str(self.session.arena.device)))

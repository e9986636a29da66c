"""Where a rollback restores from, and a history parked out of its arena (shared-arena forks)."""
from __future__ import annotations

from dataclasses import dataclass

from flashrt.capsules.types import Capsule
from flashrt.errors import CapsuleMismatchError

MAX_ANCHORS = 8    # ids of capsules of this history a delta snapshot may reference


class Sources:
    """What a rollback restores from: fixed-state checkpoints at multiples of checkpoint_every,
    and the base, the last capsule of this history the session made or restored, held
    strongly (one, so its memory stays bounded); both are chosen by the operations alone,
    never by garbage collection. Ancestors: (id, position) of the last MAX_ANCHORS capsules
    whose rows this session still holds, for delta parents (no memory held)."""

    def __init__(self, max_checkpoints: int):
        self.max_checkpoints = max_checkpoints
        self.checkpoints: list[Capsule] = []
        self.base: tuple | None = None          # (capsule, its id then)
        self.ancestors: list[tuple] = []        # (id, position)

    def clear(self) -> None:
        self.checkpoints.clear()
        self.base, self.ancestors = None, []

    def recycle(self) -> Capsule | None:
        """The oldest checkpoint's buffer when at the limit (reused for the next one)."""
        return self.checkpoints.pop(0) if len(self.checkpoints) >= self.max_checkpoints else None

    def anchor(self, cap: Capsule, cid: str) -> None:
        """cap (whose id is cid) was made from this history: the base, and an ancestor."""
        base, anc = self.base, self.ancestors
        if base is not None and base[0] is cap and anc and anc[-1][0] == base[1]:
            self.base, anc[-1] = (cap, cid), (cid, cap.position)   # snapshot(into=) again
            return
        self.base = (cap, cid)
        kept = [a for a in anc if a[0] != cid][-(MAX_ANCHORS - 1):]
        self.ancestors = kept + [(cid, cap.position)]

    def restored(self, chain) -> None:
        """The state is now chain[-1]'s (its ancestors' rows below): what rollback may use."""
        if self.checkpoints:
            self.checkpoints.clear()
        if len(chain) == 1:                       # the common case, one capsule
            cap, = chain
            cid = cap.id
            self.base, self.ancestors = (cap, cid), [(cid, cap.position)]
            return
        self.base = (chain[-1], chain[-1].id) if chain else None
        self.ancestors = [(c.id, c.position) for c in chain]

    def parent_ref(self, parent) -> tuple:
        """(metadata reference, capsule or None) for snapshot(parent=): a capsule, or the
        (id, position) of one, whose rows this history still holds."""
        if parent is None:
            return None, None
        obj = parent if isinstance(parent, Capsule) else None
        pid, ppos = (parent.id, parent.position) if obj is not None else parent
        if (pid, ppos) not in self.ancestors:
            raise CapsuleMismatchError(
                f"snapshot(parent=): this session's state does not extend capsule {pid} (it "
                "was not restored or snapshotted here, or rows below it were rewritten)")
        return {"id": pid, "position": ppos}, obj

    def drop_above(self, row: int) -> None:
        self.ancestors = [a for a in self.ancestors if a[1] <= row]
        if self.base is not None and self.base[0].position > row:
            self.base = None

    def keep_below(self, position: int) -> None:
        self.checkpoints = [c for c in self.checkpoints if c.position <= position]

    def start(self, position: int, has_fixed_state: bool) -> tuple[int, Capsule | None]:
        """(position, capsule) a rollback to `position` starts from: the nearest checkpoint
        or anchored capsule at or before it; attention-only models rewind KV by position
        and re-run one position for its outputs."""
        best = self.best(position)
        if not has_fixed_state and position > 0 and (best is None or best.position < position):
            return position - 1, None
        return (best.position, best) if best is not None else (0, None)

    def best(self, position: int) -> Capsule | None:
        """The deepest checkpoint, or the base if unchanged since, at or below position."""
        caps = [c for c in self.checkpoints if c.position <= position]
        if self.base is not None:
            cap, cid = self.base
            if cap.id == cid and cap.position <= position:
                caps.append(cap)
        return max(caps, key=lambda c: c.position, default=None)


@dataclass(frozen=True)
class Parked:
    """A history taken out of its arena (Session.park): its state and its rollback sources."""
    capsule: Capsule
    sources: Sources

    @property
    def position(self) -> int:
        return self.capsule.position

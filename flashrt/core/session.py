"""A Session: one arena over a model's shared weights, its position, and its capsules.

The session steps any stateful model over named inputs and commits positions; it snapshots,
restores, forks and rolls back by copying the arena's capsule kinds. It knows nothing of
tokens, vocabularies or sampling: the layer above (a language model, a policy) brings its own
buffers and bodies, and tells rollback how to re-run positions (`replay`).
"""
from __future__ import annotations

import itertools
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Callable

import torch

from flashrt.core.arena import CAPSULE_KINDS, Arena, BufferSpec
from flashrt.core.copy import Copier
from flashrt.capsules.types import Capsule, CapsuleMeta, ReadOnlyDict
from flashrt.errors import CapsuleMismatchError
from flashrt.core.sources import Parked, Sources
from flashrt.core.step import StepCtx
from flashrt.version import __version__

_FIXED_KINDS = frozenset(("recurrent", "conv"))    # state a position alone cannot rewind
_ROLLBACK_KINDS = frozenset(("recurrent", "conv", "meta"))   # rng: a retry samples afresh


@dataclass
class SessionOptions:
    max_seq_len: int = 4096           # per-token rows: the most positions a history holds
    prefill_chunk: int = 2048         # positions per eager step (fewer weight passes)
    checkpoint_every: int = 1024      # rollback checkpoints where steps reach multiples of this
    max_checkpoints: int = 16         # memory bound: oldest dropped first


def _check_into(into, fingerprint) -> None:
    if not isinstance(into, Capsule):
        raise TypeError(f"snapshot(into=) takes a Capsule (empty_capsule()), got {type(into).__name__}")
    if into.meta.fingerprint is not fingerprint and into.entries and into.meta.fingerprint != fingerprint:
        raise CapsuleMismatchError("snapshot(into=): that capsule was made by another model/layout")


def _restore_kinds(kinds) -> frozenset | None:
    """restore(kinds=): those kinds and meta; refused unless all are capsule kinds."""
    if kinds is None:
        return None
    want = frozenset(kinds) | {"meta"}
    bad = want - CAPSULE_KINDS
    if bad:
        raise ValueError(f"restore(kinds=): unknown or non-capsule kinds {sorted(bad)}")
    return want


class StatePlanes:
    """Every fixed buffer's value after each position of one step: name -> (T, *shape), filled
    by the model through StepCtx.planes; keep(t) makes it the arena's fixed state (the caller
    then commits t + 1 positions: KV rows above are rewound by position)."""

    def __init__(self, arena: Arena, specs: list[BufferSpec], T: int):
        self.arena, self.size = arena, T
        self.buffers = {sp.name: torch.empty((T, *sp.shape), dtype=sp.dtype, device=arena.device)
                        for sp in specs}

    def views(self, T: int) -> dict:
        """The planes of a T-position step (T <= size), as StepCtx.planes."""
        return {n: b[:T] for n, b in self.buffers.items()}

    def keep(self, t: int) -> None:
        for name, b in self.buffers.items():
            self.arena[name].copy_(b[t])


class Session:
    """One sequence (batch 1). Parallel branches are forks: sessions over the same weights."""

    def __init__(self, net, specs: list[BufferSpec], device, dtype: torch.dtype,
                 fingerprint: dict, options: SessionOptions, provenance: dict | None = None,
                 history: str | None = None):
        """history: the per-token buffer (of the layer above) whose committed rows are a
        capsule's history key (Capsule.history: what stores index and deltas extend)."""
        self.net, self.options, self.dtype = net, options, dtype
        self._extra = {"history": history} if history is not None else {}
        own = [BufferSpec("meta.position", "meta", (1,), torch.int64)]
        with torch.no_grad():
            self.arena = Arena(net.state_specs(options.max_seq_len, dtype) + specs + own, device)
        self.device = self.arena.device
        self.copier = Copier(self.arena)
        # shared, read-only, by every capsule made here: a snapshot copies no dict
        self.fingerprint = ReadOnlyDict(fingerprint, layout=self.arena.fingerprint())
        self.provenance = ReadOnlyDict(provenance or {}, device=str(self.device),
                                       torch=torch.__version__, flashrt=__version__,
                                       pid=os.getpid(), threads=torch.get_num_threads())
        self._lock = threading.RLock()
        # capsule ids "<session token>-<counter>": uuid4 per snapshot costs ~30 us of urandom
        self._ids = map(f"{uuid.uuid4().hex[:16]}-".__add__, map(str, itertools.count()))
        self._position = 0
        self._sources = Sources(options.max_checkpoints)
        self.has_fixed_state = any(s.spec.kind in _FIXED_KINDS for s in self.arena.slots)

    # ---- position ---------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Committed positions: the truth, mirrored (by _set_position) in meta.position."""
        return self._position

    max_seq_len = property(lambda self: self.options.max_seq_len, doc="Per-token rows.")

    def _set_position(self, n: int) -> None:
        self._position = n
        self.arena["meta.position"].fill_(n)

    def adopt(self, position: int) -> None:
        """The arena's bytes, written directly (a benchmark's synthetic state, an import), are
        now the committed state at `position`: checkpoints and anchors are dropped."""
        with self._lock:
            if not 0 <= position <= self.max_seq_len:
                raise ValueError(f"position {position} outside [0, {self.max_seq_len}]")
            self._set_position(position)
            self._sources.clear()

    # ---- stepping -----------------------------------------------------------------------
    def chunks(self, n: int) -> list[int]:
        """Step lengths for n positions: at most prefill_chunk, split at checkpoint boundaries when
        the model has fixed state (attention-only models rewind by position alone). A short
        step (a user turn: at most checkpoint_every/16) is not split: a second weight pass
        costs more than the checkpoint lands late (it is taken at the step's end)."""
        pos, every, out = self._position, self.options.checkpoint_every, []
        while n:
            step = min(n, self.options.prefill_chunk)
            if self.has_fixed_state and step > every // 16:
                step = min(step, every - pos % every)
            out.append(step)
            pos, n = pos + step, n - step
        return out

    def advance(self, n: int, run: Callable[[int, int], object]) -> list:
        """Append n positions in planned chunks (see chunks): run(offset, k) steps positions
        [offset, offset + k) of the n, through step() or a replayed body and commit(); returns
        what each run returned. Refused before any step when n does not fit."""
        self.check_room(n)
        outs, i = [], 0
        for k in self.chunks(n):
            start = self._position
            outs.append(run(i, k))
            if self._position != start + k:
                raise RuntimeError(f"advance: a {k}-position chunk committed "
                                   f"{self._position - start} positions")
            i += k
        return outs

    def check_room(self, n: int) -> None:
        if self._position + n > self.max_seq_len:
            raise ValueError(f"{n} positions at position {self._position} exceed max_seq_len "
                             f"{self.max_seq_len}")

    def step(self, n: int, body: Callable[[StepCtx], object], commit: bool = True):
        """Run body over positions [position, position + n) eagerly; commit them unless told
        not to (a verify step the caller may roll back). Returns what body returns."""
        start = self._position
        self._note_threads()
        ctx = StepCtx(n, torch.arange(start, start + n, device=self.device), start=start)
        out = body(ctx)
        if commit:
            self.commit(n)
        return out

    def static_ctx(self, n: int, positions: torch.Tensor | None = None) -> StepCtx:
        """A graph-safe context: positions from meta.position (a device tensor) + arange."""
        if positions is None:
            positions = self.arena["meta.position"] + torch.arange(n, device=self.device)
        return StepCtx(n, positions, static=True)

    def commit(self, n: int) -> None:
        """n more positions are committed (after a step or a replayed graph)."""
        self._note_threads()
        self._set_position(self._position + n)
        self._maybe_checkpoint(n)

    def invalidate_from(self, row: int) -> None:
        """Per-token rows from `row` on are being rewritten below the committed position:
        capsules that hold the old rows stop being rollback sources and delta parents."""
        self._sources.drop_above(row)

    def _note_threads(self) -> None:
        # CPU bits depend on the intra-op thread count: provenance records the last step's
        n = torch.get_num_threads()
        if n != self.provenance["threads"]:
            self.provenance = ReadOnlyDict(self.provenance, threads=n)

    def preserving_state(self, fn: Callable, rows: int):
        """Run fn (warm-up or capture, which steps for real `rows` positions ahead) and put
        the state back: fixed state from a capsule, per-token rows at the scratch window."""
        a, P = self.arena, self._position
        w = max(0, min(P, self.max_seq_len - rows))
        fixed = self.mark()
        saved = {n: a[n][w:P].clone() for n in a.names(CAPSULE_KINDS)
                 if a.slot(n).spec.seq_dim == 0} if w < P else {}
        a["meta.position"].fill_(w)
        try:
            with torch.no_grad():
                return fn()
        finally:
            self.copier.restore(fixed, CAPSULE_KINDS)
            for n, r in saved.items():
                a[n][w:P].copy_(r)
            self._set_position(P)

    # ---- capsules ---------------------------------------------------------------------
    def _meta(self, single_use: bool = False, parent: dict | None = None) -> CapsuleMeta:
        return CapsuleMeta(self._position, self.fingerprint, self.provenance, parent, single_use,
                           {"id": next(self._ids), **self._extra})

    def snapshot(self, into: Capsule | None = None, single_use: bool = False,
                 parent: "Capsule | tuple | None" = None) -> Capsule:
        """Copy the committed state: per-token rows [0, position) and every fixed buffer.

        parent: a capsule this session was restored from (or snapshotted) whose rows it still
        holds, or its (id, position) from ancestors(); the result stores only rows
        [parent position, position) and references it (attached when given as a capsule)."""
        with self._lock:
            if into is not None and not (isinstance(into, Capsule)
                                         and into.meta.fingerprint is self.fingerprint):
                _check_into(into, self.fingerprint)
            ref, obj = self._sources.parent_ref(parent) if parent is not None else (None, None)
            if into is None:    # the new capsule replaces the base: let go of the old one first,
                self._sources.base = None   # so a dropped one's memory serves the fresh buffer
            meta = self._meta(single_use, ref)
            cap = self.copier.snapshot(self._position, meta, into=into, parent=obj)
            self._sources.anchor(cap, meta.extra["id"])
            return cap

    def ancestors(self) -> list[tuple]:
        """(id, position) of capsules whose rows this session holds unchanged (delta parents)."""
        return [a for a in self._sources.ancestors if a[1] <= self._position]

    def mark(self, into: Capsule | None = None) -> Capsule:
        """The fixed state only (KV rows below stay valid by position): to rewind() to."""
        return self.copier.snapshot(self._position, CapsuleMeta(self._position, self.fingerprint, {}),
                                    into=into, fixed_only=True)

    def state_planes(self, T: int) -> "StatePlanes | None":
        """Buffers for a step that also keeps the fixed state after each of its T positions
        (StepCtx.planes), or None when the model writes none (StatefulModel.state_planes)."""
        fixed = [s.spec for s in self.arena.slots if s.spec.kind in _FIXED_KINDS]
        return StatePlanes(self.arena, fixed, T) if self.net.state_planes or not fixed else None

    def rewind(self, mark: Capsule) -> None:
        """Back to a mark() of this history; rng-kind buffers keep their stream."""
        self.copier.restore(mark, _ROLLBACK_KINDS & mark.kinds)
        self._set_position(mark.position)

    def empty_capsule(self, max_positions: int | None = None, host: bool = False) -> Capsule:
        """A preallocated capsule buffer for snapshot(into=), on the arena's device, or with
        host=True in host memory (pinned when CUDA runs) for load_capsule(into=)."""
        n = self.max_seq_len if max_positions is None else max_positions
        pin = (host or self.device.type == "cpu") and torch.cuda.is_available()
        return self.copier.empty(n, self.fingerprint, pin, "cpu" if host else self.device)

    def restore(self, cap: Capsule, kinds=None, on_validated: Callable | None = None) -> None:
        """Make the session's state the capsule's. Refused (state untouched) unless it fits.
        kinds: restore only those (+ meta; an unsafe ablation). on_validated: called after
        validation, before any byte is written (a store claims single-use capsules there)."""
        with self._lock:
            want = _restore_kinds(kinds)
            plan, chain = self.copier.plan_restore(cap, self.fingerprint, self.max_seq_len, want)
            if on_validated is not None:
                on_validated()
            if cap.meta.single_use:
                cap.claim()                           # validation first, then consume
            plan.run()
            self._position = cap.position           # meta.position came with the capsule's bytes
            # a partial restore leaves a mixed state: nothing may build on it
            self._sources.restored(chain if want is None else ())

    def check(self, cap: Capsule) -> None:
        """Refuse, naming the field, a capsule this session could not restore (see restore)."""
        self.copier.check_fits(cap, self.fingerprint, self.max_seq_len)

    def park(self, into: Capsule | None = None) -> Parked:
        """Take this history out of the arena (one copy of its state, into `into` if given) so
        another may use it; unpark() puts it back byte for byte, checkpoints included."""
        with self._lock:
            parked = Parked(self.copier.snapshot(self._position, self._meta(), into=into), self._sources)
            self._sources = Sources(self.options.max_checkpoints)
            return parked

    def unpark(self, parked: Parked) -> None:
        with self._lock:
            self.copier.restore(parked.capsule, parked.capsule.kinds, [parked.capsule])
            self._position, self._sources = parked.position, parked.sources

    def reset(self) -> None:
        """Empty the session: zero the fixed state (rng-kind buffers continue), position 0."""
        with self._lock, torch.no_grad():
            a = self.arena
            rng = {n: a[n].clone() for n in a.names(("rng",))}
            a.data[a.fixed_begin: a.fixed_end].zero_()
            for n, v in rng.items():
                a[n].copy_(v)
            self._set_position(0)
            self._sources.clear()

    # ---- rollback -----------------------------------------------------------------------
    def _maybe_checkpoint(self, n: int) -> None:
        """After n positions: a checkpoint when they reached or crossed a multiple of checkpoint_every."""
        every = self.options.checkpoint_every
        if self._position // every == (self._position - n) // every:
            return
        cp = self.copier.snapshot(self._position, self._meta(), into=self._sources.recycle(),
                                  fixed_only=True)
        self._sources.checkpoints.append(cp)

    def checkpoint_positions(self) -> list[int]:
        return [c.position for c in self._sources.checkpoints]

    def rollback_source(self, position: int) -> int:
        """The position a rollback to `position` restores from (then re-runs the rest)."""
        return self._sources.start(position, self.has_fixed_state)[0]

    def rollback(self, position: int, replay: Callable[[int, int], None]) -> None:
        """Return to an earlier boundary: fixed state from the nearest checkpoint or anchored
        capsule at or before `position` (per-token rows below stay valid), then
        replay(from, position) re-runs the gap. rng-kind buffers are not rewound."""
        with self._lock:
            if not 0 <= position <= self._position:
                raise ValueError(f"rollback position {position} is outside the history "
                                 f"[0, {self._position}]")
            if position == self._position:
                return
            self._sources.keep_below(position)
            src, cap = self._sources.start(position, self.has_fixed_state)
            self.invalidate_from(src)
            if cap is not None:     # rows below a delta's own are this history's: its parent not needed
                self.copier.restore(cap, _ROLLBACK_KINDS & cap.kinds, chain=[cap])
                self._set_position(src)
            elif src == 0:
                self.reset()
            else:                                   # attention-only: KV rows are the state
                self._set_position(src)
            if src < position:
                replay(src, position)

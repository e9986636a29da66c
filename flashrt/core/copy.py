"""Copies between a session's arena and capsule buffers: planning, snapshot, restore, checks.

A `Copier` belongs to whoever owns the arena (a Session) and keeps that arena's plan cache: a
fresh capsule's copy plan is a cached table moved onto its buffer, with no views built (the
arena never moves, so its addresses stay valid). Fixed-size state sits first in a capsule, at
the arena's relative offsets, so it is one copy; each per-token buffer adds one (live rows).
"""
from __future__ import annotations

import weakref

import torch

from flashrt.core.arena import CAPSULE_KINDS, Arena
from flashrt.errors import CapsuleMismatchError
from flashrt.native import SegmentPlan

from flashrt.capsules.types import FINGERPRINT_KEYS, Capsule, CapsuleMeta, Entry, ReadOnlyDict, dtype_name, round_up

_MAX_TABLES = 64      # plan tables kept per arena (one per position snapshotted fresh)
_MAX_PLANS = 8        # plans kept per capsule buffer
_MAX_CHAINS = 16      # delta chains' checked tables per arena, least recently used out (apart
                      # from _tables, which snapshots at many positions clear)


def plan_entries(arena: Arena, position: int, row0: int = 0) -> tuple[list[Entry], int]:
    """Entries for every capsule-kind buffer, and the bytes the capsule buffer needs.

    row0 > 0 makes a delta capsule: per-token state rows [row0, position) only, except the
    token history (meta kind), which is always whole so a capsule alone names its prefix.
    """
    entries = []
    for s in arena.slots:
        if s.spec.kind in CAPSULE_KINDS and s.spec.seq_dim is None:
            entries.append(Entry(s.name, s.spec.kind, dtype_name(s.spec.dtype), tuple(s.spec.shape),
                                 s.offset - arena.fixed_begin, False))
    off = round_up(arena.fixed_end - arena.fixed_begin)
    for s in arena.slots:
        if s.spec.kind not in CAPSULE_KINDS or s.spec.seq_dim is None:
            continue
        r0 = 0 if s.spec.kind == "meta" else row0
        if s.name == arena.after_fixed and r0 == 0 and entries:
            off = s.offset - arena.fixed_begin    # mirrors the arena: see copy_pairs
        shape = (position - r0,) + tuple(s.spec.shape[1:])
        entries.append(Entry(s.name, s.spec.kind, dtype_name(s.spec.dtype), shape, off, True, r0))
        off = round_up(off + shape[0] * s.spec.row_bytes)
    return entries, off


def copy_pairs(arena: Arena, cap: Capsule, entries, to_capsule: bool, table=None):
    """(src, dst) byte views between arena and capsule; the fixed block is one pair.
    table: the capsule's whole entry table (default cap.entries)."""
    pairs, fixed, joined = [], [e for e in entries if not e.seq], None
    if _fixed_block_ok(arena, cap, fixed, cap.entries if table is None else table):
        end = arena.fixed_end - arena.fixed_begin
        # the buffer laid out after the fixed range, at the same distance in the capsule: its
        # rows join the fixed block's copy (the padding between goes along: nothing reads it)
        joined = next((e for e in entries if e.seq and e.name == arena.after_fixed), None)
        if joined is not None and joined.row0 == 0 and joined.shape[0] > 0 \
                and joined.offset == arena.slot(joined.name).offset - arena.fixed_begin:
            end = joined.offset + joined.nbytes
        else:
            joined = None
        a = arena.data[arena.fixed_begin: arena.fixed_begin + end]
        c = cap.data[:end]
        pairs.append((a, c) if to_capsule else (c, a))
    else:  # a subset of kinds: copy buffer by buffer
        for e in fixed:
            a, c = arena.bytes_of(e.name), cap.raw(e)
            pairs.append((a, c) if to_capsule else (c, a))
    for e in entries:
        if e.seq and e.shape[0] > 0 and e is not joined:
            a, c = arena.rows_bytes(e.name, e.row0, e.row0 + e.shape[0]), cap.raw(e)
            pairs.append((a, c) if to_capsule else (c, a))
    return pairs


def _fixed_block_ok(arena: Arena, cap: Capsule, fixed, table) -> bool:
    """True when the capsule's fixed entries mirror the arena's fixed range byte for byte."""
    if not fixed or len(fixed) != sum(1 for e in table if not e.seq):
        return False
    if cap.data.numel() < arena.fixed_end - arena.fixed_begin:
        return False
    return all(e.offset == arena.slot(e.name).offset - arena.fixed_begin for e in fixed)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:0 name one device here: the arena reports its tensor's real device."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class Copier:
    """Snapshot, restore and fit checks for one arena, with that arena's plan cache."""

    def __init__(self, arena: Arena):
        self.arena = arena
        # address tables per entry table, moved onto each new buffer of that layout (a fresh
        # snapshot is a new buffer each time, so a per-capsule plan cannot serve it)
        self._tables: dict = {}
        self._chains: dict = {}

    def _keep(self, key, table) -> None:
        if len(self._tables) >= _MAX_TABLES:
            self._tables.clear()
        self._tables[key] = table

    def _remember(self, cap: Capsule, key, made_for, plan) -> None:
        """A plan cached on the capsule, valid while this copier (and its arena) is alive and
        the capsule still matches made_for (its entry table, or more)."""
        plans = cap.plans
        if len(plans) > _MAX_PLANS:
            plans.clear()
        plans[("copy",) + key] = (weakref.ref(self), made_for, plan)

    # ---- buffers ------------------------------------------------------------------------
    def empty(self, max_tokens: int, fingerprint: dict, pin: bool = False, device=None) -> Capsule:
        """A capsule buffer for snapshot(into=) or load(into=), sized for max_tokens."""
        _, need = plan_entries(self.arena, max_tokens)
        data = torch.empty(need, dtype=torch.uint8, device=device or self.arena.device, pin_memory=pin)
        return Capsule(data, [], CapsuleMeta(0, fingerprint, {}))

    # ---- snapshot -----------------------------------------------------------------------
    def _entries(self, position: int, row0: int, fixed_only: bool):
        entries, need = plan_entries(self.arena, position, row0)
        if fixed_only:   # rollback checkpoints: KV rows below the position stay valid in the arena
            entries = [e for e in entries if not e.seq]
            need = round_up(self.arena.fixed_end - self.arena.fixed_begin)
        return tuple(entries), need

    def _fresh(self, position: int, meta: CapsuleMeta, pin: bool, fixed_only: bool, row0: int):
        """Into a new buffer. The first snapshot at a position plans from views and keeps its
        table; later ones move that table onto their buffer: one allocation, one native copy."""
        arena, key = self.arena, ("snap", position, fixed_only, row0)
        t = self._tables.get(key)
        if t is not None:
            entries, need, derived, src, off, nb = t
            data = torch.empty(need, dtype=torch.uint8, device=arena.device, pin_memory=pin)
            seg = SegmentPlan.from_table(src, off + data.data_ptr(), nb, data.device, (data,))
            if seg is not None:
                cap = Capsule(data, entries, meta, derived)
                seg.run()
                return cap
        entries, need = self._entries(position, row0, fixed_only)
        data = torch.empty(need, dtype=torch.uint8, device=arena.device, pin_memory=pin)
        cap = Capsule(data, entries, meta)
        seg = SegmentPlan(copy_pairs(arena, cap, entries, to_capsule=True))
        self._keep(key, (cap.entries, need, cap.derived, seg.src, seg.dst - data.data_ptr(), seg.nbytes))
        seg.run()
        return cap

    def snapshot(self, position: int, meta: CapsuleMeta, into: Capsule | None = None,
                 pin: bool = False, fixed_only: bool = False, parent: Capsule | None = None) -> Capsule:
        """meta.parent set: a delta capsule over the rows below meta.parent["position"]; parent,
        when given, is attached as the capsule that holds them."""
        row0 = meta.parent["position"] if meta.parent is not None else 0
        if into is None:
            cap = self._fresh(position, meta, pin, fixed_only, row0)
            cap.parent_capsule = parent
            return cap
        key = ("snap", position, fixed_only, row0)
        hit = into.plans.get(("copy",) + key)       # checked when built; the buffer never moves
        if hit is not None and hit[0]() is self:
            entries, seg = hit[1], hit[2]
        else:
            if not _same_device(into.device, self.arena.device):
                raise CapsuleMismatchError(f"snapshot(into=): capsule is on {into.device}, "
                                           f"arena on {self.arena.device}")
            entries, need = self._entries(position, row0, fixed_only)
            if into.data.numel() < need:
                raise CapsuleMismatchError(f"snapshot(into=): capsule buffer holds "
                                           f"{into.data.numel()} B, this state needs {need} B")
            seg = SegmentPlan(copy_pairs(self.arena, into, entries, to_capsule=True, table=entries))
            self._remember(into, key, entries, seg)
        into.refill(entries, meta, parent)
        seg.run()
        return into

    # ---- restore ------------------------------------------------------------------------
    def _restore_plan(self, cap: Capsule, kinds: frozenset, chain) -> SegmentPlan:
        pairs = []
        for anc in chain[:-1]:   # ancestors give only their per-token rows below row0
            rows = [e for e in anc.entries if e.seq and e.kind != "meta" and e.kind in kinds]
            pairs += copy_pairs(self.arena, anc, rows, to_capsule=False)
        pairs += copy_pairs(self.arena, cap, [e for e in cap.entries if e.kind in kinds],
                            to_capsule=False)
        return SegmentPlan(pairs)

    def restore(self, cap: Capsule, kinds: frozenset, chain=None) -> None:
        """Copy the capsule (and, for a delta capsule, its ancestors' rows) into the arena.
        chain: cap.chain(), when the caller has it. Checked by check_fits first."""
        self._plan(cap, kinds, chain).run()

    def plan_restore(self, cap: Capsule, fingerprint: dict, max_seq_len: int,
                     kinds: frozenset | None = None) -> tuple[SegmentPlan, list]:
        """(plan, cap.chain()) to restore cap, checked by check_fits; nothing is written.
        kinds: those only (default: all it holds). A capsule checked here before, with the same
        entry table, position and (read-only, so unedited) fingerprint object, is not again."""
        made_for = None
        if isinstance(cap, Capsule) and cap.is_delta:      # a stored prefix: the same chain again
            chain = cap.chain()
            seg = self._chain_hit(chain, fingerprint, max_seq_len, kinds)
            if seg is not None:
                return seg, chain
        elif isinstance(cap, Capsule):
            meta = cap.meta
            made_for = (cap.entries, meta.fingerprint, meta.position, fingerprint, max_seq_len)
            hit = cap.plans.get(("copy", "checked", kinds))
            if hit is not None and hit[0]() is self and hit[1] == made_for:
                return hit[2], [cap]
        chain = self.check_fits(cap, fingerprint, max_seq_len)
        seg = self._plan(cap, cap.kinds if kinds is None else kinds & cap.kinds, chain)
        if made_for is not None and type(made_for[1]) is ReadOnlyDict:
            self._remember(cap, ("checked", kinds), made_for, seg)
        elif cap.is_delta and seg.mode in ("cpu", "cuda"):
            self._keep_chain(chain, fingerprint, max_seq_len, kinds, seg)
        return seg, chain

    def _keep_chain(self, chain, fingerprint, max_seq_len, kinds, seg) -> None:
        """A checked delta chain's address table, valid while every link is the same buffer,
        entry table and meta (a stored capsule is never rewritten): no views, no history walk."""
        if not all(type(c.meta.fingerprint) is ReadOnlyDict for c in chain):
            return                              # an editable fingerprint: check it every time
        links = tuple((weakref.ref(c.data), c.entries, c.meta) for c in chain)
        if len(self._chains) >= _MAX_CHAINS:
            del self._chains[next(iter(self._chains))]
        self._chains[(kinds, tuple(c.id for c in chain))] = (
            links, fingerprint, max_seq_len, seg.src, seg.dst, seg.nbytes, seg.device)

    def _chain_hit(self, chain, fingerprint, max_seq_len, kinds) -> SegmentPlan | None:
        key = (kinds, tuple(c.id for c in chain))
        t = self._chains.get(key)
        if t is None or t[1] is not fingerprint or t[2] != max_seq_len:
            return None
        for (ref, entries, meta), c in zip(t[0], chain):
            if ref() is not c.data or c.entries is not entries or c.meta is not meta:
                return None
        self._chains[key] = self._chains.pop(key)          # most recently used
        return SegmentPlan.from_table(t[3], t[4], t[5], t[6], tuple(c.data for c in chain))

    def _plan(self, cap: Capsule, kinds: frozenset, chain) -> SegmentPlan:
        if cap.is_delta:                      # ancestors may be re-attached: plan afresh
            return self._restore_plan(cap, kinds, chain or cap.chain())
        entries = cap.entries                 # keyed by the table: a rewritten capsule replans
        key = ("restore", kinds, id(entries))
        hit = cap.plans.get(("copy",) + key)
        if hit is not None and hit[0]() is self and hit[1] is entries:
            return hit[2]
        # another capsule with this very entry table (fresh snapshots share theirs) left its
        # table here: move it onto this buffer (check_fits bounded the entries by it). Tables
        # are raw addresses on one device: a host capsule into a device arena plans from views
        local, seg, base = _same_device(cap.device, self.arena.device), None, cap.data.data_ptr()
        t = self._tables.get(key) if local else None
        if t is not None and t[0] is entries:
            seg = SegmentPlan.from_table(t[1] + base, t[2], t[3], cap.data.device, (cap.data,))
        if seg is None:
            seg = self._restore_plan(cap, kinds, [cap])
            if local:
                self._keep(key, (entries, seg.src - base, seg.dst, seg.nbytes))
        self._remember(cap, key, entries, seg)
        return seg

    # ---- checks -------------------------------------------------------------------------
    def check_fits(self, cap: Capsule, fingerprint: dict, max_seq_len: int) -> list:
        """Refuse, naming the field, any capsule that does not fit; nothing is written before
        this. Returns cap.chain()."""
        if not isinstance(cap, Capsule):
            raise TypeError(f"expected a flashrt Capsule (from snapshot() or load_capsule()), "
                            f"got {type(cap).__name__}")
        if not cap.is_delta:                 # the common case, one capsule: no chain walk
            self._check_one(cap, fingerprint, max_seq_len)
            return [cap]
        chain = cap.chain()
        for c in chain:
            self._check_one(c, fingerprint, max_seq_len)
        for parent, child in zip(chain, chain[1:]):
            if child.history[: parent.position] != parent.history:
                raise CapsuleMismatchError(f"delta capsule {child.id}: its history does not extend "
                                           f"its parent's {parent.id}")
        return chain

    def _check_one(self, cap: Capsule, fingerprint: dict, max_seq_len: int) -> None:
        meta = cap.meta
        theirs, pos = meta.fingerprint, meta.position
        if not cap.entries:
            raise CapsuleMismatchError("capsule holds no state (emptied by a refused load)")
        if theirs is not fingerprint and theirs != fingerprint:   # `is`: made by this session
            for key in FINGERPRINT_KEYS:
                if theirs.get(key) != fingerprint.get(key):
                    raise CapsuleMismatchError(f"capsule {key} differs: capsule has "
                                               f"{theirs.get(key)!r}, runtime has {fingerprint.get(key)!r}")
        if pos > max_seq_len:
            raise CapsuleMismatchError(f"capsule position {pos} exceeds this runtime's "
                                       f"max_seq_len {max_seq_len}")
        # the same entry table (fresh snapshots share theirs) passed here: only this buffer's
        # size is new to check
        entries = cap.entries
        t = self._tables.get(("fits", id(entries)))
        if not (t is not None and t[0] is entries and t[1] == max_seq_len and t[2] == pos
                and cap.data.numel() >= t[3]):
            self._check_entries(cap)
            self._keep(("fits", id(entries)), (entries, max_seq_len, pos, cap.end))

    def _check_entries(self, cap: Capsule) -> None:
        arena = self.arena
        for e in cap.entries:
            if e.name not in arena:
                raise CapsuleMismatchError(f"capsule buffer {e.name!r} is not in this runtime's layout")
            spec = arena.slot(e.name).spec
            if spec.kind not in CAPSULE_KINDS:
                raise CapsuleMismatchError(f"capsule buffer {e.name!r} is of kind {spec.kind!r}, "
                                           "which no capsule holds")
            want = tuple(spec.shape[1:]) if e.seq else tuple(spec.shape)
            have = tuple(e.shape[1:]) if e.seq else tuple(e.shape)
            if (spec.kind, dtype_name(spec.dtype), want, spec.seq_dim == 0) != (e.kind, e.dtype, have, e.seq):
                raise CapsuleMismatchError(f"capsule buffer {e.name!r} has kind/dtype/shape "
                                           f"{e.kind}/{e.dtype}/{e.shape}, runtime expects "
                                           f"{spec.kind}/{dtype_name(spec.dtype)}/{spec.shape}")
            if e.seq and e.row0 + e.shape[0] != cap.position:
                raise CapsuleMismatchError(f"capsule buffer {e.name!r} holds rows [{e.row0}, "
                                           f"{e.row0 + e.shape[0]}), position is {cap.position}")
            if e.offset + e.nbytes > cap.data.numel():
                raise CapsuleMismatchError(f"capsule buffer {e.name!r} lies outside the capsule data")

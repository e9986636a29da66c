"""Execution-state capsules: a copy of the arena's capsule kinds at a committed token boundary.

A capsule is one byte buffer plus an entry table (name, kind, dtype, live shape, offset).
Fixed-size state sits first, at the same relative offsets as in the arena, so snapshot and
restore are one copy for all of it plus one per per-token buffer (live rows only).
"""
from __future__ import annotations

import functools
import threading
import weakref
from types import MappingProxyType
from dataclasses import dataclass, field, replace

import torch

from flashrt.arena import CAPSULE_KINDS, Arena
from flashrt.errors import CapsuleConsumedError, CapsuleMismatchError
from flashrt.native import SegmentPlan

_ALIGN = 64
_NO_ENTRIES = ((), MappingProxyType({}), 0, frozenset(), False)   # what an emptied capsule derives

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
    torch.float8_e4m3fn, torch.float8_e5m2)}


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def dtype_from_name(s: str) -> torch.dtype:
    return _DTYPES[s]


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str
    dtype: str
    shape: tuple          # stored shape: rows [row0, position) for per-token buffers
    offset: int           # byte offset in the capsule buffer
    seq: bool
    row0: int = 0         # first stored row; > 0 in shared-prefix (delta) capsules

    @functools.cached_property      # frozen: computed once (hot: snapshot/restore read it)
    def nbytes(self) -> int:
        n = dtype_from_name(self.dtype).itemsize
        for s in self.shape:
            n *= s
        return n


class ReadOnlyDict(dict):
    """A dict that refuses in-place changes. A session shares its fingerprint and provenance
    with every capsule it makes (a snapshot copies no dict), so no capsule may edit them for
    the others: give `cap.meta.fingerprint` a new dict instead."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("capsule fingerprint/provenance mappings are shared and read-only; "
                        "assign a new dict instead")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):             # copy/pickle rebuild it whole (never item by item)
        return (ReadOnlyDict, (dict(self),))


@dataclass(slots=True)
class CapsuleMeta:
    position: int
    fingerprint: dict     # model_type, config, weights, dtype, layout: what decides meaning
    provenance: dict      # device, threads of the last step, versions: recorded, never refused on
    parent: str | None = None
    single_use: bool = False
    extra: dict = field(default_factory=dict)


class Capsule:
    """Copy of a session's state. Build with Runtime.snapshot(); restore with Runtime.restore()."""

    def __init__(self, data: torch.Tensor, entries: list[Entry], meta: CapsuleMeta,
                 _derived: tuple | None = None):
        self.data = data                  # uint8, capacity >= end of the last entry; never rebound
        self._derived = _derived          # what the entries setter derives, when already known
        self.entries = entries
        self.meta = meta
        self._claim = threading.Lock()
        self._consumed = False
        self.parent_capsule: Capsule | None = None   # delta capsules: rows below row0 live here
        # Copy plans reused across calls (the buffers never move): key -> (arena ref, entries, plan)
        self._plans: dict = {}
        # (entries, arena ref, max_seq_len) that passed the per-buffer layout checks
        self._fits: tuple | None = None
        # entry table of the last file loaded into this buffer (format._Table): a load(into=) of
        # a file with the same table skips parsing it again
        self._file_table = None
        # (entries, header parts, spans) of the last save: saving the same table again skips them
        self._header_parts = None
        self._host_span = None            # (data_ptr, numel) once a load(into=) checked the buffer

    # The entry table is immutable; what is derived from it is computed when it is replaced.
    @property
    def entries(self) -> tuple:
        return self._entries

    @entries.setter
    def entries(self, entries) -> None:
        if entries is getattr(self, "_entries", None):
            return                        # snapshot(into=) at a cached position: same table
        if not entries:                   # emptied (a load about to write): keep the last table's
            self._entries, self._by_name, self._nbytes, self._kinds, self._is_delta = _NO_ENTRIES
            return
        derived = getattr(self, "_derived", None)
        if derived is None or entries is not derived[0]:
            t = tuple(entries)
            derived = self._derived = (t, {e.name: e for e in t}, sum(e.nbytes for e in t),
                                       frozenset(e.kind for e in t), any(e.row0 for e in t))
        self._entries, self._by_name, self._nbytes, self._kinds, self._is_delta = derived

    # ---- public properties --------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.meta.position

    @property
    def nbytes(self) -> int:
        """Bytes this capsule holds itself (a delta capsule excludes its parent's rows)."""
        return self._nbytes

    @property
    def id(self) -> str:
        return self.meta.extra.get("id", "")

    @property
    def is_delta(self) -> bool:
        return self._is_delta

    def chain(self) -> list["Capsule"]:
        """[root, ..., self]: the capsules whose rows compose this one's state."""
        out, c = [self], self
        while c.is_delta:
            p = c.parent_capsule
            if p is None:
                raise CapsuleMismatchError(f"delta capsule {c.id} needs its parent "
                                           f"{(c.meta.parent or {}).get('id')}, which is not attached")
            if p.id != c.meta.parent.get("id") or p.position != c.meta.parent.get("position"):
                raise CapsuleMismatchError(f"delta capsule {c.id}: attached parent {p.id}@{p.position} "
                                           f"is not the one it was made from {c.meta.parent}")
            out.append(p)
            c = p
        return out[::-1]

    @property
    def kinds(self) -> frozenset:
        return self._kinds

    @property
    def fingerprint(self) -> str:
        f = self.meta.fingerprint
        return f"{f['model_type']}:{f['config'][:8]}:{f['weights'][:8]}:{f['dtype']}:{f['layout'][:8]}"

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def tokens(self) -> list[int]:
        return self.view("meta.tokens").tolist()

    @property
    def consumed(self) -> bool:
        return self._consumed

    def view(self, name: str) -> torch.Tensor:
        e = self._by_name[name]
        return self.data[e.offset: e.offset + e.nbytes].view(dtype_from_name(e.dtype)).view(e.shape)

    def raw(self, e: Entry) -> torch.Tensor:
        return self.data[e.offset: e.offset + e.nbytes]

    def __repr__(self) -> str:
        return (f"Capsule(position={self.position}, nbytes={self.nbytes}, kinds={sorted(self.kinds)}, "
                f"device={self.device}, fingerprint={self.fingerprint})")

    # ---- movement -----------------------------------------------------------------------
    def to(self, device) -> "Capsule":
        device = torch.device(device)
        if device == self.device:
            return self
        pin = device.type == "cpu" and torch.cuda.is_available()
        data = torch.empty(self.data.numel(), dtype=torch.uint8, device=device, pin_memory=pin)
        data.copy_(self.data)
        if self.device.type == "cuda" or device.type == "cuda":
            torch.cuda.synchronize()
        out = Capsule(data, list(self.entries), replace(self.meta))
        out.parent_capsule = self.parent_capsule
        return out

    def save(self, path) -> None:
        _format.save_capsule(self, path)

    @staticmethod
    def load(path, device="cpu", into: "Capsule | None" = None) -> "Capsule":
        """Read a capsule file (checksum verified). into: reuse that host capsule's buffer."""
        return _format.load_capsule(path, device, into)

    # ---- single use ---------------------------------------------------------------------
    def claim(self) -> None:
        """Consume a single-use capsule exactly once (atomic across threads)."""
        if not self.meta.single_use:
            return
        with self._claim:
            if self._consumed:
                raise CapsuleConsumedError(f"single-use capsule at position {self.position} "
                                           "was already restored")
            self._consumed = True


# ---- layout of a capsule for an arena at a position ------------------------------------------
def plan_entries(arena: Arena, position: int, row0: int = 0) -> tuple[list[Entry], int]:
    """Entries for every capsule-kind buffer, and the bytes the capsule buffer needs.

    row0 > 0 makes a delta capsule: per-token state rows [row0, position) only, except the
    token history (meta kind), which is always whole so a capsule alone names its prefix.
    """
    entries = []
    for s in arena.slots:
        if s.spec.kind not in CAPSULE_KINDS or s.spec.seq_dim is not None:
            continue
        entries.append(Entry(s.name, s.spec.kind, dtype_name(s.spec.dtype), tuple(s.spec.shape),
                             s.offset - arena.fixed_begin, False))
    off = _round(arena.fixed_end - arena.fixed_begin)
    for s in arena.slots:
        if s.spec.kind not in CAPSULE_KINDS or s.spec.seq_dim is None:
            continue
        r0 = 0 if s.spec.kind == "meta" else row0
        if s.name == arena.after_fixed and r0 == 0 and entries:
            off = s.offset - arena.fixed_begin    # mirrors the arena: see copy_pairs
        shape = (position - r0,) + tuple(s.spec.shape[1:])
        entries.append(Entry(s.name, s.spec.kind, dtype_name(s.spec.dtype), shape, off, True, r0))
        off = _round(off + shape[0] * s.spec.row_bytes)
    return entries, off


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def copy_pairs(arena: Arena, cap: Capsule, entries, to_capsule: bool, table=None):
    """(src, dst) byte views between arena and capsule; the fixed block is one pair.
    table: the capsule's whole entry table (default cap.entries; snapshot(into=) plans for the
    table it is about to give the capsule)."""
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


def _remember(cap: Capsule, arena: Arena, key, entries, plan) -> None:
    """Cache a SegmentPlan on the capsule; valid while the same arena object is alive. The
    hot paths look it up inline: ``hit = cap._plans.get(key); hit[0]() is arena``."""
    if len(cap._plans) > 8:
        cap._plans.clear()
    cap._plans[key] = (weakref.ref(arena), entries, plan)


def _snapshot_entries(arena: Arena, position: int, row0: int, fixed_only: bool):
    entries, need = plan_entries(arena, position, row0)
    if fixed_only:   # rollback checkpoints: KV rows below the position stay valid in the arena
        entries = [e for e in entries if not e.seq]
        need = _round(arena.fixed_end - arena.fixed_begin)
    return tuple(entries), need


def _snapshot_plan(arena: Arena, cap: Capsule, position: int, row0: int, fixed_only: bool):
    if cap.device != arena.device:
        raise CapsuleMismatchError(f"snapshot(into=): capsule is on {cap.device}, arena on {arena.device}")
    entries, need = _snapshot_entries(arena, position, row0, fixed_only)
    if cap.data.numel() < need:
        raise CapsuleMismatchError(f"snapshot(into=): capsule buffer holds {cap.data.numel()} B, "
                                   f"this state needs {need} B")
    return entries, SegmentPlan(copy_pairs(arena, cap, entries, to_capsule=True, table=entries))


def _keep_table(arena: Arena, key, table) -> None:
    tables = arena.copy_tables
    if len(tables) >= 64:                 # one per position snapshotted fresh: bounded
        tables.clear()
    tables[key] = table


def _fresh_snapshot(arena: Arena, position: int, meta: CapsuleMeta, pin: bool, fixed_only: bool,
                    row0: int) -> Capsule:
    """snapshot() into a new buffer. The first one at a position plans from views (~1 ms at
    60 buffers) and leaves its table on the arena; later ones move that table onto their
    buffer: one allocation, one native copy."""
    key = ("snap", position, fixed_only, row0)
    t = arena.copy_tables.get(key)
    if t is not None:
        entries, need, derived, src, off, nb = t
        data = torch.empty(need, dtype=torch.uint8, device=arena.device, pin_memory=pin)
        seg = SegmentPlan.from_table(src, off + data.data_ptr(), nb, data.device, (data,))
        if seg is not None:
            cap = Capsule(data, entries, meta, derived)
            seg.run()
            return cap
    entries, need = _snapshot_entries(arena, position, row0, fixed_only)
    data = torch.empty(need, dtype=torch.uint8, device=arena.device, pin_memory=pin)
    cap = Capsule(data, entries, meta)
    seg = SegmentPlan(copy_pairs(arena, cap, entries, to_capsule=True))
    _keep_table(arena, key, (cap.entries, need, cap._derived, seg.src, seg.dst - data.data_ptr(),
                             seg.nbytes))
    seg.run()
    return cap


def snapshot_arena(arena: Arena, position: int, meta: CapsuleMeta, into: Capsule | None = None,
                   pin: bool = False, fixed_only: bool = False, parent: Capsule | None = None) -> Capsule:
    """meta.parent set: a delta capsule over the rows below meta.parent["position"]; parent,
    when given, is attached as the capsule that holds them."""
    row0 = meta.parent["position"] if meta.parent is not None else 0
    if into is None:
        cap = _fresh_snapshot(arena, position, meta, pin, fixed_only, row0)
        cap.parent_capsule = parent
        return cap
    cap, key = into, ("snap", position, fixed_only, row0)
    # a plan cached for this arena was checked when built, and the buffer never moves. Inline
    # lookup: each Python call on this path costs ~1 us with caches cold after a 1 MiB copy
    hit = cap._plans.get(key)
    if hit is not None and hit[0]() is arena:
        entries, seg = hit[1], hit[2]
    else:
        entries, seg = _snapshot_plan(arena, cap, position, row0, fixed_only)
        _remember(cap, arena, key, entries, seg)
    cap.entries, cap.meta = entries, meta
    cap._consumed = False
    cap.parent_capsule = parent
    seg.run()
    return cap


def _restore_plan(arena: Arena, cap: Capsule, kinds: frozenset, chain) -> SegmentPlan:
    pairs = []
    for anc in chain[:-1]:   # ancestors give only their per-token rows below row0
        rows = [e for e in anc.entries if e.seq and e.kind != "meta" and e.kind in kinds]
        pairs += copy_pairs(arena, anc, rows, to_capsule=False)
    pairs += copy_pairs(arena, cap, [e for e in cap.entries if e.kind in kinds], to_capsule=False)
    return SegmentPlan(pairs)


def restore_arena(arena: Arena, cap: Capsule, kinds: frozenset, chain=None) -> None:
    """Copy the capsule (and, for a delta capsule, its ancestors' rows) into the arena.
    chain: cap.chain(), when the caller has it."""
    if cap._is_delta:                       # ancestors may be re-attached: plan afresh
        _restore_plan(arena, cap, kinds, chain or cap.chain()).run()
        return
    # keyed by the entries tuple itself: a capsule rewritten in place gets a new plan
    entries = cap._entries
    key = ("restore", kinds, id(entries))
    hit = cap._plans.get(key)
    if hit is not None and hit[0]() is arena and hit[1] is entries:
        seg = hit[2]
    else:
        # another capsule with this very entry table (fresh snapshots share theirs) left its
        # table on the arena: move it onto this buffer (check_fits bounded the entries by it)
        t, seg, base = arena.copy_tables.get(key), None, cap.data.data_ptr()
        if t is not None and t[0] is entries:
            seg = SegmentPlan.from_table(t[1] + base, t[2], t[3], cap.data.device, (cap.data,))
        if seg is None:
            seg = _restore_plan(arena, cap, kinds, [cap])
            _keep_table(arena, key, (entries, seg.src - base, seg.dst, seg.nbytes))
        _remember(cap, arena, key, entries, seg)
    seg.run()


def check_fits(cap: Capsule, arena: Arena, fingerprint: dict, max_seq_len: int) -> list:
    """Refuse, naming the field, any capsule that does not fit; nothing is written before this.
    Returns cap.chain()."""
    if not cap._is_delta:                 # the common case, one capsule: no chain walk
        _check_one(cap, arena, fingerprint, max_seq_len)
        return [cap]
    chain = cap.chain()
    for anc in chain[:-1]:
        _check_one(anc, arena, fingerprint, max_seq_len)
    _check_one(cap, arena, fingerprint, max_seq_len)
    for parent, child in zip(chain, chain[1:]):
        if child.view("meta.tokens")[: parent.position].tolist() != parent.tokens:
            raise CapsuleMismatchError(f"delta capsule {child.id}: its history does not extend "
                                       f"its parent's {parent.id}")
    return chain


_FINGERPRINT_KEYS = ("model_type", "config", "weights", "dtype", "layout")


def _check_one(cap: Capsule, arena: Arena, fingerprint: dict, max_seq_len: int) -> None:
    meta = cap.meta
    theirs, pos = meta.fingerprint, meta.position
    if theirs is not fingerprint and theirs != fingerprint:   # `is`: made by this session
        for key in _FINGERPRINT_KEYS:
            if theirs.get(key) != fingerprint.get(key):
                raise CapsuleMismatchError(f"capsule {key} differs: capsule has {theirs.get(key)!r}, "
                                           f"runtime has {fingerprint.get(key)!r}")
    if pos > max_seq_len:
        raise CapsuleMismatchError(f"capsule position {pos} exceeds this runtime's "
                                   f"max_seq_len {max_seq_len}")
    # The per-buffer checks depend only on the (immutable) entry table, the arena, the
    # capacity and the buffer (Capsule.data is never rebound): a table that passed them once
    # for this arena need not be walked again.
    fits, entries = cap._fits, cap._entries
    if fits is not None and fits[0] is entries and fits[1]() is arena and fits[2] == max_seq_len \
            and fits[3] == pos and fits[4] is cap.data:
        return
    # the same entry table (fresh snapshots share theirs) passed for this arena, capacity and
    # position: only this buffer's size is new to check
    key, data = ("fits", id(entries)), cap.data
    t = arena.copy_tables.get(key)
    if not (t is not None and t[0] is entries and t[1] == max_seq_len and t[2] == pos
            and data.numel() >= t[3]):
        _check_entries(cap, arena)
        _keep_table(arena, key, (entries, max_seq_len, pos, max((e.offset + e.nbytes for e in entries),
                                                                  default=0)))
    cap._fits = (entries, weakref.ref(arena), max_seq_len, pos, data)


def _check_entries(cap: Capsule, arena: Arena) -> None:
    for e in cap.entries:
        if e.name not in arena:
            raise CapsuleMismatchError(f"capsule buffer {e.name!r} is not in this runtime's layout")
        spec = arena.slot(e.name).spec
        if spec.kind not in CAPSULE_KINDS:
            raise CapsuleMismatchError(f"capsule buffer {e.name!r} is of kind {spec.kind!r}, which no "
                                       "capsule holds")
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


from . import format as _format   # noqa: E402  (format builds on the classes above)

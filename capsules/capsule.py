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
from flashrt.native import SegmentPlan, copy_segments

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


@dataclass
class CapsuleMeta:
    position: int
    fingerprint: dict     # model_type, config, weights, dtype, layout: what decides meaning
    provenance: dict      # device, threads, versions: recorded, never refused on
    parent: str | None = None
    single_use: bool = False
    extra: dict = field(default_factory=dict)


class Capsule:
    """Copy of a session's state. Build with Runtime.snapshot(); restore with Runtime.restore()."""

    def __init__(self, data: torch.Tensor, entries: list[Entry], meta: CapsuleMeta):
        self.data = data                  # uint8, capacity >= end of the last entry
        self.entries = entries
        self.meta = meta
        self._claim = threading.Lock()
        self._consumed = False
        self.generation = 0               # bumped when rewritten in place (snapshot(into=))
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


def _cached_plan(cap: Capsule, arena: Arena, key, build):
    """A SegmentPlan cached on the capsule; valid while the same arena object is alive."""
    hit = cap._plans.get(key)
    if hit is not None and hit[0]() is arena:
        return hit[1], hit[2]
    entries, plan = build()
    if len(cap._plans) > 8:
        cap._plans.clear()
    cap._plans[key] = (weakref.ref(arena), entries, plan)
    return entries, plan


def snapshot_arena(arena: Arena, position: int, meta: CapsuleMeta, into: Capsule | None = None,
                   pin: bool = False, fixed_only: bool = False, parent: Capsule | None = None) -> Capsule:
    row0 = parent.position if parent is not None else 0

    def plan():
        entries, need = plan_entries(arena, position, row0)
        if fixed_only:   # rollback checkpoints: KV rows below the position stay valid in the arena
            entries = [e for e in entries if not e.seq]
            need = _round(arena.fixed_end - arena.fixed_begin)
        return tuple(entries), need

    if into is None:
        entries, need = plan()
        data = torch.empty(need, dtype=torch.uint8, device=arena.device, pin_memory=pin)
        cap = Capsule(data, entries, meta)
        cap.parent_capsule = parent
        copy_segments(copy_pairs(arena, cap, entries, to_capsule=True))
        return cap
    cap = into

    def build():
        if cap.device != arena.device:
            raise CapsuleMismatchError(f"snapshot(into=): capsule is on {cap.device}, "
                                       f"arena on {arena.device}")
        entries, need = plan()
        if cap.data.numel() < need:
            raise CapsuleMismatchError(f"snapshot(into=): capsule buffer holds {cap.data.numel()} B, "
                                       f"this state needs {need} B")
        return entries, SegmentPlan(copy_pairs(arena, cap, entries, to_capsule=True, table=entries))

    # a cached plan was built (and its checks passed) for this arena and this buffer, which
    # never moves
    entries, seg = _cached_plan(cap, arena, ("snap", position, fixed_only, row0), build)
    cap.entries, cap.meta = entries, meta
    cap._consumed = False
    cap.generation += 1
    cap.parent_capsule = parent
    seg.run()
    return cap


def restore_arena(arena: Arena, cap: Capsule, kinds: frozenset, chain=None) -> None:
    """Copy the capsule (and, for a delta capsule, its ancestors' rows) into the arena.
    chain: cap.chain(), when the caller has it."""
    def build():
        pairs = []
        for anc in (chain or cap.chain())[:-1]:   # ancestors give only their per-token rows below row0
            rows = [e for e in anc.entries if e.seq and e.kind != "meta" and e.kind in kinds]
            pairs += copy_pairs(arena, anc, rows, to_capsule=False)
        pairs += copy_pairs(arena, cap, [e for e in cap.entries if e.kind in kinds], to_capsule=False)
        return cap.entries, SegmentPlan(pairs)

    if cap.is_delta:                       # ancestors may be re-attached: plan afresh
        build()[1].run()
        return
    # keyed by the entries tuple itself: a capsule rewritten in place gets a new plan
    entries, seg = _cached_plan(cap, arena, ("restore", kinds, id(cap.entries)), build)
    if entries is not cap.entries:
        entries, seg = build()
    seg.run()


def check_fits(cap: Capsule, arena: Arena, fingerprint: dict, max_seq_len: int) -> list:
    """Refuse, naming the field, any capsule that does not fit; nothing is written before this.
    Returns cap.chain()."""
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
    theirs = cap.meta.fingerprint
    if theirs is not fingerprint and theirs != fingerprint:
        for key in _FINGERPRINT_KEYS:
            if theirs.get(key) != fingerprint.get(key):
                raise CapsuleMismatchError(f"capsule {key} differs: capsule has {theirs.get(key)!r}, "
                                           f"runtime has {fingerprint.get(key)!r}")
    if cap.position > max_seq_len:
        raise CapsuleMismatchError(f"capsule position {cap.position} exceeds this runtime's "
                                   f"max_seq_len {max_seq_len}")
    # The per-buffer checks depend only on the (immutable) entry table, the arena and the
    # capacity: a table that passed them once for this arena need not be walked again.
    fits = cap._fits
    if fits is not None and fits[0] is cap.entries and fits[1]() is arena and fits[2] == max_seq_len \
            and fits[3] == cap.position and fits[4] == cap.data.numel():
        return
    _check_entries(cap, arena)
    cap._fits = (cap.entries, weakref.ref(arena), max_seq_len, cap.position, cap.data.numel())


def _check_entries(cap: Capsule, arena: Arena) -> None:
    for e in cap.entries:
        if e.name not in arena:
            raise CapsuleMismatchError(f"capsule buffer {e.name!r} is not in this runtime's layout")
        spec = arena.slot(e.name).spec
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

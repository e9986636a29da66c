"""The arena: one allocation per session, carved into named, typed, fixed-address buffers.

Everything a step reads or writes (weights aside) lives here under a name and a kind, so a
capsule is "copy every buffer of the capsule kinds" and a CUDA graph sees stable addresses.

Order inside the allocation is chosen for cheap capsules: all fixed-size capsule state first
(one contiguous range, one copy), then the per-token buffers (sequence dimension outermost,
so the live extent [0, position) of each is one contiguous range), then io and scratch,
which never enter a capsule.
"""
from __future__ import annotations

import hashlib
import json
import mmap
from dataclasses import dataclass

import torch

from flashrt.errors import ArenaError

# Capsule kinds first, in the order they are laid out; io and scratch are never captured.
KINDS = ("recurrent", "conv", "rng", "meta", "kv", "io", "scratch")
CAPSULE_KINDS = frozenset(("kv", "recurrent", "conv", "rng", "meta"))
ALIGN = 256  # bytes; keeps every view 16-byte aligned for vector copies and kernels
HUGE_PAGE = 2 << 20  # bytes; the huge page of x86-64 (and arm64 on 4 KiB pages) zeroed_block aligns to


@dataclass(frozen=True)
class BufferSpec:
    """One named buffer. seq_dim=0 marks a per-token buffer whose dim 0 is the capacity."""
    name: str
    kind: str
    shape: tuple
    dtype: torch.dtype
    seq_dim: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ArenaError(f"buffer {self.name!r}: unknown kind {self.kind!r} (kinds: {KINDS})")
        if self.seq_dim not in (None, 0):
            raise ArenaError(f"buffer {self.name!r}: the sequence dimension must be outermost (0)")

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _itemsize(self.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes per token for per-token buffers, 0 otherwise."""
        return self.nbytes // self.shape[0] if self.seq_dim == 0 else 0


@dataclass(frozen=True)
class Slot:
    spec: BufferSpec
    offset: int

    @property
    def name(self):
        return self.spec.name


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _order_key(spec: BufferSpec):
    # fixed capsule state | per-token capsule state, the token history (meta) first, right after
    # the fixed state (see Arena.after_fixed) | io | scratch
    captured = spec.kind in CAPSULE_KINDS
    group = 0 if captured and spec.seq_dim is None else 1 if captured else 2
    return (group, group != 1 or spec.kind != "meta", KINDS.index(spec.kind))


def plan_slots(specs) -> tuple[tuple[Slot, ...], int]:
    """Offsets for every buffer (no allocation): the layout is data, printable before loading."""
    slots, off = [], 0
    for spec in sorted(specs, key=_order_key):   # stable: model order kept within each group
        slots.append(Slot(spec, off))
        off = _align(off + spec.nbytes)
    return tuple(slots), off


class Arena:
    """Owns one uint8 allocation; hands out typed views by name."""

    def __init__(self, specs: list[BufferSpec], device: torch.device | str = "cpu"):
        names = [s.name for s in specs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ArenaError(f"duplicate buffer names: {sorted(dup)}")
        self.slots, self.nbytes = plan_slots(specs)
        check_free_memory(self.nbytes, torch.device(device))
        # Zeroed once: recurrent/conv state must start at zero; nothing else relies on it.
        self.data = zeroed_block(self.nbytes, torch.device(device))
        self.device = self.data.device      # as tensors report it: "cuda" becomes "cuda:0"
        self._slot = {s.name: s for s in self.slots}
        self._views = {s.name: self._make_view(s) for s in self.slots}
        fixed = [s for s in self.slots if s.spec.kind in CAPSULE_KINDS and s.spec.seq_dim is None]
        # [fixed_begin, fixed_end): the contiguous range of fixed-size capsule state.
        self.fixed_begin = fixed[0].offset if fixed else 0
        self.fixed_end = (fixed[-1].offset + fixed[-1].spec.nbytes) if fixed else 0
        # The per-token capsule buffer laid out right after that range: the token history, which
        # every capsule holds whole (delta ones included). A capsule mirrors the padding between
        # them, so the fixed state and the history's live rows are one range in both: one copy.
        nxt = self.slots[len(fixed)] if fixed and len(self.slots) > len(fixed) else None
        self.after_fixed = (nxt.name if nxt is not None and nxt.spec.kind in CAPSULE_KINDS
                            and nxt.spec.seq_dim == 0 else None)

    def _make_view(self, slot: Slot) -> torch.Tensor:
        raw = self.data[slot.offset: slot.offset + slot.spec.nbytes]
        view = raw.view(slot.spec.dtype).view(slot.spec.shape)
        # the same memory under a storage object of its own (DLPack keeps the arena alive):
        # torch.compile refuses mutated inputs that share a storage under several dtypes
        return torch.from_dlpack(view.__dlpack__())

    # -- access --------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(f"no arena buffer named {name!r}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._views

    def slot(self, name: str) -> Slot:
        return self._slot[name]

    def bytes_of(self, name: str, rows: int | None = None) -> torch.Tensor:
        """Raw uint8 view of a buffer, or of its first `rows` rows for per-token buffers."""
        s = self._slot[name]
        n = s.spec.nbytes if rows is None else rows * s.spec.row_bytes
        return self.data[s.offset: s.offset + n]

    def rows_bytes(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Raw uint8 view of rows [r0, r1) of a per-token buffer."""
        s = self._slot[name]
        rb = s.spec.row_bytes
        return self.data[s.offset + r0 * rb: s.offset + r1 * rb]

    def names(self, kinds=None) -> list[str]:
        return [s.name for s in self.slots if kinds is None or s.spec.kind in kinds]

    # -- accounting ----------------------------------------------------------------------
    @property
    def fixed_state_bytes(self) -> int:
        return sum(s.spec.nbytes for s in self.slots
                   if s.spec.kind in CAPSULE_KINDS and s.spec.seq_dim is None)

    @property
    def per_token_bytes(self) -> int:
        return sum(s.spec.row_bytes for s in self.slots if s.spec.kind in CAPSULE_KINDS)

    def capsule_bytes(self, position: int) -> int:
        return self.fixed_state_bytes + self.per_token_bytes * position

    @property
    def capacity(self) -> int | None:
        caps = {s.spec.shape[0] for s in self.slots if s.spec.seq_dim == 0}
        return caps.pop() if len(caps) == 1 else None

    def fingerprint(self) -> str:
        return layout_fingerprint([s.spec for s in self.slots])

    def table(self) -> str:
        return format_table(self.slots, self.nbytes, self.fixed_state_bytes, self.per_token_bytes)


def spec_key(spec: BufferSpec) -> dict:
    """What identifies a buffer across runtimes: everything except the sequence capacity."""
    shape = list(spec.shape)
    if spec.seq_dim == 0:
        shape[0] = -1
    return {"name": spec.name, "kind": spec.kind, "dtype": str(spec.dtype).replace("torch.", ""),
            "shape": shape}


def layout_fingerprint(specs) -> str:
    keys = sorted((spec_key(s) for s in specs if s.kind in CAPSULE_KINDS), key=lambda k: k["name"])
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def format_table(slots, total, fixed, per_token) -> str:
    rows = [("name", "kind", "dtype", "shape", "offset", "bytes")]
    for s in slots:
        shape = "x".join(str(d) for d in s.spec.shape) + (" (seq)" if s.spec.seq_dim == 0 else "")
        rows.append((s.name, s.spec.kind, str(s.spec.dtype).replace("torch.", ""), shape,
                     str(s.offset), str(s.spec.nbytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"total {total} B; capsule state: fixed {fixed} B + {per_token} B/token")
    return "\n".join(lines)


def zeroed_block(nbytes: int, device: torch.device) -> torch.Tensor:
    """One zeroed (nbytes,) uint8 allocation. On a Linux CPU, from HUGE_PAGE up: fresh private
    anonymous memory, HUGE_PAGE-aligned and advised to huge pages, so a decode step that streams
    ~1 GB of weights through it takes one TLB entry per 2 MiB, not per 4 KiB, and the small ops
    between its matmuls keep their own entries (bench/README's decode section measures it).
    Elsewhere, or where the kernel does not offer huge pages, torch.zeros."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if device.type != "cpu" or nbytes < HUGE_PAGE or advice is None:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)     # keeps `region` mapped while it lives
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        region.madvise(advice, start, nbytes)               # before any page is touched
    except OSError:                                         # no transparent huge pages here
        pass
    return whole[start:start + nbytes]


def check_free_memory(nbytes: int, device: torch.device) -> None:
    """Refuse an arena the device cannot hold, before trying to allocate it."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    elif device.type == "cpu":
        free = _host_available_bytes()
        if free is None:
            return
    else:
        return
    if nbytes > free:
        raise ArenaError(f"arena of {nbytes / 2**20:.1f} MiB exceeds free {device.type} memory "
                         f"({free / 2**20:.1f} MiB); lower max_seq_len")


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

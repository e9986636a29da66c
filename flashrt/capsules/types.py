"""Capsule types: a byte buffer plus an entry table (name, kind, dtype, live shape, offset) and
the metadata that decides where it may be restored. Copying lives in copy.py, files in format.py.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from flashrt.errors import CapsuleConsumedError, CapsuleMismatchError

ALIGN = 64     # capsule buffer granularity: every entry starts at a multiple of this
# what decides a capsule's meaning: a capsule is restored only where all five agree
FINGERPRINT_KEYS = ("model_type", "config", "weights", "dtype", "layout")
_NO_ENTRIES = ((), MappingProxyType({}), 0, frozenset(), False)   # what an emptied capsule derives

_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
    torch.float8_e4m3fn, torch.float8_e5m2)}


def dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def dtype_from_name(s: str) -> torch.dtype:
    return _DTYPES[s]


def round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str
    dtype: str
    shape: tuple          # stored shape: rows [row0, position) for per-token buffers
    offset: int           # byte offset in the capsule buffer
    seq: bool
    row0: int = 0         # first stored row; > 0 in shared-prefix (delta) capsules

    @functools.cached_property      # frozen: computed once (snapshot/restore read it)
    def nbytes(self) -> int:
        n = dtype_from_name(self.dtype).itemsize
        for s in self.shape:
            n *= s
        return n


class ReadOnlyDict(dict):
    """A dict that refuses in-place changes. A session shares its fingerprint and provenance
    with every capsule it makes, so no capsule may edit them for the others."""

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
    parent: dict | None = None     # {"id", "position"} of the capsule holding rows below row0
    single_use: bool = False
    extra: dict = field(default_factory=dict)


class Capsule:
    """Copy of a session's state. Made by a session's snapshot(), used by its restore()."""

    def __init__(self, data: torch.Tensor, entries, meta: CapsuleMeta, derived: tuple | None = None):
        self.data = data                  # uint8, capacity >= end of the last entry; never rebound
        self._derived = derived           # what the entries setter derives, when already known
        self._entries = None
        self.entries = entries
        self.meta = meta
        self._claim = threading.Lock()
        self._consumed = False
        self.parent_capsule: Capsule | None = None   # delta capsules: rows below row0 live here
        # Plans derived from the (immutable) entry table and the never-rebound buffer, keyed
        # (owner, ...): copy plans ("copy": core/copy.py), file tables ("file": format.py).
        self.plans: dict = {}

    @property
    def entries(self) -> tuple:
        return self._entries

    @entries.setter
    def entries(self, entries) -> None:
        if entries is self._entries:
            return                        # snapshot(into=) at a cached position: same table
        if not entries:                   # emptied (a load about to write)
            self._entries, self._by_name, self._nbytes, self._kinds, self._is_delta = _NO_ENTRIES
            return
        derived = self._derived
        if derived is None or entries is not derived[0]:
            t = tuple(entries)
            derived = self._derived = (t, {e.name: e for e in t}, sum(e.nbytes for e in t),
                                       frozenset(e.kind for e in t), any(e.row0 for e in t))
        self._entries, self._by_name, self._nbytes, self._kinds, self._is_delta = derived

    @property
    def derived(self) -> tuple:
        """(entries, by name, nbytes, kinds, is_delta): shared by capsules of one entry table."""
        return self._derived

    # ---- properties ---------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.meta.position

    @property
    def nbytes(self) -> int:
        """Bytes this capsule holds itself (a delta capsule excludes its parent's rows)."""
        return self._nbytes

    @property
    def end(self) -> int:
        """End of the last entry: the bytes of the buffer this capsule uses."""
        return max((e.offset + e.nbytes for e in self._entries), default=0)

    @property
    def id(self) -> str:
        return self.meta.extra.get("id", "")

    @property
    def is_delta(self) -> bool:
        return self._is_delta

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
    def history(self) -> list[int]:
        """The history key: the entry the session named as its history (meta.extra["history"],
        e.g. a language model's token ids), as a list; [] when the session keeps none."""
        name = self.meta.extra.get("history")
        return self.view(name).tolist() if name in self._by_name else []

    @property
    def consumed(self) -> bool:
        return self._consumed

    def has(self, name: str) -> bool:
        return name in self._by_name

    def entry(self, name: str) -> Entry:
        return self._by_name[name]

    def view(self, name: str) -> torch.Tensor:
        e = self._by_name[name]
        return self.data[e.offset: e.offset + e.nbytes].view(dtype_from_name(e.dtype)).view(e.shape)

    def raw(self, e: Entry) -> torch.Tensor:
        return self.data[e.offset: e.offset + e.nbytes]

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

    def __repr__(self) -> str:
        return (f"Capsule(position={self.position}, nbytes={self.nbytes}, kinds={sorted(self.kinds)}, "
                f"device={self.device}, fingerprint={self.fingerprint})")

    # ---- movement and use ---------------------------------------------------------------
    def to(self, device) -> "Capsule":
        device = torch.device(device)
        if device.type == self.device.type and (device.index is None or device == self.device):
            return self
        pin = device.type == "cpu" and torch.cuda.is_available()
        # the entries' bytes only: a snapshot(into=) buffer may be sized for far more positions
        end = self.end
        data = torch.empty(end, dtype=torch.uint8, device=device, pin_memory=pin)
        data.copy_(self.data[:end])
        if self.device.type == "cuda" or device.type == "cuda":
            torch.cuda.synchronize()
        out = Capsule(data, list(self.entries), replace(self.meta))
        out.parent_capsule = self.parent_capsule
        return out

    def emptied(self) -> None:
        """Hold no capsule (before bytes land in the buffer): never restored half-written."""
        self.entries, self.meta = (), CapsuleMeta(0, {}, {})

    def refill(self, entries, meta: CapsuleMeta, parent: "Capsule | None" = None) -> None:
        """The buffer now holds a capsule with this table and metadata."""
        self.entries, self.meta = entries, meta
        self._consumed, self.parent_capsule = False, parent

    def claim(self) -> None:
        """Consume a single-use capsule exactly once (atomic across threads)."""
        if not self.meta.single_use:
            return
        with self._claim:
            if self._consumed:
                raise CapsuleConsumedError(f"single-use capsule at position {self.position} "
                                           "was already restored")
            self._consumed = True

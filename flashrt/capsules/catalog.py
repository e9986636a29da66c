"""A CapsuleStore's bookkeeping (capsules/store.py): a record per stored capsule, and the
catalog of them (by key, by capsule id, LRU order, delta parent links, a prefix index per
namespace, tombstones of claimed single-use keys). No I/O and no locking: the store holds its
lock around every call.
"""
from __future__ import annotations

from collections import OrderedDict

from flashrt.errors import CapsuleConsumedError, CapsuleMismatchError

from .disk import parent_id
from .index import PrefixIndex
from .tiers import DISK

_MAX_TOMBSTONES = 4096
_NO_INDEX = PrefixIndex()       # an empty one: a namespace that holds nothing


class _Rec:
    __slots__ = ("key", "id", "tier", "cap", "msize", "fsize", "pinned", "position", "parent",
                 "children", "single_use", "fingerprint", "entries", "ns")

    def __init__(self, key, cid, meta, entries, pinned, ns=""):
        self.key, self.id, self.pinned, self.ns = key, cid, pinned, ns
        self.tier, self.cap = None, None
        self.position, self.single_use = meta.position, bool(meta.single_use)
        self.fingerprint = meta.fingerprint
        self.parent = parent_id(meta, entries)
        self.children: set = set()
        self.entries = entries
        self.msize = self.fsize = 0

    def size(self, tier=None) -> int:
        return self.fsize if (self.tier if tier is None else tier) == DISK else self.msize


class _Catalog:
    """Records by key and by capsule id, the LRU order (oldest first), delta parent links,
    a prefix index per namespace, and tombstones of claimed single-use keys."""

    def __init__(self):
        self.recs: dict[str, _Rec] = {}
        self.by_id: dict[str, str] = {}
        self.lru: OrderedDict = OrderedDict()
        self.indexes: dict[str, PrefixIndex] = {}
        self.consumed: OrderedDict = OrderedDict()

    def rec(self, key) -> _Rec:
        rec = self.recs.get(key)
        if rec is None:
            if key in self.consumed:
                raise CapsuleConsumedError(f"single-use capsule {key!r} was already claimed")
            raise KeyError(key)
        return rec

    def add(self, rec: _Rec, tokens) -> None:
        self.recs[rec.key] = rec
        if rec.id:
            self.by_id[rec.id] = rec.key
        self.lru[rec.key] = None
        self.consumed.pop(rec.key, None)
        if rec.position > 0 and len(tokens) == rec.position:
            self.indexes.setdefault(rec.ns, PrefixIndex()).add(rec.key, tokens)

    def remove(self, rec: _Rec) -> None:
        self.recs.pop(rec.key, None)
        self.lru.pop(rec.key, None)
        if self.by_id.get(rec.id) == rec.key:
            del self.by_id[rec.id]
        if rec.parent is not None:
            pk = self.by_id.get(rec.parent)
            if pk is not None:
                self.recs[pk].children.discard(rec.key)
        self.indexes.get(rec.ns, _NO_INDEX).remove(rec.key)

    def tombstone(self, key) -> None:
        self.consumed[key] = None
        while len(self.consumed) > _MAX_TOMBSTONES:
            self.consumed.popitem(last=False)

    def chain(self, rec) -> list:
        """[root, ..., rec]: the records whose rows compose rec's state."""
        out = [rec]
        while out[-1].parent is not None:
            pk = self.by_id.get(out[-1].parent)
            if pk is None:
                raise CapsuleMismatchError(f"capsule {out[-1].key!r} needs its parent "
                                           f"{out[-1].parent}, which is not in the store")
            out.append(self.recs[pk])
        return out[::-1]

    def parent_for(self, cap, pkey) -> _Rec:
        """The stored record under pkey, checked as delta capsule cap's parent."""
        parent, ref = self.recs[pkey], cap.meta.parent
        if parent.position != ref.get("position"):
            raise CapsuleMismatchError(f"delta capsule {cap.id}: stored parent {parent.id} is at "
                                       f"position {parent.position}, it was made from {ref}")
        if parent.single_use:
            raise ValueError(f"delta capsule {cap.id}: its parent {parent.id} is single-use")
        return parent

    def candidates(self, tokens, ns: str = "") -> list:
        """Keys of namespace ns holding a prefix of tokens: [(n, keys MRU first)], longest first."""
        out = []
        for n, keys in reversed(self.indexes.get(ns, _NO_INDEX).prefixes(tokens)):
            order = {k: j for j, k in enumerate(reversed(self.lru)) if k in keys}
            out.append((n, sorted(keys, key=lambda k: order.get(k, 1 << 60))))
        return out

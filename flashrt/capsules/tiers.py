"""Placement of a store's capsules over its tiers: budgets, room-making, demotion, promotion.

One least-recently-used order over all capsules decides victims: to make room in a tier the
least recently used capsule there moves to the next tier that can take it (device -> host ->
disk), and past the last tier it is evicted. Pinned capsules never move; a parent of stored
deltas is never evicted (a leaf descendant goes first). No operation leaves a tier above its
budget. The records and the LRU order are the store's; this class only reads them.
"""
from __future__ import annotations

import torch

from .types import Capsule, round_up

DEVICE, HOST, DISK = 0, 1, 2
TIERS = ("device", "host", "disk")


def loaded_size(entries) -> int:
    """Buffer bytes load() allocates for these entries."""
    return round_up(max((e.offset + e.nbytes for e in entries), default=0))


class Tiers:
    def __init__(self, budgets: list, device: torch.device, disk, recs: dict, lru, drop, load):
        self.budget, self.device, self.disk = budgets, device, disk
        self.last = DISK if disk is not None else HOST
        self.used = [0, 0, 0]
        self._recs, self._lru, self._drop, self._load = recs, lru, drop, load

    # ---- accounting and refusals ------------------------------------------------------
    def budget_text(self) -> str:
        return ", ".join(f"{TIERS[t]} {self.budget[t] if self.budget[t] is not None else 'unbounded'} B"
                         for t in range(self.last + 1))

    def refuse_if_too_big(self, rec, key) -> None:
        fits = [self.budget[t] is None or rec.size(t) <= self.budget[t] for t in range(self.last + 1)]
        if rec.single_use and self.disk is not None:
            fits = fits[DISK:]
        if not any(fits):
            raise ValueError(f"capsule {key!r} is too large for every tier: {rec.msize} B in memory"
                             + (f", {rec.fsize} B on disk" if self.disk is not None else "")
                             + f"; budgets: {self.budget_text()}")

    def no_room(self, key, rec) -> str:
        return (f"no room for capsule {key!r} ({rec.msize} B): every tier that could hold it is "
                f"full of pinned capsules or parents of stored deltas; used "
                f"{dict(zip(TIERS, self.used))}, budgets: {self.budget_text()}")

    def release(self, rec) -> None:
        """rec leaves its tier (dropped, or its file is gone already)."""
        self.used[rec.tier] -= rec.size()

    # ---- room ---------------------------------------------------------------------------
    def make_room(self, t, need, excl) -> bool:
        """Free `need` bytes in tier t by demoting LRU victims; False if it cannot."""
        budget = self.budget[t]
        if budget is None:
            return True
        if need > budget:
            return False
        if self.used[t] + need <= budget:
            return True
        movable = sum(r.size() for r in self._recs.values()
                      if r.tier == t and not r.pinned and r.key not in excl)
        if self.used[t] - movable + need > budget:
            return False
        tried = set(excl)
        while self.used[t] + need > budget:
            victim = next((self._recs[k] for k in self._lru
                           if k not in tried and self._recs[k].tier == t and not self._recs[k].pinned),
                          None)
            if victim is None:
                if t == self.last and self._evict_descendant(t, excl):
                    continue
                return False
            tried.add(victim.key)
            self._demote(victim, excl)
        return True

    def _demote(self, rec, excl) -> bool:
        ex = excl | {rec.key}
        for t in range(rec.tier + 1, self.last + 1):
            if self.make_room(t, rec.size(t), ex):
                self.move(rec, t)
                return True
        if not rec.children:
            self._drop(rec)
            return True
        return False

    def _evict_descendant(self, t, excl) -> bool:
        """Only referenced parents left in the last tier: evict one of their leaf descendants."""
        for k in self._lru:
            p = self._recs[k]
            if p.tier != t or p.pinned or k in excl or not p.children:
                continue
            stack, leaves = list(p.children), []
            while stack:
                c = self._recs.get(stack.pop())
                if c is None or c.tier is None:
                    continue
                if c.children:
                    stack.extend(c.children)
                elif not c.pinned and c.key not in excl:
                    leaves.append(c.key)
            for lk in self._lru:
                if lk in leaves:
                    self._drop(self._recs[lk])
                    return True
        return False

    # ---- moving bytes ---------------------------------------------------------------------
    def mem_copy(self, cap: Capsule, t) -> Capsule:
        if t == DEVICE:
            return cap.to(self.device)
        out = cap.to("cpu")
        if torch.cuda.is_available() and not out.data.is_pinned():
            out = Capsule(out.data.pin_memory(), out.entries, out.meta)
        return out

    def place_first(self, rec, cap, order) -> None:
        """Put a new record's capsule into the first tier of `order` with room (made by
        demoting others); ValueError naming the tiers when none has any."""
        t = next((t for t in order if self.make_room(t, rec.size(t), {rec.key})), None)
        if t is None:
            raise ValueError(self.no_room(rec.key, rec))
        self.place(rec, cap, t)

    def place(self, rec, cap, t) -> None:
        """Put a new record's capsule into tier t (room already made)."""
        if t == DISK:
            self._write(rec, cap)
        else:
            rec.cap = self.mem_copy(cap, t)
            rec.msize = rec.cap.data.numel()
        rec.tier = t
        self.used[t] += rec.size()

    def _write(self, rec, cap) -> None:
        self.disk.write(rec.key, cap)
        rec.cap, rec.msize = None, loaded_size(rec.entries)

    def move(self, rec, t) -> None:
        src, old = rec.tier, rec.size()
        if t == DISK:
            self._write(rec, rec.cap)
        elif src == DISK:
            rec.cap = self.mem_copy(self._load(rec, self.device if t == DEVICE else "cpu"), t)
            rec.msize = rec.cap.data.numel()
        else:
            rec.cap = self.mem_copy(rec.cap, t)
        self.used[src] -= old
        rec.tier = t
        self.used[t] += rec.size()
        if src == DISK:
            self.disk.remove(rec.key)

    def promote(self, rec, excl) -> None:
        if rec.pinned or rec.tier == DEVICE:
            return
        for t in (DEVICE, HOST) if rec.tier == DISK else (DEVICE,):
            b = self.budget[t]
            if (b is None or rec.msize <= b) and b != 0 and self.make_room(t, rec.msize, excl):
                self.move(rec, t)
                return

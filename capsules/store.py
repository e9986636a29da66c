"""CapsuleStore: a tiered, budgeted cache of capsules with longest-prefix lookup.

    store = CapsuleStore(device_bytes=2 << 30, host_bytes=8 << 30, disk_dir="caps", disk_bytes=None)
    key = store.put(rt.snapshot())          # key defaults to the capsule's id
    cap = store.get(key)                    # promoted to the device tier when it fits
    cap, n = store.match(tokens)            # longest stored prefix of `tokens`
    rt.set_context(tokens, store=store)     # restore that prefix, prefill only the rest

Tiers and budgets
    device  capsules on the store's device (default: CUDA when available, else CPU). On a
            CPU-only machine the device tier is CPU memory too: it is simply the first budget.
    host    CPU memory, page-locked ("pinned") when CUDA is available so copies to the GPU
            are asynchronous.
    disk    one capsule file per key, ``<disk_dir>/<key>.capsule`` (the format of
            capsules/format.py). Only when disk_dir is given; disk_bytes=None: unbounded.
    Each capsule lives in exactly one tier and counts against that tier's budget: its buffer
    size (``cap.data.numel()``) in memory, its file size on disk. No operation ever leaves a
    tier above its budget. A capsule larger than every budget is refused by put() with a
    ValueError naming its size and the budgets.

Eviction order
    One least-recently-used order over all capsules (put, get and match touch). To make room
    in a tier the least recently used capsule there is demoted to the next tier that can take
    it (device -> host -> disk); past the last tier it is evicted (dropped). A demotion may
    cascade. Pinned capsules (put(pin=True)) never leave the tier they were placed in, and
    count against it. get() promotes a capsule to the device tier when it fits (else, from
    disk, to the host tier), demoting others as needed.

Shared-prefix (delta) capsules
    A delta capsule stores only its own rows and refers to its parent by meta.parent["id"].
    put() of a delta whose parent is not stored also puts the attached parent. A parent is
    never evicted while a stored child refers to it: eviction skips it (children, which are
    more recently used, go first; if only referenced parents are left, an unpinned
    descendant is evicted first). drop() of a referenced parent is refused. Tiers move
    freely: get() returns a capsule whose parent chain is attached again from the store,
    whatever tier each ancestor is in (an ancestor that cannot be promoted is loaded for
    that one capsule). The store's own copies never hold parent links, so a tier's budget is
    what the store holds.

Returned capsules
    get()/match() return a new Capsule object that shares its buffer with the store's copy
    (no copy on a memory hit). put() likewise shares the buffer of the capsule it is given
    (copying only to change device): do not rewrite a capsule in place (snapshot(into=))
    after putting it.

Crash safety (disk tier)
    The directory is the index: there is no other on-disk state. A file is written by
    capsules/format.save_capsule: to ``.<key>.capsule.tmp-<pid>-<random>``, fsynced, then
    renamed over ``<key>.capsule`` and the directory fsynced; so a reader sees the old file,
    the new one, or none, never a partial one. Opening a store scans disk_dir: every
    ``*.capsule`` file's header is parsed and checked (canonical form, sizes consistent with
    the file length; verify=True also loads and checksums every byte); a file that raises
    CapsuleCorruptError is reported with warnings.warn and deleted. Temp files and claimed
    files (below) whose writer pid is no longer alive are deleted; those of live processes
    are left alone (they are in flight). Least-recently-used order is rebuilt from file
    mtimes. Pins are not persisted. A delta whose parent is not in the directory is skipped
    with a warning (not deleted, not counted). Every load (get, match, take) checksums the
    whole file; a corrupt one is deleted, with its stored descendants, and raises.

Single-use capsules
    A single-use capsule (snapshot(single_use=True)) is restored at most once, across threads
    and, with a disk tier, across processes sharing disk_dir: there it is always kept in the
    disk tier, and the claim is ``os.rename(<key>.capsule, <key>.capsule.claimed-<pid>-<rand>)``
    -- atomic on one filesystem, so exactly one caller's rename succeeds; the winner loads
    the claimed file and deletes it, every other caller gets CapsuleConsumedError. Without a
    disk tier the claim is the removal from the index under the store's lock. get() and
    match() never hand out single-use capsules; take(key) claims and returns one, and
    restore_into(session, key) has the session validate it first and claim it (the
    restore's on_validated hook) before any byte is written, so a refused restore consumes
    nothing and a caller that loses the claim has its live state untouched.

Several processes may open one disk_dir; each keeps its own index (built when it opens) and
its own accounting, so budgets and LRU order are per process. What one process removes,
another sees as a missing file: get() then forgets the key and raises KeyError.
"""
from __future__ import annotations

import os
import re
import secrets
import threading
import warnings
from collections import OrderedDict

import torch

from flashrt.errors import CapsuleConsumedError, CapsuleCorruptError, CapsuleError, CapsuleMismatchError

from . import format as _fmt
from .index import PrefixIndex
from .types import FINGERPRINT_KEYS, Capsule, round_up

DEVICE, HOST, DISK = 0, 1, 2
TIERS = ("device", "host", "disk")
SUFFIX = ".capsule"
_KEY = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")
_TMP = re.compile(r"^\..+\.tmp-(\d+)-[0-9a-f]+$")
_CLAIMED = re.compile(r"^.+\.claimed-(\d+)-[0-9a-f]+$")
_MAX_TOMBSTONES = 4096


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid < (1 << 31)
    return True


def _loaded_size(entries) -> int:
    """Buffer bytes load() allocates for these entries."""
    return round_up(max((e.offset + e.nbytes for e in entries), default=0))


class _Rec:
    __slots__ = ("key", "id", "tier", "cap", "msize", "fsize", "pinned", "position", "parent",
                 "children", "single_use", "fingerprint", "entries")

    def __init__(self, key, cid, meta, entries, pinned):
        self.key, self.id, self.pinned = key, cid, pinned
        self.tier, self.cap = None, None
        self.position, self.single_use = meta.position, bool(meta.single_use)
        self.fingerprint = meta.fingerprint
        self.parent = (meta.parent or {}).get("id") if any(e.row0 for e in entries) else None
        self.children: set = set()
        self.entries = entries
        self.msize = self.fsize = 0

    def size(self, tier=None) -> int:
        return self.fsize if (self.tier if tier is None else tier) == DISK else self.msize


class CapsuleStore:
    """Capsules by key over device / host / disk tiers; see the module docstring."""

    def __init__(self, device_bytes: int = 0, host_bytes: int = 0, disk_dir=None,
                 disk_bytes: int | None = None, device=None, verify: bool = False):
        for name, v in (("device_bytes", device_bytes), ("host_bytes", host_bytes),
                        ("disk_bytes", disk_bytes)):
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:   # as tensors report it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.disk_dir = os.path.abspath(os.fspath(disk_dir)) if disk_dir is not None else None
        self._budget = [device_bytes, host_bytes, disk_bytes if self.disk_dir else 0]
        self._last = DISK if self.disk_dir else HOST
        self._used = [0, 0, 0]
        self._recs: dict[str, _Rec] = {}
        self._by_id: dict[str, str] = {}
        self._lru: OrderedDict = OrderedDict()        # key -> None, oldest first
        self._index = PrefixIndex()
        self._consumed: OrderedDict = OrderedDict()    # tombstones of claimed single-use keys
        self._lock = threading.RLock()
        if self.disk_dir:
            os.makedirs(self.disk_dir, exist_ok=True)
            self._scan(verify)

    # ---- public API ----------------------------------------------------------------------
    def put(self, cap: Capsule, key: str | None = None, pin: bool = False) -> str:
        """Store `cap` under `key` (default: cap.id); returns the key."""
        with self._lock:
            key = self._check_key(cap.id if key is None else key)
            old = self._recs.get(key)
            if old is not None:
                if old.id == cap.id and old.position == cap.position:
                    old.pinned = old.pinned or pin
                    self._touch(old)
                    return key
                self._drop(old, explicit=True)
            if cap.id and cap.id in self._by_id:
                raise ValueError(f"capsule {cap.id} is already stored under key {self._by_id[cap.id]!r}")
            rec = _Rec(key, cap.id, cap.meta, cap.entries, pin)
            rec.msize = cap.data.numel()
            rec.fsize = _fmt.file_size(cap) if self.disk_dir else 0
            self._refuse_if_too_big(rec, key)
            parent = self._parent_for_put(cap, rec) if rec.parent is not None else None
            private = Capsule(cap.data, cap.entries, cap.meta)
            tiers = [DISK] if rec.single_use and self.disk_dir else list(range(self._last + 1))
            self._recs[key] = rec                       # registered (tier None) so room-making
            if parent is not None:                      # sees the parent as referenced
                parent.children.add(key)
            try:
                for t in tiers:
                    if self._make_room(t, rec.size(t), {key}):
                        self._place(rec, private, t)
                        break
                else:
                    raise ValueError(self._no_room(key, rec))
            except BaseException:
                self._recs.pop(key, None)
                if parent is not None:
                    parent.children.discard(key)
                raise
            if rec.id:
                self._by_id[rec.id] = key
            self._lru[key] = None
            self._consumed.pop(key, None)
            self._index_tokens(rec, cap.tokens)
            return key

    def get(self, key: str) -> Capsule:
        """The capsule under `key`, parent chain attached; LRU touch and promotion."""
        with self._lock:
            rec = self._rec(key)
            if rec.single_use:
                raise CapsuleError(f"capsule {key!r} is single-use: claim it with take() or "
                                   "restore_into(), not get()")
            return self._get(rec)

    def drop(self, key: str) -> None:
        """Remove `key` (and its file). Refused while a stored delta capsule needs it."""
        with self._lock:
            self._drop(self._rec(key), explicit=True)

    def take(self, key: str) -> Capsule:
        """Remove and return `key`; for a single-use capsule this is the (atomic) claim."""
        with self._lock:
            rec = self._rec(key)
            if not rec.single_use:
                if rec.children:
                    self._drop(rec, explicit=True)          # raises: names the children
                cap = self._get(rec, promote=False)
                self._drop(rec)
                return cap
        cap, token = self._peek(key)
        self._claim(key, token)
        return cap

    def restore_into(self, session, key: str) -> Capsule:
        """session.restore(the capsule under key); a single-use one is claimed only after the
        session has validated it, so a refused restore consumes nothing. Returns the capsule."""
        cap, token = self._peek(key)
        session.restore(cap, on_validated=None if token is None else lambda: self._claim(key, token))
        return cap

    def match(self, tokens, fingerprint: dict | None = None):
        """(capsule, n): the longest stored capsule whose token history is tokens[:n], or
        (None, 0). fingerprint (a runtime's): only capsules made by that model and layout."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1).tolist()
        tokens = [int(t) for t in tokens]
        with self._lock:
            cands = self._index.prefixes(tokens)
            for n, keys in reversed(cands):
                order = {k: j for j, k in enumerate(reversed(self._lru)) if k in keys}
                for k in sorted(keys, key=lambda k: order.get(k, 1 << 60)):
                    rec = self._recs.get(k)
                    if rec is None or rec.single_use or not self._fp_ok(rec, fingerprint):
                        continue
                    try:
                        return self._get(rec), n
                    except (CapsuleCorruptError, KeyError):
                        continue          # vanished or damaged: already forgotten; try the next
            return None, 0

    def footprint(self) -> dict:
        with self._lock:
            return dict(zip(TIERS, self._used))

    def budgets(self) -> dict:
        return dict(zip(TIERS, self._budget))

    def tier(self, key: str) -> str:
        with self._lock:
            return TIERS[self._rec(key).tier]

    def key_of(self, capsule_id: str) -> str | None:
        """The key a capsule id is stored under, if any."""
        with self._lock:
            return self._by_id.get(capsule_id)

    def keys(self) -> list:
        """Keys, least recently used first."""
        with self._lock:
            return list(self._lru)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._recs

    def __len__(self) -> int:
        return len(self._recs)

    def __repr__(self) -> str:
        f = self.footprint()
        return "CapsuleStore(" + ", ".join(f"{t}={f[t]}/{b}" for t, b in zip(TIERS, self._budget)) + ")"

    # ---- internals: records ---------------------------------------------------------------
    def _check_key(self, key) -> str:
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"bad capsule key {key!r}: use 1-200 characters of [A-Za-z0-9._-], "
                             "not starting with '.' (keys name files in the disk tier)")
        return key

    def _rec(self, key) -> _Rec:
        rec = self._recs.get(key)
        if rec is None:
            if key in self._consumed:
                raise CapsuleConsumedError(f"single-use capsule {key!r} was already claimed")
            raise KeyError(key)
        return rec

    def _path(self, key) -> str:
        return os.path.join(self.disk_dir, key + SUFFIX)

    def _touch(self, rec):
        self._lru.move_to_end(rec.key)

    @staticmethod
    def _fp_ok(rec, fp) -> bool:
        return fp is None or all(rec.fingerprint.get(k) == fp.get(k) for k in FINGERPRINT_KEYS)

    def _parent_for_put(self, cap, rec) -> _Rec:
        ref = cap.meta.parent or {}
        pkey = self._by_id.get(ref.get("id"))
        if pkey is None:
            if cap.parent_capsule is None:
                raise CapsuleMismatchError(f"delta capsule {cap.id} needs its parent {ref.get('id')}, "
                                           "which is neither stored nor attached")
            pkey = self.put(cap.parent_capsule)
        parent = self._recs[pkey]
        if parent.position != ref.get("position"):
            raise CapsuleMismatchError(f"delta capsule {cap.id}: stored parent {parent.id} is at "
                                       f"position {parent.position}, it was made from {ref}")
        if parent.single_use:
            raise ValueError(f"delta capsule {cap.id}: its parent {parent.id} is single-use")
        self._touch(parent)
        return parent

    def _refuse_if_too_big(self, rec, key):
        fits = [self._budget[t] is None or rec.size(t) <= self._budget[t] for t in range(self._last + 1)]
        if rec.single_use and self.disk_dir:
            fits = fits[DISK:]
        if not any(fits):
            raise ValueError(f"capsule {key!r} is too large for every tier: {rec.msize} B in memory"
                             + (f", {rec.fsize} B on disk" if self.disk_dir else "")
                             + f"; budgets: {self._budget_text()}")

    def _budget_text(self) -> str:
        return ", ".join(f"{TIERS[t]} {self._budget[t] if self._budget[t] is not None else 'unbounded'} B"
                         for t in range(self._last + 1))

    def _no_room(self, key, rec) -> str:
        return (f"no room for capsule {key!r} ({rec.msize} B): every tier that could hold it is "
                f"full of pinned capsules or parents of stored deltas; used {self.footprint()}, "
                f"budgets: {self._budget_text()}")

    # ---- internals: tiers -----------------------------------------------------------------
    def _make_room(self, t, need, excl) -> bool:
        """Free `need` bytes in tier t by demoting LRU victims; False if it cannot."""
        budget = self._budget[t]
        if budget is None:
            return True
        if need > budget:
            return False
        if self._used[t] + need <= budget:
            return True
        movable = sum(r.size() for r in self._recs.values()
                      if r.tier == t and not r.pinned and r.key not in excl)
        if self._used[t] - movable + need > budget:
            return False
        tried = set(excl)
        while self._used[t] + need > budget:
            victim = next((self._recs[k] for k in self._lru
                           if k not in tried and self._recs[k].tier == t and not self._recs[k].pinned),
                          None)
            if victim is None:
                if t == self._last and self._evict_descendant(t, excl):
                    continue
                return False
            tried.add(victim.key)
            self._demote(victim, excl)
        return True

    def _demote(self, rec, excl) -> bool:
        ex = excl | {rec.key}
        for t in range(rec.tier + 1, self._last + 1):
            if self._make_room(t, rec.size(t), ex):
                self._move(rec, t)
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

    def _mem_copy(self, cap: Capsule, t) -> Capsule:
        if t == DEVICE:
            return cap.to(self.device)
        out = cap.to("cpu")
        if torch.cuda.is_available() and not out.data.is_pinned():
            out = Capsule(out.data.pin_memory(), out.entries, out.meta)
        return out

    def _place(self, rec, cap, t):
        """Put a new record's capsule into tier t (room already made)."""
        if t == DISK:
            self._write(rec, cap)
        else:
            rec.cap = self._mem_copy(cap, t)
            rec.msize = rec.cap.data.numel()
        rec.tier = t
        self._used[t] += rec.size()

    def _write(self, rec, cap):
        _fmt.save(cap, self._path(rec.key))
        rec.cap, rec.msize = None, _loaded_size(rec.entries)

    def _move(self, rec, t):
        src, old = rec.tier, rec.size()
        if t == DISK:
            self._write(rec, rec.cap)
        elif src == DISK:
            rec.cap = self._mem_copy(self._load(rec, self.device if t == DEVICE else "cpu"), t)
            rec.msize = rec.cap.data.numel()
        else:
            rec.cap = self._mem_copy(rec.cap, t)
        self._used[src] -= old
        rec.tier = t
        self._used[t] += rec.size()
        if src == DISK:
            _unlink(self._path(rec.key))

    def _load(self, rec, device) -> Capsule:
        """Load a disk record's file; a missing or corrupt file forgets it (and its children)."""
        path = self._path(rec.key)
        try:
            return _fmt.load(path, device)
        except FileNotFoundError:
            self._forget(rec)
            raise KeyError(f"{rec.key} (its file vanished: claimed or removed by another process)")
        except CapsuleCorruptError as e:
            warnings.warn(f"capsule store: dropping corrupt capsule {rec.key!r}: {e}")
            self._forget(rec)
            raise

    def _forget(self, rec):
        """Drop rec and every stored descendant (they cannot be restored without it)."""
        for c in list(rec.children):
            if c in self._recs:
                self._forget(self._recs[c])
        self._drop(rec)

    def _drop(self, rec, explicit=False):
        if explicit and rec.children:
            raise ValueError(f"capsule {rec.key!r} is the parent of stored delta capsules "
                             f"{sorted(rec.children)}; drop them first")
        self._recs.pop(rec.key, None)
        self._lru.pop(rec.key, None)
        if self._by_id.get(rec.id) == rec.key:
            del self._by_id[rec.id]
        if rec.parent is not None:
            pk = self._by_id.get(rec.parent)
            if pk is not None:
                self._recs[pk].children.discard(rec.key)
        if rec.tier is not None:
            self._used[rec.tier] -= rec.size()
            if rec.tier == DISK:
                _unlink(self._path(rec.key))
        rec.cap, rec.tier = None, None
        self._unindex(rec)

    def _promote(self, rec, excl):
        if rec.pinned or rec.tier == DEVICE:
            return
        for t in (DEVICE, HOST) if rec.tier == DISK else (DEVICE,):
            b = self._budget[t]
            if (b is None or rec.msize <= b) and b != 0 and self._make_room(t, rec.msize, excl):
                self._move(rec, t)
                return

    def _chain(self, rec) -> list:
        out = [rec]
        while out[-1].parent is not None:
            pk = self._by_id.get(out[-1].parent)
            if pk is None:
                raise CapsuleMismatchError(f"capsule {out[-1].key!r} needs its parent "
                                           f"{out[-1].parent}, which is not in the store")
            out.append(self._recs[pk])
        return out[::-1]                  # root first

    def _get(self, rec, promote=True) -> Capsule:
        chain = self._chain(rec)
        for r in reversed(chain):         # child first, so ancestors end up more recent
            self._touch(r)
        excl = {r.key for r in chain}
        for r in chain if promote else ():
            if r.key in self._recs:
                self._promote(r, excl)
        view = None
        for r in chain:
            v = self._view(r)
            v.parent_capsule = view
            view = v
        return view

    def _view(self, rec) -> Capsule:
        if rec.key not in self._recs:
            raise KeyError(rec.key)
        if rec.cap is None:               # on disk and not promoted: a load for this caller only
            return self._load(rec, self.device)
        return Capsule(rec.cap.data, rec.cap.entries, rec.cap.meta)

    # ---- internals: single use ------------------------------------------------------------
    def _peek(self, key):
        """(capsule, claim token or None) without consuming anything."""
        with self._lock:
            rec = self._rec(key)
            if not rec.single_use:
                return self._get(rec), None
            if rec.tier != DISK:
                return self._get(rec), ("mem", rec)
            parent = self._get(self._recs[self._by_id[rec.parent]]) if rec.parent else None
        try:
            cap = _fmt.load(self._path(key), self.device)
        except FileNotFoundError:
            self._tombstone(key, rec)
            raise CapsuleConsumedError(f"single-use capsule {key!r} was already claimed") from None
        cap.parent_capsule = parent
        return cap, ("disk", rec)

    def _claim(self, key, token):
        kind, rec = token
        if kind == "mem":
            with self._lock:
                if self._recs.get(key) is not rec:
                    raise CapsuleConsumedError(f"single-use capsule {key!r} was already claimed")
                self._drop(rec)
                self._tombstone(key, None)
            return
        path = self._path(key)
        claimed = f"{path}.claimed-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(path, claimed)      # the atomic step: exactly one caller succeeds
        except FileNotFoundError:
            self._tombstone(key, rec)
            raise CapsuleConsumedError(f"single-use capsule {key!r} was already claimed") from None
        _unlink(claimed)
        self._tombstone(key, rec)

    def _tombstone(self, key, rec):
        with self._lock:
            if rec is not None and self._recs.get(key) is rec:
                if rec.tier == DISK:
                    self._used[DISK] -= rec.size()
                    rec.tier = None       # its file is gone already
                self._drop(rec)
            self._consumed[key] = None
            while len(self._consumed) > _MAX_TOMBSTONES:
                self._consumed.popitem(last=False)

    # ---- internals: token index -----------------------------------------------------------
    def _index_tokens(self, rec, tokens):
        if rec.position > 0 and len(tokens) == rec.position:
            self._index.add(rec.key, tokens)

    def _unindex(self, rec):
        self._index.remove(rec.key)

    # ---- internals: opening a disk store ---------------------------------------------------
    def _scan(self, verify):
        found = []
        for name in os.listdir(self.disk_dir):
            path = os.path.join(self.disk_dir, name)
            m = _TMP.match(name) or _CLAIMED.match(name)
            if m:
                if not _pid_alive(int(m.group(1))):
                    _unlink(path)         # a writer or claimer that died mid-way
                continue
            if not name.endswith(SUFFIX) or not _KEY.match(name[: -len(SUFFIX)]):
                continue
            try:
                if verify:
                    cap = _fmt.load(path)
                    entries, meta, tokens = list(cap.entries), cap.meta, cap.tokens
                    size = os.path.getsize(path)
                else:
                    entries, meta, tokens, size = _fmt.read_header(path)
                mtime = os.stat(path).st_mtime_ns
            except FileNotFoundError:
                continue                  # claimed or removed meanwhile
            except CapsuleCorruptError as e:
                warnings.warn(f"capsule store: deleting corrupt file: {e}")
                _unlink(path)
                continue
            found.append((mtime, name[: -len(SUFFIX)], entries, meta, tokens, size))
        found.sort(key=lambda f: (f[0], f[1]))
        ids = {}
        for mtime, key, entries, meta, tokens, size in found:
            cid = meta.extra.get("id", "") if isinstance(meta.extra, dict) else ""
            if cid and cid in ids:
                warnings.warn(f"capsule store: {key}{SUFFIX} repeats capsule id {cid} of "
                              f"{ids[cid]}{SUFFIX}; skipped")
                continue
            ids[cid] = key
        by_key = {f[1]: f for f in found}
        for mtime, key, entries, meta, tokens, size in found:
            if ids.get(meta.extra.get("id", "")) != key:
                continue
            rec = _Rec(key, meta.extra.get("id", ""), meta, entries, False)
            # skip deltas whose ancestry is incomplete on disk
            p, ok, seen = rec.parent, True, set()
            while p is not None:
                pk = ids.get(p)
                if pk is None or pk in seen:
                    ok = False
                    break
                seen.add(pk)
                pm = by_key[pk][3]
                p = (pm.parent or {}).get("id") if any(e.row0 for e in by_key[pk][2]) else None
            if not ok:
                warnings.warn(f"capsule store: {key}{SUFFIX} is a delta capsule whose parent "
                              f"{rec.parent} is not in {self.disk_dir}; skipped")
                continue
            rec.tier, rec.fsize, rec.msize = DISK, size, _loaded_size(entries)
            self._recs[key] = rec
            if rec.id:
                self._by_id[rec.id] = key
            self._lru[key] = None
            self._used[DISK] += size
            self._index_tokens(rec, tokens)
        for rec in self._recs.values():
            if rec.parent is not None:
                self._recs[self._by_id[rec.parent]].children.add(rec.key)
        b = self._budget[DISK]
        if b is not None and self._used[DISK] > b:   # opened with a smaller budget: trim (LRU)
            if not self._make_room(DISK, 0, set()):
                raise ValueError(f"disk tier holds {self._used[DISK]} B of capsules that cannot be "
                                 f"evicted, over disk_bytes={b}")


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

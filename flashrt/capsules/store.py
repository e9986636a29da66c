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

Shared tier
    CapsuleStore(..., shared=RedisTier(...)) (capsules/redis_tier.py) adds a tier below disk
    shared by a fleet: put() also queues the capsule for publishing there, and match() with a
    fingerprint asks it for a longer prefix than the local one, putting what it fetches into
    the local tiers. Its faults never reach the caller: they are misses.

Namespaces
    put/match/key_of(namespace=ns): a capsule is matched and found only in its namespace; each
    has its own prefix index (budgets and LRU order are shared). view(ns): capsules/namespaces.py.

Several processes may open one disk_dir; each keeps its own index (built when it opens) and
its own accounting, so budgets and LRU order are per process. What one process removes,
another sees as a missing file: get() then forgets the key and raises KeyError.
"""
from __future__ import annotations

import threading
import warnings

import torch

from flashrt.errors import CapsuleConsumedError, CapsuleCorruptError, CapsuleError, CapsuleMismatchError

from . import format as _fmt
from .catalog import _Catalog, _Rec
from .disk import KEY, DiskDir
from .tiers import DISK, TIERS, Tiers, loaded_size
from .types import FINGERPRINT_KEYS, Capsule

class CapsuleStore:
    """Capsules by key over device / host / disk tiers; see the module docstring."""

    def __init__(self, device_bytes: int = 0, host_bytes: int = 0, disk_dir=None,
                 disk_bytes: int | None = None, device=None, verify: bool = False, shared=None):
        _check_budgets(device_bytes=device_bytes, host_bytes=host_bytes, disk_bytes=disk_bytes)
        self.device = _store_device(device)
        self._disk = DiskDir(disk_dir) if disk_dir is not None else None
        self.disk_dir = self._disk.dir if self._disk else None
        self._cat = c = _Catalog()
        self._recs, self._by_id, self._lru = c.recs, c.by_id, c.lru
        self._lock = threading.RLock()
        self.shared = shared      # a tier below disk shared by a fleet (capsules/redis_tier.py)
        self._tiers = Tiers([device_bytes, host_bytes, disk_bytes if self._disk else 0], self.device,
                            self._disk, c.recs, c.lru, self._drop, self._load)
        if self._disk:
            _index_disk(c, self._tiers, self._disk, verify)

    # ---- public API ----------------------------------------------------------------------
    def put(self, cap: Capsule, key: str | None = None, pin: bool = False, namespace: str = "") -> str:
        """Store `cap` under `key` (default: cap.id) in `namespace`, queued for the shared tier too."""
        key = self._put(cap, key, pin, namespace)
        if self.shared is not None:
            self.shared.publish(cap, self.view(namespace), pin, namespace=namespace)
        return key

    def view(self, namespace: str = ""):
        """This store as namespace `namespace` sees it (capsules/namespaces.py)."""
        from .namespaces import NamespaceView
        return NamespaceView(self, namespace)

    def _put(self, cap: Capsule, key: str | None, pin: bool, ns: str = "") -> str:
        with self._lock:
            key = _check_key(cap.id if key is None else key)
            old = self._recs.get(key)
            if old is not None:
                if old.ns != ns:
                    raise ValueError(f"capsule key {key!r} is taken in another namespace")
                if old.id == cap.id and old.position == cap.position:
                    old.pinned = old.pinned or pin
                    self._lru.move_to_end(key)
                    return key
                self._drop(old, explicit=True)
            if cap.id and cap.id in self._by_id:
                raise ValueError(f"capsule {cap.id} is already stored under key {self._by_id[cap.id]!r}")
            rec = _Rec(key, cap.id, cap.meta, cap.entries, pin, ns)
            rec.msize, rec.fsize = cap.data.numel(), _fmt.file_size(cap) if self._disk else 0
            self._tiers.refuse_if_too_big(rec, key)
            parent = self._parent_for_put(cap, ns) if rec.parent is not None else None
            order = [DISK] if rec.single_use and self._disk else list(range(self._tiers.last + 1))
            self._recs[key] = rec          # registered (tier None): room-making sees the parent
            if parent is not None:         # as referenced
                parent.children.add(key)
            try:
                self._tiers.place_first(rec, Capsule(cap.data, cap.entries, cap.meta), order)
            except BaseException:
                self._recs.pop(key, None)
                if parent is not None:
                    parent.children.discard(key)
                raise
            self._cat.add(rec, cap.history)
            return key

    def get(self, key: str) -> Capsule:
        """The capsule under `key`, parent chain attached; LRU touch and promotion."""
        with self._lock:
            rec = self._cat.rec(key)
            if rec.single_use:
                raise CapsuleError(f"capsule {key!r} is single-use: claim it with take() or "
                                   "restore_into(), not get()")
            return self._get(rec)

    def pin(self, key: str, pinned: bool = True) -> None:
        """Keep `key` in its tier (pinned=False: evictable again, least recently used first)."""
        with self._lock:
            self._cat.rec(key).pinned = pinned

    def drop(self, key: str) -> None:
        """Remove `key` (and its file). Refused while a stored delta capsule needs it."""
        with self._lock:
            self._drop(self._cat.rec(key), explicit=True)

    def take(self, key: str) -> Capsule:
        """Remove and return `key`; for a single-use capsule this is the (atomic) claim."""
        with self._lock:
            rec = self._cat.rec(key)
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

    def match(self, tokens, fingerprint: dict | None = None, namespace: str = ""):
        """(capsule, n): the longest capsule of `namespace` whose token history is tokens[:n], or
        (None, 0). fingerprint (a runtime's): only capsules made by that model and layout."""
        tokens = _token_list(tokens)
        cap, n = self._match(tokens, fingerprint, namespace)
        if self.shared is not None:       # a longer prefix elsewhere in the fleet, fetched here
            cap, n = self.shared.extend_match(self.view(namespace), tokens, fingerprint, cap, n,
                                              namespace=namespace)
        return cap, n

    def _match(self, tokens, fingerprint, ns=""):
        with self._lock:
            for n, keys in self._cat.candidates(tokens, ns):
                for k in keys:
                    rec = self._recs.get(k)
                    if rec is None or rec.single_use or not _fp_ok(rec, fingerprint):
                        continue
                    try:
                        return self._get(rec), n
                    except (CapsuleCorruptError, KeyError):
                        continue          # vanished or damaged: already forgotten; try the next
            return None, 0

    def footprint(self) -> dict:
        with self._lock:
            return dict(zip(TIERS, self._tiers.used))

    def budgets(self) -> dict:
        return dict(zip(TIERS, self._tiers.budget))

    def tier(self, key: str) -> str:
        with self._lock:
            return TIERS[self._cat.rec(key).tier]

    def key_of(self, capsule_id: str, namespace: str | None = None) -> str | None:
        """The key a capsule id is stored under, if any (namespace given: only in it)."""
        with self._lock:
            key = self._by_id.get(capsule_id)
            if key is not None and namespace is not None and self._recs[key].ns != namespace:
                return None
            return key

    def namespace_of(self, key: str) -> str | None:
        with self._lock:
            rec = self._recs.get(key)
            return rec.ns if rec is not None else None

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
        return f"CapsuleStore(used {self.footprint()} of {self.budgets()})"

    # ---- internals: records ---------------------------------------------------------------
    def _parent_for_put(self, cap, ns="") -> _Rec:
        ref = cap.meta.parent or {}
        pkey = self._by_id.get(ref.get("id"))
        if pkey is not None and self._recs[pkey].ns != ns:
            raise CapsuleMismatchError(f"delta capsule {cap.id}: its parent {ref.get('id')} is "
                                       "stored in another namespace")
        if pkey is None:
            if cap.parent_capsule is None:
                raise CapsuleMismatchError(f"delta capsule {cap.id} needs its parent {ref.get('id')}, "
                                           "which is neither stored nor attached")
            pkey = self.put(cap.parent_capsule, namespace=ns)
        self._lru.move_to_end(pkey)
        return self._cat.parent_for(cap, pkey)

    def _load(self, rec, device) -> Capsule:
        """Load a disk record's file; a missing or corrupt file forgets it (and its children)."""
        try:
            return self._disk.load(rec.key, device)
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
        self._cat.remove(rec)
        if rec.tier is not None:
            self._tiers.release(rec)
            if rec.tier == DISK:
                self._disk.remove(rec.key)
        rec.cap, rec.tier = None, None

    def _get(self, rec, promote=True) -> Capsule:
        chain = self._cat.chain(rec)
        for r in reversed(chain):         # child first, so ancestors end up more recent
            self._lru.move_to_end(r.key)
        excl = {r.key for r in chain}
        for r in chain if promote else ():
            if r.key in self._recs:
                self._tiers.promote(r, excl)
        view = None
        for r in chain:
            if r.key not in self._recs:
                raise KeyError(r.key)
            # on disk and not promoted: a load for this caller only
            v = self._load(r, self.device) if r.cap is None else \
                Capsule(r.cap.data, r.cap.entries, r.cap.meta)
            v.parent_capsule = view
            view = v
        return view

    # ---- internals: single use ------------------------------------------------------------
    def _peek(self, key):
        """(capsule, claim token or None) without consuming anything."""
        with self._lock:
            rec = self._cat.rec(key)
            if not rec.single_use:
                return self._get(rec), None
            if rec.tier != DISK:
                return self._get(rec), ("mem", rec)
            parent = self._get(self._recs[self._by_id[rec.parent]]) if rec.parent else None
        try:
            cap = self._disk.load(key, self.device)
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
        won = self._disk.claim(key)       # the atomic step: exactly one caller succeeds
        self._tombstone(key, rec)
        if not won:
            raise CapsuleConsumedError(f"single-use capsule {key!r} was already claimed")

    def _tombstone(self, key, rec):
        with self._lock:
            if rec is not None and self._recs.get(key) is rec:
                if rec.tier == DISK:
                    self._tiers.release(rec)
                    rec.tier = None       # its file is gone already
                self._drop(rec)
            self._cat.tombstone(key)


def _token_list(tokens) -> list:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.reshape(-1).tolist()
    return [int(t) for t in tokens]


def _check_budgets(**budgets) -> None:
    for name, v in budgets.items():
        if v is not None and (not isinstance(v, int) or v < 0):
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")


def _store_device(device) -> torch.device:
    """The device tier's device as tensors report it (cuda -> cuda:N)."""
    d = torch.device(device if device is not None else
                     "cuda" if torch.cuda.is_available() else "cpu")
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


def _check_key(key) -> str:
    if not isinstance(key, str) or not KEY.match(key):
        raise ValueError(f"bad capsule key {key!r}: use 1-200 characters of [A-Za-z0-9._-], "
                         "not starting with '.' (keys name files in the disk tier)")
    return key


def _fp_ok(rec, fp) -> bool:
    return fp is None or all(rec.fingerprint.get(k) == fp.get(k) for k in FINGERPRINT_KEYS)


def _index_disk(cat: _Catalog, tiers: Tiers, disk: DiskDir, verify: bool) -> None:
    """Index the disk directory (the directory is the index: no other on-disk state)."""
    for key, entries, meta, tokens, size in disk.scan(verify):
        rec = _Rec(key, meta.extra.get("id", ""), meta, entries, False)
        rec.tier, rec.fsize, rec.msize = DISK, size, loaded_size(entries)
        cat.add(rec, tokens)
        tiers.used[DISK] += size
    for rec in cat.recs.values():
        if rec.parent is not None:
            cat.recs[cat.by_id[rec.parent]].children.add(rec.key)
    b = tiers.budget[DISK]
    if b is not None and tiers.used[DISK] > b:   # opened with a smaller budget: LRU trim
        if not tiers.make_room(DISK, 0, set()):
            raise ValueError(f"disk tier holds {tiers.used[DISK]} B of capsules that cannot be "
                             f"evicted, over disk_bytes={b}")

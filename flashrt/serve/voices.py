"""VoiceBook: the voices clients made, each a voice capsule (Synthesizer.make_voice) under a name.

Names are per tenant (tenants.py): a voice exists only for the API key that made it. In memory
the voices are a CapsuleStore within --voice-budget-mb, pinned. With --capsule-dir each is also
a file of a disk CapsuleStore in <dir>/voices/ (written before the upload is answered, never
evicted), and memory is then a cache of the disk: a restarted server finds every voice there.
A voice's key is "<tenant>.<name>" (the keyless tenant's: the name alone; names hold no '.').
The checkpoint's own voices (`default` among them) are speech.py's, never stored here.

With --capsule-redis the fleet's voices are named capsules of the Redis tier (RedisTier.put_named,
namespace = tenant, under the synthesizer's fingerprint), stored before the upload is answered:
any server lists, speaks with and deletes them. Redis is then what decides which voices exist;
memory and disk are caches of it (get: memory, disk, then Redis, each use checked against the
name's capsule id there; a cached voice Redis no longer names is dropped). While Redis cannot be
asked, listing and speaking use the caches, and uploads and deletes are refused (503): a change
only one server saw would split the fleet.
"""
from __future__ import annotations

import threading
from pathlib import Path

from flashrt.capsules import Capsule, CapsuleCorruptError, CapsuleError, CapsuleStore

from .wire import APIError


def _key(tenant: str, name: str) -> str:
    return f"{tenant}.{name}" if tenant else name


def _name(key: str, tenant: str) -> str | None:
    """The voice name of a key when it is tenant's, else None."""
    owner, _, name = key.rpartition(".")
    return name if owner == tenant else None


def _unreachable(what: str) -> APIError:
    return APIError(503, f"{what}: the shared voice store (--capsule-redis) cannot be reached; retry "
                    "later", type="server_error", code="voice_store_unavailable",
                    headers={"Retry-After": "5"})


class VoiceBook:
    def __init__(self, budget_bytes: int, per_tenant: int, disk_dir=None, device="cpu", shared=None,
                 fingerprint: dict | None = None):
        """shared: a capsules.redis_tier.RedisTier (owned: close() closes it); fingerprint: the
        synthesizer's, which its voices are stored and found under."""
        if shared is not None and fingerprint is None:
            raise ValueError("VoiceBook: a shared tier needs the synthesizer's fingerprint")
        self.disk = CapsuleStore(disk_dir=Path(disk_dir) / "voices") if disk_dir else None
        self.mem = CapsuleStore(device_bytes=budget_bytes, device=device)
        self.shared, self.fingerprint = shared, fingerprint
        self.per_tenant = per_tenant
        self._lock = threading.Lock()        # a count check and its put are one step

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()

    def names(self, tenant: str) -> list[str]:
        local = self._local_names(tenant)
        if self.shared is None or (listed := self.shared.names(self.fingerprint, tenant)) is None:
            return sorted(local)
        for name in local.difference(listed):            # deleted on another server
            self._forget(_key(tenant, name))
        return listed

    def __contains__(self, item: tuple) -> bool:
        return item[1] in self.names(item[0])

    def get(self, tenant: str, name: str) -> Capsule:
        """The voice capsule; KeyError when there is none (a damaged file without a shared tier:
        CapsuleCorruptError, and the store has deleted it)."""
        k = _key(tenant, name)
        local = self._local(k)
        if self.shared is None:
            if local is None:
                raise KeyError(k)
            return local
        got = self.shared.get_named(name, self.fingerprint, tenant,
                                    have=lambda cid: local if local is not None and local.id == cid else None)
        if got is not None:
            if got is not local:                         # another server's voice, or a newer one
                self._forget(k)
                self._keep(k, got)
            return got
        if local is not None and self.shared.names(self.fingerprint, tenant) is None:
            return local                                 # Redis cannot be asked: the cache serves
        if local is not None:
            self._forget(k)
        raise KeyError(k)

    def put(self, tenant: str, name: str, cap: Capsule) -> None:
        """Keep a new voice (blocking: it may write a file and Redis). 409 when the name is taken,
        429 past --max-voices-per-key, 507 when memory (the only copy) is full, 503 when Redis
        cannot take it."""
        with self._lock:
            have = self.names(tenant)
            if name in have:
                raise _taken(name)
            if len(have) >= self.per_tenant:
                raise APIError(429, f"this key keeps {self.per_tenant} voices already "
                               "(--max-voices-per-key): delete one first", param="name",
                               type="rate_limit_error", code="voice_limit")
            k = _key(tenant, name)
            if self.shared is not None:
                try:
                    stored = self.shared.put_named(name, cap, tenant)
                except FileExistsError:                  # another server's upload took it first
                    raise _taken(name) from None
                if not stored:
                    raise _unreachable(f"voice {name!r} was not kept")
                self._keep(k, cap)
                return
            if self.disk is not None:
                self.disk.put(cap, key=k)
            try:
                self.mem.put(cap, key=k, pin=self.disk is None)
            except ValueError as e:
                if self.disk is None:
                    raise APIError(507, f"no memory left for voice {name!r} (--voice-budget-mb): {e}",
                                   type="server_error", code="voice_budget_full") from None

    def drop(self, tenant: str, name: str) -> bool:
        """Forget a voice (and its file, and its Redis name); False when there was none."""
        k = _key(tenant, name)
        with self._lock:
            if self.shared is None:
                return self._forget(k)
            gone = self.shared.drop_named(name, self.fingerprint, tenant)
            if gone is None:
                raise _unreachable(f"voice {name!r} was not deleted")
            self._forget(k)
            return gone

    # ---- the local copies -------------------------------------------------------------------
    def _local_names(self, tenant: str) -> set:
        keys = set(self.mem.keys()) | set(self.disk.keys() if self.disk is not None else ())
        return {n for k in keys if (n := _name(k, tenant)) is not None}

    def _local(self, k: str) -> Capsule | None:
        """Memory's copy, else the disk's (then cached in memory), else None. A damaged file is
        gone (the store deleted it): raised without a shared tier, else fetched again."""
        try:
            return self.mem.get(k)
        except KeyError:
            if self.disk is None:
                return None
        try:
            cap = self.disk.get(k)
        except KeyError:
            return None
        except CapsuleCorruptError:
            if self.shared is None:
                raise
            return None
        self._keep(k, cap, disk=False)
        return cap

    def _keep(self, k: str, cap: Capsule, disk: bool = True) -> None:
        """A cached copy: on disk (when there) and in memory as far as it fits."""
        try:
            if disk and self.disk is not None:
                self.disk.put(cap, key=k)
            self.mem.put(cap, key=k)
        except (ValueError, CapsuleError, OSError):     # full: served without a copy here
            pass

    def _forget(self, k: str) -> bool:
        found = False
        for store in (self.mem, self.disk):
            if store is not None and k in store:
                try:
                    store.drop(k)
                    found = True
                except KeyError:                         # dropped meanwhile by another request
                    pass
        return found


def _taken(name: str) -> APIError:
    return APIError(409, f"voice {name!r} exists: delete it first (DELETE /v1/audio/voices/{name})",
                    param="name", code="voice_exists")

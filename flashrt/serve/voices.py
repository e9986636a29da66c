"""VoiceBook: the voices clients made, each a voice capsule (Synthesizer.make_voice) under a name.

Names are per tenant (tenants.py): a voice exists only for the API key that made it. In memory
the voices are a CapsuleStore within --voice-budget-mb, pinned. With --capsule-dir each is also
a file of a disk CapsuleStore in <dir>/voices/ (written before the upload is answered, never
evicted), and memory is then a cache of the disk: a restarted server finds every voice there.
A voice's key is "<tenant>.<name>" (the keyless tenant's: the name alone; names hold no '.').
The checkpoint's own voices (`default` among them) are speech.py's, never stored here.
"""
from __future__ import annotations

import threading
from pathlib import Path

from flashrt.capsules import Capsule, CapsuleError, CapsuleStore

from .wire import APIError


def _key(tenant: str, name: str) -> str:
    return f"{tenant}.{name}" if tenant else name


def _name(key: str, tenant: str) -> str | None:
    """The voice name of a key when it is tenant's, else None."""
    owner, _, name = key.rpartition(".")
    return name if owner == tenant else None


class VoiceBook:
    def __init__(self, budget_bytes: int, per_tenant: int, disk_dir=None, device="cpu"):
        self.disk = CapsuleStore(disk_dir=Path(disk_dir) / "voices") if disk_dir else None
        self.mem = CapsuleStore(device_bytes=budget_bytes, device=device)
        self.per_tenant = per_tenant
        self._lock = threading.Lock()        # a count check and its put are one step

    def names(self, tenant: str) -> list[str]:
        keys = set(self.mem.keys()) | set(self.disk.keys() if self.disk is not None else ())
        return sorted(n for k in keys if (n := _name(k, tenant)) is not None)

    def __contains__(self, item: tuple) -> bool:
        k = _key(*item)
        return k in self.mem or (self.disk is not None and k in self.disk)

    def get(self, tenant: str, name: str) -> Capsule:
        """The voice capsule; KeyError when there is none (a damaged file: CapsuleCorruptError,
        and the store has deleted it)."""
        k = _key(tenant, name)
        try:
            return self.mem.get(k)
        except KeyError:
            if self.disk is None:
                raise
        cap = self.disk.get(k)
        try:
            self.mem.put(cap, key=k)             # cached; memory full: served from disk
        except (ValueError, CapsuleError):
            pass
        return cap

    def put(self, tenant: str, name: str, cap: Capsule) -> None:
        """Keep a new voice (blocking: it may write a file). 409 when the name is taken, 429 past
        --max-voices-per-key, 507 when memory (without a disk) is full."""
        with self._lock:
            if (tenant, name) in self:
                raise APIError(409, f"voice {name!r} exists: delete it first (DELETE /v1/audio/voices/"
                               f"{name})", param="name", code="voice_exists")
            if len(self.names(tenant)) >= self.per_tenant:
                raise APIError(429, f"this key keeps {self.per_tenant} voices already "
                               "(--max-voices-per-key): delete one first", param="name",
                               type="rate_limit_error", code="voice_limit")
            k = _key(tenant, name)
            if self.disk is not None:
                self.disk.put(cap, key=k)
            try:
                self.mem.put(cap, key=k, pin=self.disk is None)
            except ValueError as e:
                if self.disk is None:
                    raise APIError(507, f"no memory left for voice {name!r} (--voice-budget-mb): {e}",
                                   type="server_error", code="voice_budget_full") from None

    def drop(self, tenant: str, name: str) -> bool:
        """Forget a voice (and its file); False when there was none."""
        k, found = _key(tenant, name), False
        with self._lock:
            for store in (self.mem, self.disk):
                if store is not None and k in store:
                    store.drop(k)
                    found = True
        return found

"""TurnStore, the server's capsules: a memory CapsuleStore (the reuse cache) + a disk copy.

Every prompt end and turn end lands in the memory store (shared-prefix deltas, so a turn
costs its own rows). With a capsule directory, each turn end is also written as a full
capsule by a background writer (the worker only pays the snapshot copy; at most
MAX_PENDING wait, more are skipped), replacing that conversation's previous turn file; the
directory is LRU-trimmed to its own budget. Sessions saved by name go to its named/
folder (capsules.NamedCapsules: a folder per tenant, a byte budget and a count per tenant,
never trimmed). On start, the newest files that fit the memory budget are loaded into the
memory store, so a restarted server reuses earlier conversations.

Spills (stored responses, retained ids: response_store.py): a full capsule written by the
same writer under a key of its own, pinned in the disk tier (never trimmed, never made
redundant by a later turn) until dropped; pins are not persisted, so keep_spill re-pins it
after a restart, and recall puts it back into memory when the memory store lacks it.

Every capsule lives in a namespace (tenants.py): the memory store's (CapsuleStore namespaces,
which its Redis tier follows) and a turn file's, whose key is "<namespace>.<capsule id>" (the
default namespace: the id alone), so a restart puts each back where it was.
"""
from __future__ import annotations

import concurrent.futures
import os
import queue
from pathlib import Path
import threading
import warnings

from flashrt.capsules.format import file_size
from flashrt.capsules.named import NamedCapsules
from flashrt.capsules.store import CapsuleStore
from flashrt.errors import CapsuleError

MAX_PENDING = 64          # turn capsules waiting for the disk writer (each a full snapshot)


def _disk_key(ns: str, cap) -> str:
    return f"{ns}.{cap.id}" if ns else cap.id


def _key_ns(key: str) -> str:
    """The namespace of a turn file's key (capsule ids hold no '.')."""
    return key.split(".", 1)[0] if "." in key else ""


class TurnStore:
    def __init__(self, budget_bytes: int, disk_dir=None, shared=None, disk_bytes: int | None = None,
                 named_bytes: int | None = None, named_per_tenant: int | None = None):
        # shared: a fleet tier (capsules.redis_tier) the memory store publishes to and asks
        self.mem = CapsuleStore(device_bytes=budget_bytes, host_bytes=0, shared=shared)
        self.shared = shared
        self.disk = CapsuleStore(disk_dir=disk_dir, disk_bytes=disk_bytes) if disk_dir else None
        self.named = (NamedCapsules(Path(disk_dir) / "named", named_bytes, named_per_tenant)
                      if disk_dir else None)
        self._written: dict[str, tuple] = {}     # disk key -> (namespace, tokens), this process's
        self._q: queue.Queue = queue.Queue(MAX_PENDING)
        self._writer = None
        if self.disk is not None:
            self._preload(budget_bytes)
            self._writer = threading.Thread(target=self._write_loop, name="flashrt-capsule-writer",
                                            daemon=True)
            self._writer.start()

    def view(self, ns: str):
        """The memory store as namespace ns sees it."""
        return self.mem.view(ns)

    def _preload(self, budget: int) -> None:
        used = 0
        for key in reversed(self.disk.keys()):           # newest first, until one does not fit
            try:
                cap = self.disk.get(key)
            except (KeyError, CapsuleError) as e:
                warnings.warn(f"flashrt serve: skipping capsule {key!r} on disk: {e}")
                continue
            if used + cap.data.numel() > budget:
                return
            try:
                self.mem.put(cap, namespace=_key_ns(key))
                used += cap.data.numel()
            except (ValueError, CapsuleError):
                continue

    def remember_turn(self, rt, ns: str = "") -> None:
        """Turn end: the session's state into memory (a delta) and, with a disk, a full copy."""
        rt.set_context(rt.tokens, store=self.view(ns))  # nothing to run: only the memo
        if self.disk is not None and rt.position:
            try:
                self._q.put_nowait((ns, rt.snapshot()))
            except queue.Full:                           # a slow disk must not fill the memory
                warnings.warn(f"flashrt serve: {MAX_PENDING} turn capsules wait for the disk: "
                              "this one is kept in memory only")

    def spill(self, cap, ns: str = "") -> concurrent.futures.Future:
        """`cap` (a full capsule) written to disk, pinned, by the writer (here when its queue is
        full: a spill is not dropped). The Future gives (key, bytes on disk), or None when it
        cannot be written (no disk, no room beside the pinned files)."""
        fut = concurrent.futures.Future()
        if self.disk is None:
            fut.set_result(None)
            return fut
        try:
            self._q.put_nowait((ns, cap, fut))
        except queue.Full:
            self._spill(ns, cap, fut)
        return fut

    def _spill(self, ns, cap, fut) -> None:
        try:
            key = self.disk.put(cap, key=_disk_key(ns, cap), pin=True)
            fut.set_result((key, file_size(cap)))
        except (OSError, ValueError, CapsuleError) as e:
            warnings.warn(f"flashrt serve: capsule not spilled to disk: {e}")
            fut.set_result(None)

    def keep_spill(self, key: str) -> int | None:
        """Pin a spilled file again (after a restart); its bytes, or None when it is gone."""
        if self.disk is None or key not in self.disk:
            return None
        self.disk.pin(key)
        try:
            return os.path.getsize(Path(self.disk.disk_dir) / f"{key}.capsule")
        except OSError:
            return None

    def drop_spill(self, key: str) -> None:
        if self.disk is not None and key in self.disk:
            try:
                self.disk.drop(key)
            except (KeyError, ValueError):
                pass

    def recall(self, tokens, ns: str, key: str, fingerprint: dict) -> bool:
        """The memory store holds the capsule of exactly `tokens` (namespace ns): found, or put
        back from the spilled file `key`. False: neither."""
        cap, n = self.view(ns).match(tokens, fingerprint)
        if cap is not None and n == len(tokens):
            return True
        if self.disk is None or key not in self.disk or _key_ns(key) != ns:
            return False
        try:
            self.view(ns).put(self.disk.get(key))
        except (KeyError, ValueError, CapsuleError) as e:
            warnings.warn(f"flashrt serve: spilled capsule {key!r} not recalled: {e}")
            return False
        cap, n = self.view(ns).match(tokens, fingerprint)
        return cap is not None and n == len(tokens)

    def _write_loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if len(item) == 3:
                self._spill(*item)
                self._q.task_done()
                continue
            ns, cap = item
            try:
                toks = tuple(cap.history)
                key = self.disk.put(cap, key=_disk_key(ns, cap))
                # a turn file made redundant by this one (same namespace and conversation,
                # shorter) goes; files the budget evicted are forgotten
                for k, (kns, t) in list(self._written.items()):
                    if k not in self.disk:
                        del self._written[k]
                    elif kns == ns and len(t) < len(toks) and toks[: len(t)] == t:
                        self.disk.drop(k)
                        del self._written[k]
                self._written[key] = (ns, toks)
            except (OSError, ValueError, CapsuleError) as e:
                warnings.warn(f"flashrt serve: turn capsule not written to disk: {e}")
            finally:
                self._q.task_done()

    def flush(self) -> None:
        """Wait until every queued turn capsule is on disk."""
        if self.disk is not None:
            self._q.join()

    def save_named(self, rt, name: str, tenant: str = "", overwrite: bool = False) -> int:
        """The session's state on disk under `name` of `tenant` (named/, never trimmed). An
        existing name raises FileExistsError unless overwrite; a limit, NamedLimitError."""
        if not overwrite and (name, tenant) in self.named:
            raise FileExistsError(name)
        cap = rt.snapshot()
        self.named.save(cap, name, tenant, overwrite)
        return cap.position

    def load_named(self, name: str, tenant: str = "", ns: str = "", fingerprint: dict | None = None):
        """The tokens of a capsule `tenant` saved by name; the capsule goes into memory (in
        namespace ns) for reuse. KeyError: no such name; CapsuleMismatchError: another model's;
        CapsuleCorruptError: damaged (moved aside)."""
        cap = self.named.load(name, tenant, fingerprint)
        try:
            self.view(ns).put(cap)
        except (ValueError, CapsuleError):
            pass                                       # too big, or already there: reuse by tokens
        return cap.history

    def close(self) -> None:
        if self.shared is not None:
            self.shared.flush()
            self.shared.close()
        if self._writer is not None:
            self._q.put(None)
            self._writer.join(timeout=30)

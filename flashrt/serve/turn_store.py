"""TurnStore, the server's capsules: a memory CapsuleStore (the reuse cache) + a disk copy.

Every prompt end and turn end lands in the memory store (shared-prefix deltas, so a turn
costs its own rows). With a capsule directory, each turn end is also written as a full
capsule by a background writer (the worker only pays the snapshot copy; at most
MAX_PENDING wait, more are skipped), replacing that conversation's previous turn file; the
directory is LRU-trimmed to its own budget. Sessions saved by name go to its named/
folder, never trimmed. On start, the newest files that fit the memory budget are loaded into
the memory store, so a restarted server reuses earlier conversations.
"""
from __future__ import annotations

import queue
from pathlib import Path
import threading
import warnings

from flashrt.capsules.store import CapsuleStore
from flashrt.errors import CapsuleError

MAX_PENDING = 64          # turn capsules waiting for the disk writer (each a full snapshot)


class TurnStore:
    def __init__(self, budget_bytes: int, disk_dir=None, shared=None, disk_bytes: int | None = None):
        # shared: a fleet tier (capsules.redis_tier) the memory store publishes to and asks
        self.mem = CapsuleStore(device_bytes=budget_bytes, host_bytes=0, shared=shared)
        self.shared = shared
        self.disk = CapsuleStore(disk_dir=disk_dir, disk_bytes=disk_bytes) if disk_dir else None
        self.named = CapsuleStore(disk_dir=Path(disk_dir) / "named") if disk_dir else None
        self._written: dict[str, tuple] = {}     # disk key -> tokens, turn files of this process
        self._q: queue.Queue = queue.Queue(MAX_PENDING)
        self._writer = None
        if self.disk is not None:
            self._preload(budget_bytes)
            self._writer = threading.Thread(target=self._write_loop, name="flashrt-capsule-writer",
                                            daemon=True)
            self._writer.start()

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
                self.mem.put(cap)
                used += cap.data.numel()
            except (ValueError, CapsuleError):
                continue

    def remember_turn(self, rt) -> None:
        """Turn end: the session's state into memory (a delta) and, with a disk, a full copy."""
        rt.set_context(rt.tokens, store=self.mem)       # nothing to run: only the memo
        if self.disk is not None and rt.position:
            try:
                self._q.put_nowait(rt.snapshot())
            except queue.Full:                           # a slow disk must not fill the memory
                warnings.warn(f"flashrt serve: {MAX_PENDING} turn capsules wait for the disk: "
                              "this one is kept in memory only")

    def _write_loop(self) -> None:
        while True:
            cap = self._q.get()
            if cap is None:
                return
            try:
                toks = tuple(cap.history)
                key = self.disk.put(cap)
                # a turn file made redundant by this one (same conversation, shorter) goes;
                # files the budget evicted are forgotten
                for k, t in list(self._written.items()):
                    if k not in self.disk:
                        del self._written[k]
                    elif len(t) < len(toks) and toks[: len(t)] == t:
                        self.disk.drop(k)
                        del self._written[k]
                self._written[key] = toks
            except (OSError, ValueError, CapsuleError) as e:
                warnings.warn(f"flashrt serve: turn capsule not written to disk: {e}")
            finally:
                self._q.task_done()

    def flush(self) -> None:
        """Wait until every queued turn capsule is on disk."""
        if self.disk is not None:
            self._q.join()

    def save_named(self, rt, name: str, overwrite: bool = False) -> int:
        """The session's state on disk under `name` (named/, never trimmed). An existing name
        raises FileExistsError unless overwrite."""
        if not overwrite and name in self.named:
            raise FileExistsError(name)
        cap = rt.snapshot()
        self.named.put(cap, key=name)
        return cap.position

    def load_named(self, name: str):
        """The tokens of a capsule saved by name; the capsule goes into memory for reuse."""
        cap = self.named.get(name)
        try:
            self.mem.put(cap)
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

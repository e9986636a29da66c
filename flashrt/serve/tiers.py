"""The server's capsules: a memory CapsuleStore (the reuse cache) plus an optional disk copy.

Every prompt end and turn end lands in the memory store (shared-prefix deltas, so a turn
costs its own rows). With a capsule directory, each turn end is also written as a full
capsule by a background writer (the worker only pays the snapshot copy), replacing that
conversation's previous turn file. On start, the newest files that fit the memory budget
are loaded into the memory store, so a restarted server reuses earlier conversations.
"""
from __future__ import annotations

import queue
import threading
import warnings

from flashrt.capsules.store import CapsuleStore
from flashrt.errors import CapsuleError

NAMED = "session."        # key prefix of capsules saved by name (/v1/sessions/{id}/save)


class Tiers:
    def __init__(self, budget_bytes: int, disk_dir=None, shared=None):
        # shared: a fleet tier (capsules.redis_tier) the memory store publishes to and asks
        self.mem = CapsuleStore(device_bytes=budget_bytes, host_bytes=0, shared=shared)
        self.shared = shared
        self.disk = CapsuleStore(disk_dir=disk_dir) if disk_dir else None
        self._written: dict[str, tuple] = {}     # disk key -> tokens, turn files of this process
        self._q: queue.Queue = queue.Queue()
        self._writer = None
        if self.disk is not None:
            self._preload(budget_bytes)
            self._writer = threading.Thread(target=self._write_loop, name="flashrt-capsule-writer",
                                            daemon=True)
            self._writer.start()

    def _preload(self, budget: int) -> None:
        used = 0
        for key in reversed(self.disk.keys()):           # newest first
            try:
                cap = self.disk.get(key)
            except (KeyError, CapsuleError) as e:
                warnings.warn(f"flashrt serve: skipping capsule {key!r} on disk: {e}")
                continue
            if used + cap.data.numel() > budget:
                continue
            try:
                self.mem.put(cap)
                used += cap.data.numel()
            except (ValueError, CapsuleError):
                continue

    def remember_turn(self, rt) -> None:
        """Turn end: the session's state into memory (a delta) and, with a disk, a full copy."""
        rt.set_context(rt.tokens, store=self.mem)       # nothing to run: only the memo
        if self.disk is not None and rt.position:
            self._q.put(rt.snapshot())

    def _write_loop(self) -> None:
        while True:
            cap = self._q.get()
            if cap is None:
                return
            try:
                toks = tuple(cap.tokens)
                key = self.disk.put(cap)
                # a turn file made redundant by this one (same conversation, shorter) goes
                for k, t in list(self._written.items()):
                    if len(t) < len(toks) and toks[: len(t)] == t and k in self.disk:
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

    def save_named(self, rt, name: str) -> int:
        cap = rt.snapshot()
        self.disk.put(cap, key=NAMED + name)
        return cap.position

    def load_named(self, name: str):
        """The tokens of a capsule saved by name; the capsule goes into memory for reuse."""
        cap = self.disk.get(NAMED + name)
        try:
            self.mem.put(cap)
        except (ValueError, CapsuleError):
            pass                                       # too big, or already there: reuse by tokens
        return cap.tokens

    def close(self) -> None:
        if self.shared is not None:
            self.shared.flush()
            self.shared.close()
        if self._writer is not None:
            self._q.put(None)
            self._writer.join(timeout=30)

"""Language-model sessions made at load time (and captured, on CUDA), handed out by fork()."""
from __future__ import annotations

import threading


class LanguageModelPool:
    def __init__(self, make, n: int):
        self._free = [make(self) for _ in range(n)]
        self._lock = threading.Lock()

    def acquire(self):
        with self._lock:
            if not self._free:
                raise RuntimeError("no free session for fork(): all pre-allocated sessions are in "
                                   "use; close() a fork or load with a larger sessions=")
            return self._free.pop()

    def release(self, rt) -> None:
        rt.reset()
        with self._lock:
            if rt not in self._free:
                self._free.append(rt)

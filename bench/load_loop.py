"""load(into=) in a tight loop, for A/B of two trees on one interpreter (bench/README.md's A/B).

    python bench/load_loop.py TREE [--fresh]     # TREE: a checkout (e.g. a git worktree of 18dabfa)

A Qwen3-0.6B-shape capsule of 16 positions (4.1 MiB) is saved once, then loaded into one
preallocated capsule 300 times after 20 warm-up loads; --fresh also loads a fresh capsule
between loads (the allocation pattern of bench/capsules.py). Prints the median and p25.
Works on trees from before the capsules/ split (Capsule.save / Capsule.load) and after.
"""
import os
import statistics
import sys
import tempfile
import time

tree = os.path.abspath(sys.argv[1])
sys.path.insert(0, tree)
from bench import common as C  # noqa: E402

C.attach_native()
import flashrt  # noqa: E402
import torch  # noqa: E402

if hasattr(flashrt, "load_capsule"):
    LOAD = flashrt.load_capsule
else:                                          # before the capsules/ split
    from flashrt.capsules.capsule import Capsule
    LOAD = Capsule.load
torch.set_num_threads(2)
rt = flashrt.load(C.checkpoint("qwen3", "real"), max_seq_len=64, dtype="float32")
rt.prefill(list(range(16)))
pre = rt.empty_capsule()
rt.snapshot(into=pre)
f = os.path.join(tempfile.gettempdir(), "flashrt-load-loop.capsule")
flashrt.save_capsule(pre, f) if hasattr(flashrt, "save_capsule") else pre.save(f)
tgt = rt.empty_capsule(16)
for _ in range(20):
    LOAD(f, into=tgt)
ts, fresh = [], None
for _ in range(300):
    t0 = time.perf_counter()
    LOAD(f, into=tgt)
    ts.append(time.perf_counter() - t0)
    if "--fresh" in sys.argv:
        fresh = LOAD(f)
print(f"{tree}: load(into) median {statistics.median(ts) * 1e3:.3f} ms, p25 {sorted(ts)[75] * 1e3:.3f} ms"
      + (" (fresh loads between)" if fresh is not None else ""))

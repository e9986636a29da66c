"""restore() and snapshot(into=) of a 1 MiB capsule in a tight loop, for A/B of two trees on one
interpreter (bench/README.md's A/B): at this size a call's Python layers are visible next to
the copy.

    python bench/copy_loop.py TREE [--stub-copy]   # TREE: a checkout (e.g. a worktree of 18dabfa)

A Qwen3-0.6B-shape capsule of 2 positions (1.0 MiB) is restored / snapshotted into 2,000 times
per sample; prints the best of 5 samples in us per call. --stub-copy replaces the native copy
with a no-op, leaving only the Python cost of a call. Works on trees from before the Session
redesign and after.
"""
import os
import sys
import time

tree = os.path.abspath(sys.argv[1])
sys.path.insert(0, tree)
from bench import common as C  # noqa: E402

C.attach_native()
import flashrt  # noqa: E402
import torch  # noqa: E402
from flashrt import native  # noqa: E402

torch.set_num_threads(2)
rt = flashrt.load(C.checkpoint("qwen3", "real"), max_seq_len=8, dtype="float32", cuda_graphs=False)
rt.prefill([1, 2])
cap = rt.empty_capsule(2)
rt.snapshot(into=cap)
rt.restore(cap)
if "--stub-copy" in sys.argv:
    native.SegmentPlan.run = lambda self: None
for name, fn in (("restore", lambda: rt.restore(cap)), ("snapshot(into)", lambda: rt.snapshot(into=cap))):
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        best = min(best, (time.perf_counter() - t0) / 2000 * 1e6)
    print(f"{tree}: {name} {best:.2f} us/call ({cap.nbytes} B)"
          + (" (copy stubbed out)" if "--stub-copy" in sys.argv else ""))

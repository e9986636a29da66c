"""One eager step in two situations that cost a server latency (random weights):

  threads   restore a capsule at 544 positions, step 16 tokens: on the thread that loaded the
            model vs on another thread (why flashrt serve loads and steps on one thread)
  boundary  restore + 16 tokens from position 1000 (no checkpoint boundary) vs from 1020
            (crosses 1024: a short step is not split there)

    python bench/step_cases.py [--size real] [--repeats 6]
"""
from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402


def main(argv=None) -> int:
    p = C.base_parser("bench/step_cases.py", "16-token step: thread and checkpoint-boundary cases")
    p.add_argument("--arch", default="qwen3_5")
    p.add_argument("--size", default="real")
    a = p.parse_args(argv)
    a.repeats = a.repeats or 6
    C.setup(a)
    C.banner("step_cases", a)
    import torch
    torch.set_grad_enabled(False)
    rt = C.load_flashrt(C.checkpoint(a.arch, a.size), a, 2048)
    ids = C.random_ids(1100, rt.net.vocab_size, 0)
    rt.prefill(ids[:544])
    at544 = rt.snapshot()

    def step(cap, p):
        rt.restore(cap)
        t0 = time.perf_counter()
        rt.prefill(ids[p: p + 16])
        return (time.perf_counter() - t0) * 1e3

    def other_thread(fn):
        out = []
        t = threading.Thread(target=lambda: out.append(fn()))
        t.start()
        t.join()
        return out[0]

    res = {"loading thread": [], "another thread": []}
    for _ in range(a.repeats):                  # alternated
        res["loading thread"].append(step(at544, 544))
        res["another thread"].append(other_thread(lambda: step(at544, 544)))
    rt.restore(at544)                           # the thread cases left it at 560
    rt.prefill(ids[544:1000])
    at1000 = rt.snapshot()
    rt.prefill(ids[1000:1020])
    at1020 = rt.snapshot()
    assert (at1000.position, at1020.position) == (1000, 1020), (at1000.position, at1020.position)
    res["1000+16 (no boundary)"], res["1020+16 (crosses 1024)"] = [], []
    for _ in range(a.repeats):
        res["1000+16 (no boundary)"].append(step(at1000, 1000))
        res["1020+16 (crosses 1024)"].append(step(at1020, 1020))
    for k, v in res.items():
        print(f"{k:24s} median {statistics.median(v):7.1f} ms  [{min(v):.1f}-{max(v):.1f}]")
    print(C.RANDOM_NOTE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

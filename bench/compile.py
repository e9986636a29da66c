"""torch.compile of the step bodies (load(compile=True)) against the same bodies eager, on one
machine in one run: a 16-token step after a capsule restore (a user turn) and a decode step,
each compiled body's first call (the compile), and the identity checks: the compiled path's
never-left continuation is bitwise, and its logits stay within tolerance of the eager path's.

    python bench/compile.py [--arch qwen3_5] [--size real] [--context 512] [--repeats 5]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402


def main(argv=None) -> int:
    p = C.base_parser("bench/compile.py", "torch.compile'd step bodies vs eager bodies")
    p.add_argument("--arch", default="qwen3_5")
    p.add_argument("--size", default=None, help="tiny, small or real (default real; tiny in --quick)")
    p.add_argument("--context", type=int, default=None, help="positions before the timed steps")
    a = p.parse_args(argv)
    a.size = a.size or ("tiny" if a.quick else "real")
    a.context = a.context or (32 if a.quick else 512)
    a.repeats = a.repeats or (1 if a.quick else 5)
    a.warmup = 1 if a.warmup is None else a.warmup
    C.setup(a)
    info = C.banner("compile", a)
    import torch
    from flashrt.lm import use_graph_bodies
    torch.set_grad_enabled(False)
    path = C.checkpoint(a.arch, a.size)
    n = a.context + 16 + 8
    # eager and compiled: the default linear kernels (one opaque op inside compiled bodies);
    # all step through the graph bodies (captured on CUDA, run as they are on CPU)
    # "eager F.linear": what inductor would lower itself, for reference
    rts = {"eager": C.load_flashrt(path, a, n),
           "eager F.linear": C.load_flashrt(path, a, n, linear_kernel="aten"),
           "compiled": C.load_flashrt(path, a, n, compile=True)}
    for rt in rts.values():
        if rt.graphs is None:
            use_graph_bodies(rt)
    ids = C.random_ids(a.context + 16, rts["eager"].net.vocab_size, 0)
    caps, first, turn, never_left = {}, {}, ids[a.context:], {}
    for name, rt in rts.items():
        rt.prefill(ids[: a.context])             # longer than a body: the eager step
        caps[name] = rt.snapshot()
        t0 = time.perf_counter()
        lt = rt.prefill(turn)                     # first call of the 16-token body
        t1 = time.perf_counter()
        ld = rt.decode(7)                         # first call of the 1-token body
        first[name] = (t1 - t0, time.perf_counter() - t1)
        never_left[name] = (lt, ld)
    out = {}

    def turn_case(name):
        rt = rts[name]
        return C.Case(lambda: rt.prefill(turn), setup=lambda: rt.restore(caps[name]),
                      post=lambda l: out.__setitem__(("turn", name), l))

    def decode_case(name):
        rt = rts[name]
        return C.Case(lambda: rt.decode(7), setup=lambda: (rt.restore(caps[name]), rt.prefill(turn)),
                      post=lambda l: out.__setitem__(("decode", name), l))
    st = C.measure({f"{k} {m}": (turn_case if k == "turn" else decode_case)(m)
                    for k in ("turn", "decode") for m in rts}, a.repeats, a.warmup, a.device,
                   desc="compile")
    # compiled path: the timed runs restored the capsule and ran the same steps; their last
    # logits must be bitwise the run that never left (the first calls above)
    exact = bool(torch.equal(never_left["compiled"][0], out[("turn", "compiled")]) and
                 torch.equal(never_left["compiled"][1], out[("decode", "compiled")]))
    diff = max(float((out[(k, "compiled")] - out[(k, "eager")]).abs().max()) for k in ("turn", "decode"))
    lab = C.label(a.arch, a.size)
    t = C.Table(f"{lab}: torch.compile'd step bodies vs eager ({a.device}, {a.dtype}, context "
                f"{a.context})", ["step", "eager ms", "eager F.linear ms", "compiled ms",
                                  "compiled/eager", "compiled/eager F.linear", "compile s"])
    for k, label, j in (("turn", "16 tokens after a restore", 0), ("decode", "decode 1 token after them", 1)):
        c = st[f"{k} compiled"]
        t.add(label, st[f"{k} eager"].ms(), st[f"{k} eager F.linear"].ms(), c.ms(),
              C.fmt_ratio(C.ratio(c, st[f"{k} eager"])),
              C.fmt_ratio(C.ratio(c, st[f"{k} eager F.linear"])),
              f"{first['compiled'][j] - first['eager'][j]:.1f}")
    t.notes.append(f"compiled path: restore + the same steps bitwise the run that never left: {exact}; "
                   f"max |dlogit| compiled vs eager: {diff:.2e}")
    t.notes.append("eager and compiled: the default linear kernels (oneDNN; 2-32 rows on the "
                   "extension's small-M kernel); eager F.linear: MKL through F.linear; compile s: "
                   "first call of the compiled body minus the eager one's")
    t.notes.append(f"weights: {C.short_path(path)} (random)")
    print()
    print(t.text())
    data = {"arch": a.arch, "size": a.size, "context": a.context, "stats": st,
            "first_call_s": first, "compiled_never_left_bitwise": exact, "max_abs_logit_diff": diff}
    C.write_json("compile", a, info, [t], data, argv)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())

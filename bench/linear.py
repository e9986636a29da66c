"""The CPU projection kernels on a model's own weights, side by side in one run: a step of M
rows through every projection of the model (the weights stream from DRAM, as in a real step),
with oneDNN's inner product, the extension's small-M kernel (csrc/linear_cpu.cpp; one row: its
GEMV) and F.linear (MKL), the kernels alternated round by round, medians. M = 16 is a user turn
after a capsule restore; 2-8 a speculative verify; 1 a decode step (--head adds the vocabulary
head, one step's largest weight). --dtype bfloat16: bf16 weights (the small-M kernel widens
them to float32 in registers and rounds each output once), plus oneDNN's float32 inner product
on weights widened per call; oneDNN's own bf16 column only where it runs bf16. --weights int8:
the weights quantized as load(..., weights="int8") does, torch's int8 weight-only kernel
against the small-M kernel's int8 path (float32 x).

    python bench/linear.py [--arch qwen3_5] [--size real] [--rows 1 2 4 8 16 32] [--repeats 7]
                           [--dtype bfloat16] [--weights int8] [--head]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

NAMES = {"onednn": "oneDNN", "widened": "oneDNN widened", "torch-int8": "torch int8"}


def main(argv=None) -> int:
    p = C.base_parser("bench/linear.py", "CPU projection kernels on a model's weights")
    p.add_argument("--arch", default="qwen3_5")
    p.add_argument("--size", default=None, help="tiny, small or real (default real; tiny in --quick)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--weights", choices=("float", "int8"), default="float",
                   help="int8: the weights quantized per row (float32 activations)")
    p.add_argument("--head", action="store_true", help="the vocabulary head too (it runs on one row)")
    a = p.parse_args(argv)
    a.size = a.size or ("tiny" if a.quick else "real")
    a.repeats = a.repeats or (1 if a.quick else 7)
    a.warmup = 1 if a.warmup is None else a.warmup
    C.setup(a)
    if a.device != "cpu" or a.dtype not in ("float32", "bfloat16"):
        raise SystemExit("bench/linear.py times the CPU kernels (--device cpu, --dtype float32 or bfloat16)")
    if a.weights == "int8" and a.dtype != "float32":
        raise SystemExit("bench/linear.py --weights int8 runs float32 activations (--dtype float32)")
    info = C.banner("linear", a)
    import torch
    import torch.nn.functional as F
    from flashrt import native
    from flashrt.nn.linear import WIDEN, Linear, dequantize_int8, linear, small_m_rows
    if not native.SMALL_M_LINEAR or (a.weights == "int8" and not native.SMALL_M_INT8):
        raise SystemExit(f"the small-M kernel does not run here: {native.ext_status()}")
    torch.set_grad_enabled(False)
    path = C.checkpoint(a.arch, a.size)
    rt = C.load_flashrt(path, a, 64, **({"weights": "int8"} if a.weights == "int8" else {}))
    vocab = rt.net.vocab_size
    ws = [m.weight for m in rt.net.modules() if isinstance(m, Linear) and m.weight.shape[0] != vocab]
    if a.head:
        ws.append(rt.net.embed_tokens.weight if rt.net.config.tie_word_embeddings else rt.net.lm_head.weight)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    int8, bf16 = a.weights == "int8", a.dtype == "bfloat16"
    if int8:
        def torch_int8(x, w):       # what int8_linear runs outside the small-M rows
            return torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w, w.scale)
        small = lambda x, w: native.small_m_linear_int8(x, w, w.scale)   # noqa: E731
        fns = {"torch-int8": torch_int8, "small-M": small}
        dense = {id(w): dequantize_int8(w) for w in ws}     # the float64 reference's weights
    else:
        # bf16: every M on the small-M kernel, to show where the other kernels take over
        small = ((lambda x, w: native.small_m_linear(x.float(), w).to(x.dtype)) if bf16 else
                 (lambda x, w: native.small_m_linear(x, w)))
        fns = {"small-M": small, "F.linear": F.linear}
        if rt.net.linear_kernel != WIDEN:           # oneDNN runs this dtype here
            fns["onednn"] = lambda x, w: linear(x, w, kernel="onednn")
        if bf16:                                    # what WIDEN runs above its small-M rows
            fns["widened"] = lambda x, w: torch.ops.mkldnn._linear_pointwise(
                x.float(), w.float(), None, "none", [], "").to(x.dtype)
    g = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(max(a.rows), k, generator=g).to(ws[0].dtype if not int8 else torch.float32)
          for k in {w.shape[1] for w in ws}}
    cases, diffs = {}, {}
    for M in a.rows:
        for name, f in fns.items():
            cases[f"{name} M={M}"] = C.Case(lambda f=f, M=M: [f(xs[w.shape[1]][:M], w) for w in ws])
        wd = (lambda w: dense[id(w)]) if int8 else (lambda w: w)
        ref = [F.linear(xs[w.shape[1]][:M].double(), wd(w).double()) for w in ws]
        got = [fns["small-M"](xs[w.shape[1]][:M], w) for w in ws]
        diffs[M] = max(float(((y - r) / r.abs().max()).abs().max()) for y, r in zip(got, ref))
    st = C.measure_alt(cases, a.repeats, a.warmup, a.device, desc="linear")
    others = [k for k in ("onednn", "widened", "torch-int8") if k in fns]
    extra = [] if int8 else ["F.linear ms"]
    t = C.Table(f"{C.label(a.arch, a.size)}: all {len(ws)} projections of one step"
                f"{' and the vocabulary head' if a.head else ''}, M rows "
                f"({C.fmt_bytes(nbytes)} of {'int8' if int8 else a.dtype} weights)",
                ["rows"] + [f"{NAMES[k]} ms" for k in others] + ["small-M ms"] + extra
                + [f"{NAMES[k]}/small-M" for k in others]
                + [f"weights GB/s ({NAMES[k]})" for k in others] + ["weights GB/s (small-M)"])
    for M in a.rows:
        s = st[f"small-M M={M}"]
        t.add(M, *[st[f"{k} M={M}"].ms() for k in others], s.ms(),
              *([] if int8 else [st[f"F.linear M={M}"].ms()]),
              *[C.fmt_ratio(C.ratio(st[f"{k} M={M}"], s)) for k in others],
              *[f"{nbytes / st[f'{k} M={M}'].median / 1e9:.1f}" for k in others],
              f"{nbytes / s.median / 1e9:.1f}")
    lo, hi = small_m_rows(rt.net.linear_kernel, torch.int8 if int8 else ws[0].dtype)
    t.notes.append(f"ratio > 1: the small-M kernel faster; the runtime ({rt.net.linear_kernel!r}) "
                   f"takes it for {lo}..{hi} rows" if hi else
                   f"the runtime ({rt.net.linear_kernel!r}) does not take the small-M kernel")
    t.notes.append("kernels alternated round by round (measure_alt); medians; one row: the GEMV")
    if "widened" in fns:
        t.notes.append("oneDNN widened: float32 inner product on the bf16 weight widened per call "
                       "(the runtime's path for longer steps where oneDNN has no bf16)")
    if int8:
        t.notes.append("torch int8: aten._weight_int8pack_mm (x rounded to bf16, bf16 out); "
                       "small-M: float32 x, one float32 sum per output times the row's bf16 scale")
    t.notes.append(f"small-M column vs a float64 reference: max error {max(diffs.values()):.1e}, "
                   "relative to each output's largest |value|")
    t.notes.append(f"weights: {C.short_path(path)} (random)")
    print()
    print(t.text())
    C.write_json("linear", a, info, [t], {"arch": a.arch, "size": a.size, "weights": a.weights,
                                          "head": a.head, "weight_bytes": nbytes,
                                          "stats": st, "max_rel_err": diffs}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

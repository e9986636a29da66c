"""Time to first token with and without prefix reuse, FlashRT vs transformers (vs llama.cpp).

For each model and shared-prefix length P (suffix of S new tokens):
  flashrt cold      reset; prefill(prefix + suffix); first token = argmax of the last logits
  flashrt capsule   restore(capsule taken after the prefix); prefill(suffix); first token
  transformers cold         forward(prefix + suffix, logits_to_keep=1)
  transformers deep-copy    copy.deepcopy(cache after the prefix); forward(suffix, that cache)
  llama.cpp (optional)      eval(prefix + suffix) / llama_state_seq_set_data(state after prefix)
                            + eval(suffix), over a GGUF of the same checkpoint (bench/gguf.py)
Every path then decodes greedily; "same N tok" says whether its first N greedy tokens equal
those of its own cold path (flashrt also compares the first-token logits bit for bit).

    python bench/ttft.py                 # CPU defaults: qwen3_5 0.8B shape + qwen3/lfm2 small, 512-2048
    python bench/ttft.py --full          # + 4096 and the real shapes of all three
    python bench/ttft.py --quick         # tiny checkpoints, prefix 64/128, one repeat
"""
from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402
from bench.gguf import gguf_path  # noqa: E402

LLAMA_MISSING = ("not installed (optional bench extra: pip install llama-cpp-python, then "
                 "bench/gguf.py; see bench/README)")


def parse(argv):
    p = C.base_parser("bench/ttft.py", "TTFT: cold prefill vs capsule / cache-copy prefix reuse")
    p.add_argument("--full", action="store_true", help="add prefix 4096 and real shapes of all three "
                   "(on CUDA the default is already real shapes at 2k-16k)")
    p.add_argument("--models", default=None,
                   help="comma list of arch:size (default qwen3_5:real,qwen3:small,lfm2:small)")
    p.add_argument("--prefix", type=int, nargs="+", default=None, help="shared prefix lengths")
    p.add_argument("--suffix", type=int, default=16, help="new tokens after the prefix (default 16)")
    p.add_argument("--gen", type=int, default=16, help="greedy tokens compared per path (default 16)")
    p.add_argument("--gguf", action="append", default=[], metavar="ARCH:SIZE=PATH",
                   help="GGUF conversion of that checkpoint for the llama.cpp column (repeatable; "
                   "default: bench/gguf.py's output in ~/.cache/flashrt/gguf when present)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers columns")
    p.add_argument("--compile", action="store_true",
                   help="flashrt.load(compile=True): steps of <= 64 tokens run torch.compile'd bodies")
    p.add_argument("--plot", default=None, help="PNG path (default bench/results/ttft.png)")
    a = p.parse_args(argv)
    C.setup(a)
    cuda = a.device.startswith("cuda")
    if a.models is None:
        if a.quick:
            a.models = "qwen3_5:tiny,qwen3:tiny,lfm2:tiny"
        elif a.full or cuda:
            a.models = "qwen3_5:real,qwen3:small,lfm2:small,qwen3:real,lfm2:real"
        else:
            a.models = "qwen3_5:real,qwen3:small,lfm2:small"
    a.configs = [tuple(m.split(":")) if ":" in m else (m, "small") for m in a.models.split(",")]
    if a.prefix is None:
        if a.quick:
            a.prefix = [64, 128]
        elif cuda:
            a.prefix = [2048, 4096, 8192, 16384]
        else:
            a.prefix = [512, 1024, 2048] + ([4096] if a.full else [])
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.warmup = (0 if a.quick else 1) if a.warmup is None else a.warmup
    a.gguf = dict(g.split("=", 1) for g in a.gguf)
    return a


# ---- llama.cpp (optional) ---------------------------------------------------------------------
def llama_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_version() -> str:
    try:
        from importlib.metadata import version
        return "llama-cpp-python " + version("llama_cpp_python")
    except Exception:
        return "(version unknown)"


class LlamaPath:
    """llama.cpp (through llama-cpp-python's ctypes bindings) over a GGUF conversion of the same
    checkpoint (bench/gguf.py): same token ids, same weights, weights and KV cache in the same
    dtype as the other columns.

    Reuse goes through llama.cpp's C sequence-state API into a buffer allocated once
    (llama_state_seq_get_data / llama_state_seq_set_data), not llama-cpp-python's
    save_state/load_state, which add Python-side copies of the whole state. Logits are read with
    llama_get_logits_ith(-1): with logits_all=False the wrapper's `scores` are not filled."""

    KV_TYPES = {"float32": 0, "float16": 1, "bfloat16": 30}     # GGML_TYPE_F32 / F16 / BF16

    def __init__(self, gguf: str, n_ctx: int, threads: int, dtype: str, extra_bufts: bool = True):
        """extra_bufts=False: llama.cpp's --no-repack (llama_model_params.use_extra_bufts), which
        llama-cpp-python's Llama() does not take: its default params are wrapped while it loads."""
        import ctypes

        import llama_cpp
        import llama_cpp.llama_cpp as lib
        from llama_cpp import Llama
        self.lib, self.ctypes = llama_cpp, ctypes
        kv = self.KV_TYPES[dtype]
        default = lib.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = extra_bufts
            return p
        lib.llama_model_default_params = params
        try:
            # n_batch 2048 / n_ubatch 512: llama.cpp's own CLI defaults
            self.llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                             n_batch=2048, n_ubatch=512, type_k=kv, type_v=kv, logits_all=False,
                             verbose=False)
        finally:
            lib.llama_model_default_params = default
        self.ctx = self.llm._ctx.ctx
        self.n_vocab = self.llm.n_vocab()
        self.buf, self.n_state, self.prefix = None, 0, []

    def _last(self):
        import numpy as np
        ptr = self.lib.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def cold(self, ids):
        self.llm.reset()
        self.llm.eval(ids)
        return self._last()

    def prime(self, prefix):
        self.cold(prefix)
        n = self.lib.llama_state_seq_get_size(self.ctx, 0)
        self.buf = (self.ctypes.c_uint8 * n)()
        self.n_state = self.lib.llama_state_seq_get_data(self.ctx, self.buf, n, 0)
        self.prefix = list(prefix)
        return self.n_state

    def reuse(self, suffix):
        if self.lib.llama_state_seq_set_data(self.ctx, self.buf, self.n_state, 0) != self.n_state:
            raise RuntimeError("llama_state_seq_set_data refused the saved state")
        P = len(self.prefix)
        self.llm.n_tokens = P                   # what load_state does, without its copies
        self.llm.input_ids[:P] = self.prefix
        self.llm.eval(suffix)
        return self._last()

    def greedy(self, logits, n):
        """(tokens, per-step logits), like common.rt_greedy."""
        toks, steps = [], [logits]
        for i in range(n):
            t = int(logits.argmax())
            toks.append(t)
            if i + 1 < n:
                self.llm.eval([t])
                logits = self._last()
                steps.append(logits)
        return toks, steps


# ---- one model ----------------------------------------------------------------------------------
def bench_model(arch, size, a, table, llama_rows, on_point=None):
    import torch
    path = C.checkpoint(arch, size)
    lab = C.label(arch, size)
    n_ctx = max(a.prefix) + a.suffix + a.gen + 1
    rt = C.load_flashrt(path, a, max_seq_len=n_ctx, compile=a.compile)
    hf = None if a.no_hf else C.load_hf(path, a)
    llama, why = None, None
    gguf = a.gguf.get(f"{arch}:{size}") or gguf_path(arch, size, a.dtype)
    if not llama_installed():
        why = LLAMA_MISSING
    elif a.device != "cpu":
        why = "llama-cpp-python built for the CPU here; this run is on " + a.device
    elif not Path(gguf).exists():
        why = f"no GGUF at {C.short_path(gguf)} (python bench/gguf.py --llama-src ... --dtype {a.dtype})"
    else:
        try:
            llama = LlamaPath(str(gguf), n_ctx, torch.get_num_threads(), a.dtype)
        except Exception as e:               # a family llama.cpp cannot load: say why
            why = f"llama.cpp could not load {C.short_path(gguf)}: {type(e).__name__}: {e}"
    vocab = rt.net.vocab_size
    out = {"arch": arch, "size": size, "label": lab, "checkpoint": C.short_path(path),
           "hf_attn": C.hf_attn_name(hf) if hf is not None else None, "points": []}
    for P in C.progress(a.prefix, desc=f"{arch}/{size} prefixes"):
        prefix = C.random_ids(P, vocab, seed=P)
        suffix = C.random_ids(a.suffix, vocab, seed=P + 7919)
        full = prefix + suffix
        rt.reset()
        rt.prefill(prefix)
        cap = rt.snapshot()
        got = {}

        def keep(name, toks_logits):
            got[name] = toks_logits

        cases = {
            "flashrt_cold": C.Case(lambda: rt.prefill(full), setup=rt.reset,
                                   post=lambda l: keep("flashrt_cold", (C.rt_greedy(rt, l, a.gen), l))),
            "flashrt_capsule": C.Case(lambda: (rt.restore(cap), rt.prefill(suffix))[1],
                                      post=lambda l: keep("flashrt_capsule", (C.rt_greedy(rt, l, a.gen), l))),
        }
        if hf is not None:
            _, pcache = C.hf_forward(hf, prefix, a.device)
            cases["hf_cold"] = C.Case(lambda: C.hf_forward(hf, full, a.device),
                                      post=lambda r: keep("hf_cold", (C.hf_greedy(hf, *r, a.gen, a.device), r[0])))
            cases["hf_reuse"] = C.Case(
                lambda: C.hf_forward(hf, suffix, a.device, copy.deepcopy(pcache)),
                post=lambda r: keep("hf_reuse", (C.hf_greedy(hf, *r, a.gen, a.device), r[0])))
        if llama is not None:
            llama_state = llama.prime(prefix)
            cases["llama_cold"] = C.Case(lambda: llama.cold(full),
                                         post=lambda l: keep("llama_cold", (llama.greedy(l, a.gen), l)))
            cases["llama_reuse"] = C.Case(lambda: llama.reuse(suffix),
                                          post=lambda l: keep("llama_reuse", (llama.greedy(l, a.gen), l)))
        # warm-up before the first prefix and any prefix up to 512 tokens; longer ones reuse
        # warmed code paths (a warm-up cold prefill of thousands of tokens costs most of a
        # minute on 2 CPU cores); on CUDA always
        warm = P == a.prefix[0] or P <= 512 or a.device.startswith("cuda")
        st = C.measure(cases, a.repeats, a.warmup if warm else 0, a.device,
                       desc=f"{arch}/{size} P={P}")

        def toks(name):
            return got[name][0][0] if name in got else None

        pt = {"prefix": P, "suffix": a.suffix, "capsule_bytes": cap.nbytes,
              "times": {k: v for k, v in st.items()}, "tokens": {k: toks(k) for k in got}}
        pt["flashrt_same_tokens"] = toks("flashrt_capsule") == toks("flashrt_cold")
        pt["flashrt_same_logits"] = bool(torch.equal(got["flashrt_capsule"][1], got["flashrt_cold"][1]))
        pt["flashrt_speedup"] = C.ratio(st["flashrt_cold"], st["flashrt_capsule"])
        row = [lab, P, C.fmt_bytes(cap.nbytes), st["flashrt_cold"].ms(0), st["flashrt_capsule"].ms(1),
               C.fmt_ratio(pt["flashrt_speedup"], 1),
               _same(pt["flashrt_same_tokens"]) + (" (logits bitwise)" if pt["flashrt_same_logits"] else
                                                   " (logits differ)")]
        if hf is not None:
            pt["hf_same_tokens"] = toks("hf_reuse") == toks("hf_cold")
            pt["hf_max_abs_logit_diff"] = float((got["hf_reuse"][1] - got["hf_cold"][1]).abs().max())
            pt["hf_speedup"] = C.ratio(st["hf_cold"], st["hf_reuse"])
            pt["flashrt_vs_hf_cold"] = C.ratio(st["flashrt_cold"], st["hf_cold"])
            pt["flashrt_vs_hf_reuse"] = C.ratio(st["flashrt_capsule"], st["hf_reuse"])
            row += [st["hf_cold"].ms(0), st["hf_reuse"].ms(1), C.fmt_ratio(pt["hf_speedup"], 1),
                    _same(pt["hf_same_tokens"]), C.fmt_ratio(pt["flashrt_vs_hf_cold"]),
                    C.fmt_ratio(pt["flashrt_vs_hf_reuse"])]
        else:
            row += ["-"] * 6
        if llama is not None:
            pt["llama_state_bytes"] = llama_state
            pt["llama_same_tokens"] = toks("llama_reuse") == toks("llama_cold")
            pt["llama_same_logits"] = bool((got["llama_reuse"][1] == got["llama_cold"][1]).all())
            pt["llama_speedup"] = C.ratio(st["llama_cold"], st["llama_reuse"])
            pt["flashrt_vs_llama_cold"] = C.ratio(st["flashrt_cold"], st["llama_cold"])
            pt["flashrt_vs_llama_reuse"] = C.ratio(st["flashrt_capsule"], st["llama_reuse"])
            # same model? llama.cpp's cold path against flashrt's: greedy agreement and first logits
            mine, theirs = toks("flashrt_cold"), toks("llama_cold")
            pt["llama_agree_with_flashrt"] = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y),
                                                  len(mine))
            pt["llama_vs_flashrt_max_abs_logit_diff"] = float(
                abs(got["llama_cold"][1] - got["flashrt_cold"][1].float().cpu().numpy()).max())
            llama_rows.append([lab, P, C.fmt_bytes(llama_state), st["llama_cold"].ms(0),
                               st["llama_reuse"].ms(1), C.fmt_ratio(pt["llama_speedup"], 1),
                               _same(pt["llama_same_tokens"]) + (" (logits bitwise)" if pt["llama_same_logits"]
                                                                  else " (logits differ)"),
                               f'{pt["llama_agree_with_flashrt"]}/{a.gen}, '
                               f'{pt["llama_vs_flashrt_max_abs_logit_diff"]:.1e}',
                               C.fmt_ratio(pt["flashrt_vs_llama_cold"]),
                               C.fmt_ratio(pt["flashrt_vs_llama_reuse"])])
        elif P == a.prefix[0]:
            llama_rows.append([lab, "-", "-", "-", "-", "-", why, "-", "-", "-"])
        out["llama"] = why or "ran"
        table.add(*row)
        out["points"].append(pt)
        if on_point is not None:
            on_point(out)
        del cap, got, cases
        C.free_memory()
    del rt, hf, llama
    C.free_memory()
    return out


def _hybrid_kernels_note(device: str) -> str:
    import importlib.util
    if all(importlib.util.find_spec(m) for m in ("fla", "causal_conv1d")):
        return ("hybrid layers: flash-linear-attention / causal-conv1d installed; transformers "
                "uses them, flashrt for bf16/fp16 on CUDA")
    return ("hybrid layers: flash-linear-attention / causal-conv1d not installed; transformers and "
            f"flashrt both run their PyTorch reference kernels (on {device})")


def _same(b: bool) -> str:
    return "yes" if b else "NO"


def plot(results, path, a) -> None:
    try:                  # optional: a machine without it still gets the JSON and the tables
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed ({path} not written)")
        return
    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    series = [("flashrt_cold", "flashrt cold", "C0", "--"), ("flashrt_capsule", "flashrt capsule", "C0", "-"),
              ("hf_cold", "transformers cold", "C1", "--"), ("hf_reuse", "transformers deep-copy", "C1", "-"),
              ("llama_cold", "llama.cpp cold", "C2", "--"), ("llama_reuse", "llama.cpp state", "C2", "-")]
    for ax, r in zip(axes[0], results):
        xs = [p["prefix"] for p in r["points"]]
        for key, name, color, ls in series:
            ys = [p["times"][key].median * 1e3 for p in r["points"] if key in p["times"]]
            if len(ys) == len(xs) and ys:
                ax.plot(xs, ys, linestyle=ls, color=color, marker="o", ms=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_title(r["label"], fontsize=9)
        ax.set_xlabel(f"shared prefix tokens (+{a.suffix} new)")
        ax.set_ylabel("TTFT ms (median)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"TTFT on {a.device} {a.dtype} (random weights; {C.cpu_model() if a.device == 'cpu' else a.device})",
                 fontsize=9)
    C.save_figure(fig, path)


def main(argv=None) -> int:
    a = parse(argv)
    info = C.banner("ttft", a)
    headers = ["model", "prefix", "capsule", "flashrt cold ms", "flashrt capsule ms", "speedup",
               f"same {a.gen} tok", "transformers cold ms", "deep-copy ms", "speedup",
               f"same {a.gen} tok", "flashrt/tf cold", "flashrt/tf reuse"]
    table = C.Table(f"TTFT ({a.device}, {a.dtype}, suffix {a.suffix} tokens)", headers)
    llama_rows, results = [], []
    data = {"prefixes": a.prefix, "suffix": a.suffix, "gen": a.gen, "repeats": a.repeats,
            "warmup": a.warmup, "llama_cpp_installed": llama_installed()}

    def partial(out):         # after every prefix: a run cut short (gpu_check) keeps its points
        C.write_json("ttft", a, info, [table], dict(data, results=results + [out], partial=True), argv)
    for arch, size in a.configs:
        if not C.arch_available(arch):
            print(f"{arch}: model file not present in this checkout, skipped")
            continue
        results.append(bench_model(arch, size, a, table, llama_rows, partial))
    table.notes += ["speedup = cold / reuse for the same system; flashrt/tf < 1: flashrt faster",
                    f"same {a.gen} tok: the reuse path's first {a.gen} greedy tokens equal its own cold "
                    "path's; for flashrt also whether the first-token logits are bitwise equal",
                    _hybrid_kernels_note(a.device)]
    tables = [table]
    lt = C.Table(f"llama.cpp on the same checkpoint (GGUF, {a.dtype} weights and KV cache; "
                 "sequence-state API into a preallocated buffer)",
                 ["model", "prefix", "state", "cold ms", "state-restore ms", "speedup",
                  f"same {a.gen} tok", "vs flashrt cold", "flashrt/llama cold", "flashrt/llama reuse"],
                 [[str(c) for c in r] for r in llama_rows])
    lt.notes += ["state-restore = llama_state_seq_set_data of the state saved after the prefix, then "
                 "eval(suffix); flashrt/llama < 1: flashrt faster",
                 f"vs flashrt cold: leading greedy tokens of llama.cpp's cold path equal to flashrt's "
                 f"(of {a.gen}) and max |first-token logit diff|: a check that the GGUF is the same model",
                 f"llama.cpp {llama_version()}: its own CPU kernels (ggml), same thread count"]
    tables.append(lt)
    C.print_tables(tables)
    print(C.RANDOM_NOTE)
    C.write_json("ttft", a, info, tables, dict(data, results=results), argv)
    if results:
        png = Path(a.plot) if a.plot else C.result_path("ttft", a).with_suffix(".png")
        plot(results, png, a)
    ok = all(p["flashrt_same_tokens"] for r in results for p in r["points"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

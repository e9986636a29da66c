"""Decode speed: ms per token and the GB/s a step streams, flashrt against llama.cpp (same
weights as GGUF: f32, bf16, Q8_0) and transformers, at positions 64, 512 and 2048, in float32,
bfloat16 and int8 weights; the machine's copy bandwidth as the limit; and what int8 costs in
quality on the shipped trained model (random weights have logits too flat to judge by).

  flashrt        restore the capsule at the position, then generate(n, greedy): n steps of
                 sample + one-token step (the product's CPU path)
  llama.cpp      llama_state_seq_set_data of the state at the position, then n greedy steps of
                 eval([token]) + argmax (llama-cpp-python's bindings, ttft.py's LlamaPath)
  transformers   a copy of its cache at the position (untimed), then n greedy one-token
                 forwards (logits_to_keep=1); float32 and bfloat16 only

Per position the systems alternate round by round (order reversed every other round). GB/s =
the bytes a step must stream (bench/decode_profile.py's count: weights in the format, state
read and written, K/V rows up to the position) / ms per token; llama.cpp's weights are its
GGUF's tensor bytes (Q8_0: 34 bytes per 32 weights). The limit is that count at the copy
bandwidth measured here (read + write, 1 GiB).

Quality (the shipped model, flashrt/assets/pystdlib-qwen35, on the held-out stdlib files it was
trained without): held-out loss over the training's own evaluation windows, and greedy
agreement with its bf16 form, teacher-forced (argmax at every position of those windows) and
free-running (greedy replies to held-out prompts).

    python bench/decode.py                        # Qwen3.5-0.8B shape, 2 threads (about 15 min)
    python bench/decode.py --quick                # tiny shape, seconds: proves the script runs
    flashrt bench decode --positions 512 --formats bfloat16 int8
"""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402
from bench.decode_profile import FORMATS, copy_bandwidth, step_bytes  # noqa: E402
from bench.gguf import gguf_path  # noqa: E402

LLAMA_TYPE = {"float32": "float32", "bfloat16": "bfloat16", "int8": "q8_0"}   # bench/gguf.py --dtype
LLAMA_KV = {"float32": "float32", "bfloat16": "bfloat16", "int8": "float32"}    # KV like flashrt's
# llama.cpp's extra buffer types (weight repacking; on AMX CPUs its AMX int8 path) per format: its
# AMX Q8_0 matmul died in ldtilecfg (SIGSEGV, general protection fault) on this project's Sapphire
# Rapids VM, so Q8_0 runs --no-repack: ggml's AVX-512 VNNI dot products
LLAMA_EXTRA_BUFTS = {"float32": True, "bfloat16": True, "int8": False}
ACCEPT_POS, ACCEPT_LOSS, ACCEPT_AGREE = 512, 0.01, 0.95      # the acceptance lines
SYSTEMS = ("flashrt", "llama.cpp", "transformers")


def parse(argv):
    p = C.base_parser("bench/decode.py", "Decode ms per token and GB/s: flashrt vs llama.cpp vs "
                      "transformers, float32 / bfloat16 / int8; int8 quality on the trained model")
    p.add_argument("--size", default=None, help="qwen3_5 checkpoint size (default real; --quick tiny)")
    p.add_argument("--positions", type=int, nargs="+", default=None, help="default 64 512 2048")
    p.add_argument("--formats", nargs="+", default=None, choices=list(FORMATS),
                   help="default float32 bfloat16 int8")
    p.add_argument("--steps", type=int, default=None, help="decode steps per sample (default 16)")
    p.add_argument("--gguf", action="append", default=[], metavar="FORMAT=PATH",
                   help="the GGUF for a format's llama.cpp column (default bench/gguf.py's output: "
                   "~/.cache/flashrt/gguf/qwen3_5-<size>-<float32|bfloat16|q8_0>.gguf)")
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--no-quality", action="store_true", help="skip the trained model's quality table")
    p.add_argument("--prompts", type=int, default=None, help="held-out prompts, free-running (default 8)")
    p.add_argument("--gen", type=int, default=None, help="greedy tokens per prompt (default 32)")
    p.add_argument("--plot", default=None, help="PNG path (default next to the JSON)")
    a = p.parse_args(argv)
    a.threads = a.threads or 2
    C.setup(a)
    a.size = a.size or ("tiny" if a.quick else "real")
    a.positions = a.positions or ([16, 48] if a.quick else [64, 512, 2048])
    a.formats = a.formats or list(FORMATS)
    a.steps = a.steps or (2 if a.quick else 16)
    a.repeats = a.repeats or (1 if a.quick else 5)
    a.warmup = (0 if a.quick else 1) if a.warmup is None else a.warmup
    a.prompts = a.prompts or (2 if a.quick else 8)
    a.gen = a.gen or (8 if a.quick else 32)
    a.gguf = dict(g.split("=", 1) for g in a.gguf)
    return a


# ---- the three systems, each restored to a position and stepped n greedy tokens ---------------
class Flashrt:
    def __init__(self, path, a, fmt, ids):
        from flashrt.lm import load
        dtype, weights = FORMATS[fmt]
        self.rt = load(path, device=a.device, dtype=dtype, weights=weights,
                       max_seq_len=max(a.positions) + a.steps + 8)
        self.caps, done = {}, 0
        for P in sorted(a.positions):
            self.rt.prefill(ids[done:P])
            self.caps[P], done = self.rt.snapshot(), P
        self.bytes = {P: step_bytes(self.rt, P) for P in a.positions}
        self.kernel = self.rt.model.linear_kernel

    def case(self, P, n):
        cap = self.caps[P]
        return C.Case(lambda: self.rt.generate(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                      setup=lambda: self.rt.restore(cap))


class Llama:
    """ttft.py's LlamaPath with one saved sequence state per position."""

    def __init__(self, gguf, a, fmt, ids):
        import torch

        from bench.ttft import LlamaPath
        self.lp = LlamaPath(str(gguf), max(a.positions) + a.steps + 8, torch.get_num_threads(),
                            LLAMA_KV[fmt], extra_bufts=LLAMA_EXTRA_BUFTS[fmt])
        lib, ct, self.states = self.lp.lib, self.lp.ctypes, {}
        for P in a.positions:
            self.lp.cold(ids[:P])
            size = lib.llama_state_seq_get_size(self.lp.ctx, 0)
            buf = (ct.c_uint8 * size)()
            self.states[P] = (buf, lib.llama_state_seq_get_data(self.lp.ctx, buf, size, 0), ids[:P])
        self.first = ids

    def restore(self, P):
        buf, n, ids = self.states[P]
        if self.lp.lib.llama_state_seq_set_data(self.lp.ctx, buf, n, 0) != n:
            raise RuntimeError("llama_state_seq_set_data refused the saved state")
        self.lp.llm.n_tokens = P                # what load_state does, without its copies
        self.lp.llm.input_ids[:P] = ids

    def steps(self, P, n):
        t = self.first[P]                       # the state holds no logits: the prompt's next id
        for _ in range(n):
            self.lp.llm.eval([t])
            t = int(self.lp._last().argmax())

    def case(self, P, n):
        return C.Case(lambda: self.steps(P, n), setup=lambda: self.restore(P))


class Transformers:
    def __init__(self, path, a, fmt, ids):
        dtype, _ = FORMATS[fmt]
        self.model = C.load_hf(path, argparse_ns(a, dtype))
        self.device, self.caches, self.first, self.live = a.device, {}, ids, None
        for P in a.positions:
            _, self.caches[P] = C.hf_forward(self.model, ids[:P], a.device)

    def steps(self, P, n):
        t, cache = self.first[P], self.live
        for _ in range(n):
            logits, cache = C.hf_forward(self.model, [t], self.device, cache)
            t = int(logits.argmax())

    def case(self, P, n):
        def setup():
            self.live = copy.deepcopy(self.caches[P])
        return C.Case(lambda: self.steps(P, n), setup=setup)


def argparse_ns(a, dtype):
    import argparse
    return argparse.Namespace(**{**vars(a), "dtype": dtype})


def llama_gguf(a, fmt) -> tuple[Path | None, str | None]:
    from bench.ttft import llama_installed
    if a.no_llama:
        return None, "skipped (--no-llama)"
    if not llama_installed():
        return None, ("llama-cpp-python is not installed (pip install 'flashrt[llama]', then "
                      "bench/gguf.py --dtype float32 bfloat16 q8_0; see bench/README.md)")
    if a.device != "cpu":
        return None, "llama-cpp-python is built for the CPU here; this run is on " + a.device
    g = Path(a.gguf.get(fmt) or gguf_path("qwen3_5", a.size, LLAMA_TYPE[fmt]))
    if not g.exists():
        return None, (f"no GGUF at {C.short_path(g)} (python bench/gguf.py --llama-src ... --models "
                      f"qwen3_5:{a.size} --dtype {LLAMA_TYPE[fmt]})")
    return g, None


# ---- one format ----------------------------------------------------------------------------------
def bench_format(a, path, fmt, ids) -> dict:
    out = {"format": fmt, "dtype": FORMATS[fmt][0], "weights": FORMATS[fmt][1], "notes": {}}
    systems = {"flashrt": Flashrt(path, a, fmt, ids)}
    out["linear_kernel"] = systems["flashrt"].kernel
    gguf, why = llama_gguf(a, fmt)
    if gguf is not None:
        try:
            systems["llama.cpp"] = Llama(gguf, a, fmt, ids)
            out["gguf"], out["gguf_bytes"] = C.short_path(gguf), gguf.stat().st_size
        except Exception as e:                  # say why, keep the other columns
            why = f"llama.cpp could not load {C.short_path(gguf)}: {type(e).__name__}: {e}"
    out["notes"]["llama.cpp"] = why
    if a.no_hf:
        out["notes"]["transformers"] = "skipped (--no-hf)"
    elif FORMATS[fmt][1] != "float":
        out["notes"]["transformers"] = "no int8 weight path on the CPU"
    else:
        systems["transformers"] = Transformers(path, a, fmt, ids)
    rows = {}
    for P in a.positions:
        cases = {s: sys_.case(P, a.steps) for s, sys_ in systems.items()}
        st = C.measure_alt(cases, a.repeats, a.warmup, a.device, desc=f"{fmt} position {P}")
        nb = systems["flashrt"].bytes[P]
        own = sum(nb.values())
        weights = nb["projections"] + nb["MLP"] + nb["vocab head"] + nb["norms"]
        row = {"bytes": own, "bytes_by_group": nb}
        for s in SYSTEMS:
            if s not in st:
                row[s] = None
                continue
            ms = st[s].median * 1e3 / a.steps
            b = own - weights + out["gguf_bytes"] if s == "llama.cpp" else own
            row[s] = {"stats": st[s], "ms_per_token": ms,
                      "ms_min": st[s].min * 1e3 / a.steps, "ms_max": st[s].max * 1e3 / a.steps,
                      "bytes": b, "gbs": b / ms / 1e6}
        rows[P] = row
    out["rows"] = rows
    del systems
    C.free_memory()
    return out


# ---- quality on the trained model ------------------------------------------------------------------
QUALITY = {"bfloat16": ("bfloat16", "float"), "float32": ("float32", "float"),
           "int8": ("float32", "int8"), "int8, bf16 activations": ("bfloat16", "int8")}


def quality(a) -> dict:
    """Held-out loss and argmax at every position of the training's evaluation windows, and
    free-running greedy replies to held-out prompts, per form; agreement against bfloat16."""
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer

    from bench.speculative import heldout_prompts
    from flashrt.assets import trained_model_path
    from flashrt.dev.train import corpus_files, encode, read_texts, val_windows
    from flashrt.lm import load
    path = trained_model_path()
    forms = {name: load(path, dtype=d, weights=w, max_seq_len=512) for name, (d, w) in QUALITY.items()}
    info = forms["float32"].model.info
    every = int(info["corpus"]["heldout_rule"].split()[1].rstrip("thsnrd"))
    n_windows = 4 if a.quick else info["heldout"]["windows"]
    stream = encode(Tokenizer.from_file(str(path / "tokenizer.json")), read_texts(corpus_files()[::every]))
    windows = val_windows(stream, info["training"]["seq"], info["heldout"]["windows"])[:n_windows]
    prompts = heldout_prompts(forms["float32"], a.prompts, 128)
    out = {}
    for name, rt in forms.items():
        loss, argmax = 0.0, []
        for w in windows:
            rt.reset()
            logits = rt.prefill(w.tolist(), all_logits=True)
            loss += float(F.cross_entropy(logits[:-1], w[1:], reduction="sum"))
            argmax.append(logits[:-1].argmax(-1))
        replies = []
        for p in prompts:
            rt.reset()
            replies.append(rt.generate(p, max_new_tokens=a.gen, ignore_eos=True))
        out[name] = {"loss": loss / (windows.shape[0] * (windows.shape[1] - 1)),
                     "argmax": torch.cat(argmax), "replies": replies, "fingerprint": rt.fingerprint["weights"]}
    ref = out["bfloat16"]
    for name, r in out.items():
        r["loss_change"] = r["loss"] / ref["loss"] - 1
        r["agree_teacher_forced"] = float((r["argmax"] == ref["argmax"]).float().mean())
        same = [sum(x == y for x, y in zip(mine, theirs)) for mine, theirs in zip(r["replies"], ref["replies"])]
        lead = [next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), len(mine))
                for mine, theirs in zip(r["replies"], ref["replies"])]
        r["agree_free_running"] = sum(same) / sum(len(x) for x in ref["replies"])
        r["leading_equal"] = sum(lead) / len(lead)
        r["replies_equal"] = sum(x == y for x, y in zip(r["replies"], ref["replies"]))
    for r in out.values():
        del r["argmax"]
    return {"forms": out, "positions": int(windows.shape[0] * (windows.shape[1] - 1)),
            "windows": int(windows.shape[0]), "prompts": len(prompts), "gen": a.gen,
            "trained_loss": info["heldout"]["main_loss"]}


# ---- tables and plot --------------------------------------------------------------------------------
def cell(r, digits=1):
    if r is None:
        return "-"
    return f"{r['ms_per_token']:.{digits}f} [{r['ms_min']:.{digits}f}-{r['ms_max']:.{digits}f}]"


def tables(a, runs, q, bw, load_note) -> list:
    acc = C.Table(f"Acceptance (issue): decode at position {ACCEPT_POS}, {a.size} shape, {a.threads} "
                  "threads; int8 quality on the trained model", ["criterion", "measured", "line", "met"])
    for r in runs:
        row = r["rows"].get(ACCEPT_POS)
        other = f"llama.cpp {LLAMA_TYPE[r['format']].replace('q8_0', 'Q8_0')}"
        if row is None or row["llama.cpp"] is None:
            acc.add(f"flashrt {r['format']} <= {other}", r["notes"]["llama.cpp"] or f"no position {ACCEPT_POS}",
                    "ratio <= 1.00", "not measured")
            continue
        ratio = row["flashrt"]["ms_per_token"] / row["llama.cpp"]["ms_per_token"]
        acc.add(f"flashrt {r['format']} <= {other}", f"{row['flashrt']['ms_per_token']:.1f} vs "
                f"{row['llama.cpp']['ms_per_token']:.1f} ms: {ratio:.2f}x", "ratio <= 1.00",
                "yes" if ratio <= 1 else "no")
    if q is not None:
        for name, f in q["forms"].items():
            if not name.startswith("int8"):
                continue
            acc.add(f"{name}: held-out loss vs bf16", f"{100 * f['loss_change']:+.3f}%",
                    f"< +{100 * ACCEPT_LOSS:.0f}%", "yes" if f["loss_change"] < ACCEPT_LOSS else "no")
            acc.add(f"{name}: greedy agreement with bf16 (every held-out position)",
                    f"{100 * f['agree_teacher_forced']:.1f}%", f">= {100 * ACCEPT_AGREE:.0f}%",
                    "yes" if f["agree_teacher_forced"] >= ACCEPT_AGREE else "no")
    acc.notes += [f"machine load: {load_note}; timings are medians of {a.repeats} samples of {a.steps} "
                  "greedy steps, the systems alternated"]
    t = C.Table(f"Decode ms per token [min-max] and GB/s ({a.size} shape, {a.device}, {a.threads} threads)",
                ["format", "position", "flashrt ms", "GB/s", "llama.cpp ms", "GB/s", "transformers ms",
                 "GB/s", "limit ms (copy bw)", "flashrt/llama.cpp", "flashrt/transformers"])
    for r in runs:
        for P, row in r["rows"].items():
            f, l, h = row["flashrt"], row["llama.cpp"], row["transformers"]
            gb = lambda x: "-" if x is None else f"{x['gbs']:.1f}"  # noqa: E731
            rat = lambda x: "-" if x is None else f"{f['ms_per_token'] / x['ms_per_token']:.2f}x"  # noqa: E731
            t.add(r["format"], P, cell(f), gb(f), cell(l), gb(l), cell(h), gb(h),
                  f"{row['bytes'] / bw['copy_gbs'] / 1e6:.1f}", rat(l), rat(h))
    fmts = {r["format"]: r for r in runs}
    t.notes += [f"{name}: {r['dtype']} activations, {r['weights']} weights (flashrt linear kernel "
                f"{r['linear_kernel']}); llama.cpp {LLAMA_TYPE[name]} GGUF"
                + (f" ({C.fmt_bytes(r['gguf_bytes'])})" if r.get("gguf_bytes") else "")
                + f", KV {LLAMA_KV[name]}" + ("" if LLAMA_EXTRA_BUFTS[name] else ", --no-repack (its "
                                              "AMX int8 path faults on this VM)")
                for name, r in fmts.items()]
    if "int8" in fmts:
        t.notes.append("int8: per-row symmetric int8 projections and tied head (flashrt.nn.linear."
                       "quantize_int8); a decode step's matmuls run the extension's small-M kernel "
                       "(int8 widened to float32 in registers, float32 activations), the rest in float32")
    skipped = {}                              # (system, why) -> the formats it holds for
    for r in runs:
        for s, why in r["notes"].items():
            if why:
                skipped.setdefault((s, why), []).append(r["format"])
    t.notes += [f"{s} ({', '.join(f)}): {why}" for (s, why), f in skipped.items()]
    t.notes += ["GB/s = bytes a step streams (weights in its format, state read and written, K/V rows "
                "up to the position; bench/decode_profile.py) / ms per token; llama.cpp's weights: its "
                "GGUF's bytes", f"limit = flashrt's bytes at the copy bandwidth measured here: "
                f"{bw['copy_gbs']:.1f} GB/s (read + write of 1 GiB; a read alone {bw['read_gbs']:.1f} GB/s)",
                "flashrt/x < 1: flashrt faster; " + C.RANDOM_NOTE]
    out = [acc, t]
    if q is not None:
        qt = C.Table(f"int8 on the shipped trained model (pystdlib-qwen35): {q['windows']} held-out "
                     f"windows ({q['positions']} positions), {q['prompts']} held-out prompts x {q['gen']} "
                     "greedy tokens", ["form", "held-out loss", "vs bf16", "argmax = bf16's",
                                       "free-running = bf16's", "leading equal", "replies equal"])
        for name, f in q["forms"].items():
            qt.add(name, f"{f['loss']:.4f}", f"{100 * f['loss_change']:+.3f}%",
                   f"{100 * f['agree_teacher_forced']:.1f}%", f"{100 * f['agree_free_running']:.1f}%",
                   f"{f['leading_equal']:.1f} / {q['gen']}", f"{f['replies_equal']} / {q['prompts']}")
        qt.notes += [f"held-out loss in nats per token over the training's own evaluation windows (its "
                     f"saved figure: {q['trained_loss']}); argmax = bf16's: teacher-forced, every position "
                     "of those windows; free-running: greedy replies, position by position (one early "
                     "difference changes the rest); leading equal: tokens before the first difference",
                     "forms: bfloat16 = the checkpoint as shipped, bf16 compute; float32 = its weights in "
                     "float32 compute; int8 = per-row symmetric int8 weights of the shipped bf16 values "
                     "(projections and the tied head), float32 or bf16 activations"]
        out.append(qt)
    return out


def plot(runs, bw, path, a):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed ({path} not written)")
        return None
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.6), squeeze=False)
    for ax, r in zip(axes[0], runs):
        Ps = list(r["rows"])
        for s, col, mark in (("flashrt", "C0", "o"), ("llama.cpp", "C2", "s"), ("transformers", "C1", "^")):
            ys = [r["rows"][P][s]["ms_per_token"] if r["rows"][P][s] else math.nan for P in Ps]
            if any(not math.isnan(y) for y in ys):
                ax.plot(Ps, ys, marker=mark, color=col, label=s)
        ax.plot(Ps, [r["rows"][P]["bytes"] / bw["copy_gbs"] / 1e6 for P in Ps], ls="--", color="gray",
                label=f"bytes at copy bandwidth ({bw['copy_gbs']:.0f} GB/s)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ps, [str(P) for P in Ps])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("position")
        ax.set_ylabel("ms per token (median)")
        ax.set_title(f"{r['format']} (llama.cpp {LLAMA_TYPE[r['format']]})", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"Decode, qwen3_5 {a.size} shape, {a.device}, {a.threads} threads (random weights)",
                 fontsize=9)
    C.save_figure(fig, path)
    return path


def main(argv=None) -> int:
    import os
    a = parse(argv)
    info = C.banner("decode", a)
    load0 = os.getloadavg()
    path = C.checkpoint("qwen3_5", a.size)
    bw = copy_bandwidth(1 << (26 if a.quick else 30))
    print(f"checkpoint {C.short_path(path)}; copy bandwidth {bw['copy_gbs']:.1f} GB/s (read + write), "
          f"read {bw['read_gbs']:.1f} GB/s")
    import json
    vocab = json.loads((path / "config.json").read_text())
    vocab = (vocab.get("text_config") or vocab)["vocab_size"]
    ids = C.random_ids(max(a.positions) + 1, vocab, seed=1)
    runs = [bench_format(a, path, fmt, ids) for fmt in a.formats]
    q = None if a.no_quality else quality(a)
    load1 = os.getloadavg()
    tabs = tables(a, runs, q, bw, f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end")
    C.print_tables(tabs)
    res = C.result_path("decode", a)
    png = plot(runs, bw, Path(a.plot) if a.plot else res.with_suffix(".png"), a)
    data = {"size": a.size, "checkpoint": C.short_path(path), "positions": a.positions, "steps": a.steps,
            "repeats": a.repeats, "warmup": a.warmup, "bandwidth": bw, "runs": runs, "quality": q,
            "load_average": [load0, load1],
            "plot": str(png.relative_to(C.ROOT)) if png and png.is_relative_to(C.ROOT) else png}
    C.write_json("decode", a, info, tabs, data, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

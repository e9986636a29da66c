"""Prefill and decode latency: FlashRT vs transformers' eager model, same weights and dtype.

Prefill: time from token ids to the last position's logits (transformers: logits_to_keep=1,
with its cache built as in any generate call). Decode: one step with the cache of a prefilled
context (transformers: its own cache object, use_cache=True).

    python bench/models.py                      # qwen3 at the real Qwen3-0.6B shape, fp32, CPU
    python bench/models.py --arch all --repeats 1
    python bench/models.py --quick              # tiny checkpoints, short prompts, one repeat
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402


def parse(argv):
    p = C.base_parser("bench/models.py", "Prefill and decode step: flashrt vs transformers")
    p.add_argument("--arch", default="qwen3", help="qwen3, qwen3_5, lfm2, all, or a comma list")
    p.add_argument("--size", default=None, help="tiny, small or real (default real; tiny in --quick)")
    p.add_argument("--prefill", type=int, nargs="+", default=None,
                   help="prefill lengths (default 512 2048; 32 128 in --quick)")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="timed decode steps after the first prefill length (default 16; 4 in --quick)")
    p.add_argument("--hf-attn", default=None,
                   help="transformers attn_implementation (default: its own default, sdpa)")
    a = p.parse_args(argv)
    C.setup(a)
    a.size = a.size or ("tiny" if a.quick else "real")
    a.prefill = a.prefill or ([32, 128] if a.quick else [512, 2048])
    a.decode_steps = a.decode_steps or (4 if a.quick else 16)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.warmup = 1 if a.warmup is None else a.warmup
    a.archs = list(C.ARCHS) if a.arch == "all" else a.arch.split(",")
    return a


def bench_arch(arch, a, tables):
    import torch
    path = C.checkpoint(arch, a.size)
    lab = C.label(arch, a.size)
    ctx = a.prefill[0]
    rt = C.load_flashrt(path, a, max_seq_len=max(a.prefill) + a.decode_steps + a.warmup + 2)
    hf = C.load_hf(path, a, a.hf_attn)
    vocab = rt.net.vocab_size
    res = {"arch": arch, "size": a.size, "checkpoint": C.short_path(path), "hf_attn": C.hf_attn_name(hf),
           "hf_class": type(hf).__name__, "prefill": {}, "decode": {}}
    t = C.Table(f"{lab}: prefill and decode ({a.device}, {a.dtype}, transformers attn="
                f"{res['hf_attn']})",
                ["step", "flashrt ms", "transformers ms", "flashrt/transformers", "max |dlogit|"])

    for i, L in enumerate(a.prefill):
        ids = C.random_ids(L, vocab, seed=L)
        last = {}
        cases = {"flashrt": C.Case(lambda: rt.prefill(ids), setup=rt.reset,
                                   post=lambda l: last.__setitem__("f", l)),
                 "transformers": C.Case(lambda: C.hf_forward(hf, ids, a.device)[0],
                                        post=lambda l: last.__setitem__("h", l))}
        # warm-up before the first length and every length up to 512 (first calls at a new
        # shape are slow); longer ones reuse warmed code paths, and a warm-up prefill of 2048
        # tokens at the real shape costs most of a minute on 2 CPU cores (CUDA: always warm up)
        warm = i == 0 or L <= 512 or a.device.startswith("cuda")
        st = C.measure(cases, a.repeats, a.warmup if warm else 0, a.device,
                       desc=f"{arch} prefill {L}")
        diff = float((last["f"] - last["h"]).abs().max())
        r = C.ratio(st["flashrt"], st["transformers"])
        res["prefill"][L] = {"flashrt": st["flashrt"], "transformers": st["transformers"],
                             "ratio": r, "max_abs_logit_diff": diff}
        t.add(f"prefill {L}", st["flashrt"].ms(), st["transformers"].ms(), C.fmt_ratio(r), f"{diff:.2e}")

    # decode: context of `ctx` tokens, then steps timed one by one, alternating the two systems
    ids = C.random_ids(ctx, vocab, seed=ctx)
    rt.reset()
    lf = rt.prefill(ids)
    lh, cache = C.hf_forward(hf, ids, a.device)
    stf, sth = C.Stats(), C.Stats()
    state = {"f": lf, "h": lh, "cache": cache}
    # both systems decode flashrt's greedy tokens: each feeding its own argmax, bf16 noise on
    # random weights' flat logits splits the two histories, and the logit check compares nothing
    diff = 0.0

    def f_step():
        state["f"] = rt.decode(state["tok"])

    def h_step():
        state["h"], state["cache"] = C.hf_forward(hf, [state["tok"]], a.device, state["cache"])

    for i in C.progress(range(a.warmup + a.decode_steps), desc=f"{arch} decode"):
        state["tok"] = int(state["f"].argmax())         # untimed: the token, then the check
        df, _ = C.time_once(f_step, a.device)
        dh, _ = C.time_once(h_step, a.device)
        diff = max(diff, float((state["f"] - state["h"]).abs().max()))
        if i >= a.warmup:
            stf.samples.append(df)
            sth.samples.append(dh)
    r = C.ratio(stf, sth)
    res["decode"] = {"context": ctx, "steps": a.decode_steps, "flashrt": stf, "transformers": sth,
                     "ratio": r, "max_abs_logit_diff": diff}
    t.add(f"decode step @{ctx}", stf.ms(), sth.ms(), C.fmt_ratio(r), f"{diff:.2e}")
    if rt.graphs is not None and rt.graphs.captured:     # graph replay against eager, same weights
        eager = type(rt)(rt.model, dataclasses.replace(rt.options, cuda_graphs=False))
        ste, e = C.Stats(), {"l": eager.prefill(ids)}

        def e_step():
            e["l"] = eager.decode(int(e["l"].argmax()))
        for i in range(a.warmup + a.decode_steps):
            d, _ = C.time_once(e_step, a.device)
            if i >= a.warmup:
                ste.samples.append(d)
        res["decode_eager"] = ste
        t.add(f"decode step @{ctx}, eager (no graphs)", ste.ms(), sth.ms(),
              C.fmt_ratio(C.ratio(ste, sth)), "")
        t.notes.append(f"graph replay / eager decode: {C.fmt_ratio(C.ratio(stf, ste))}")
        del eager
    t.notes.append("ratio < 1: flashrt faster; max |dlogit|: largest logit difference between the "
                   "two systems on the same input (a sanity check, not a timing)")
    t.notes.append(f"weights: {C.short_path(path)} (random)")
    tables.append(t)
    res["fork"] = fork_costs(rt, state, a, tables, lab)
    del rt, hf, cache, state
    C.free_memory()
    torch.manual_seed(0)
    return res


def fork_costs(rt, state, a, tables, lab) -> dict:
    """fork() at the decode context: shared arena (the default with captured graphs: one state
    copy, no capture) against snapshot() alone (both into fresh memory); then one fork and its
    parent decoding in turn, each step a turn switch (park into a reused buffer + unpark) plus
    a decode, against plain decode steps and against snapshot(into=) + restore, the two copies
    a switch makes."""
    tok = int(state["f"].argmax())
    kids = []

    def fork():
        kids.append(rt.fork(share=True))
    mark = rt.snapshot()
    twin = rt.fork(mark, share=True)            # taking turns with rt for the whole run
    buf = rt.empty_capsule()

    def switch_pair():
        twin.decode(tok)
        rt.decode(tok)

    def plain_pair():
        rt.decode(tok)
        rt.decode(tok)
    cases = {"snapshot": C.Case(rt.snapshot), "fork": C.Case(fork),
             "copies": C.Case(lambda: (rt.snapshot(into=buf), rt.restore(buf))),
             # both at the mark, the parent resident (untimed): each timed decode is a switch
             "switch_pair": C.Case(switch_pair, setup=lambda: (twin.restore(mark), rt.restore(mark))),
             "plain_pair": C.Case(plain_pair, setup=lambda: rt.restore(mark))}
    st = C.measure(cases, a.repeats, a.warmup, a.device, desc="fork")
    for k in kids + [twin]:
        k.close()
    t = C.Table(f"{lab}: fork at {rt.position} positions ({a.device}, {a.dtype}, graphs "
                f"{'captured' if rt.graphs is not None and rt.graphs.captured else 'off'})",
                ["case", "ms", "vs"])
    t.add("snapshot() (fresh buffer)", st["snapshot"].ms(), "")
    t.add("fork(share=True)", st["fork"].ms(), C.fmt_ratio(C.ratio(st["fork"], st["snapshot"])) + " of snapshot")
    t.add("decode on fork + decode on parent", st["switch_pair"].ms(),
          C.fmt_ratio(C.ratio(st["switch_pair"], st["plain_pair"])) + " of two plain decodes")
    t.add("two plain decodes", st["plain_pair"].ms(), "")
    # a switch parks one state and unparks another: two switches are 2 x (snapshot(into) + restore)
    extra = st["switch_pair"].median - st["plain_pair"].median
    t.add("two switches (difference of the medians)", f"{extra * 1e3:.1f}",
          C.fmt_ratio(extra / (2 * st["copies"].median)) + " of 2 x (snapshot(into) + restore)")
    t.add("snapshot(into) + restore", st["copies"].ms(), "")
    t.notes.append("a shared fork holds its state in a capsule while the other runs: each turn "
                   "switch parks one state (into a buffer an earlier switch freed) and unparks "
                   "another (flashrt/core/shared.py); the fork's own snapshot takes fresh memory",
                   "two switches: a difference of two medians of whole decode pairs, so it says "
                   "something only where the state copied is large next to the decodes' noise")
    tables.append(t)
    return dict(st)


def main(argv=None) -> int:
    a = parse(argv)
    info = C.banner("models", a)
    tables, results = [], []
    for arch in a.archs:
        if not C.arch_available(arch):
            print(f"{arch}: model file not present in this checkout, skipped")
            continue
        n = len(tables)
        results.append(bench_arch(arch, a, tables))
        for t in tables[n:]:
            print()
            print(t.text())
    data = {"prefill_lengths": a.prefill, "decode_steps": a.decode_steps, "repeats": a.repeats,
            "warmup": a.warmup, "size": a.size, "results": results}
    C.write_json("models", a, info, tables, data, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

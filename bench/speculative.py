"""Speculative decoding with the Qwen3.5 MTP layer: step costs, acceptance, modeled tokens/s.

Measured side by side on one session at a fixed context (each timed run restores the same
capsule first, untimed):
  decode            one plain single-token step (the baseline: 1 token per step)
  draft k           the MTP drafting k tokens (first MTP step over one pair + k-1 chained steps)
  mtp T             one MTP step over T pairs (the first draft step also writes the accepted
                    rows of the previous round: T = tokens committed then)
  verify k          one main step over k+1 tokens returning all-position hidden states + logits
                    and keeping the state after each position (mechanism "planes", the default:
                    the per-token GDN rule + the plane copies)
  keep plane        the plane copy back on partial acceptance
  verify k, no planes  the same step without planes (the chunked GDN rule): mechanism "rerun"
  mark/rewind       the fixed-state copy of mechanism "rerun" (preallocated, one copy each way)
  re-prefill n      the main step over the n = a+1 accepted tokens after a rewind ("rerun")
Acceptance is measured by running speculative generate; with random weights the MTP layer and
the main model are unrelated, so it accepts almost nothing (the JSON says so). The model trained
here (`--sizes trained`: flashrt/assets/pystdlib-qwen35, `python -m flashrt.dev.train`) has a trained
MTP layer: on prompts cut from the stdlib files it held out, its acceptance per draft position
for each k and plain vs speculative tokens/s (both mechanisms) are measured side by side, next
to the break-even acceptance modeled from this run's step costs. Tokens/s as a function of a
per-token acceptance probability a comes from the measured costs:
  E[tokens per round] = (1 - a^(k+1)) / (1 - a),  P(j accepted) = a^j (1-a), P(k) = a^k
  planes: E[cost] = mtp(first) + (k-1) mtp(1) + verify k + P(j < k) keep plane
  rerun:  E[cost] = mtp(first) + (k-1) mtp(1) + mark + verify k, no planes
                    + sum_{j<k} P(j) (rewind + re-prefill j+1)
End-to-end generate runs with an oracle drafter (a = 1: it proposes plain greedy's own tokens)
and an always-wrong one (a = 0) check the model against wall clock.

    python bench/speculative.py                 # trained model, qwen3_5 tiny and small, k = 1..4
    python bench/speculative.py --sizes trained # only the model trained on the stdlib
    python bench/speculative.py --full          # + the real Qwen3.5-0.8B shape
    python bench/speculative.py --quick         # tiny, one repeat
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

RATES = (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def parse(argv):
    p = C.base_parser("bench/speculative.py", "Speculative decoding (Qwen3.5 MTP): step costs, "
                      "acceptance, tokens/s vs acceptance rate")
    p.add_argument("--full", action="store_true", help="add the real Qwen3.5-0.8B shape")
    p.add_argument("--sizes", default=None, help="comma list of qwen3_5 sizes or 'trained' (default "
                   "trained,tiny,small; trained,tiny in --quick; + real with --full)")
    p.add_argument("--prompts", type=int, default=None, help="held-out prompts for the trained "
                   "model's acceptance (default 8; 2 quick)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4], help="draft lengths")
    p.add_argument("--context", type=int, default=None, help="context length (default 128; 32 quick)")
    p.add_argument("--gen", type=int, default=None, help="tokens per end-to-end run (default 48; 16 quick)")
    a = p.parse_args(argv)
    C.setup(a)
    a.sizes = (a.sizes.split(",") if a.sizes else
               ["trained", "tiny"] if a.quick else ["trained", "tiny", "small", "real"] if a.full
               else ["trained", "tiny", "small"])
    a.prompts = a.prompts or (2 if a.quick else 8)
    a.context = a.context or (32 if a.quick else 128)
    a.gen = a.gen or (16 if a.quick else 48)
    a.repeats = a.repeats or (1 if a.quick else 5)
    a.warmup = (0 if a.quick else 1) if a.warmup is None else a.warmup
    return a


# ---- model of tokens/s -------------------------------------------------------------------------
MECHS = ("planes", "rerun")


def modeled(ms: dict, k: int, rate: float) -> dict:
    """Expected tokens and ms per round of both mechanisms at per-token acceptance `rate`."""
    pj = [rate ** j * (1 - rate) for j in range(k)] + [rate ** k]
    tokens = sum((j + 1) * p for j, p in enumerate(pj))           # = (1 - a^(k+1)) / (1 - a)
    first = sum(p * ms["mtp"][min(j + 1, max(ms["mtp"]))] for j, p in enumerate(pj))
    draft = first + (k - 1) * ms["mtp"][1]
    cost = {"planes": draft + ms["verify"][k] + sum(pj[:k]) * ms["keep_plane"],
            "rerun": draft + ms["snapshot"] + ms["verify_no_planes"][k]
            + sum(p * (ms["restore"] + ms["reprefill"][j + 1]) for j, p in enumerate(pj[:k]))}
    out = {"tokens_per_round": tokens, "ms_draft": draft}
    for m in MECHS:
        out[f"ms_per_round_{m}"] = cost[m]
        out[f"tok_s_{m}"] = 1e3 * tokens / cost[m]
    return out


def break_even(ms: dict, k: int, mech: str = "planes") -> float | None:
    """Smallest acceptance rate (0.01 steps) where `mech` beats plain decode."""
    plain = 1e3 / ms["decode"]
    for i in range(101):
        if modeled(ms, k, i / 100)[f"tok_s_{mech}"] >= plain:
            return i / 100
    return None


# ---- measurements ------------------------------------------------------------------------------
def bench_size(size, a, tables):
    import torch

    import flashrt.lm.speculative as S

    trained = size == "trained"
    path = trained_path() if trained else C.checkpoint("qwen3_5", size)
    lab = "qwen3_5/trained (pystdlib)" if trained else C.label("qwen3_5", size)
    kmax = max(a.ks)
    rt = C.load_flashrt(path, a, max_seq_len=a.context + 2 * a.gen + 4 * kmax + 16)
    net, ar, dev = rt.net, rt.arena, a.device
    if not net.has_draft_head:
        raise SystemExit(f"{path}: no MTP weights")
    vocab = net.vocab_size
    prompt = heldout_prompts(rt, 1, a.context)[0] if trained else C.random_ids(a.context, vocab, seed=1)
    rt.generate(prompt, max_new_tokens=1, speculative="mtp")   # MTP rows of the prompt filled
    P = rt.position
    base = rt.snapshot()
    session = rt.activate()       # the steps and marks below act on its state: take its turn
    steps = S.EagerSteps(net, session) if rt.graphs is None else rt.speculation().steps_for(kmax)
    toks = C.random_ids(kmax + 1, vocab, seed=2)
    hid = ar[net.draft_hidden][None].clone()
    hidk = hid.expand(kmax + 1, -1).contiguous()
    cap = session.mark()
    T = lambda ids: torch.tensor(ids, device=dev)  # noqa: E731
    reset = lambda: rt.restore(base)               # noqa: E731
    planes = steps.planes_for(kmax + 1)            # what a partial round copies back (keep)

    def draft(k):
        logits, g = steps.draft(T(toks[:1]), hid, P - 1)
        for j in range(1, k):
            logits, g = steps.draft(T([int(logits[-1].argmax())]), g[-1:], P - 1 + j)
        return int(logits[-1].argmax())

    cases = {"decode": C.Case(lambda: rt.decode(toks[0]), setup=reset),
             "snapshot": C.Case(lambda: session.mark(into=cap)),
             "restore": C.Case(lambda: session.rewind(cap)),
             "keep plane": C.Case(lambda: planes.keep(0))}
    for n in range(1, kmax + 2):
        cases[f"mtp {n}"] = C.Case(lambda n=n: steps.draft(T(toks[:n]), hidk[:n], P - 1), setup=reset)
        cases[f"main {n}"] = C.Case(lambda n=n: steps.main(T(toks[:n]), all_logits=False), setup=reset)
    for k in a.ks:
        cases[f"draft {k}"] = C.Case(lambda k=k: draft(k), setup=reset)
        cases[f"verify {k}"] = C.Case(lambda k=k: steps.main(T(toks[:k + 1]), planes=True), setup=reset)
        cases[f"verify no planes {k}"] = C.Case(lambda k=k: steps.main(T(toks[:k + 1])), setup=reset)
    st = C.measure(cases, a.repeats, a.warmup, dev, desc=f"qwen3_5/{size} steps")
    rt.restore(base)
    med = {n: s.median * 1e3 for n, s in st.items()}
    ms = {"decode": med["decode"], "snapshot": med["snapshot"], "restore": med["restore"],
          "keep_plane": med["keep plane"],
          "mtp": {n: med[f"mtp {n}"] for n in range(1, kmax + 2)},
          "reprefill": {n: med[f"main {n}"] for n in range(1, kmax + 1)},
          "verify": {k: med[f"verify {k}"] for k in a.ks},
          "verify_no_planes": {k: med[f"verify no planes {k}"] for k in a.ks},
          "draft": {k: med[f"draft {k}"] for k in a.ks}}
    fixed_bytes = sum(b[0].numel() * b.element_size() for b in planes.buffers.values())

    t = C.Table(f"{lab}: step costs at context {P} ({dev}, {a.dtype}; ms, median [min-max])",
                ["k", "draft k", "verify k (k+1 tok)", "verify/decode", "keep plane",
                 "verify k, no planes", "mark", "rewind", "re-prefill 1..k"])
    for k in a.ks:
        rp = ", ".join(f"{ms['reprefill'][n]:.2f}" for n in range(1, k + 1))
        t.add(k, st[f"draft {k}"].ms(2), st[f"verify {k}"].ms(2),
              f"{ms['verify'][k] / ms['decode']:.2f}", st["keep plane"].ms(3),
              st[f"verify no planes {k}"].ms(2), st["snapshot"].ms(3), st["restore"].ms(3), rp)
    t.notes += [f"plain decode step: {st['decode'].ms(2)} ms; MTP step over T pairs: " +
                ", ".join(f"T={n} {ms['mtp'][n]:.2f}" for n in range(1, kmax + 2)),
                "verify k: mechanism planes (the default): the step also keeps the fixed state "
                f"({C.fmt_bytes(fixed_bytes)}: recurrent + conv + MTP hidden) after each position; "
                "keep plane: one copied back on partial acceptance",
                "verify k, no planes / mark / rewind / re-prefill: mechanism rerun (mark copies the "
                f"whole fixed block, {C.fmt_bytes(ar.fixed_end - ar.fixed_begin)} incl. logits)"]
    tables.append(t)

    # ---- acceptance and end-to-end ------------------------------------------------------------
    # each run: prompt + first token untimed (for speculative runs through generate, which also
    # fills the prompt's MTP rows), then generate(a.gen) timed
    plain_rt = rt.fork()
    plain_rt.reset()
    plain_rt.prefill(prompt)
    ref = plain_rt.generate(max_new_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    ref += plain_rt.generate(max_new_tokens=a.gen, ignore_eos=True)
    plain_s = time.perf_counter() - t0

    def oracle(err):
        def d(r, k):
            i = len(r.tokens) - len(prompt)          # ref[i] is the pending token
            out = [ref[i + 1 + j] if i + 1 + j < len(ref) else 0 for j in range(k)]
            return [(x + 1) % vocab for x in out] if err else out
        return d

    e2e = {"plain": {"tok_s": a.gen / plain_s}}
    acc = {}
    for k in a.ks:
        for name, dr in (("mtp", None), ("oracle a=1", oracle(False)), ("wrong a=0", oracle(True))):
            for mech in MECHS:                       # back to back, same drafter and k
                r = rt.fork()
                r.reset()
                S.use_mechanism(r, mech)
                kw = dict(ignore_eos=True, speculative="mtp", draft_tokens=k, drafter=dr)
                out = r.generate(prompt, max_new_tokens=1, **kw)
                t0 = time.perf_counter()
                out += r.generate(max_new_tokens=a.gen, **kw)
                s = time.perf_counter() - t0
                stats = S.last_stats(r)
                rate = stats["accepted"] / max(1, stats["drafted"])
                e2e[f"{name} k={k} {mech}"] = {"tok_s": a.gen / s, "acceptance": rate, "stats": stats,
                                               "same_as_plain": out == ref}
                if name == "mtp" and mech == "planes":
                    acc[k] = rate
                r.close()
    te = C.Table(f"{lab}: end-to-end generate of {a.gen} tokens after a {a.context}-token prompt "
                 "(wall clock, one run each)",
                 ["drafter", "k", "acceptance", "tok/s planes", "tok/s rerun", "planes/rerun",
                  "planes vs plain", "modeled planes", "modeled rerun", "= plain greedy"])
    pl = e2e["plain"]["tok_s"]
    te.add("plain", "-", "-", f"{pl:.1f}", "-", "-", "1.00x", f"{1e3 / ms['decode']:.1f}", "-", "-")
    for k in a.ks:
        for name, rate in (("mtp", acc[k]), ("oracle a=1", 1.0), ("wrong a=0", 0.0)):
            ep, er = e2e[f"{name} k={k} planes"], e2e[f"{name} k={k} rerun"]
            mod = modeled(ms, k, ep["acceptance"] if name == "mtp" else rate)
            m = {x: mod[f"tok_s_{x}"] for x in MECHS}
            if name != "mtp":   # injected drafters cost ~nothing: the round without its draft term
                m = {x: 1e3 * mod["tokens_per_round"] / (mod[f"ms_per_round_{x}"] - mod["ms_draft"])
                     for x in MECHS}
            te.add(name, k, f"{ep['acceptance']:.3f}", f"{ep['tok_s']:.1f}", f"{er['tok_s']:.1f}",
                   C.fmt_ratio(ep["tok_s"] / er["tok_s"]), C.fmt_ratio(ep["tok_s"] / pl),
                   f"{m['planes']:.1f}", f"{m['rerun']:.1f}",
                   f"{ep['same_as_plain']}, {er['same_as_plain']}")
    te.notes += [("trained model, one held-out prompt (see the acceptance table for more)" if trained else
                  "random weights: the MTP layer and the main model are unrelated, so MTP drafts are "
                  "accepted almost never") + "; the oracle/wrong drafters pin acceptance at 1 and 0",
                 "planes / rerun: speculative.use_mechanism, run back to back; '= plain greedy' for both",
                 "wall clock of generate() after the prompt: includes the end-of-call MTP flush and "
                 "commit of the pending token; modeled tok/s is per decoding round only"]
    tables.append(te)

    tm = C.Table(f"{lab}: modeled tokens/s vs per-token acceptance rate a (plain decode "
                 f"{1e3 / ms['decode']:.1f} tok/s)",
                 ["a"] + [f"k={k} planes (x plain)" for k in a.ks] + [f"k={k} rerun" for k in a.ks])
    curve = {}
    for rate in RATES:
        row, rest = [f"{rate:.1f}"], []
        for k in a.ks:
            m = modeled(ms, k, rate)
            curve.setdefault(k, []).append({"a": rate, **m})
            row.append(f"{m['tok_s_planes']:.1f} ({m['tok_s_planes'] * ms['decode'] / 1e3:.2f}x)")
            rest.append(f"{m['tok_s_rerun']:.1f}")
        tm.add(*(row + rest))
    be = {mech: {k: break_even(ms, k, mech) for k in a.ks} for mech in MECHS}
    tm.notes += ["tokens per round = (1 - a^(k+1)) / (1 - a); cost per round: planes = draft + verify "
                 "+ P(partial) keep plane; rerun = draft + mark + verify without planes + P(partial) "
                 "(rewind + re-prefill of the accepted tokens); all measured above"] + [
                 f"break-even acceptance vs plain decode, {mech}: " +
                 ", ".join(f"k={k}: {be[mech][k]}" for k in a.ks) for mech in MECHS]
    tables.append(tm)
    out = {"size": size, "checkpoint": C.short_path(path), "context": P, "ms": ms,
           "stats": {n: s for n, s in st.items()}, "acceptance_mtp": acc, "end_to_end": e2e,
           "modeled": curve, "break_even": be,
           "acceptance_note": "trained MTP layer" if trained else
           "random weights: MTP drafts are essentially never accepted"}
    if trained:
        out["trained"] = trained_acceptance(rt, ms, a, tables)
    return out


# ---- the trained model: acceptance per draft position on held-out code ----------------------
def trained_path():
    from flashrt.assets import trained_model_path
    return trained_model_path()


def heldout_prompts(rt, n: int, length: int) -> list:
    """`length` tokens from the middle of each of the first n held-out stdlib files (the files
    flashrt.dev.train held out: every val_every-th in sorted order) long enough to hold them."""
    from flashrt.dev.train import corpus_files
    every = int(rt.model.info["corpus"]["heldout_rule"].split()[1].rstrip("thsnrd"))
    out = []
    for f in corpus_files()[::every]:
        ids = rt.tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= 2 * length:
            out.append(ids[len(ids) // 2: len(ids) // 2 + length])
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} held-out files hold {2 * length} tokens")


def trained_acceptance(rt, ms: dict, a, tables) -> dict:
    """Per prompt, plain greedy then MTP k = 1..4 with each mechanism, back to back (wall clock,
    after the prompt)."""
    import flashrt.lm.speculative as S
    prompts = heldout_prompts(rt, a.prompts, a.context)
    runs = ["plain"] + [(k, m) for k in a.ks for m in MECHS]
    tot = {name: {"s": 0.0, "tokens": 0, "same": 0, "per_prompt_s": []} for name in runs}
    counts = {k: {"reached_at": [0] * k, "accepted_at": [0] * k, "rounds": 0, "drafted": 0,
                  "accepted": 0} for k in a.ks}
    for prompt in C.progress(prompts, desc="trained acceptance"):
        ref = None
        for name in runs:
            r = rt.fork()
            r.reset()
            kw = {}
            if name != "plain":
                kw = dict(speculative="mtp", draft_tokens=name[0])
                S.use_mechanism(r, name[1])
            first = r.generate(prompt, max_new_tokens=1, ignore_eos=True, **kw)
            t0 = time.perf_counter()
            out = first + r.generate(max_new_tokens=a.gen, ignore_eos=True, **kw)
            tot[name]["s"] += time.perf_counter() - t0
            tot[name]["per_prompt_s"].append(time.perf_counter() - t0)
            tot[name]["tokens"] += a.gen
            ref = out if name == "plain" else ref
            tot[name]["same"] += out == ref
            if name != "plain" and name[1] == "planes":
                st = S.last_stats(r)
                c = counts[name[0]]
                for key in ("rounds", "drafted", "accepted"):
                    c[key] += st[key]
                for key in ("reached_at", "accepted_at"):
                    c[key] = [x + y for x, y in zip(c[key], st[key])]
            r.close()
    plain_tps = tot["plain"]["tokens"] / tot["plain"]["s"]
    t = C.Table(f"qwen3_5/trained: MTP acceptance on {len(prompts)} held-out stdlib prompts "
                f"({a.context} tokens each, {a.gen} greedy tokens; {a.device}, {a.dtype})",
                ["k", "accepted / drafted", "per position j=1..k: accepted/reached", "pooled a",
                 "break-even a", "tok/s plain", "tok/s planes", "tok/s rerun", "planes/plain",
                 "rerun/plain", "median per prompt (planes)", "= plain greedy"])
    res = {"prompts": len(prompts), "plain_tok_s": plain_tps, "per_k": {}}
    for k in a.ks:
        c = counts[k]
        pos = [c["accepted_at"][j] / max(1, c["reached_at"][j]) for j in range(k)]
        pooled = sum(c["accepted_at"]) / max(1, sum(c["reached_at"]))
        tps = {m: tot[(k, m)]["tokens"] / tot[(k, m)]["s"] for m in MECHS}
        be = {m: break_even(ms, k, m) for m in MECHS}
        per = statistics.median(p / q for p, q in zip(tot["plain"]["per_prompt_s"],
                                                      tot[(k, "planes")]["per_prompt_s"]))
        t.add(k, f"{c['accepted'] / max(1, c['drafted']):.3f}",
              " ".join(f"{p:.2f}" for p in pos), f"{pooled:.3f}",
              " / ".join("-" if be[m] is None else f"{be[m]:.2f}" for m in MECHS),
              f"{plain_tps:.1f}", f"{tps['planes']:.1f}", f"{tps['rerun']:.1f}",
              C.fmt_ratio(tps["planes"] / plain_tps), C.fmt_ratio(tps["rerun"] / plain_tps),
              C.fmt_ratio(per), " / ".join(f"{tot[(k, m)]['same']}/{len(prompts)}" for m in MECHS))
        res["per_k"][k] = {**c, "acceptance": c["accepted"] / max(1, c["drafted"]),
                           "per_position": pos, "pooled_a": pooled, "break_even_a": be,
                           "tok_s": tps, "speedup": {m: tps[m] / plain_tps for m in MECHS},
                           "speedup_median_prompt_planes": per,
                           "same_as_plain": {m: tot[(k, m)]["same"] for m in MECHS}}
    t.notes += ["per position j: P(draft j accepted | drafts 1..j-1 accepted), from "
                "flashrt.lm.speculative.last_stats (planes runs); pooled a = all accepted / all reached "
                "(the per-token rate of the model behind break-even)",
                "break-even a (planes / rerun): smallest per-token acceptance at which the modeled "
                "mechanism beats plain decode, from this run's step costs (table above); -: never at k",
                "tok/s: wall clock of generate() after the prompt, summed over prompts; plain and MTP "
                "runs alternate per prompt; median per prompt: of the per-prompt MTP/plain speed ratios; "
                "'= plain greedy' (planes / rerun): identical token lists (near-ties may part)"]
    tables.append(t)
    return res


def main(argv=None) -> int:
    a = parse(argv)
    info = C.banner("speculative", a)
    if not C.arch_available("qwen3_5"):
        print("qwen3_5: model file not present in this checkout")
        return 1
    import torch
    torch.set_grad_enabled(False)
    tables, results = [], []
    for size in a.sizes:
        results.append(bench_size(size, a, tables))
    C.print_tables(tables)
    print(C.RANDOM_NOTE + " (except qwen3_5/trained: trained here on the Python stdlib)")
    data = {"ks": a.ks, "context": a.context, "gen": a.gen, "repeats": a.repeats,
            "warmup": a.warmup, "rates": list(RATES), "results": results,
            "mechanisms": {"planes": "the verify keeps the fixed state after each position; one "
                           "copied back on partial acceptance (default)",
                           "rerun": "mark the fixed state, rewind, re-run the accepted tokens"}}
    C.write_json("speculative-trained" if a.sizes == ["trained"] else "speculative", a, info, tables,
                 data, argv, script="speculative")
    ok = all(r["end_to_end"][f"{n} k={k} {m}"]["same_as_plain"] for r in results for k in a.ks
             for n in ("oracle a=1", "wrong a=0") for m in MECHS)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

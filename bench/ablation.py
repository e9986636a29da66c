"""Ablation: after an excursion, restore the full capsule vs only its KV rows.

For each prompt and each token boundary b of it:
  never-left   reset; prefill(prompt[:b]); capsule = snapshot(); prefill(prompt[b:]); greedy G steps
  full         restore(capsule); prefill(excursion); restore(capsule);            same continuation
  KV-only      restore(capsule); prefill(excursion); restore(capsule, kinds={"kv"}); same continuation
The excursion is a run of unrelated random tokens, so recurrent/conv state moves on while KV
rows past b are simply ignored. Full restore must give logits bitwise equal to the never-left
run at every step (100%); KV-only leaves hybrid models' recurrent/conv state stale, so their
logits differ, and greedy tokens usually follow. qwen3 (attention only) is the control: KV is
its whole state, so KV-only == full there.

    python bench/ablation.py                # tiny + small checkpoints of all three archs
    python bench/ablation.py --quick        # tiny only, 2 prompts x 2 boundaries
"""
from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402


def parse(argv):
    p = C.base_parser("bench/ablation.py", "Full vs KV-only capsule restore after an excursion")
    p.add_argument("--models", default=None, help="comma list of arch:size (default: tiny and small "
                   "of qwen3_5, lfm2, qwen3; tiny only in --quick)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per model (default 8; 2 quick)")
    p.add_argument("--boundaries", type=int, default=None, help="boundaries per prompt (default 4; 2 quick)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 96; 32 quick)")
    p.add_argument("--gen", type=int, default=None, help="greedy steps compared (default 16; 8 quick)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    C.setup(a)
    if a.models is None:
        sizes = ["tiny"] if a.quick else ["tiny", "small"]
        a.models = ",".join(f"{arch}:{s}" for s in sizes for arch in ("qwen3_5", "lfm2", "qwen3"))
    a.configs = [tuple(m.split(":")) if ":" in m else (m, "tiny") for m in a.models.split(",")]
    a.prompts = a.prompts or (2 if a.quick else 8)
    a.boundaries = a.boundaries or (2 if a.quick else 4)
    a.prompt_len = a.prompt_len or (32 if a.quick else 96)
    a.gen = a.gen or (8 if a.quick else 16)
    return a


def continuation(rt, ids, gen):
    """prefill(ids), then greedy decode; (tokens, [logits per step])."""
    return C.rt_greedy(rt, rt.prefill(ids), gen)


def compare(ref, run):
    """(logits bitwise equal at every step, tokens equal, first divergent greedy step or None,
    max |dlogit| at the first step)."""
    import torch
    (rt_, rl), (t, l) = ref, run
    same_logits = len(rl) == len(l) and all(torch.equal(x, y) for x, y in zip(rl, l))
    first = next((i for i, (x, y) in enumerate(zip(rt_, t)) if x != y), None)
    return same_logits, rt_ == t, first, float((rl[0] - l[0]).abs().max())


def bench_model(arch, size, a, table):
    import torch  # noqa: F401
    path = C.checkpoint(arch, size)
    lab = C.label(arch, size)
    rng = random.Random(f"{a.seed}-{arch}-{size}")
    rt = C.load_flashrt(path, a, max_seq_len=a.prompt_len + 64 + a.gen + 1)
    vocab = rt.net.vocab_size
    runs = []
    total = a.prompts * a.boundaries
    it = iter(C.progress(range(total), desc=f"{arch}/{size}", total=total))
    for pi in range(a.prompts):
        prompt = C.random_ids(a.prompt_len, vocab, seed=rng.randrange(2**31))
        bounds = sorted(rng.sample(range(1, a.prompt_len), a.boundaries))
        for b in bounds:
            next(it, None)
            excursion = C.random_ids(rng.randint(4, 64), vocab, seed=rng.randrange(2**31))
            rt.reset()
            rt.prefill(prompt[:b])
            cap = rt.snapshot()
            ref = continuation(rt, prompt[b:], a.gen)
            rt.restore(cap)
            rt.prefill(excursion)
            rt.restore(cap)
            full = compare(ref, continuation(rt, prompt[b:], a.gen))
            rt.restore(cap)
            rt.prefill(excursion)
            rt.restore(cap, kinds={"kv"})
            kv = compare(ref, continuation(rt, prompt[b:], a.gen))
            runs.append({"prompt": pi, "boundary": b, "excursion": len(excursion),
                         "full_logits_equal": full[0], "full_tokens_equal": full[1],
                         "kv_logits_equal": kv[0], "kv_tokens_equal": kv[1],
                         "kv_first_divergent_step": kv[2], "kv_first_step_max_abs_dlogit": kv[3]})
    for _ in it:
        pass
    n = len(runs)
    pct = lambda k, want: 100.0 * sum(r[k] == want for r in runs) / n  # noqa: E731
    firsts = [r["kv_first_divergent_step"] for r in runs if r["kv_first_divergent_step"] is not None]
    summary = {"runs": n, "full_identity_pct": pct("full_logits_equal", True),
               "full_tokens_identity_pct": pct("full_tokens_equal", True),
               "kv_logits_diverge_pct": pct("kv_logits_equal", False),
               "kv_tokens_diverge_pct": pct("kv_tokens_equal", False),
               "kv_mean_first_divergent_step": statistics.mean(firsts) if firsts else None,
               "kv_mean_first_step_max_abs_dlogit": statistics.mean(r["kv_first_step_max_abs_dlogit"]
                                                                    for r in runs),
               "fixed_state_bytes": rt.arena.fixed_state_bytes,
               "kinds": sorted({s.spec.kind for s in rt.arena.slots})}
    control = " (control)" if arch == "qwen3" else ""
    table.add(lab + control, n, f"{summary['full_identity_pct']:.0f}%",
              f"{summary['kv_logits_diverge_pct']:.0f}%", f"{summary['kv_tokens_diverge_pct']:.0f}%",
              "-" if summary["kv_mean_first_divergent_step"] is None
              else f"{summary['kv_mean_first_divergent_step']:.1f}",
              f"{summary['kv_mean_first_step_max_abs_dlogit']:.3g}")
    del rt
    C.free_memory()
    return {"arch": arch, "size": size, "label": lab, "checkpoint": C.short_path(path), "summary": summary,
            "runs": runs}


def main(argv=None) -> int:
    a = parse(argv)
    info = C.banner("ablation", a, timed=False)
    table = C.Table(f"Full vs KV-only restore after an excursion ({a.device}, {a.dtype}; "
                    f"{a.prompts} prompts x {a.boundaries} boundaries, prompt {a.prompt_len} tokens, "
                    f"{a.gen} greedy steps)",
                    ["model", "runs", "full restore identical", "KV-only logits differ",
                     "KV-only tokens differ", "mean first divergent step", "mean |dlogit| step 0"])
    results = []
    for arch, size in a.configs:
        if not C.arch_available(arch):
            print(f"{arch}: model file not present in this checkout, skipped")
            continue
        results.append(bench_model(arch, size, a, table))
    table.notes += ["full restore identical: logits bitwise equal to the never-left run at every "
                    "step (must be 100%)",
                    "first divergent step: first greedy token that differs (0 = the first generated "
                    "token), over the runs whose tokens differ",
                    "boundaries are arbitrary token positions, not chunk- or block-aligned",
                    "with random weights greedy tokens are a weak check; the logits columns are the "
                    "strong one"]
    C.print_tables([table])
    print(C.RANDOM_NOTE)
    data = {"prompts": a.prompts, "boundaries": a.boundaries, "prompt_len": a.prompt_len,
            "gen": a.gen, "seed": a.seed, "results": results}
    C.write_json("ablation", a, info, [table], data, argv)
    ok = all(r["summary"]["full_identity_pct"] == 100.0 for r in results)
    ctrl = all(r["summary"]["kv_logits_diverge_pct"] == 0.0 for r in results if r["arch"] == "qwen3")
    if not ok:
        print("FAIL: a full restore did not reproduce the never-left run bit for bit")
    if not ctrl:
        print("FAIL: qwen3 control: KV-only restore differed from the never-left run")
    return 0 if ok and ctrl else 1


if __name__ == "__main__":
    raise SystemExit(main())

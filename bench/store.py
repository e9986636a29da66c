"""Capsule store: a multi-turn agent trace, and the cost of shared-prefix capsules.

Trace: a long system prompt (tool descriptions), then turns that append a user message and an
assistant reply, with retries (regenerate the last reply) and branches (a different user
message from an earlier turn). Each turn asks for the context "everything so far + the user
message": flashrt answers with `rt.set_context(tokens, store=store)` (longest stored prefix or
own history, then prefill only the rest); the cold column prefills the same tokens from empty.

Shared-prefix cost: N children of one parent of P tokens, each adding its own tokens, stored
as delta capsules (`snapshot(parent=)`) against full capsules.

    python bench/store.py            # qwen3_5 small, 1024-token system prompt, 10 turns
    python bench/store.py --quick    # tiny, 96-token system prompt
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402


def parse(argv):
    p = C.base_parser("bench/store.py", "Capsule store: agent trace and shared-prefix cost")
    p.add_argument("--arch", default="qwen3_5")
    p.add_argument("--size", default=None, help="default small (tiny with --quick)")
    p.add_argument("--system", type=int, default=None, help="system prompt tokens (1024; 96 quick)")
    p.add_argument("--turns", type=int, default=None, help="turns in the trace (10; 5 quick)")
    p.add_argument("--user", type=int, default=24, help="tokens per user message")
    p.add_argument("--reply", type=int, default=12, help="tokens per assistant reply (greedy)")
    p.add_argument("--children", type=int, default=8, help="children for the shared-prefix figure")
    p.add_argument("--parent", type=int, default=None, help="parent tokens (2048; 128 quick)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    C.setup(a)
    a.size = a.size or ("tiny" if a.quick else "small")
    a.system = a.system or (96 if a.quick else 1024)
    a.turns = a.turns or (5 if a.quick else 10)
    a.parent = a.parent or (128 if a.quick else 2048)
    return a


def make_trace(a, vocab):
    """[(kind, context tokens)]: turn k's context; 'retry' repeats a context, 'branch' forks an
    earlier one with another user message. Assistant replies are filled in while running."""
    rng = random.Random(a.seed)
    msg = lambda: [rng.randrange(vocab) for _ in range(a.user)]  # noqa: E731
    system = [rng.randrange(vocab) for _ in range(a.system)]
    plan = []
    for k in range(a.turns):
        if k >= 2 and k % 4 == 2:
            plan.append(("retry", None))
        elif k >= 3 and k % 4 == 3:
            plan.append(("branch", msg()))
        else:
            plan.append(("turn", msg()))
    return system, plan


def run_trace(a, rt, cold_rt, store):
    import torch

    from flashrt.lm.inputs import common_prefix
    system, plan = make_trace(a, rt.net.vocab_size)
    history, contexts, rows = list(system), [], []
    for k, (kind, user) in enumerate(C.progress(plan, desc="trace")):
        if kind == "retry":
            ctx = contexts[-1]
        elif kind == "branch":
            ctx = contexts[max(0, len(contexts) - 2)][: -a.user] + user   # an earlier turn, other message
        else:
            ctx = history + user
        own = common_prefix(rt.tokens, ctx)
        hit = store.match(ctx, rt.fingerprint)[1]
        t_warm, logits = C.time_once(lambda: rt.set_context(ctx, store=store), a.device)
        t_cold, cold_logits = C.time_once(lambda: (cold_rt.reset(), cold_rt.prefill(ctx))[1], a.device)
        reused = max(own if own < len(ctx) or own == rt.position else 0, hit)
        reply = rt.generate(max_new_tokens=a.reply, ignore_eos=True)
        contexts.append(ctx)
        history = ctx + reply
        rows.append({"turn": k, "kind": kind, "context": len(ctx), "store_hit": hit,
                     "own_prefix": own, "prefilled": len(ctx) - min(len(ctx), max(hit, own)),
                     "ttft_store_ms": t_warm * 1e3, "ttft_cold_ms": t_cold * 1e3,
                     "max_dlogit": float((logits - cold_logits).abs().max()),
                     "same_argmax": bool(torch.argmax(logits) == torch.argmax(cold_logits)),
                     "reused": reused})
    return rows


def shared_prefix_cost(a, rt):
    import random as _r
    r = _r.Random(a.seed + 1)
    V = rt.net.vocab_size
    rt.reset()
    rt.prefill([r.randrange(V) for _ in range(a.parent)])
    parent = rt.snapshot()
    own = a.user + a.reply
    full_total = delta_total = 0
    for _ in C.progress(range(a.children), desc="children"):
        rt.restore(parent)
        rt.prefill([r.randrange(V) for _ in range(own)])
        full_total += rt.snapshot().nbytes
        delta_total += rt.snapshot(parent=parent).nbytes
    fixed, per_tok = rt.arena.fixed_state_bytes, rt.arena.per_token_bytes
    return {"children": a.children, "parent_tokens": a.parent, "own_tokens": own,
            "parent_bytes": parent.nbytes, "full_children_bytes": full_total,
            "delta_children_bytes": delta_total,
            "model_n_x_fixed_plus_own": a.children * (fixed + own * per_tok)}


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    x = [r["turn"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(x, [r["ttft_cold_ms"] for r in rows], "o-", label="cold prefill")
    ax.plot(x, [r["ttft_store_ms"] for r in rows], "s-", label="flashrt set_context + store")
    for r in rows:
        if r["kind"] != "turn":
            ax.annotate(r["kind"], (r["turn"], r["ttft_store_ms"]), fontsize=7)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Agent trace TTFT per turn (random weights)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    from flashrt.capsules import CapsuleStore
    a = parse(argv)
    info = C.banner("store", a)
    path = C.checkpoint(a.arch, a.size)
    max_len = max(a.system + a.turns * (a.user + a.reply) + 64, a.parent + a.user + a.reply + 8)
    rt = C.load_flashrt(path, a, max_len)
    cold = C.load_flashrt(path, a, max_len)
    store = CapsuleStore(device_bytes=2 * 2**30, host_bytes=2 * 2**30)
    rows = run_trace(a, rt, cold, store)
    cost = shared_prefix_cost(a, rt)

    t1 = C.Table(f"Agent trace on {C.label(a.arch, a.size)} ({a.device}, {a.dtype}): TTFT per turn, "
                 f"system prompt {a.system} tokens",
                 ["turn", "kind", "context", "reused", "prefilled", "TTFT store ms", "TTFT cold ms",
                  "cold/store", "same argmax"])
    for r in rows:
        t1.add(r["turn"], r["kind"], r["context"], r["reused"], r["prefilled"],
               f"{r['ttft_store_ms']:.1f}", f"{r['ttft_cold_ms']:.1f}",
               C.fmt_ratio(r["ttft_cold_ms"] / r["ttft_store_ms"]), r["same_argmax"])
    hits = sum(1 for r in rows if r["reused"] > 0)
    tot_pref = sum(r["prefilled"] for r in rows)
    tot_ctx = sum(r["context"] for r in rows)
    t1.notes += [f"hit rate {hits}/{len(rows)} turns; tokens prefilled {tot_pref} of {tot_ctx} "
                 f"({100 * tot_pref / tot_ctx:.1f}%); total TTFT store "
                 f"{sum(r['ttft_store_ms'] for r in rows):.0f} ms vs cold "
                 f"{sum(r['ttft_cold_ms'] for r in rows):.0f} ms",
                 "each turn of the trace happens once: its TTFTs are single samples (the trace's "
                 "totals are the figure to compare, not one turn's ratio)",
                 "reused: tokens taken from a stored capsule or the session's own history; "
                 "same argmax: first token equals the cold prefill's (paths differ in chunking, "
                 "so logits agree to tolerance, not bitwise)"]
    t2 = C.Table(f"Shared-prefix capsules: {cost['children']} children of a {cost['parent_tokens']}-token "
                 f"parent, {cost['own_tokens']} own tokens each",
                 ["capsules", "bytes", "per child"])
    n = cost["children"]
    t2.add("parent (stored once)", C.fmt_bytes(cost["parent_bytes"]), "-")
    t2.add("children as full capsules", C.fmt_bytes(cost["full_children_bytes"]),
           C.fmt_bytes(cost["full_children_bytes"] / n))
    t2.add("children as delta capsules", C.fmt_bytes(cost["delta_children_bytes"]),
           C.fmt_bytes(cost["delta_children_bytes"] / n))
    t2.add("N x (fixed + own tokens), from the layout", C.fmt_bytes(cost["model_n_x_fixed_plus_own"]),
           C.fmt_bytes(cost["model_n_x_fixed_plus_own"] / n))
    C.print_tables([t1, t2])
    png = plot(rows, C.result_path("store", a).with_suffix(".png"))
    if png:
        print(f"plot: {png}")
    C.write_json("store", a, info, [t1, t2], {"trace": rows, "shared_prefix": cost}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

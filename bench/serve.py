"""flashrt bench serve: a voice-agent dialogue over HTTP, TTFT per turn (random weights).

The dialogue: a system prompt, then turns of (user tokens -> streamed greedy reply); at the
barge-in turn the client cancels after a few tokens (delivered_tokens) and the next turn
appends to what was delivered, as a voice agent does after an interruption. Per turn:

  flashrt        `flashrt serve` (capsules at prompt and turn ends; restore/extend, prefill the rest)
  re-prefill     the same server with --capsule-budget-mb 0: every prompt prefilled in full,
                 what a voice framework gets today after it cancels and re-sends the conversation
  in-process     Runtime.set_context(same tokens, CapsuleStore) + the greedy token in this
                 process: the capsule TTFT with no HTTP, to show the server's overhead

TTFT over HTTP = request sent -> first SSE chunk (one chunk per token), on one keep-alive
client; the flashrt server and the in-process run first do one untimed dialogue of the same
shape (other tokens). All three send
identical token ids (the flashrt run's prompts). llama-cpp-python's server is not measured
here (not installed on this machine; its column is left out rather than estimated).

    python bench/serve.py --size small --system-tokens 512 --turns 8 --barge-turn 4
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402


def parse(argv):
    p = C.base_parser("bench/serve.py", "voice-agent dialogue over HTTP: per-turn TTFT")
    p.add_argument("--arch", default="qwen3_5")
    p.add_argument("--size", default="real", help="tiny | small | real (Qwen3.5-0.8B shape)")
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--barge-turn", type=int, default=4, help="turn whose reply is cut off (1-based)")
    p.add_argument("--barge-after", type=int, default=4, help="tokens delivered before the barge-in")
    p.add_argument("--user-tokens", type=int, default=16)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--plot", default=None, help="PNG path (default next to the JSON)")
    a = p.parse_args(argv)
    a.repeats = a.repeats or (1 if a.quick else 3)
    if a.quick:
        a.size, a.system_tokens, a.turns = "tiny", 64, 5
    return a


def start_server(ckpt, a, budget_mb):
    sys.path.insert(0, str(C.ROOT / "tests"))
    from serve_util import Server
    threads = ["--threads", str(a.threads)] if a.threads else []
    return Server(ckpt, "--capsule-budget-mb", str(budget_mb), "--max-sessions", "1",
                  "--max-seq-len", str(a.max_seq_len), "--dtype", a.dtype, "--device", a.device, *threads)


def stream_turn(srv, client, prompt, a, barge: bool):
    """One streamed turn: (ttft s, delivered reply ids, cached_tokens)."""
    body = {"model": srv.model, "prompt": prompt, "max_tokens": a.reply_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    ids, ttft, usage, rid = [], None, None, None
    t0 = time.perf_counter()
    with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ttft is None:
                ttft = time.perf_counter() - t0
            rid = ev["id"]
            if ev.get("usage"):
                usage = ev["usage"]
            if ev["choices"]:
                ids += ev["choices"][0]["token_ids"]
                if barge and len(ids) >= a.barge_after and ev["choices"][0]["finish_reason"] is None:
                    kept = srv.post(f"/v1/completions/{rid}/cancel", {"delivered_tokens": a.barge_after})
                    ids = ids[: kept.json()["kept_tokens"][0]]
                    barge = False
    return ttft, ids, usage["prompt_tokens_details"]["cached_tokens"]


def dialogue(srv, a, seed, prompts=None):
    """Run the dialogue; prompts=None builds it (history + user turn), else replays those.
    One keep-alive client, as an agent holds: a fresh httpx client costs ~60 ms by itself."""
    import httpx
    client = httpx.Client(timeout=600)
    r = random.Random(seed)
    V = 256                       # byte ids: any checkpoint's vocabulary has them
    history = [r.randrange(V) for _ in range(a.system_tokens)]
    srv.complete([r.randrange(V) for _ in range(8)], max_tokens=2)     # warm-up, unrelated
    out = []
    for t in range(1, a.turns + 1):
        user = [r.randrange(V) for _ in range(a.user_tokens)]
        prompt = prompts[t - 1]["prompt"] if prompts else history + user
        ttft, reply, cached = stream_turn(srv, client, prompt, a, barge=(t == a.barge_turn))
        out.append({"turn": t, "prompt": prompt, "reply": reply, "ttft": ttft, "cached": cached})
        history = prompt + reply
    client.close()
    return out


def in_process(ckpt, a, turns):
    """in_process_steps on a worker thread, where the server's engine runs it too (torch's
    OpenMP team behaves differently on the main thread: up to 20x slower on a busy machine)."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(in_process_steps, ckpt, a, turns).result()


def in_process_steps(ckpt, a, turns):
    """Capsule TTFT on the same tokens, no HTTP: set_context + the greedy token per turn."""
    import torch

    from flashrt.capsules.store import CapsuleStore
    if a.threads:                 # per calling thread, as in the server's engine
        torch.set_num_threads(a.threads)
    rt = C.load_flashrt(ckpt, a, a.max_seq_len)
    for _ in range(2):            # the first pass warms up (shapes, allocator); the second is timed
        store, out = CapsuleStore(device_bytes=8 << 30), []
        rt.reset()
        for t in turns:
            t0 = time.perf_counter()
            logits = rt.set_context(t["prompt"], store=store)
            int(logits.argmax())                                       # the first greedy token
            out.append(time.perf_counter() - t0)
            rt.set_context(t["prompt"] + t["reply"], store=store)     # the turn end, as served
    return out


def plot(rows, path, a):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    turns = [r["turn"] for r in rows]
    for key, lab in (("reprefill_ms", "cancel + full re-prefill (HTTP)"), ("flashrt_ms", "flashrt serve (HTTP)"),
                     ("inproc_ms", "in-process capsule")):
        ax.plot(turns, [r[key] for r in rows], marker="o", label=lab)
    ax.axvline(a.barge_turn + 0.5, color="grey", ls=":", label="barge-in")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT ms (median)")
    ax.set_yscale("log")
    ax.set_title(f"voice-agent dialogue, {C.label(a.arch, a.size)}, {a.dtype} (random weights)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    a = parse(argv)
    C.setup(a)
    info = C.banner("serve", a)
    ckpt = C.checkpoint(a.arch, a.size)
    runs = {"flashrt": [], "reprefill": [], "inproc": []}
    for rep in range(a.repeats):
        srv = start_server(ckpt, a, 4096)
        try:
            # an untimed dialogue of the same shape first, as the in-process run warms up
            dialogue(srv, a, seed=1000 + rep)
            runs["flashrt"].append(dialogue(srv, a, seed=rep))
        finally:
            srv.stop()
        srv = start_server(ckpt, a, 0)
        try:
            runs["reprefill"].append(dialogue(srv, a, seed=rep, prompts=runs["flashrt"][-1]))
        finally:
            srv.stop()
        runs["inproc"].append(in_process(ckpt, a, runs["flashrt"][-1]))
        print(f"repeat {rep + 1}/{a.repeats} done", flush=True)
    rows = []
    for i in range(a.turns):
        f = [d[i] for d in runs["flashrt"]]
        b = [d[i] for d in runs["reprefill"]]
        assert all(x["prompt"] == y["prompt"] for x, y in zip(f, b)), "baseline sent other tokens"
        med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        rows.append({"turn": i + 1, "prompt_tokens": len(f[0]["prompt"]), "cached": f[0]["cached"],
                     "flashrt_ms": med([x["ttft"] for x in f]), "reprefill_ms": med([x["ttft"] for x in b]),
                     "inproc_ms": med([d[i] for d in runs["inproc"]]),
                     "reprefill_cached": b[0]["cached"]})
    t = C.Table(f"TTFT per turn over HTTP ({C.label(a.arch, a.size)}, {a.device}, {a.dtype}; system "
                f"{a.system_tokens}, user {a.user_tokens}, reply {a.reply_tokens} tokens; median of {a.repeats})",
                ["turn", "prompt tok", "cached tok", "flashrt ms", "re-prefill ms", "in-process ms",
                 "re-prefill/flashrt", "flashrt/in-process"])
    for r in rows:
        mark = " (after barge-in)" if r["turn"] == a.barge_turn + 1 else ""
        t.add(f"{r['turn']}{mark}", r["prompt_tokens"], r["cached"], f"{r['flashrt_ms']:.1f}",
              f"{r['reprefill_ms']:.1f}", f"{r['inproc_ms']:.1f}",
              C.fmt_ratio(r["reprefill_ms"] / r["flashrt_ms"]), C.fmt_ratio(r["flashrt_ms"] / r["inproc_ms"]))
    t.notes += [f"turn {a.barge_turn}: cancelled after {a.barge_after} tokens (delivered_tokens); "
                "the next turn appends to exactly what was delivered",
                "re-prefill: the same server with --capsule-budget-mb 0 (cached tok always 0)",
                "in-process: Runtime.set_context(same tokens, CapsuleStore) + argmax, no HTTP, "
                "on a worker thread as in the server",
                "llama-cpp-python's server: not measured in this run (not installed)"]
    C.print_tables([t])
    print(C.RANDOM_NOTE)
    path = C.write_json("serve", a, info, [t], {"rows": rows, "runs": {
        k: [[{kk: vv for kk, vv in x.items() if kk != "prompt"} if isinstance(x, dict) else x for x in d]
            for d in v] for k, v in runs.items()}}, argv)
    png = plot(rows, Path(a.plot) if a.plot else path.with_suffix(".png"), a)
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

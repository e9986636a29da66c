"""flashrt serve --draft-tokens: a turn's reply over HTTP with and without MTP drafts.

Servers on the shipped default model (trained here; its MTP layer's drafts are accepted),
`--draft-tokens 0` and each k, all up at once; every held-out prompt (cut from the stdlib
files the model did not train on, as bench/speculative.py does) goes to each server in turn,
streamed greedy. Per request: TTFT (request -> first chunk) and the reply's decode rate
((tokens - 1) / (last chunk - first chunk)). Each server first answers one untimed request.

    python bench/serve_speculative.py                  # k = 1, 2, 3; 8 prompts of 128 tokens
    python bench/serve_speculative.py --quick
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402


def parse(argv):
    p = C.base_parser("bench/serve_speculative.py", "flashrt serve: reply decode rate with and "
                      "without --draft-tokens (shipped model)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="draft tokens per round")
    p.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 8; 2 quick)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens")
    p.add_argument("--gen", type=int, default=None, help="reply tokens (default 64; 16 quick)")
    a = p.parse_args(argv)
    C.setup(a)
    a.prompts = a.prompts or (2 if a.quick else 8)
    a.gen = a.gen or (16 if a.quick else 64)
    return a


def reply(srv, client, ids, gen) -> dict:
    body = {"model": srv.model, "prompt": ids, "max_tokens": gen, "temperature": 0,
            "ignore_eos": True, "stream": True}
    toks, stamps = [], []
    t0 = time.perf_counter()
    with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                new = json.loads(line[6:])["choices"][0]["token_ids"]
                if new:
                    stamps.append(time.perf_counter() - t0)
                    toks += new
    return {"ttft": stamps[0], "tok_s": (len(toks) - 1) / (stamps[-1] - stamps[0]), "ids": toks}


def main(argv=None) -> int:
    import httpx

    a = parse(argv)
    info = C.banner("serve_speculative", a)
    sys.path.insert(0, str(C.ROOT / "tests"))
    from serve_util import Server

    import flashrt
    from bench.speculative import heldout_prompts, trained_path
    path = trained_path()
    prompts = heldout_prompts(flashrt.load(path, dtype="float32", max_seq_len=512), a.prompts, a.context)
    threads = ["--threads", str(a.threads)] if a.threads else []
    ks = [0] + a.ks
    servers = {}
    try:
        for k in ks:
            servers[k] = Server(path, "--max-sessions", "1", "--draft-tokens", str(k), "--dtype", a.dtype,
                                "--capsule-budget-mb", "0", *threads)
        runs = {k: [] for k in ks}
        with httpx.Client(timeout=300) as client:
            for k in ks:
                reply(servers[k], client, prompts[0][: a.context // 2], a.gen)     # untimed
            for ids in C.progress(prompts, desc="prompts"):
                for k in ks:                        # each prompt to every server in turn
                    runs[k].append(reply(servers[k], client, ids, a.gen))
    finally:
        for s in servers.values():
            s.stop()
    med = statistics.median
    plain = runs[0]
    t = C.Table(f"flashrt serve on the shipped model: {a.gen}-token greedy replies to {len(prompts)} held-out "
                f"prompts of {a.context} tokens ({a.device}, {a.dtype}; median over prompts)",
                ["--draft-tokens", "TTFT ms", "decode tok/s", "x --draft-tokens 0", "= --draft-tokens 0"])
    rows = []
    for k in ks:
        r = runs[k]
        speed = med(x["tok_s"] / p["tok_s"] for x, p in zip(r, plain))
        same = sum(x["ids"] == p["ids"] for x, p in zip(r, plain))
        rows.append({"k": k, "ttft_ms": med(x["ttft"] for x in r) * 1e3,
                     "tok_s": med(x["tok_s"] for x in r), "speedup": speed, "same": same})
        t.add(k, f"{rows[-1]['ttft_ms']:.1f}", f"{rows[-1]['tok_s']:.1f}", C.fmt_ratio(speed),
              f"{same}/{len(prompts)}")
    t.notes += ["decode tok/s: (reply tokens - 1) / (last chunk - first chunk) of the SSE stream; x: the "
                "median over prompts of each prompt's ratio to the same prompt on --draft-tokens 0",
                "servers: one session each, --capsule-budget-mb 0 (every prompt prefilled), all up at "
                "once, each prompt sent to each in turn; '=': identical reply ids (near-ties may part)",
                "weights: the shipped model trained here (flashrt/assets/pystdlib-qwen35)"]
    C.print_tables([t])
    C.write_json("serve-speculative", a, info, [t], {"rows": rows, "ks": ks, "gen": a.gen,
                                                      "context": a.context}, argv, script="serve_speculative")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Command line: generate, demo, make-checkpoint, layout, serve, bench."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

RANDOM_NOTE = "NOTE: random weights — the text below is meaningless; the point is speed and state."


def _load(args):
    from flashrt.lm import load
    return load(args.model, device=args.device, dtype=args.dtype, max_seq_len=args.max_seq_len,
                cuda_graphs=not args.eager)


def _sync(rt):
    import torch
    if rt.model.device.type == "cuda":
        torch.cuda.synchronize()


def cmd_generate(args) -> int:
    rt = _load(args)
    if rt.model.random_weights:
        print(RANDOM_NOTE)
    ids = [int(x) for x in args.ids.split(",")] if args.ids else rt.tokenizer.encode(args.prompt)
    t0 = time.perf_counter()
    rt.prefill(ids)
    _sync(rt)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    out = rt.generate(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    _sync(rt)
    dt = time.perf_counter() - t1
    print(rt.tokenizer.decode(out))
    print(f"\n[{len(ids)} prompt tokens] TTFT {ttft * 1e3:.1f} ms; {len(out)} tokens at "
          f"{len(out) / dt:.1f} tok/s ({rt.finish_reason})")
    return 0


def cmd_demo(args) -> int:
    from flashrt.dev.demo import run_demo
    return run_demo(arch=args.arch, size=args.size, prefix=args.prefix, device=args.device,
                    random=args.random, model=args.model)


def cmd_make_checkpoint(args) -> int:
    from flashrt.models.checkpoint import main
    return main(args.rest)


def cmd_layout(args) -> int:
    rt = _load(args)
    print(rt.layout())
    return 0


# `flashrt bench redis` runs bench/redis_tier.py: a script named redis.py would shadow redis-py
_BENCH_FILES = {"redis": "redis_tier"}


def cmd_bench(args) -> int:
    root = Path(__file__).resolve().parent.parent / "bench"
    script = root / f"{_BENCH_FILES.get(args.which, args.which)}.py"
    if not script.exists():
        print(f"bench scripts live in the source checkout (bench/{args.which}.py); not found at {root}",
              file=sys.stderr)
        return 2
    import runpy
    sys.argv = [str(script)] + args.rest
    runpy.run_path(str(script), run_name="__main__")
    return 0


def cmd_serve(args) -> int:
    try:
        from flashrt.serve.server import main as serve_main
    except ImportError as e:
        print(f"flashrt serve needs the serve extra (pip install 'flashrt[serve]'): {e}", file=sys.stderr)
        return 2
    return serve_main(args)


def _model_args(p):
    p.add_argument("--model", required=True, help="Hugging Face-format checkpoint directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: best for device)")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--eager", action="store_true", help="disable CUDA graphs (debugging)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="flashrt", description="FlashRT execution-state runtime")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a continuation; prints TTFT and tokens/s")
    _model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--ids", help="comma-separated token ids")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(fn=cmd_generate)
    d = sub.add_parser("demo", help="the README demo on the shipped model trained on Python's stdlib")
    d.add_argument("--model", default=None, help="checkpoint directory (default: the shipped trained model)")
    d.add_argument("--random", action="store_true",
                   help="a random-weight checkpoint of --arch/--size instead")
    d.add_argument("--arch", default="qwen3_5", help="with --random")
    d.add_argument("--size", default="small", help="with --random")
    d.add_argument("--prefix", type=int, default=512, help="prefix tokens for the TTFT comparison")
    d.add_argument("--device", default="cpu")
    d.set_defaults(fn=cmd_demo)
    m = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint (ARCH SIZE OUT_DIR)")
    m.add_argument("rest", nargs=argparse.REMAINDER)
    m.set_defaults(fn=cmd_make_checkpoint)
    lay = sub.add_parser("layout", help="print the arena layout of a checkpoint")
    _model_args(lay)
    lay.set_defaults(fn=cmd_layout)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with capsule reuse and barge-in")
    from flashrt.serve.server import parser as serve_parser
    serve_parser(s)
    s.set_defaults(fn=cmd_serve)
    b = sub.add_parser("bench", help="run a benchmark: ttft | capsules | ablation | models | serve | redis | "
                                     "policy | asr | tts | decode | voice | agent")
    b.add_argument("which", choices=["ttft", "capsules", "ablation", "models", "serve", "redis", "policy",
                                     "asr", "tts", "decode", "voice", "agent"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

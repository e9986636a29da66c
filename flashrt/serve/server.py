"""Build the engine and app from a checkpoint directory, and run uvicorn."""
from __future__ import annotations

import argparse
from pathlib import Path


def build(model_dir, device="cpu", dtype=None, max_seq_len=4096, capsule_budget_mb=1024,
          capsule_dir=None, api_key=None, max_sessions=4, max_queue=None, seed=0, threads=None,
          capsule_redis=None, capsule_disk_mb=8192, session_idle_s=3600.0, draft_tokens=0):
    """(asgi app, engine): load the model with max_sessions sessions, wire the routes, and
    guard every path (API key when given, body size limit)."""
    from flashrt.lm import load as load_lm

    from .app import MAX_BODY, Guard, create_app
    from .engine import Engine
    from .text import ChatTemplate
    if max_sessions < 1:
        raise ValueError(f"--max-sessions must be >= 1, got {max_sessions}")
    if max_queue is not None and max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {max_queue}")
    if draft_tokens < 0:
        raise ValueError(f"--draft-tokens must be >= 0, got {draft_tokens}")
    if capsule_disk_mb <= 0 or session_idle_s <= 0:
        raise ValueError(f"--capsule-disk-mb and --session-idle-s must be > 0, got "
                         f"{capsule_disk_mb} and {session_idle_s}")
    def load():
        return load_lm(model_dir, device=device, dtype=dtype, max_seq_len=max_seq_len,
                       sessions=max_sessions, seed=seed)
    shared = None
    if capsule_redis:                   # a fleet-shared tier below this server's own
        from flashrt.capsules.redis_tier import RedisTier
        shared = RedisTier.from_url(capsule_redis)
    engine = Engine(load, int(capsule_budget_mb * (1 << 20)), capsule_dir, max_sessions, max_queue, threads,
                    shared, int(capsule_disk_mb * (1 << 20)), draft_tokens)
    name = Path(model_dir).resolve().name
    app = create_app(engine, ChatTemplate(model_dir), name, api_key, session_idle_s=session_idle_s)
    return Guard(app, api_key, MAX_BODY), engine


def parser(p=None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="flashrt serve")
    p.add_argument("model", metavar="MODEL_DIR", help="Hugging Face-format checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: best for device)")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--capsule-budget-mb", type=float, default=1024,
                   help="memory for stored capsules (prompt and turn ends), LRU beyond it; 0: no reuse, every "
                   "prompt prefilled in full (the baseline of bench/serve.py)")
    p.add_argument("--capsule-dir", default=None,
                   help="write each turn's capsule here too; a restarted server reuses them")
    p.add_argument("--capsule-disk-mb", type=float, default=8192,
                   help="disk for --capsule-dir, LRU beyond it (named saves are kept)")
    p.add_argument("--capsule-redis", default=None, metavar="URL",
                   help="share capsules with a fleet through Redis (redis:// or rediss://, AUTH in the URL)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' everywhere")
    p.add_argument("--max-sessions", type=int, default=4, help="model sessions (concurrent requests)")
    p.add_argument("--max-queue", type=int, default=None, help="waiting requests before 429 (default 4x sessions)")
    p.add_argument("--session-idle-s", type=float, default=3600,
                   help="/v1/sessions idle this long expire (and the least recently used idle one "
                   "goes when the table is full)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of the engine (default: torch's)")
    p.add_argument("--draft-tokens", type=int, default=0,
                   help="speculative decoding with the checkpoint's MTP layer, this many drafts a "
                   "round (0: off); output follows the same greedy/sampling rule")
    return p


def main(args) -> int:
    import uvicorn
    app, engine = build(args.model, args.device, args.dtype, args.max_seq_len, args.capsule_budget_mb,
                        args.capsule_dir, args.api_key, args.max_sessions, args.max_queue,
                        threads=args.threads, capsule_redis=args.capsule_redis,
                        capsule_disk_mb=args.capsule_disk_mb, session_idle_s=args.session_idle_s,
                        draft_tokens=args.draft_tokens)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"flashrt serve: listening on {args.host}, not loopback only"
              + ("" if args.api_key else " and WITHOUT an API key"))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        engine.close()     # done by the app's shutdown already, unless uvicorn failed to start
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(parser().parse_args()))

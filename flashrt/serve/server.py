"""Build the engine and app from a checkpoint directory, and run uvicorn."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build(model_dir, options=None, **settings):
    """(asgi app, engine) for model_dir: load the model (options.max_sessions sessions), wire
    the routes, and guard every path (API key when set, body size limit).

    options: a ServeOptions (default: the defaults); settings: keywords of
    ServeOptions.from_settings (device, max_seq_len, max_sessions, draft_tokens, ...) over it."""
    from .app import MAX_BODY, Guard, create_app
    from .engine import Engine
    from .options import ServeOptions
    from .text import ChatTemplate
    if settings or options is None:
        options = ServeOptions.from_settings(options, **settings)
    template = ChatTemplate(model_dir)
    engine = Engine(options, model_dir=model_dir)
    app = create_app(engine, template, Path(model_dir).resolve().name, options)
    return Guard(app, options.api_key, MAX_BODY), engine


def parser(p=None) -> argparse.ArgumentParser:
    """The `flashrt serve` command line: MODEL_DIR and a flag per setting (read once, by
    ServeOptions.from_args)."""
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
    """`flashrt serve`: args is parser()'s namespace, read once into a ServeOptions."""
    import uvicorn

    from .options import ServeOptions
    try:
        options = ServeOptions.from_args(args)
    except ValueError as e:
        print(f"flashrt serve: {e}", file=sys.stderr)
        return 2
    app, engine = build(args.model, options)
    if options.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"flashrt serve: listening on {options.host}, not loopback only"
              + ("" if options.api_key else " and WITHOUT an API key"))
    try:
        uvicorn.run(app, host=options.host, port=options.port, log_level="warning")
    finally:
        engine.close()     # done by the app's shutdown already, unless uvicorn failed to start
    return 0


if __name__ == "__main__":
    sys.exit(main(parser().parse_args()))

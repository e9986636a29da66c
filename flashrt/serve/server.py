"""Build the engine and app from a checkpoint directory, and run uvicorn."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build(model_dir, options=None, **settings):
    """(asgi app, engine) for model_dir: load the model (options.max_sessions sessions), wire
    the routes, and guard every path (guard.py: API keys, or without one Host, Origin and
    content type; body size limit and read timeout).

    options: a ServeOptions (default: the defaults); settings: keywords of
    ServeOptions.from_settings (device, max_seq_len, max_sessions, draft_tokens, ...) over it."""
    from .app import create_app
    from .engine import Engine
    from .guard import MAX_BODY, Guard
    from .options import ServeOptions
    from flashrt.chat import ChatTemplate
    if settings or options is None:
        options = ServeOptions.from_settings(options, **settings)
    template = ChatTemplate(model_dir)
    engine = Engine(options, model_dir=model_dir)
    app = create_app(engine, template, Path(model_dir).resolve().name, options)
    return Guard(app, options.keys, MAX_BODY, host=options.host, allowed_hosts=options.allowed_hosts,
                 read_timeout_s=options.read_timeout_s), engine


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
                   help="share capsules (turns, voices) with a fleet through Redis (redis:// or "
                        "rediss://, AUTH in the URL)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' everywhere (visible in ps: prefer the "
                   "FLASHRT_API_KEY environment variable or --api-keys FILE)")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="API keys, one a line: each key is a tenant with its own sessions, names and "
                   "capsule reuse")
    p.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="without an API key, also answer requests whose Host is NAME (repeatable; '*': "
                   "any). Default: the bound address and localhost names only")
    p.add_argument("--read-timeout-s", type=float, default=30,
                   help="a request's head, and then its body, must arrive within this (408 past it)")
    p.add_argument("--max-sessions-per-key", type=int, default=1024, help="/v1/sessions a key may hold")
    p.add_argument("--session-tokens-per-key", type=int, default=8_000_000,
                   help="tokens a key's sessions and their snapshots may hold together")
    p.add_argument("--max-named-per-key", type=int, default=64, help="sessions a key may save by name")
    p.add_argument("--capsule-named-mb", type=float, default=1024,
                   help="disk for sessions saved by name (all keys); full: a save is a 507")
    p.add_argument("--max-sessions", type=int, default=4, help="model sessions (concurrent requests)")
    p.add_argument("--max-queue", type=int, default=None, help="waiting requests before 429 (default 4x sessions)")
    p.add_argument("--session-idle-s", type=float, default=3600,
                   help="/v1/sessions idle this long expire (and the least recently used idle one "
                   "goes when the table is full)")
    p.add_argument("--response-ttl-s", type=float, default=86400,
                   help="stored /v1/responses and retained ids (and their pinned capsules) are kept this long "
                   "(a retain renews it), or until deleted or released")
    p.add_argument("--response-retain-mb", type=float, default=256,
                   help="memory the capsules of stored responses and retained ids may hold pinned; past it "
                   "they are spilled to --capsule-dir (within --capsule-disk-mb), without one store=true is a 507")
    p.add_argument("--idempotency-max-records", type=int, default=10000,
                   help="answers of requests with an Idempotency-Key kept for replay (each for "
                   "--response-ttl-s), least recently used out first; with --capsule-redis they are "
                   "in Redis, bounded by that TTL")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of the engine (default: torch's)")
    p.add_argument("--draft-tokens", type=int, default=0,
                   help="speculative decoding with the checkpoint's MTP layer, this many drafts a "
                   "round (0: off); output follows the same greedy/sampling rule")
    p.add_argument("--asr-model", default=None, metavar="DIR",
                   help="a nemotron_asr_streaming checkpoint: serve POST /v1/audio/transcriptions and the "
                   "/v1/realtime?intent=transcription WebSocket (server VAD needs silero-vad)")
    p.add_argument("--asr-sessions", type=int, default=2,
                   help="concurrent recognizer streams (forks of one loaded model); a 429 past them")
    p.add_argument("--asr-lookahead", type=int, default=None,
                   help="the recognizer's right context in 80 ms frames (Nemotron: 0, 1, 6 or 13; "
                   "default the model's first)")
    p.add_argument("--max-audio-s", type=float, default=300,
                   help="longest audio file /v1/audio/transcriptions takes (a 400 past it)")
    p.add_argument("--tts-model", default=None, metavar="DIR",
                   help="a pocket_tts checkpoint (codec in DIR/audio_tokenizer): serve POST /v1/audio/speech "
                   "and voices at /v1/audio/voices")
    p.add_argument("--tts-sessions", type=int, default=2,
                   help="concurrent syntheses (forks of one loaded model); a 429 past them")
    p.add_argument("--max-speech-chars", type=int, default=4096,
                   help="longest `input` /v1/audio/speech takes, in characters (a 400 past it)")
    p.add_argument("--max-voice-s", type=float, default=30,
                   help="longest reference WAV POST /v1/audio/voices takes (a 400 past it)")
    p.add_argument("--max-voices-per-key", type=int, default=32, help="voices a key may keep")
    p.add_argument("--voice-budget-mb", type=float, default=512,
                   help="memory for voice capsules, all keys (a 507 when full); with --capsule-dir "
                   "voices are on disk too and survive a restart")
    p.add_argument("--max-voice-sessions", type=int, default=0,
                   help="serve the voice agent at the /v1/voice WebSocket, this many sessions at once (a "
                   "429 past them; each holds a language-model session of --max-seq-len); needs "
                   "--asr-model, --tts-model and silero-vad. 0 (default): off")
    p.add_argument("--voice-idle-s", type=float, default=30,
                   help="a voice session whose client sends nothing this long is closed")
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
              + ("" if options.keys else " and WITHOUT an API key (Host must be a localhost name "
                 "or an --allowed-host)"))
    from .guard import MAX_CONNECTIONS, protocol
    try:
        uvicorn.run(app, host=options.host, port=options.port, log_level="warning",
                    http=protocol(options.read_timeout_s), limit_concurrency=MAX_CONNECTIONS,
                    timeout_keep_alive=5)
    finally:
        engine.close()     # done by the app's shutdown already, unless uvicorn failed to start
    return 0


if __name__ == "__main__":
    sys.exit(main(parser().parse_args()))

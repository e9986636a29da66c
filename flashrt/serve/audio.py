"""Speech routes (--asr-model DIR): POST /v1/audio/transcriptions as OpenAI defines it, and the
Realtime transcription WebSocket /v1/realtime?intent=transcription (realtime.py), over AudioWorker.

AudioWorker (a workers.LeaseWorker): one thread of its own loads the recognizer (flashrt.speech:
a streaming transcriber, and Silero VAD when the silero-vad package is installed), forks
--asr-sessions recognizer sessions over its weights, and runs every call on them in order; routes
lease a session (a 429 when all are busy) and hand it work; a lease ends when its client does,
however it goes.

Transcriptions: a WAV file (audio_wire.decode_wav) is pushed in pieces, then the endpoint fork
flushes what the lookahead still holds. `language`, `prompt` and `temperature` are accepted and
ignored (greedy decoding, no conditioning); verbose_json segments are the VAD's speech spans.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from . import audio_wire
from .wire import APIError
from .workers import Lease, LeasedStream, LeaseWorker, close_on_shutdown, need

# audio per worker call: other sessions' calls interleave between pieces (live sockets wait
# at most one piece), a vanished client is noticed between them, stream=true sends a delta each
PIECE_S = 1.0


@dataclass
class Slot:
    """One recognizer session: a transcriber and (when installed) a VAD, forks over shared weights."""
    transcriber: object
    vad: object


class AudioWorker(LeaseWorker):
    what, flag, busy_code = "recognizer", "--asr-sessions", "asr_sessions_busy"

    def __init__(self, options):
        """Load options.asr_model on a thread of its own, which then runs all recognizer work."""
        self.name = Path(options.asr_model).resolve().name
        self.vad_error: str | None = None
        super().__init__(options, "flashrt-audio")

    def setup(self) -> list:
        import torch

        from flashrt.speech import VoiceActivity, load_transcriber
        o = self.options
        if o.threads:                 # torch's OpenMP thread count is per calling thread
            torch.set_num_threads(o.threads)
        base = load_transcriber(o.asr_model, o.asr_lookahead, device=o.lm.device)
        try:
            vad = VoiceActivity()
        except (ImportError, FileNotFoundError) as e:
            vad, self.vad_error = None, f"server VAD is unavailable on this server ({e})"
        self.transcriber, self.vad = base, vad
        self.sample_rate, self.frame_seconds = base.sample_rate, base.frame_seconds
        self.tokenizer, self.latency_ms = base.tokenizer, base.latency_ms
        return [Slot(base if i == 0 else base.fork(), vad if i == 0 or vad is None else vad.fork())
                for i in range(o.asr_sessions)]

    def reset(self, slot: Slot) -> None:
        slot.transcriber.reset()
        if slot.vad is not None:
            slot.vad.reset()


def add_audio_routes(app: FastAPI, options) -> AudioWorker | None:
    """The speech routes; without options.asr_model they answer 404 saying how to enable them."""
    worker = AudioWorker(options) if options.asr_model else None
    if worker is not None:
        close_on_shutdown(app, worker)

    need_worker = need(worker, "asr_not_enabled", (
        "speech is off on this server: start flashrt serve with --asr-model DIR "
        "(a nemotron_asr_streaming checkpoint) for /v1/audio/transcriptions and "
        "/v1/realtime"))

    def check_model(model: str) -> None:
        if model and model != worker.name:
            raise APIError(404, f"unknown model {audio_wire._echo(model)}: this server transcribes with "
                           f"{worker.name!r}", param="model", code="model_not_found")

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        w = need_worker()
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "multipart/form-data":
            raise APIError(400, "send the audio as multipart/form-data with a `file` part (as OpenAI's "
                           "API does)", code="unsupported_media_type")
        async with request.form(max_files=1, max_fields=64) as form:
            req, upload = audio_wire.parse_form(form)
            check_model(req.model)
            data = await upload.read()
        pcm = await asyncio.to_thread(audio_wire.decode_wav, data, w.sample_rate, options.max_audio_s)
        del data
        lease = w.acquire()
        if req.stream:
            return LeasedStream(_stream(w, lease, pcm), w, lease)
        try:
            return await _transcribe(request, w, lease, pcm, req)
        finally:
            w.release(lease)

    from .realtime import add_realtime_route
    add_realtime_route(app, need_worker, check_model)
    return worker


async def _push(worker: AudioWorker, lease: Lease, pcm):
    """Transcripts of pcm pushed piece by piece, then of the endpoint flush (final=True)."""
    step = int(PIECE_S * worker.sample_rate)
    for i in range(0, len(pcm), step):
        piece = pcm[i: i + step]
        yield await worker.run(lease, lambda s, p=piece: s.transcriber.push(p, worker.sample_rate))
    yield await worker.run(lease, lambda s: s.transcriber.endpoint())


async def _transcribe(request, worker, lease, pcm, req):
    ids, times, texts, before = [], [], [], None
    async for r in _push(worker, lease, pcm):
        texts.append(audio_wire.render(worker.tokenizer, r.tokens, before))
        ids += r.tokens
        times += r.times
        before = ids[-1] if ids else None
        if not r.final and await request.is_disconnected():
            raise APIError(499, "the client went away", code="client_gone")
    text, duration = "".join(texts), len(pcm) / worker.sample_rate
    if req.response_format == "text":
        return PlainTextResponse(text)
    if req.response_format == "json":
        return {"text": text, "usage": audio_wire.duration_usage(duration)}
    spans, no_speech = await worker.run(lease, lambda s: _speech_spans(s.vad, pcm, worker.sample_rate))
    segs = audio_wire.segments(worker.tokenizer, ids, times, spans, duration, no_speech)
    if req.response_format in ("srt", "vtt"):
        return PlainTextResponse(audio_wire.subtitles(segs, req.response_format))
    return {"task": "transcribe", "language": req.language or "unknown", "duration": round(duration, 3),
            "text": text, "segments": segs, "usage": audio_wire.duration_usage(duration)}


def _speech_spans(vad, pcm, rate):
    """(VAD speech spans in seconds, each span's no-speech probability), or (None, None) without a VAD."""
    if vad is None:
        return None, None
    res = vad.push(pcm, rate)
    probs = res.probs
    events = list(res.events) + list(vad.finish().events)      # finish() resets the VAD
    spans, chunk = [], vad.chunk_samples
    for start, end in zip(events[::2], events[1::2]):
        spans.append((start.seconds, end.seconds))
    no_speech = []
    for s, e in spans:
        p = probs[int(s * rate) // chunk: max(int(s * rate) // chunk + 1, int(e * rate) // chunk)]
        no_speech.append(float(1 - p.mean()) if p.numel() else 1.0)
    return spans, no_speech


async def _stream(worker, lease, pcm):
    """SSE: transcript.text.delta per piece with text, then transcript.text.done."""
    texts, ids, frames, before = [], [], 0, None
    try:
        async for r in _push(worker, lease, pcm):
            t = audio_wire.render(worker.tokenizer, r.tokens, before)
            ids += r.tokens
            frames = max(frames, r.end_frame)
            before = ids[-1] if ids else None
            if t:
                texts.append(t)
                yield f"data: {json.dumps({'type': 'transcript.text.delta', 'delta': t})}\n\n"
        done = {"type": "transcript.text.done", "text": "".join(texts),
                "usage": audio_wire.token_usage(frames, len(ids))}
        yield f"data: {json.dumps(done)}\n\n"
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        worker.release(lease)


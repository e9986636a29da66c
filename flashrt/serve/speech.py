"""Speech out (--tts-model DIR, a pocket_tts checkpoint): POST /v1/audio/speech as OpenAI defines
it, and voices as an extension (POST /v1/audio/voices, GET /v1/audio/voices, DELETE
/v1/audio/voices/{name}), over SpeechWorker.

SpeechWorker (a workers.LeaseWorker): one thread of its own loads the synthesizer
(flashrt.speech.load_synthesizer), forks --tts-sessions synthesizers over its weights and runs
every call on them; a request leases one (a 429 when all are busy) for as long as its client
reads, and a client that goes away frees it at the next frame.

Speech: `input` is tokenized with the checkpoint's tokenizer (random-weight checkpoints: UTF-8
bytes) and cut into chunks as transformers' split_text cuts it (sentences grouped up to 50
tokens; a run of 50 tokens with no sentence or clause mark is cut there). Every chunk starts from
the voice capsule, one noise stream from `seed` through them all (extension; default 0, so a
request repeated is answered with the same audio). The body is streamed a frame (80 ms at the
released shape) at a time as the model makes it: stream_format "audio" (pcm, or wav whose header
leaves the sizes open) or "sse" (speech.audio.delta events with base64 audio, then
speech.audio.done with usage: text tokens in, frames out). `speed` (0.25 to 4.0) other than 1.0
time-stretches the stream keeping its pitch (stretch.py, WSOLA; 1.0 sends the model's samples
as they are). Formats that need an encoder (mp3, opus, aac, flac) are refused; response_format
defaults to wav (OpenAI's default, mp3, needs one).

Voices: a voice is a voice capsule (the reference WAV's prompt prefilled once) kept in a
VoiceBook (voices.py: per API key; with --capsule-dir on disk too, so it survives a restart;
with --capsule-redis in Redis, so every server of a fleet has it).
The checkpoint's voices are predefined for every key: each file of its voices/ folder
(NAME.safetensors holding one (frames, latent_dim) tensor of voice latents, or NAME.wav),
`default` being the first by name, or no voice prompt where the folder is absent.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import FastAPI, Request

from flashrt.capsules import CapsuleError

from . import audio_wire, speech_wire
from .guard import tenant_of
from .speech_wire import DEFAULT_VOICE
from .stretch import TimeStretch
from .voices import VoiceBook
from .wire import APIError, _echo
from .workers import LeasedStream, LeaseWorker, close_on_shutdown, need

CHUNK_TOKENS = 50          # transformers' split_text max_tokens
_SENTENCE_MARKS, _CLAUSE_MARKS = (".", "!", "...", "?"), (",", ";", ":")


class Utterance:
    """One request's speech on its leased synthesizer, a frame per call (worker thread only):
    the chunks said in turn, each from the voice capsule; stretch: `speed`'s TimeStretch."""

    def __init__(self, chunks: list, voice, seed: int, stretch: TimeStretch | None = None):
        self.chunks, self.voice, self.seed, self.stretch = chunks, voice, seed, stretch
        self.said, self.frames, self._frames = 0, 0, None

    def __call__(self, synth) -> bytes | None:
        """The next frame as 16-bit PCM (stretched: what it completes, maybe nothing), or None
        after the last."""
        if self._frames is None and self.said == 0:
            synth.reply(self.voice, seed=self.seed)
        while True:
            if self._frames is not None:
                pcm = next(self._frames, None)
                if pcm is not None:
                    self.frames += 1
                    x = pcm.cpu().numpy()
                    return speech_wire.s16le(x if self.stretch is None else self.stretch.push(x))
            if self.said == len(self.chunks):
                rest, self.stretch = self.stretch, None
                return None if rest is None else speech_wire.s16le(rest.finish())
            self._frames = synth.say(self.chunks[self.said])
            self.said += 1


class SpeechWorker(LeaseWorker):
    what, flag, busy_code = "synthesizer", "--tts-sessions", "tts_sessions_busy"

    def __init__(self, options):
        """Load options.tts_model on a thread of its own, which then runs all synthesis."""
        self.name = Path(options.tts_model).resolve().name
        self.predefined: dict = {}           # the checkpoint's voices: name -> capsule (or None)
        self.fingerprint: dict | None = None   # the synthesizer's, which its voices are stored under
        super().__init__(options, "flashrt-speech")

    def setup(self) -> list:
        import torch

        from flashrt.speech import SentenceRule, load_synthesizer
        o = self.options
        if o.threads:                 # torch's OpenMP thread count is per calling thread
            torch.set_num_threads(o.threads)
        base = load_synthesizer(o.tts_model, device=o.lm.device, dtype=o.lm.dtype)
        tok = self.tokenizer = base.tokenizer
        self.sample_rate, self.vocab = base.sample_rate, base.net.config.vocab_size
        self.fingerprint = base.fingerprint
        self.rule = SentenceRule(_marks(tok, _SENTENCE_MARKS), _marks(tok, _CLAUSE_MARKS), CHUNK_TOKENS,
                                 tok.decode)
        # positions a voice may take: a chunk and its frame budget must fit after it
        self.voice_room = base.session.max_seq_len - CHUNK_TOKENS - base.budget(CHUNK_TOKENS) - 1
        self.predefined = self._shipped_voices(base)
        return [base] + [base.fork() for _ in range(o.tts_sessions - 1)]

    def _shipped_voices(self, synth) -> dict:
        import torch
        from safetensors.torch import load_file
        folder, out = Path(self.options.tts_model) / "voices", {}
        files = sorted(folder.iterdir()) if folder.is_dir() else []
        for f in files:
            if f.suffix not in (".safetensors", ".wav") or not speech_wire.VOICE_NAME.match(f.stem):
                continue
            if f.suffix == ".safetensors":
                tensors = list(load_file(str(f)).values())
                if len(tensors) != 1:
                    raise ValueError(f"{f}: a voice file holds one tensor of latents, found {len(tensors)}")
                cap = synth.make_voice(latents=tensors[0].float())
            else:
                pcm = audio_wire.decode_wav(f.read_bytes(), synth.sample_rate, self.options.max_voice_s,
                                            "--max-voice-s")
                cap = synth.make_voice(torch.from_numpy(pcm))
            if (why := self.too_long(cap)) is not None:
                raise ValueError(f"{f}: {why}")
            out[f.stem] = cap
        if DEFAULT_VOICE not in out:
            out = {DEFAULT_VOICE: next(iter(out.values()), None), **out}
        return out

    def too_long(self, cap) -> str | None:
        """Why a voice capsule leaves no room to speak after it, or None."""
        if cap.position <= self.voice_room:
            return None
        return (f"its voice prompt takes {cap.position} positions; this model leaves room for "
                f"{self.voice_room} (shorten the reference audio)")

    def chunks(self, text: str) -> list:
        """Text -> chunks of token ids (split_text's, runs over CHUNK_TOKENS cut); thread-safe."""
        from flashrt.speech import split_sentences
        ids = self.tokenizer.encode(text)
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if not ids or bad is not None:
            raise APIError(400, "input has no text this model's tokenizer can speak", param="input",
                           code="empty_input")
        return [c[i: i + CHUNK_TOKENS] for c in split_sentences(ids, self.rule)
                for i in range(0, len(c), CHUNK_TOKENS)]


def _marks(tok, marks) -> frozenset:
    """Token ids of punctuation marks as they follow a word (what split_text cuts after)."""
    out = set()
    for m in marks:
        ids = tok.encode("a" + m)
        if ids and tok.decode(ids[-1:]) == m:
            out.add(ids[-1])
    return frozenset(out)


def add_speech_routes(app: FastAPI, options) -> SpeechWorker | None:
    """The speech-out routes; without options.tts_model they answer 404 saying how to enable them."""
    worker = SpeechWorker(options) if options.tts_model else None
    book = None
    if worker is not None:
        close_on_shutdown(app, worker)
        shared = None
        if options.capsule_redis:          # voices shared with the fleet (voices.py)
            from flashrt.capsules.redis_tier import RedisTier
            shared = RedisTier.from_url(options.capsule_redis)
        book = VoiceBook(options.voice_bytes, options.max_voices_per_key, options.capsule_dir,
                         options.lm.device, shared, worker.fingerprint)
        close_on_shutdown(app, book)
        worker.book = book           # the voice session (voice_session.py) speaks with them too

    need_worker = need(worker, "tts_not_enabled", (
        "speech out is off on this server: start flashrt serve with --tts-model "
        "DIR (a pocket_tts checkpoint) for /v1/audio/speech and /v1/audio/voices"))

    async def voice_of(tenant: str, name: str):
        if name in worker.predefined:
            return worker.predefined[name]
        try:
            return await asyncio.to_thread(book.get, tenant, name)
        except KeyError:
            raise APIError(404, f"unknown voice {_echo(name)}: GET /v1/audio/voices lists them",
                           param="voice", code="voice_not_found") from None
        except CapsuleError as e:
            raise APIError(409, f"voice {name!r} could not be loaded: {e}", param="voice",
                           code="voice_damaged") from None

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        w = need_worker()
        req = speech_wire.parse_speech(await request.body(), options.max_speech_chars)
        if req.model != w.name:
            raise APIError(404, f"unknown model {_echo(req.model)}: this server speaks with {w.name!r}",
                           param="model", code="model_not_found")
        voice = await voice_of(tenant_of(request), req.voice_name)
        chunks = await asyncio.to_thread(w.chunks, req.input)
        stretch = TimeStretch(req.speed, w.sample_rate) if req.speed != 1.0 else None
        utt, lease = Utterance(chunks, voice, req.seed, stretch), w.acquire()
        try:                          # the first frame before the answer: a refusal is still a status
            first = await w.run(lease, utt)
        except BaseException as e:
            w.release(lease)
            if isinstance(e, CapsuleError):
                raise APIError(409, f"voice {req.voice_name!r} does not fit this model: {e}",
                               param="voice", code="voice_mismatch") from None
            raise
        head = speech_wire.wav_header(w.sample_rate) if req.response_format == "wav" else b""
        n_ids = sum(len(c) for c in chunks)
        if req.stream_format == "sse":
            return LeasedStream(_sse(w, lease, utt, head + (first or b""), n_ids), w, lease)
        return LeasedStream(_audio(w, lease, utt, head + (first or b"")), w, lease,
                            media_type=speech_wire.MEDIA[req.response_format])

    @app.get("/v1/audio/voices")
    async def list_voices(request: Request):
        w = need_worker()
        tenant = tenant_of(request)
        cards = [speech_wire.voice_card(n, True) for n in w.predefined]
        cards += [speech_wire.voice_card(n, False) for n in await asyncio.to_thread(book.names, tenant)]
        return {"object": "list", "data": cards}

    @app.post("/v1/audio/voices")
    async def create_voice(request: Request):
        import torch
        w = need_worker()
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media != "multipart/form-data":
            raise APIError(400, "send the voice as multipart/form-data: a `name` field and a `file` "
                           "part (a WAV)", code="unsupported_media_type")
        async with request.form(max_files=1, max_fields=8) as form:
            name, upload = speech_wire.parse_voice_form(form)
            data = await upload.read()
        tenant = tenant_of(request)
        if name in w.predefined or (tenant, name) in book:
            raise APIError(409, f"voice {name!r} exists: delete it first (predefined voices cannot be)",
                           param="name", code="voice_exists")
        pcm = await asyncio.to_thread(audio_wire.decode_wav, data, w.sample_rate, options.max_voice_s,
                                      "--max-voice-s")
        del data
        lease = w.acquire()
        try:
            cap = await w.run(lease, lambda synth: synth.make_voice(torch.from_numpy(pcm)))
        finally:
            w.release(lease)
        if (why := w.too_long(cap)) is not None:
            raise APIError(400, f"the reference audio is too long: {why}", param="file", code="audio_too_long")
        await asyncio.to_thread(book.put, tenant, name, cap)
        return speech_wire.voice_card(name, False)

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(name: str, request: Request):
        need_worker()
        if name in worker.predefined:
            raise APIError(400, f"voice {name!r} is the checkpoint's: it cannot be deleted", param="name",
                           code="voice_predefined")
        speech_wire.check_voice_name(name, "name", known_default=True)
        if not await asyncio.to_thread(book.drop, tenant_of(request), name):
            raise APIError(404, f"unknown voice {_echo(name)}", param="name", code="voice_not_found")
        return {"id": name, "object": "audio.voice.deleted", "deleted": True}

    return worker


async def _audio(worker, lease, utt: Utterance, first: bytes):
    """The audio body: a frame's bytes at a time, as the worker makes them."""
    try:
        chunk = first
        while chunk is not None:
            if chunk:
                yield chunk
            chunk = await worker.run(lease, utt)
    finally:
        worker.release(lease)


async def _sse(worker, lease, utt: Utterance, first: bytes, text_tokens: int):
    """speech.audio.delta per frame, then speech.audio.done with usage (an error: its event)."""
    try:
        chunk = first
        while chunk is not None:
            if chunk:
                yield speech_wire.sse_delta(chunk)
            chunk = await worker.run(lease, utt)
        yield speech_wire.sse_done(text_tokens, utt.frames)
    except APIError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        worker.release(lease)


"""The voice agent behind the server: a WebSocket at /v1/voice (--max-voice-sessions N, with
--asr-model and --tts-model), microphone PCM in, the agent's speech and transcript events out;
GET /v1/voice/sessions counts the sessions held.

Each connection leases a voice session (a 429 at the handshake when all N are held): a
flashrt.voice.VoiceAgent on sessions of the server's own models (a language-model session over
the engine's weights, a recognizer and VAD forked from /v1/realtime's, a synthesizer forked
from /v1/audio/speech's). Every agent call runs on one voice worker thread (VoiceWorker), half
a second of audio at a time, so sessions interleave and the event loop never waits on a model.
A task per connection reads the client's messages as they come (up to INBOX ahead of the
worker), so a client that closes or vanishes frees its session at once, backlog or not; one
that sends nothing for --voice-idle-s while its session waits for input is closed.

Protocol (OpenAI Realtime names where one fits):
  1. server: session.created {session: the defaults}.
  2. client, first: session.update {session: {audio: {input: {format: {type: "audio/pcm",
     rate: 16000}}, output: {voice: NAME}}, instructions: system prompt, output_audio_transport:
     "base64" | "binary", options: {max_reply_tokens, temperature, top_k, top_p, seed,
     tts_temperature, tts_eos_threshold, tts_max_frames, sentence_max_tokens, endpointing_ms,
     lead_ms, listen_lag_ms}}} (every field optional; the beta's flat input_audio_format and voice are read
     too; other fields are ignored). The voice is one of GET /v1/audio/voices (the key's own
     included). Anything else first, a wrong rate or format, an unknown voice or a bad option:
     an error event naming it, then the socket is closed (1008). Options are fixed from here.
  3. server: session.updated {session}; client: the microphone, without pause (silence too:
     the session runs on the input's clock), as binary frames of PCM16 LE mono at 16 kHz or
     input_audio_buffer.append {audio: base64 of the same}. Optionally
     output_audio_buffer.played {samples}: reply audio played so far, counted from the reply's
     first frame at the output rate; from the first report on it replaces the real-time
     estimate that decides what a barge-in keeps.
  4. server, as the audio causes them: input_audio_buffer.speech_started / speech_stopped
     {item_id, audio_start_ms / audio_end_ms}; conversation.item.input_audio_transcription.delta
     {item_id, delta} and .completed {item_id, transcript, branch: new | kept | restarted |
     ignored}; response.created {response: {id}}; response.output_audio_transcript.delta
     {response_id, delta}; response.output_audio.delta {response_id, frame, delta: base64
     PCM16 at session.audio.output.format.rate} (binary transport: the PCM as a binary frame
     instead); response.done {response: {id, status: completed | cancelled, output_text,
     timings: ms after the end of the user's speech per stage, prefill_tokens,
     context_tokens, endpoint, branch}}; on a barge-in conversation.item.truncated {item_id,
     audio_end_ms, played_samples, transcript: the reply text the user heard, which is all
     the conversation keeps}.
  Errors: error {error: {message, type, param, code, event_id}}. A frame past MAX_FRAME
  bytes, a torn sample, bad JSON or an unknown event type is answered so and dropped; the
  session goes on. An agent failure (a turn past the context) and idling end it (1011, 1008).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect

from flashrt.capsules import CapsuleError
from flashrt.voice import VoiceAgent, VoiceOptions

from . import speech_wire, voice_wire
from .audio_wire import error_event, event, json_event, new_id
from .guard import tenant_of
from .realtime import deny
from .wire import APIError, _echo
from .workers import LeaseWorker, close_on_shutdown, need

PIECE_S = 0.5            # audio per worker call: other sessions' calls interleave between pieces
MAX_FRAME = 1 << 19      # bytes a client message may hold (16 s of 16 kHz PCM16 in a binary frame)
INBOX = 16               # client messages read ahead of the worker (then TCP holds the client back)


@dataclass
class Slot:
    """One voice session's models: sessions over the server's loaded weights."""
    lm: object
    transcriber: object
    vad: object
    synth: object


class VoiceWorker(LeaseWorker):
    what, flag, busy_code = "voice", "--max-voice-sessions", "voice_sessions_busy"

    def __init__(self, options, engine, audio, speech):
        """Make options.max_voice_sessions slots on a thread of its own, which then runs every
        voice agent's calls. audio, speech: the started AudioWorker and SpeechWorker."""
        if audio.vad is None:
            raise ValueError(f"--max-voice-sessions: the voice agent needs the VAD: {audio.vad_error}")
        self.engine, self.audio, self.speech = engine, audio, speech
        self.model_name = Path(engine.model_dir).resolve().name
        self.sample_rate, self.out_rate = audio.sample_rate, speech.sample_rate
        super().__init__(options, "flashrt-voice")

    def setup(self) -> list:
        import torch
        o = self.options
        if o.threads:                 # torch's OpenMP thread count is per calling thread
            torch.set_num_threads(o.threads)
        slots = []
        for _ in range(o.max_voice_sessions):
            tr = self.audio.transcriber.fork()
            if tr.tokenizer is None:          # a checkpoint without one: ids as text
                tr.tokenizer = voice_wire.TokenIds()
            slots.append(Slot(self.engine.new_session(), tr, self.audio.vad.fork(),
                              self.speech.slots[0].fork()))
        return slots

    @property
    def held(self) -> int:
        with self._lock:
            return len(self.slots) - len(self._free)


class VoiceCall:
    """One connection's voice agent and its wire ids; start(), push() and played() run on the
    voice worker, on the connection's leased slot."""

    def __init__(self, worker: VoiceWorker, settings: voice_wire.VoiceSettings, voice):
        self.settings, self.voice, self.agent = settings, voice, None
        self.wire = voice_wire.Transcript(worker.sample_rate, worker.out_rate, settings.transport)

    def start(self, slot: Slot) -> None:
        self.agent = VoiceAgent(slot.lm, slot.transcriber, slot.vad, slot.synth, self.voice,
                                self.settings.options)

    def push(self, slot: Slot, pcm) -> list:
        return self.wire.events(self.agent.push(pcm, self.agent.sample_rate))

    def played(self, slot: Slot, samples: int) -> list:
        self.agent.played(samples)
        return []


def session_info(w: VoiceWorker, sid: str, settings: voice_wire.VoiceSettings) -> dict:
    rules, o = w.audio.vad.rules, settings.options
    return {"id": sid, "object": "realtime.session", "type": "realtime", "model": w.model_name,
            "instructions": o.system_prompt, "voice": settings.voice,
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": w.sample_rate},
                                "transcription": {"model": w.audio.name},
                                "turn_detection": {"type": "server_vad", "threshold": rules.threshold,
                                                   "prefix_padding_ms": rules.speech_pad_ms,
                                                   "silence_duration_ms": rules.min_silence_duration_ms}},
                      "output": {"format": {"type": "audio/pcm", "rate": w.out_rate}, "voice": settings.voice,
                                 "model": w.speech.name}},
            "output_audio_transport": settings.transport,
            "options": {k: getattr(o, k) for k in voice_wire.TUNABLE}}


def add_voice_routes(app: FastAPI, options, engine, audio, speech) -> VoiceWorker | None:
    """/v1/voice and /v1/voice/sessions; without --max-voice-sessions they answer 404 saying
    how to enable them. audio, speech: the speech workers (None where off)."""
    worker = VoiceWorker(options, engine, audio, speech) if options.max_voice_sessions else None
    if worker is not None:
        close_on_shutdown(app, worker)

    need_worker = need(worker, "voice_not_enabled", (
        "the voice agent is off on this server: start flashrt serve with "
        "--max-voice-sessions N, --asr-model DIR and --tts-model DIR for /v1/voice"))

    @app.get("/v1/voice/sessions")
    async def voice_sessions():
        w = need_worker()
        return {"object": "voice.sessions", "held": w.held, "max_sessions": len(w.slots)}

    @app.websocket("/v1/voice")
    async def voice(ws: WebSocket):
        try:
            w = need_worker()
            lease = w.acquire()
        except APIError as e:
            return await deny(e)(ws)
        try:
            await ws.accept()
            await _serve(ws, w, lease, tenant_of(ws))
        except (WebSocketDisconnect, OSError):    # gone: the session is freed below
            pass
        finally:
            w.release(lease)
    return worker


class _Closed(Exception):
    """The session ends: its error event is sent, then the socket is closed with this code."""

    def __init__(self, err: APIError, code: int):
        super().__init__(err.message)
        self.err, self.code = err, code


class _Inbox:
    """The client's messages, read by a task of their own as they arrive (at most INBOX ahead of
    the worker), so a client that leaves is known at once, whatever backlog it left behind."""

    def __init__(self, ws: WebSocket):
        self.queue: asyncio.Queue = asyncio.Queue(INBOX)
        self.gone = asyncio.Event()
        self.task = asyncio.create_task(self._read(ws))

    async def _read(self, ws: WebSocket) -> None:
        try:
            while (msg := await ws.receive())["type"] != "websocket.disconnect":
                await self.queue.put(msg)
        except (WebSocketDisconnect, OSError):
            pass
        finally:
            self.gone.set()
            with contextlib.suppress(asyncio.QueueFull):
                self.queue.put_nowait(None)      # wakes next(); a full queue is not waited on

    async def next(self, idle_s: float):
        """The next message, or None once the client is gone (what it sent before is dropped);
        _Closed when none comes for idle_s; a 400 for one past MAX_FRAME."""
        if self.gone.is_set():
            return None
        try:
            msg = await asyncio.wait_for(self.queue.get(), idle_s)
        except asyncio.TimeoutError:
            raise _Closed(APIError(408, f"no message for {idle_s:g} s (--voice-idle-s): the session is "
                                   "closed", code="idle_timeout"), 1008) from None
        if msg is None or self.gone.is_set():
            return None
        size = len(msg.get("bytes") or b"") + len(msg.get("text") or "")
        if size > MAX_FRAME:
            raise APIError(400, f"a message of {size}+ bytes exceeds the limit of {MAX_FRAME} bytes: send "
                           "the audio in smaller frames", code="frame_too_large")
        return msg


def _json(msg) -> dict:
    return json_event(msg, "the first message must be the session.update JSON event, got a binary frame",
                      "session_update_expected")


async def _voice(w: VoiceWorker, tenant: str, name: str):
    """The voice capsule named `name` (the checkpoint's, or the key's own), or a 400/404."""
    if name in w.speech.predefined:
        cap = w.speech.predefined[name]
        if cap is None:
            raise APIError(400, f"voice {name!r} is no voice prompt (the TTS checkpoint has no voices/ "
                           "folder): make one with POST /v1/audio/voices and name it in "
                           "session.audio.output.voice", param="session.audio.output.voice",
                           code="voice_unavailable")
        return cap
    try:
        return await asyncio.to_thread(w.speech.book.get, tenant, name)
    except KeyError:
        raise APIError(404, f"unknown voice {_echo(name)}: GET /v1/audio/voices lists them",
                       param="session.audio.output.voice", code="voice_not_found") from None
    except CapsuleError as e:
        raise APIError(409, f"voice {name!r} could not be loaded: {e}", param="session.audio.output.voice",
                       code="voice_damaged") from None


async def _start(inbox: _Inbox, w: VoiceWorker, lease, tenant: str, idle_s: float) -> VoiceCall | None:
    """The first message -> the started call (None: the client left first); _Closed on a
    bad one."""
    try:
        msg = await inbox.next(idle_s)
        if msg is None:
            return None
        settings = voice_wire.parse_update(_json(msg), w.sample_rate, w.engine.max_seq_len)
        call = VoiceCall(w, settings, await _voice(w, tenant, settings.voice))
        try:
            await w.run(lease, call.start)
        except (ValueError, TypeError) as e:     # the agent refused its parts
            raise APIError(400, f"the voice agent could not start: {e}", code="voice_session_failed") from None
    except APIError as e:
        raise _Closed(e, 1008) from None
    return call


async def _serve(ws: WebSocket, w: VoiceWorker, lease, tenant: str) -> None:
    sid, idle_s, inbox = new_id("sess"), w.options.voice_idle_s, _Inbox(ws)

    async def send(items):
        for x in items:
            if inbox.gone.is_set():          # nobody to send to: the route frees the session
                raise WebSocketDisconnect(1006)
            await (ws.send_bytes(x) if isinstance(x, bytes) else ws.send_text(json.dumps(x)))
    try:
        defaults = voice_wire.VoiceSettings(speech_wire.DEFAULT_VOICE, VoiceOptions())
        await send([event("session.created", session=session_info(w, sid, defaults))])
        call = await _start(inbox, w, lease, tenant, idle_s)
        if call is None:
            return
        await send([event("session.updated", session=session_info(w, sid, call.settings))])
        while True:
            eid = None
            try:
                msg = await inbox.next(idle_s)
                if msg is None:
                    return
                ev = None if msg.get("bytes") is not None else _json(msg)
                eid = ev.get("event_id") if ev is not None else None
                jobs = _jobs(msg, ev, w, call)
            except APIError as e:            # refused and dropped: the session goes on
                await send([error_event(e, eid if isinstance(eid, str) else None)])
                continue
            for job in jobs:
                if inbox.gone.is_set():
                    return
                await send(await _run(w, lease, job))
    except _Closed as c:
        await send([error_event(c.err)])
        await ws.close(code=c.code, reason=c.err.message[:120])
    finally:
        inbox.task.cancel()


async def _run(w: VoiceWorker, lease, job) -> list:
    """A call on the worker; a failure ends the session (the agent's state is unknown then)."""
    try:
        return await w.run(lease, job)
    except Exception as e:                 # noqa: BLE001 (said to the client, then closed)
        err = e if isinstance(e, APIError) else APIError(
            500, f"the voice session failed: {type(e).__name__}: {e}", type="server_error",
            code="voice_session_failed")
        raise _Closed(err, 1011) from None


def _jobs(msg, ev: dict | None, w: VoiceWorker, call: VoiceCall) -> list:
    """A client message (ev: its JSON event, None for a binary frame) -> worker calls; a 400
    for what is refused."""
    if ev is None:
        pcm = voice_wire.audio_bytes(msg["bytes"], w.sample_rate)
    else:
        kind = ev.get("type")
        if kind == "input_audio_buffer.append":
            pcm = voice_wire.audio_base64(ev, w.sample_rate)
        elif kind == "output_audio_buffer.played":
            n = ev.get("samples")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise APIError(400, f"output_audio_buffer.played needs `samples`: an integer >= 0, got "
                               f"{_echo(n)}", param="samples", code="invalid_event")
            return [lambda s: call.played(s, n)]
        elif kind == "session.update":
            raise APIError(400, "the voice session's settings are fixed by its first session.update: "
                           "open a new session to change them", param="type", code="session_fixed")
        else:
            raise APIError(400, f"unsupported event type {_echo(kind)}: the voice session takes "
                           "input_audio_buffer.append, output_audio_buffer.played and binary PCM16 frames",
                           param="type", code="invalid_event_type")
    step = int(PIECE_S * w.sample_rate)
    return [lambda s, p=pcm[i: i + step]: call.push(s, p) for i in range(0, len(pcm), step)]

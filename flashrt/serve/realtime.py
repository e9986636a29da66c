"""GET /v1/realtime?intent=transcription: the subset of OpenAI's Realtime transcription events a
live-audio client needs, over one leased recognizer session (audio.AudioWorker).

Client events: input_audio_buffer.append {audio: base64 PCM16 LE mono at 16 kHz},
input_audio_buffer.commit, input_audio_buffer.clear, session.update (or
transcription_session.update): turn_detection {type: server_vad, threshold, silence_duration_ms,
prefix_padding_ms} or null (then the client commits each utterance); other fields are ignored.
Server events: session.created / updated, input_audio_buffer.speech_started / speech_stopped /
committed / cleared, conversation.item.input_audio_transcription.delta / completed, error.

All audio runs through the live stream; an utterance (item) gets the tokens of its frames. At
speech_stopped (or a commit) the endpoint fork flushes the lookahead for the final text at once,
and the live stream goes on untouched: its later tokens for frames the flush covered are dropped.
"""
from __future__ import annotations

import base64
import binascii
import json

import numpy as np
from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from . import audio_wire
from .audio_wire import error_event, event, json_event, new_id, render
from .guard import error_response
from .wire import APIError

APPEND_PIECE_S = 1.0     # an append is run in pieces this long: other sessions' calls interleave
PENDING_S = 2.0          # tokens outside speech are kept this long for a start the VAD confirms late
_ABSENT = object()


class LiveStream:
    """One connection's transcription state. Its methods run on the audio worker (they step the
    leased slot); each returns the server events it produced, in order."""

    def __init__(self, worker, session_id: str):
        self.id, self.model, self.rate = session_id, worker.name, worker.sample_rate
        self.frame_samples = round(worker.frame_seconds * worker.sample_rate)
        self.tokenizer = worker.tokenizer
        self.vad_on = worker.vad is not None
        self.rules = worker.vad.rules if worker.vad is not None else None
        self._vad = None            # None: the slot's VAD; a fork of it once rules change
        self.vad_base = 0           # stream sample at which the VAD stream started
        self.item, self.prev_item = None, None
        self.item_start, self.item_ids, self.item_texts = 0, [], []
        self.pending: list = []     # (token, frame) decoded outside any utterance (server VAD)
        self.floor = 0              # frames below this were transcribed by an endpoint flush
        self.fed = 0                # samples pushed since the last reset
        self.offset_ms = 0.0        # session time of stream sample 0 (clear restarts the stream)

    def info(self) -> dict:
        r, fmt = self.rules, {"type": "audio/pcm", "rate": self.rate}
        td = None if not self.vad_on else {"type": "server_vad", "threshold": r.threshold,
                                           "prefix_padding_ms": r.speech_pad_ms,
                                           "silence_duration_ms": r.min_silence_duration_ms}
        return {"id": self.id, "object": "realtime.transcription_session", "type": "transcription",
                "input_audio_format": "pcm16", "input_audio_transcription": {"model": self.model},
                "turn_detection": td,
                "audio": {"input": {"format": fmt, "transcription": {"model": self.model}, "turn_detection": td}}}

    def _ms(self, sample: int) -> int:
        return int(self.offset_ms + sample * 1000 / self.rate)

    def _vad_of(self, slot):
        return self._vad if self._vad is not None else slot.vad

    # ---- client events (on the worker) -----------------------------------------------------------
    def append(self, slot, pcm: np.ndarray) -> list:
        from flashrt.speech import SpeechStart
        out, tr, fed0 = [], slot.transcriber, self.fed
        if not self.vad_on and self.item is None and len(pcm):
            self._open(out, fed0, announce=False)
        vad = self._vad_of(slot) if self.vad_on else None
        cursor = 0
        for ev in vad.push(pcm, self.rate).events if vad is not None else ():
            # push the recognizer up to the chunk that decided the event: an end flushes there
            cut = min(max(self.vad_base + (ev.chunk + 1) * vad.chunk_samples - fed0, cursor), len(pcm))
            if cut > cursor:
                self._live(out, tr.push(pcm[cursor:cut], self.rate))
            cursor = cut
            if isinstance(ev, SpeechStart):
                self._start(out, self.vad_base + ev.sample)
            else:
                out.append(event("input_audio_buffer.speech_stopped", item_id=self.item,
                                 audio_end_ms=self._ms(self.vad_base + ev.sample)))
                self._commit(out, tr)
        if cursor < len(pcm):
            self._live(out, tr.push(pcm[cursor:], self.rate))
        self.fed += len(pcm)
        keep = (self.fed - PENDING_S * self.rate) / self.frame_samples
        self.pending = [p for p in self.pending if p[1] >= keep]
        return out

    def commit(self, slot) -> list:
        if self.item is None:
            raise APIError(400, "nothing to commit: " + ("no speech since the last commit" if self.vad_on
                           else "no audio appended since the last commit"),
                           code="input_audio_buffer_commit_empty")
        out = []
        self._commit(out, slot.transcriber)
        if self.vad_on and self._vad_of(slot).speaking:     # the speech goes on: a new utterance
            self._open(out, self.fed, announce=False)
        return out

    def clear(self, slot) -> list:
        slot.transcriber.reset()
        if slot.vad is not None:
            self._vad_of(slot).reset()
        self.offset_ms += self.fed * 1000 / self.rate
        self.fed = self.floor = self.vad_base = 0
        self.item, self.pending = None, []
        return [event("input_audio_buffer.cleared")]

    def update(self, slot, session, vad_error: str | None, reply: str) -> list:
        """session.update: the turn detection (server VAD rules, or none) and checked formats."""
        from flashrt.speech import VadRules
        td = _turn_detection(session, self.rate)
        if td is None:
            self.vad_on = False
        elif td is not _ABSENT:
            if slot.vad is None:
                raise APIError(400, f"{vad_error}: turn_detection must be null (commit each utterance)",
                               param="session.turn_detection", code="vad_unavailable")
            r = self.rules or slot.vad.rules
            try:
                silence = float(td.get("silence_duration_ms", r.min_silence_duration_ms))
                pad = float(td.get("prefix_padding_ms", r.speech_pad_ms))
                rules = VadRules(threshold=float(td.get("threshold", r.threshold)), speech_pad_ms=pad,
                                 min_silence_duration_ms=silence, min_speech_duration_ms=r.min_speech_duration_ms)
            except (TypeError, ValueError) as e:
                raise APIError(400, f"invalid turn_detection: {e}", param="session.turn_detection") from None
            if not self.vad_on:             # a VAD stream from here: it starts at this sample
                self._vad = slot.vad.fork(rules=rules)
                self._vad.reset()
                self.vad_base, self.vad_on = self.fed, True
            elif rules != self.rules:       # new rules, the same VAD state
                self._vad = self._vad_of(slot).fork(rules=rules)
            self.rules = rules
        return [event(reply, session=self.info())]

    # ---- utterances ----------------------------------------------------------------------------
    def _live(self, out: list, r) -> None:
        new = [(t, f) for t, f in zip(r.tokens, r.frames) if f >= self.floor]
        if self.item is None:
            self.pending += new
        else:
            self._add(out, [(t, f) for t, f in new if f >= self.item_start])

    def _add(self, out: list, toks: list) -> None:
        if not toks:
            return
        ids = [t for t, _ in toks]
        text = render(self.tokenizer, ids, self.item_ids[-1] if self.item_ids else None)
        self.item_ids += ids
        if text:
            self.item_texts.append(text)
            out.append(event("conversation.item.input_audio_transcription.delta", item_id=self.item,
                             content_index=0, delta=text))

    def _open(self, out: list, sample: int, announce: bool) -> None:
        self.item, self.item_ids, self.item_texts = new_id(), [], []
        self.item_start = max(sample // self.frame_samples, self.floor)
        if announce:
            out.append(event("input_audio_buffer.speech_started", item_id=self.item,
                             audio_start_ms=self._ms(sample)))
        held, self.pending = [p for p in self.pending if p[1] >= self.item_start], []
        self._add(out, held)

    def _start(self, out: list, sample: int) -> None:
        if self.item is None:
            self._open(out, sample, announce=True)
        else:                               # an utterance opened by hand: now it is speech
            out.append(event("input_audio_buffer.speech_started", item_id=self.item,
                             audio_start_ms=self._ms(sample)))

    def _commit(self, out: list, tr) -> None:
        if self.item is None:
            self._open(out, self.fed, announce=False)
        final = tr.endpoint()       # a fork flushed with zero lookahead: the live stream untouched
        out.append(event("input_audio_buffer.committed", previous_item_id=self.prev_item, item_id=self.item))
        self._add(out, [(t, f) for t, f in zip(final.tokens, final.frames)
                        if f >= max(self.floor, self.item_start)])
        out.append(event("conversation.item.input_audio_transcription.completed", item_id=self.item,
                         content_index=0, transcript="".join(self.item_texts)))
        self.floor = max(self.floor, final.end_frame)
        self.prev_item, self.item = self.item, None


def _turn_detection(session: dict, rate: int):
    """The session's turn_detection (None: off, _ABSENT: unchanged), its format checked."""
    if not isinstance(session, dict):
        raise APIError(400, "session must be an object", param="session")
    if session.get("type", "transcription") != "transcription":
        raise APIError(400, "this endpoint transcribes only: session.type must be 'transcription'",
                       param="session.type")
    audio_in = (session.get("audio") or {}).get("input") or {}
    fmt = audio_in.get("format", session.get("input_audio_format"))
    ok = fmt in (None, "pcm16") or (isinstance(fmt, dict) and fmt.get("type") in ("audio/pcm", "pcm16")
                                     and fmt.get("rate", rate) == rate)
    if not ok:
        raise APIError(400, f"input audio format {audio_wire._echo(fmt)}: this server takes PCM16 at "
                       f"{rate} Hz", param="session.input_audio_format", code="unsupported_audio_format")
    for where in (audio_in, session):
        if "turn_detection" in where:
            td = where["turn_detection"]
            if td is not None and (not isinstance(td, dict) or td.get("type", "server_vad") != "server_vad"):
                raise APIError(400, f"turn_detection {audio_wire._echo(td)}: only server_vad (or null) "
                               "is supported", param="session.turn_detection")
            return td
    return _ABSENT


def _pcm(ev: dict, rate: int) -> np.ndarray:
    audio = ev.get("audio")
    if not isinstance(audio, str):
        raise APIError(400, "input_audio_buffer.append needs `audio`: base64 PCM16", param="audio")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "audio is not valid base64", param="audio", code="invalid_audio") from None
    if len(raw) % 2:
        raise APIError(400, f"audio of {len(raw)} bytes: PCM16 has 2 bytes a sample (mono, "
                       f"little-endian, {rate} Hz)", param="audio", code="invalid_audio")
    return np.frombuffer(raw, "<i2")


def deny(err: APIError):
    """An APIError as the HTTP answer to a WebSocket handshake (uvicorn's denial extension), or
    a policy close where the server has none."""
    async def send(ws: WebSocket):
        if "websocket.http.response" in ws.scope.get("extensions", {}):
            await ws.send_denial_response(error_response(err))
        else:
            await ws.close(code=1008, reason=err.message[:120])
    return send


def add_realtime_route(app, need_worker, check_model) -> None:
    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        try:
            w = need_worker()
            if ws.query_params.get("intent") != "transcription":
                raise APIError(400, "this server's Realtime endpoint transcribes only: connect with "
                               "?intent=transcription", param="intent", code="unsupported_intent")
            check_model(ws.query_params.get("model", ""))
            lease = w.acquire()
        except APIError as e:
            return await deny(e)(ws)
        try:
            await ws.accept()
            await _serve(ws, w, lease)
        except (WebSocketDisconnect, OSError):    # gone mid-stream: the session is freed below
            pass
        finally:
            w.release(lease)


async def _serve(ws: WebSocket, w, lease) -> None:
    stream = LiveStream(w, new_id("sess"))

    async def send(events):
        for e in events:
            await ws.send_text(json.dumps(e))
    await send([event("session.created", session=stream.info())])
    if w.vad is None:
        await send([error_event(APIError(400, f"{w.vad_error}: turn detection is off, end each utterance "
                                         "with input_audio_buffer.commit", code="vad_unavailable"))])
    piece = int(APPEND_PIECE_S * w.sample_rate)
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return
        eid = None
        try:
            ev = json_event(msg, "send events as JSON text frames")
            eid, kind = ev.get("event_id"), ev.get("type")
            if kind == "input_audio_buffer.append":
                pcm = _pcm(ev, w.sample_rate)
                for i in range(0, len(pcm), piece):
                    await send(await w.run(lease, lambda s, p=pcm[i: i + piece]: stream.append(s, p)))
            elif kind == "input_audio_buffer.commit":
                await send(await w.run(lease, stream.commit))
            elif kind == "input_audio_buffer.clear":
                await send(await w.run(lease, stream.clear))
            elif kind in ("session.update", "transcription_session.update"):
                await send(await w.run(lease, lambda s: stream.update(s, ev.get("session"), w.vad_error,
                                                                    kind.replace("update", "updated"))))
            else:
                raise APIError(400, f"unsupported event type {audio_wire._echo(kind)}: this endpoint takes "
                               "input_audio_buffer.append / commit / clear and session.update",
                               param="type", code="invalid_event_type")
        except APIError as e:
            await send([error_event(e, eid if isinstance(eid, str) else None)])

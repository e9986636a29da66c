"""The voice session's wire (voice_session.py): the first message, session.update, checked into
VoiceSettings, and the voice agent's events (flashrt.voice) as Realtime-style JSON events.

Names follow OpenAI's Realtime API where one fits (session.update, input_audio_buffer.*,
conversation.item.input_audio_transcription.*, response.output_audio.*, conversation.item.
truncated, error); what it has no word for is an extension, named here once.
"""
from __future__ import annotations

import base64
import binascii
import math
from dataclasses import asdict, dataclass

import numpy as np

from flashrt.voice import (BargeIn, FinalTranscript, PartialTranscript, ReplyAudio, ReplyText,
                           SpeechStarted, SpeechStopped, TurnDone, VoiceOptions)

from . import speech_wire
from .audio_wire import event, new_id, render
from .wire import APIError, _echo

# session.options a client may set (VoiceOptions fields), with their type and bounds (inclusive)
TUNABLE = {
    "max_reply_tokens": (int, 1, None), "sentence_max_tokens": (int, 1, 1024),
    "temperature": (float, 0.0, 10.0), "top_k": (int, 0, None), "top_p": (float, 0.0, 1.0),
    "seed": (int, 0, (1 << 63) - 1), "tts_temperature": (float, 0.0, 10.0),
    "tts_eos_threshold": (float, -1e3, 1e3), "tts_max_frames": (int, 1, 100_000),
    "endpointing_ms": (float, 0.0, 10_000.0), "lead_ms": (float, 1.0, 60_000.0),
    "listen_lag_ms": (float, 1.0, 60_000.0),
}
TRANSPORTS = ("base64", "binary")


class TokenIds:
    """The recognizer's text where its checkpoint has no tokenizer (random weights): each id as
    "<id>", as /v1/audio/transcriptions writes it."""
    kind = "ids"

    @staticmethod
    def decode(ids) -> str:
        return render(None, ids)


@dataclass(frozen=True)
class VoiceSettings:
    """What the first session.update sets, once: the voice's name, the agent's options, and
    how reply audio is sent (base64 in response.output_audio.delta, or binary frames)."""
    voice: str
    options: VoiceOptions
    transport: str = "base64"


def _bad(message: str, param: str, code: str = "invalid_session") -> APIError:
    return APIError(400, message, param=param, code=code)


def parse_update(ev, rate: int, max_seq_len: int) -> VoiceSettings:
    """The first client event -> VoiceSettings, or a 400 naming the field. rate: the input
    sample rate the agent takes; max_seq_len: the language model's context."""
    if not isinstance(ev, dict) or ev.get("type") != "session.update":
        kind = ev.get("type") if isinstance(ev, dict) else None
        raise _bad(f"the first event must be session.update (its audio format, voice and options), "
                   f"got {_echo(kind)}", "type", "session_update_expected")
    s = ev.get("session", {})
    if not isinstance(s, dict):
        raise _bad("session must be an object", "session")
    if s.get("type", "realtime") != "realtime":
        raise _bad(f"session.type {_echo(s.get('type'))}: the voice session is 'realtime'", "session.type")
    audio = s.get("audio", {})
    if not isinstance(audio, dict) or any(not isinstance(audio.get(k, {}), dict) for k in ("input", "output")):
        raise _bad("session.audio must be {input: {...}, output: {...}}", "session.audio")
    fmt_in = audio.get("input", {}).get("format", s.get("input_audio_format"))
    ok = fmt_in in (None, "pcm16") or (isinstance(fmt_in, dict) and fmt_in.get("type") in ("audio/pcm", "pcm16")
                                       and fmt_in.get("rate", rate) == rate)
    if not ok:
        raise _bad(f"input audio format {_echo(fmt_in)}: the voice session takes PCM16 mono at {rate} Hz "
                   "(resample first)", "session.audio.input.format", "unsupported_audio_format")
    fmt_out = audio.get("output", {}).get("format", s.get("output_audio_format"))
    if fmt_out not in (None, "pcm16") and not (isinstance(fmt_out, dict) and fmt_out.get("type") in
                                               ("audio/pcm", "pcm16") and set(fmt_out) <= {"type", "rate"}):
        raise _bad(f"output audio format {_echo(fmt_out)}: the voice session speaks PCM16 mono "
                   "(at the synthesizer's rate, session.audio.output.format.rate)",
                   "session.audio.output.format", "unsupported_audio_format")
    voice = audio.get("output", {}).get("voice", s.get("voice", speech_wire.DEFAULT_VOICE))
    if not isinstance(voice, str) or not speech_wire.VOICE_NAME.match(voice):
        raise _bad(f"voice {_echo(voice)}: expected a voice name (GET /v1/audio/voices lists them)",
                   "session.audio.output.voice")
    transport = s.get("output_audio_transport", "base64")
    if transport not in TRANSPORTS:
        raise _bad(f"output_audio_transport {_echo(transport)}: expected one of {list(TRANSPORTS)}",
                   "session.output_audio_transport")
    instructions = s.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("instructions must be a string (the system prompt)", "session.instructions")
    return VoiceSettings(voice, _options(s.get("options", {}), instructions or None, max_seq_len), transport)


def _options(opts, system_prompt, max_seq_len: int) -> VoiceOptions:
    if not isinstance(opts, dict):
        raise _bad("session.options must be an object of voice options", "session.options")
    unknown = sorted(set(opts) - set(TUNABLE))
    if unknown:
        raise _bad(f"unknown voice option(s) {_echo(unknown)}: expected some of {sorted(TUNABLE)} (the "
                   "system prompt is session.instructions)", f"session.options.{unknown[0]}")
    for name, v in opts.items():
        kind, lo, hi = TUNABLE[name]
        hi = max_seq_len if name == "max_reply_tokens" else hi
        number = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not number or (kind is int and not isinstance(v, int)) or v < lo or (hi is not None and v > hi):
            want = f"{'an integer' if kind is int else 'a number'} in [{lo}, {hi if hi is not None else 'inf'}]"
            raise _bad(f"session.options.{name}={_echo(v)}: expected {want}", f"session.options.{name}")
    try:
        return VoiceOptions(system_prompt=system_prompt, **opts)
    except ValueError as e:            # a rule across fields; it names the field
        raise _bad(str(e), "session.options") from None


def audio_bytes(raw: bytes, rate: int) -> np.ndarray:
    """PCM16 little-endian mono bytes -> (n,) int16 samples, or a 400 for a torn sample."""
    if len(raw) % 2:
        raise APIError(400, f"audio of {len(raw)} bytes: PCM16 has 2 bytes a sample (mono, little-endian, "
                       f"{rate} Hz)", param="audio", code="invalid_audio")
    return np.frombuffer(raw, "<i2")


def audio_base64(ev: dict, rate: int) -> np.ndarray:
    audio = ev.get("audio")
    if not isinstance(audio, str):
        raise APIError(400, "input_audio_buffer.append needs `audio`: base64 PCM16", param="audio",
                       code="invalid_audio")
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "audio is not valid base64", param="audio", code="invalid_audio") from None
    return audio_bytes(raw, rate)


class Transcript:
    """The voice agent's events as wire events, with the ids that tie them together: a user
    item per turn (opened at its speech, closed when the reply is released), a response and
    its output item per reply. Reply audio: PCM16 bytes (binary transport) or base64 events."""

    def __init__(self, rate: int, out_rate: int, transport: str):
        self.rate, self.out_rate, self.binary = rate, out_rate, transport == "binary"
        self.item: str | None = None           # the user's turn being heard
        self.response: str | None = None       # the reply being made
        self.output_item: str | None = None    # the reply's item (kept after response.done)

    def _user(self) -> str:
        if self.item is None:
            self.item = new_id("item")
        return self.item

    def _reply(self, out: list) -> str:
        if self.response is None:               # the reply is released: the user's turn is over
            self.response, self.output_item, self.item = new_id("resp"), new_id("item"), None
            out.append(event("response.created", response={
                "id": self.response, "object": "realtime.response", "status": "in_progress",
                "output": [{"id": self.output_item, "type": "message", "role": "assistant"}]}))
        return self.response

    def events(self, evs) -> list:
        """flashrt.voice events -> wire events (dicts) and audio frames (bytes), in order."""
        out: list = []
        for e in evs:
            if isinstance(e, SpeechStarted):
                out.append(event("input_audio_buffer.speech_started", item_id=self._user(),
                                 audio_start_ms=e.sample * 1000 // self.rate))
            elif isinstance(e, SpeechStopped):
                out.append(event("input_audio_buffer.speech_stopped", item_id=self._user(),
                                 audio_end_ms=e.sample * 1000 // self.rate))
            elif isinstance(e, PartialTranscript):
                out.append(event("conversation.item.input_audio_transcription.delta", item_id=self._user(),
                                 content_index=0, delta=e.text))
            elif isinstance(e, FinalTranscript):
                out.append(event("conversation.item.input_audio_transcription.completed",
                                 item_id=self._user(), content_index=0, transcript=e.text, branch=e.branch))
                if e.branch == "ignored":
                    self.item = None
            elif isinstance(e, ReplyText):
                rid = self._reply(out)
                out.append(event("response.output_audio_transcript.delta", response_id=rid,
                                 item_id=self.output_item, delta=e.delta))
            elif isinstance(e, ReplyAudio):
                rid = self._reply(out)
                pcm = speech_wire.s16le(e.pcm.float().cpu().numpy())
                out.append(pcm if self.binary else event(
                    "response.output_audio.delta", response_id=rid, item_id=self.output_item,
                    frame=e.frame, delta=base64.b64encode(pcm).decode("ascii")))
            elif isinstance(e, TurnDone):
                rid = self._reply(out)
                t = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in asdict(e.timings).items()}
                out.append(event("response.done", response={
                    "id": rid, "object": "realtime.response",
                    "status": "cancelled" if e.interrupted else "completed",
                    "status_details": {"type": "cancelled", "reason": "turn_detected"} if e.interrupted else None,
                    "output": [{"id": self.output_item, "type": "message", "role": "assistant"}],
                    "output_text": e.text, "timings": t}))
                self.response = None
            elif isinstance(e, BargeIn):
                out.append(event("conversation.item.truncated", item_id=self.output_item, content_index=0,
                                 audio_end_ms=e.played_samples * 1000 // self.out_rate,
                                 played_samples=e.played_samples, transcript=e.heard_text))
        return out

"""Audio wire protocol: WAV decoding, the transcription form's fields, response formats and the
Realtime events, each refusal an APIError naming its field (the routes are audio.py, realtime.py).

WAV only (RIFF/WAVE): 16-bit PCM or 32/64-bit float, any channel count (mixed down to mono), at
the recognizer's sample rate (no resampling). Without a tokenizer (random-weight checkpoints)
a token's text is its id as "<id>".
"""
from __future__ import annotations

import json
import secrets
import struct
from dataclasses import dataclass

import numpy as np

from .wire import APIError, _echo, check_text

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
# accepted and ignored: the recognizer is greedy and has no language or prompt conditioning
IGNORED = frozenset({"language", "languages[]", "languages", "prompt", "temperature",
                     "chunking_strategy"})
# OpenAI fields this server does not implement: refused by name
UNSUPPORTED = frozenset({"include[]", "include", "known_speaker_names[]", "known_speaker_references[]",
                         "keywords[]", "known_speaker_names", "known_speaker_references", "keywords"})
_GRANULARITIES = ("timestamp_granularities[]", "timestamp_granularities")
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
_STREAMING_SIZE = 0xFFFFFFFF      # a data size left unset by a writer to a pipe: "to the end"


def _bad(message: str, code: str, param: str = "file") -> APIError:
    return APIError(400, message, param=param, code=code)


def decode_wav(data: bytes, rate: int, max_seconds: float, limit_flag: str = "--max-audio-s") -> np.ndarray:
    """WAV bytes -> (n,) float32 mono in [-1, 1] at `rate`, or a 400 naming what is wrong (past
    max_seconds: naming limit_flag, the option that sets it)."""
    if not data:
        raise _bad("file is empty (0 bytes)", "empty_audio")
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise _bad("file is not a WAV (RIFF/WAVE) file: this server reads WAV only, 16-bit PCM or "
                   f"float (convert first, e.g. ffmpeg -i IN -ar {rate} -ac 1 out.wav)", "invalid_audio_format")
    pos, fmt = 12, None
    while True:
        if pos + 8 > len(data):
            raise _bad(f"truncated WAV: it ends at byte {len(data)} before its "
                       f"{'data' if fmt else 'fmt'} chunk", "truncated_audio")
        cid, size = data[pos: pos + 4], int.from_bytes(data[pos + 4: pos + 8], "little")
        body = pos + 8
        if cid == b"fmt ":
            if size < 16 or body + size > len(data):
                raise _bad(f"truncated WAV: its fmt chunk declares {size} bytes, {len(data) - body} "
                           "are present (16 or more needed)", "truncated_audio")
            fmt = _format(data, body, size, rate)
        elif cid == b"data":
            if fmt is None:
                raise _bad("invalid WAV: its data chunk comes before any fmt chunk", "invalid_audio_format")
            if size == _STREAMING_SIZE:
                size = len(data) - body
            if body + size > len(data):
                raise _bad(f"truncated WAV: its data chunk declares {size} bytes, {len(data) - body} "
                           "are present", "truncated_audio")
            return _samples(data[body: body + size], *fmt, rate, max_seconds, limit_flag)
        pos = body + size + (size & 1)     # chunks are padded to an even length


def _format(data: bytes, at: int, size: int, rate: int) -> tuple:
    tag, channels, sr, _, block, bits = struct.unpack_from("<HHIIHH", data, at)
    if tag == _EXTENSIBLE and size >= 40:      # the real format is the SubFormat GUID's first 2 bytes
        tag = int.from_bytes(data[at + 24: at + 26], "little")
    kind = {(_PCM, 16): "<i2", (_FLOAT, 32): "<f4", (_FLOAT, 64): "<f8"}.get((tag, bits))
    if kind is None:
        what = {_PCM: f"{bits}-bit PCM", _FLOAT: f"{bits}-bit float"}.get(tag, f"format tag {tag:#x}")
        raise _bad(f"unsupported WAV encoding ({what}): send 16-bit PCM or 32-bit float",
                   "invalid_audio_format")
    if channels < 1 or block != channels * bits // 8:
        raise _bad(f"invalid WAV: {channels} channel(s) of {bits} bits with a frame of {block} bytes",
                   "invalid_audio_format")
    if sr != rate:
        raise _bad(f"sample rate {sr} Hz: this model takes {rate} Hz audio (resample first, e.g. "
                   f"ffmpeg -i IN -ar {rate} out.wav)", "unsupported_sample_rate")
    return kind, channels, block


def _samples(raw: bytes, kind: str, channels: int, block: int, rate: int, max_seconds: float,
             limit_flag: str) -> np.ndarray:
    if len(raw) % block:
        raise _bad(f"truncated WAV: its {len(raw)} data bytes end inside a {block}-byte frame",
                   "truncated_audio")
    n = len(raw) // block
    if n == 0:
        raise _bad("the WAV holds no audio samples", "empty_audio")
    if n > max_seconds * rate:
        raise _bad(f"audio of {n / rate:.1f} s is longer than this server takes ({max_seconds:g} s, "
                   f"{limit_flag})", "audio_too_long")
    x = np.frombuffer(raw, kind).reshape(n, channels)
    if kind == "<i2":
        x = x.astype(np.float32) / 32768.0
    elif not np.isfinite(x).all():
        raise _bad("the WAV has non-finite samples (NaN or inf)", "invalid_audio")
    return np.ascontiguousarray(x.mean(axis=1, dtype=np.float32) if channels > 1 else x[:, 0], np.float32)


@dataclass(frozen=True)
class TranscriptionRequest:
    """The checked fields of a POST /v1/audio/transcriptions form (the file apart)."""
    model: str = ""
    language: str | None = None
    response_format: str = "json"
    stream: bool = False


def parse_form(form) -> tuple:
    """A parsed multipart form -> (TranscriptionRequest, the file part)."""
    keys = list(dict.fromkeys(form.keys()))
    known = {"file", "model", "response_format", "stream", *_GRANULARITIES, *IGNORED}
    unknown = [k for k in keys if k not in known]
    if unknown:
        refused = [k for k in unknown if k in UNSUPPORTED]
        raise APIError(400, f"unsupported parameter(s): {_echo(', '.join(unknown), 400)}"
                       + (" (not implemented by flashrt serve)" if refused else " (unknown)"),
                       param=_echo(unknown[0], 200), code="unsupported_parameter")
    text = {}
    for k in keys:
        if k == "file":
            continue
        vals = form.getlist(k)
        if any(not isinstance(v, str) for v in vals):
            raise APIError(400, f"{_echo(k, 200)} must be a text field, not a file", param=_echo(k, 200))
        text[k] = [check_text(v, k) for v in vals]
    files = form.getlist("file")
    if not files:
        raise APIError(400, "file is required: the audio as a multipart file part", param="file")
    if len(files) > 1 or isinstance(files[0], str):
        raise APIError(400, "file must be one file part (a WAV)", param="file")
    one = {k: v[-1] for k, v in text.items()}
    fmt = one.get("response_format", "json")
    if fmt not in FORMATS:
        raise APIError(400, f"response_format {_echo(fmt)}: expected one of {list(FORMATS)}",
                       param="response_format")
    stream = one.get("stream", "false").strip().lower()
    if stream not in ("true", "false"):
        raise APIError(400, f"stream must be true or false, got {_echo(stream)}", param="stream")
    if stream == "true" and fmt not in ("json", "text"):
        raise APIError(400, "stream=true sends transcript.text events: response_format must be json or "
                       f"text, got {fmt}", param="response_format")
    grains = {g for k in _GRANULARITIES for g in text.get(k, [])}
    if grains - {"segment"}:
        raise APIError(400, f"timestamp_granularities {sorted(grains)}: only 'segment' is supported",
                       param="timestamp_granularities")
    if "temperature" in one:
        try:
            t = float(one["temperature"])
        except ValueError:
            t = -1.0
        if not 0.0 <= t <= 1.0:
            raise APIError(400, f"temperature must be a number in [0, 1], got {_echo(one['temperature'])}",
                           param="temperature")
    return TranscriptionRequest(one.get("model", ""), one.get("language"), fmt, stream == "true"), files[0]


# ---- text and responses ------------------------------------------------------------------------
def render(tokenizer, ids, before: int | None = None) -> str:
    """Text of token ids after token `before` (a SentencePiece word boundary survives); without a
    tokenizer each id as "<id>"."""
    ids = list(ids)
    if tokenizer is None:
        return "".join(f"<{t}>" for t in ids)
    if not ids:
        return ""
    if before is None:
        return tokenizer.decode(ids)
    head, full = tokenizer.decode([before]), tokenizer.decode([before] + ids)
    return full[len(head):] if full.startswith(head) else tokenizer.decode(ids)


def segments(tokenizer, ids: list, times: list, spans, duration: float, no_speech=None) -> list:
    """verbose_json segments: one per VAD span (start, end seconds), each token in the last span
    starting at or before its time; spans None (no VAD): one over the whole file."""
    if spans is None or not spans and ids:      # no VAD, or tokens where it heard no speech
        spans, no_speech = [(0.0, duration)], None
    if not spans:
        return []
    parts = [[] for _ in spans]
    starts = [s for s, _ in spans]
    for t, at in zip(ids, times):
        parts[max(0, int(np.searchsorted(starts, at, side="right")) - 1)].append(t)
    out, before = [], None
    for i, ((s, e), toks) in enumerate(zip(spans, parts)):
        out.append({"id": i, "seek": 0, "start": round(s, 3), "end": round(e, 3),
                    "text": render(tokenizer, toks, before), "tokens": toks, "temperature": 0.0,
                    "avg_logprob": None, "compression_ratio": None,
                    "no_speech_prob": None if no_speech is None else round(no_speech[i], 4)})
        before = toks[-1] if toks else before
    return out


def _stamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def subtitles(segs: list, kind: str) -> str:
    """SRT or WebVTT text of the segments."""
    if kind == "srt":
        return "".join(f"{i + 1}\n{_stamp(s['start'], ',')} --> {_stamp(s['end'], ',')}\n{s['text'].strip()}\n\n"
                       for i, s in enumerate(segs))
    return "WEBVTT\n\n" + "".join(f"{_stamp(s['start'], '.')} --> {_stamp(s['end'], '.')}\n"
                                  f"{s['text'].strip()}\n\n" for s in segs)


def duration_usage(seconds: float) -> dict:
    return {"type": "duration", "seconds": round(seconds, 3)}


def token_usage(frames: int, tokens: int) -> dict:
    """Usage of a streamed transcription: encoder frames in (audio tokens), tokens out."""
    return {"type": "tokens", "input_tokens": frames, "output_tokens": tokens,
            "total_tokens": frames + tokens,
            "input_token_details": {"audio_tokens": frames, "text_tokens": 0}}


# ---- Realtime events ---------------------------------------------------------------------------
def event(type_: str, **fields) -> dict:
    return {"type": type_, "event_id": f"event_{secrets.token_urlsafe(12)}", **fields}


def error_event(err: APIError, client_event_id: str | None = None) -> dict:
    return event("error", error={**err.body()["error"], "event_id": client_event_id})


def json_event(msg: dict, binary: str, code: str = "invalid_event") -> dict:
    """A WebSocket text frame's JSON event object; binary, code: the error for a binary frame here."""
    if msg.get("text") is None:
        raise APIError(400, binary, code=code)
    try:
        ev = json.loads(msg["text"])
    except ValueError as e:
        raise APIError(400, f"invalid JSON event: {e}", code="invalid_json") from None
    if not isinstance(ev, dict):
        raise APIError(400, "an event must be a JSON object", code="invalid_event")
    return ev


def new_id(prefix: str = "item") -> str:
    """A Realtime id: item_..., sess_..."""
    return f"{prefix}_{secrets.token_urlsafe(12)}"

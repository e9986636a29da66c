"""Speech-out wire protocol: POST /v1/audio/speech's body, the audio it answers with (raw PCM, a
streamed WAV, or SSE events) and the voice upload form of /v1/audio/voices, each refusal an
APIError naming its field (the routes are speech.py).

Audio is 16-bit signed little-endian mono at the codec's rate (24 kHz for Pocket TTS), sent as
it is made. A WAV's header goes out before the length is known: its RIFF and data sizes are
0xFFFFFFFF ("to the end", as a writer to a pipe leaves them; audio_wire.decode_wav reads that).
"""
from __future__ import annotations

import base64
import json
import re
import struct
from typing import Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .wire import APIError, _echo, check_text, parse

FORMATS = ("pcm", "wav")
OPENAI_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
STREAM_FORMATS = ("audio", "sse")
MEDIA = {"pcm": "audio/pcm", "wav": "audio/wav"}
MIN_SPEED, MAX_SPEED = 0.25, 4.0          # OpenAI's range
DEFAULT_VOICE = "default"
VOICE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")     # no '.': a voice file's key is tenant.name
_UNSET = 0xFFFFFFFF


class VoiceRef(BaseModel):
    """OpenAI's form of a custom voice: {"id": ...}."""
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str


class SpeechRequest(BaseModel):
    """POST /v1/audio/speech. `seed` (extension): the flow head's noise stream; the same input,
    voice and seed give the same audio (default 0, so a repeated request repeats its audio)."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    input: str
    voice: Union[str, VoiceRef]
    response_format: str = "wav"
    speed: float = 1.0
    stream_format: str = "audio"
    instructions: str | None = None
    seed: int = Field(0, ge=0, le=2 ** 63 - 1)

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


def parse_speech(body: bytes, max_chars: int) -> SpeechRequest:
    """A JSON body -> a checked SpeechRequest, or a 400 naming the field."""
    req = parse(SpeechRequest, body)
    if len(req.input) > max_chars:
        raise APIError(400, f"input of {len(req.input)} characters is longer than this server takes "
                       f"({max_chars}, --max-speech-chars)", param="input", code="string_above_max_length")
    check_text(req.input, "input")
    if not req.input.strip():
        raise APIError(400, "input is empty: give the text to speak", param="input", code="empty_input")
    fmt = req.response_format
    if fmt not in FORMATS:
        why = ("needs an audio encoder this server does not have" if fmt in OPENAI_FORMATS
               else "is not a response format")
        raise APIError(400, f"response_format {_echo(fmt)} {why}: supported here: {', '.join(FORMATS)} "
                       "(pcm: raw 16-bit little-endian mono at 24 kHz)", param="response_format",
                       code="unsupported_response_format")
    if not MIN_SPEED <= req.speed <= MAX_SPEED:
        raise APIError(400, f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {req.speed}", param="speed")
    if req.stream_format not in STREAM_FORMATS:
        raise APIError(400, f"stream_format {_echo(req.stream_format)}: expected one of "
                       f"{list(STREAM_FORMATS)}", param="stream_format")
    if req.instructions:
        raise APIError(400, "instructions are not supported: this model takes no style prompt (choose "
                       "a voice instead)", param="instructions", code="unsupported_parameter")
    check_voice_name(req.voice_name, "voice", known_default=True)
    return req


def check_voice_name(name: str, param: str, known_default: bool = False) -> str:
    if not VOICE_NAME.match(name):
        raise APIError(404 if known_default else 400,
                       f"{'unknown voice' if known_default else 'bad voice name'} {_echo(name)}: a "
                       "voice name is 1-64 characters of [A-Za-z0-9_-]", param=param,
                       code="voice_not_found" if known_default else "invalid_voice_name")
    return name


def parse_voice_form(form) -> tuple:
    """POST /v1/audio/voices' multipart form -> (name, the file part)."""
    keys = list(dict.fromkeys(form.keys()))
    unknown = [k for k in keys if k not in ("name", "file")]
    if unknown:
        raise APIError(400, f"unsupported parameter(s): {_echo(', '.join(unknown), 400)} (a voice is "
                       "`name` and `file`)", param=_echo(unknown[0], 200), code="unsupported_parameter")
    names, files = form.getlist("name"), form.getlist("file")
    if len(names) != 1 or not isinstance(names[0], str):
        raise APIError(400, "name is required: one text field naming the voice", param="name")
    name = check_voice_name(check_text(names[0], "name"), "name")
    if name == DEFAULT_VOICE:
        raise APIError(409, f"{DEFAULT_VOICE!r} is the checkpoint's voice: choose another name",
                       param="name", code="voice_exists")
    if len(files) != 1 or isinstance(files[0], str):
        raise APIError(400, "file is required: the reference audio as one multipart file part (a WAV)",
                       param="file")
    return name, files[0]


# ---- audio out -----------------------------------------------------------------------------------
def s16le(pcm) -> bytes:
    """(n,) float samples in [-1, 1] -> 16-bit little-endian PCM (clipped, rounded)."""
    x = np.asarray(pcm, dtype=np.float32)
    return np.clip(np.rint(x * 32767.0), -32768, 32767).astype("<i2").tobytes()


def wav_header(rate: int) -> bytes:
    """A streamed WAV's header: 16-bit PCM mono at `rate`, sizes left 'to the end'."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (b"RIFF" + struct.pack("<I", _UNSET) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", _UNSET))


def usage(text_tokens: int, frames: int) -> dict:
    """Text tokens in, latent frames out (one a 1920-sample frame at the released shape)."""
    return {"input_tokens": text_tokens, "output_tokens": frames, "total_tokens": text_tokens + frames}


def sse_delta(audio: bytes) -> str:
    return f"data: {json.dumps({'type': 'speech.audio.delta', 'audio': base64.b64encode(audio).decode()})}\n\n"


def sse_done(text_tokens: int, frames: int) -> str:
    return f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage(text_tokens, frames)})}\n\n"


def voice_card(name: str, predefined: bool) -> dict:
    """A voice in /v1/audio/voices; predefined voices (the checkpoint's) cannot be deleted."""
    return {"id": name, "object": "audio.voice", "predefined": predefined}

"""What VoiceAgent.push returns: typed events, in stream order, and a turn's timings.

Sample positions count the agent's input stream (16 kHz) from its start; reply audio is the
synthesizer's (24 kHz for Pocket TTS), counted from the reply's start.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STAGES = ("vad", "transcript", "prefill", "first_token", "first_sentence", "first_audio")


@dataclass(frozen=True)
class SpeechStarted:
    sample: int             # first sample of the speech (the VAD's padding included)


@dataclass(frozen=True)
class SpeechStopped:
    sample: int             # end of the speech (exclusive, the VAD's padding included)


@dataclass(frozen=True)
class PartialTranscript:
    text: str               # new text of the user's turn, from the live recognizer


@dataclass(frozen=True)
class FinalTranscript:
    text: str               # the user's whole turn
    branch: str             # "new", "kept" (the preemptive reply on the same text goes on),
                            # "restarted" (the text changed: the reply was dropped by a restore)
                            # or "ignored" (no text and no turn pending: nothing to answer)


@dataclass(frozen=True)
class ReplyText:
    delta: str              # text the agent will speak (reasoning and tool-call text left out)


@dataclass(frozen=True)
class ReplyAudio:
    pcm: torch.Tensor       # (frame_size,) float32 at the synthesizer's sample rate
    frame: int              # index of this frame in the reply, from 0


@dataclass(frozen=True)
class TurnTimings:
    """When each stage of a turn was done, in ms after the end of the user's speech, on a turn
    clock: compute measured with time.perf_counter, audio the agent waited for counted in audio
    time, as if the caller pushed audio in real time (a push is handled once its last sample
    has arrived and the agent is free). Stages (STAGES): the VAD's end-of-speech decision (its
    silence rule included), the final transcript, the LM prefill of the turn, the first reply
    token, the first complete sentence, the first audio frame out (voice to voice). A stage a
    kept preemptive reply had already passed is marked when the final transcript was."""
    vad: float
    transcript: float
    prefill: float | None = None
    first_token: float | None = None
    first_sentence: float | None = None
    first_audio: float | None = None
    prefill_tokens: int = 0         # positions the LM ran for this turn's prompt
    context_tokens: int = 0         # positions the LM held once the prompt was in
    endpoint: str = "fork"          # "fork" (endpoint fork) or "lookahead" (waited it out)
    branch: str = "new"             # as FinalTranscript.branch

    def split(self) -> dict:
        """Each stage's own share: ms since the stage before it (None where not reached)."""
        out, last = {}, 0.0
        for s in STAGES:
            t = getattr(self, s)
            out[s] = None if t is None else t - last
            last = last if t is None else t
        return out


@dataclass(frozen=True)
class TurnDone:
    timings: TurnTimings
    text: str               # what the agent made to say this turn
    interrupted: bool       # a barge-in cut the reply before it was all made


@dataclass(frozen=True)
class BargeIn:
    heard_text: str         # the reply text the user heard: what the conversation now holds
    played_samples: int     # reply audio played before the user spoke over it


Event = (SpeechStarted | SpeechStopped | PartialTranscript | FinalTranscript | ReplyText | ReplyAudio
         | TurnDone | BargeIn)

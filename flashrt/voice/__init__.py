"""The voice agent: microphone audio in, the agent's speech and transcript events out, every stage
on capsules.

Rule: voice/ composes the faces of flashrt.lm, flashrt.speech, flashrt.chat and flashrt.capsules;
it never imports serve, core, models, nn or native (a model reaches it loaded, through lm's and
speech's loaders).

agent.py holds VoiceAgent (push(pcm) -> events, played(samples)): the VAD's end of speech, the
recognizer's endpoint fork, preemptive replies dropped by a restore, sentence-wise speech from a
voice capsule, and barge-in that rolls the synthesizer and the language model back to what was
played. VoiceOptions(without_capsules=True) runs the same models the way voice frameworks do
today, for comparison. events.py holds the events and TurnTimings; reply.py one reply in the
making; text.py the conversation's chat rendering and the text between the stages. pipecat.py
(the `voice-clients` extra; imported by name only) is for Pipecat pipelines pointed at `flashrt
serve`: an LLM service whose barge-in cancels the server's reply at what was played.
"""
from __future__ import annotations

from .agent import VoiceAgent  # noqa: F401
from .events import (STAGES, BargeIn, FinalTranscript, PartialTranscript, ReplyAudio,  # noqa: F401
                     ReplyText, SpeechStarted, SpeechStopped, TurnDone, TurnTimings)
from .options import VoiceOptions  # noqa: F401
from .text import turn_prompt  # noqa: F401

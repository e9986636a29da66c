"""The speech layer, on a Session: voice activity detection and streaming recognition.

Rule: speech/ sits on a Session: it imports core, models, capsules and errors; never lm, serve or dev.

vad.py holds VoiceActivity: 16 kHz PCM of any length in, speech start / end events out, with
the silero-vad package's segmentation rules (VadRules); its model runs under the contract of
flashrt.models.protocol.VadModel (models/silero_vad.py: the package's real weights, loaded from
the installed `silero-vad` wheel, the `speech` extra). Every piece of state is an arena buffer,
so snapshot / restore / fork continue bitwise, mid-utterance included.

synthesizer.py holds Synthesizer: text ids in, 24 kHz PCM out frame by frame, a
flashrt.models.protocol.SynthesizerModel and its CodecModel (models/pocket_tts.py and
pocket_tts_codec.py) on one session; make_voice() prefills a voice prompt once into a capsule.

transcriber.py holds StreamingTranscriber: 16 kHz PCM of any length in, token deltas with their
audio time out, a flashrt.models.protocol.TranscriberModel (models/nemotron_asr_streaming.py)
at a lookahead chosen at construction; endpoint() flushes a fork with zero lookahead and returns
the final tokens at once, the live stream untouched.
"""
from __future__ import annotations

from .vad import SpeechEnd, SpeechStart, VadResult, VadRules, VoiceActivity, check_vad_model  # noqa: F401
from .synthesizer import (IncrementalSpeaker, SentenceRule, Synthesizer, load_codec,  # noqa: F401
                          load_synthesizer, split_sentences)
from .transcriber import (StreamingTranscriber, Transcript, check_transcriber_model,  # noqa: F401
                          load_transcriber)

"""VoiceOptions: every setting of a voice agent, one object from construction to each turn."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class VoiceOptions:
    """without_capsules: the baseline voice frameworks run today, for comparison: the whole
    conversation re-prefilled each turn, the voice re-encoded per reply, the recognizer's
    lookahead waited out instead of the endpoint fork, the synthesizer cleared on barge-in."""
    system_prompt: str | None = None
    template_kwargs: dict = field(default_factory=lambda: {"enable_thinking": False})
    max_reply_tokens: int = 64
    temperature: float = 0.7          # LM sampling (0: greedy)
    top_k: int = 0
    top_p: float = 0.95
    seed: int = 0                     # turn i samples (LM and TTS) with seed + i
    tts_temperature: float = 0.7
    tts_eos_threshold: float = -4.0
    tts_max_frames: int | None = None     # per sentence (None: the synthesizer's budget)
    sentence_max_tokens: int = 50     # SentenceRule.max_tokens, in the synthesizer's tokens
    endpointing_ms: float = 0.0       # silence after the VAD's end before the reply plays; the
                                      # reply is prepared preemptively meanwhile
    lead_ms: float | None = 1500.0    # reply audio made ahead of what was played (None: all at once)
    listen_lag_ms: float | None = None    # past its first audio, the reply waits while the agent is
                                      # this far behind the microphone (None: it never waits; 100 suits)
    without_capsules: bool = False

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"VoiceOptions.{name}={getattr(self, name)!r}: expected {want}")
        for name in ("max_reply_tokens", "sentence_max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, "an integer >= 1")
        if self.tts_max_frames is not None and (isinstance(self.tts_max_frames, bool)
                                                or not isinstance(self.tts_max_frames, int)
                                                or self.tts_max_frames < 1):
            bad("tts_max_frames", "None or an integer >= 1")
        for name in ("temperature", "tts_temperature", "endpointing_ms"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                bad(name, "a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "a value in (0, 1]")
        for name in ("lead_ms", "listen_lag_ms"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v <= 0):
                bad(name, "None or a finite number of ms > 0")
        if not isinstance(self.template_kwargs, dict):
            bad("template_kwargs", "a dict of chat template variables")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            bad("system_prompt", "None or a string")

    def tts_knobs(self, turn: int) -> dict:
        """The synthesizer's reply settings for turn `turn`."""
        return dict(seed=self.seed + turn, temperature=self.tts_temperature,
                    eos_threshold=self.tts_eos_threshold)

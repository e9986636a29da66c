"""One reply in the making: language-model tokens -> text -> spoken content -> sentences -> audio.

Each step samples one token from the model's last logits and commits it (the end-of-turn token
is not committed: the next user turn's text closes the reply, as the chat template writes it),
decodes it, lets the chat format's parser keep reasoning and tool-call text out of what is
spoken, and feeds the content to the IncrementalSpeaker, which speaks each sentence once it is
complete. content_after[i] is how much content was known once token i was read: a barge-in
keeps the tokens whose content lies within what was played (a token whose text was held back
by the parser counts with the content that released it).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Callable

from flashrt.chat import Content, ReplyParser

from .events import ReplyAudio, ReplyText
from .options import VoiceOptions
from .text import Detokenizer


class Reply:
    """lm: the LanguageModel holding the prompt (start: its position). make_speaker(): the
    IncrementalSpeaker, made at the first content (so a voice re-encoded per reply is counted
    where frameworks pay it). now(): the turn clock."""

    def __init__(self, lm, make_speaker: Callable, parser: ReplyParser, options: VoiceOptions,
                 now: Callable[[], float]):
        self.lm, self.options, self.parser, self._now = lm, options, parser, now
        self._make_speaker, self.speaker = make_speaker, None
        self.detok = Detokenizer(lm.tokenizer.decode)
        self._eos = set(lm.model.eos_ids)
        self.start = lm.position
        self.tokens: list[int] = []
        self.content = ""                      # what is spoken
        self.content_after: list[int] = []     # len(content) once token i was read
        self.frames = self.samples = 0         # audio made
        self.done = False                      # every token sampled and every sentence spoken
        self.marks: dict[str, float] = {}      # stage -> turn clock (first_token, ...)

    def step(self) -> list:
        """One token and the audio of any sentence it completes: ReplyText / ReplyAudio events."""
        if self.done:
            return []
        lm, o = self.lm, self.options
        tok = None
        if len(self.tokens) < o.max_reply_tokens and lm.position < lm.max_seq_len:
            tok = lm.sample(o.temperature, o.top_k, o.top_p)
            self.marks.setdefault("first_token", self._now())
        if tok is None or tok in self._eos:
            return self._finish()
        lm.decode(tok)
        self.tokens.append(tok)
        out = self._content(self.parser.feed(self.detok.feed(tok)))
        self.content_after.append(len(self.content))
        return out

    def _finish(self) -> list:
        out = self._content(self.parser.feed(self.detok.finish()) + self.parser.finish())
        if self.content_after:
            self.content_after[-1] = len(self.content)
        if self.speaker is not None:
            out += self._speak(self.speaker.flush())
        self.done = True
        return out

    def _content(self, events: list) -> list:
        text = "".join(e.text for e in events if isinstance(e, Content))
        if not text:
            return []
        self.content += text
        if self.speaker is None:
            self.speaker = self._make_speaker()
        return [ReplyText(text), *self._speak(self.speaker.feed(text))]

    def _speak(self, frames) -> list:
        out = []
        while True:
            t0 = self._now()
            pcm = next(frames, None)
            if pcm is None:
                return out
            self.marks.setdefault("first_sentence", t0)
            self.marks.setdefault("first_audio", self._now())
            out.append(ReplyAudio(pcm, self.frames))
            self.frames, self.samples = self.frames + 1, self.samples + pcm.numel()

    # ---- what was heard ------------------------------------------------------------------
    def kept(self, chars: int) -> int:
        """Tokens whose spoken content lies within its first `chars` characters."""
        return bisect_right(self.content_after, chars)

    def heard(self, k: int) -> str:
        """The content of the first k tokens (what the user heard of them)."""
        return self.content[: self.content_after[k - 1]] if k else ""

    def raw(self, k: int) -> str:
        """The first k tokens' text as the model wrote it (reasoning and markup included)."""
        return self.lm.tokenizer.decode(self.tokens[:k]) if k else ""

    def estimate_chars(self, played: int) -> int:
        """Content played, in proportion to the audio played: what a framework without the
        synthesizer's accounting keeps (its sentence timing unknown)."""
        return len(self.content) * min(played, self.samples) // max(self.samples, 1)

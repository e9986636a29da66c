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
        self._audio = None                     # the speaker's frames not yet made (one per step)
        self._ending = False                   # the text ended: done once _audio runs out
        self.marks: dict[str, float] = {}      # stage -> turn clock (first_token, ...)

    def step(self) -> list:
        """One audio frame of a sentence being spoken, else one token (ReplyText; a sentence it
        completes starts speaking): a step is short, so the caller can listen between steps."""
        if self.done:
            return []
        if self._audio is not None:
            return self._frame()
        if self._ending:
            self.done = True
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
        self._ending = True
        if self.speaker is not None:
            self._audio = self.speaker.flush()
            return out + self._frame()
        self.done = True
        return out

    def _content(self, events: list) -> list:
        text = "".join(e.text for e in events if isinstance(e, Content))
        if not text:
            return []
        self.content += text
        if self.speaker is None:
            self.speaker = self._make_speaker()
        self._audio = self.speaker.feed(text)
        return [ReplyText(text), *self._frame()]

    def _frame(self) -> list:
        """The next frame of the speaker's pending sentences ([] when they are all spoken)."""
        t0 = self._now()
        pcm = next(self._audio, None)
        if pcm is None:
            self._audio = None
            self.done = self._ending
            return []
        self.marks.setdefault("first_sentence", t0)
        self.marks.setdefault("first_audio", self._now())
        self.frames, self.samples = self.frames + 1, self.samples + pcm.numel()
        return [ReplyAudio(pcm, self.frames - 1)]

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
        """Content played, in proportion to the audio played, of the text the synthesizer was
        given: what a framework without the synthesizer's accounting keeps (its sentence timing
        unknown; text past the last sentence end was never spoken)."""
        given = self.speaker.given_chars if self.speaker is not None else 0
        return given * min(played, self.samples) // max(self.samples, 1)

"""Text between the stages: the conversation's chat rendering, the reply's incremental decoding,
and the synthesizer's tokenization with character offsets and its sentence rule.

A conversation is appended to, never re-rendered: each user turn adds the text its chat template
writes after the last reply (turn_prompt), so the language model's history stays a prefix of
the next prompt and a turn prefills only its own tokens, whatever the template does to earlier
messages (Qwen3.5's drops the think block of replies before the last user message).
"""
from __future__ import annotations

from typing import Callable

from flashrt.chat import ChatTemplate
from flashrt.speech import SentenceRule

_SENTINEL = "\x00flashrt.voice.reply_end\x00"


def turn_prompt(template: ChatTemplate, history: list[dict], user: str, kwargs: dict) -> str:
    """The text appended for the user's turn `user` to a conversation whose messages are
    `history` (its last reply, as the model holds it, may end it): the whole rendering at the
    first turn, else what the template writes after the last reply's text (its closing tag,
    the user message, the generation prompt). ChatTemplate renders PLAIN ("role: content")
    for a checkpoint without a template. Raises ValueError if the template refuses."""
    msgs = history + [{"role": "user", "content": user}]
    if not history or history[-1]["role"] != "assistant":
        return template.render(msgs, True, template_kwargs=kwargs)
    last = dict(history[-1], content=history[-1]["content"] + _SENTINEL)
    text = template.render(history[:-1] + [last, msgs[-1]], True, template_kwargs=kwargs)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not write a reply's text verbatim: the voice "
                         "agent cannot append a turn to what the model holds")
    return text.split(_SENTINEL, 1)[1]


class Detokenizer:
    """Token ids in, text deltas out: a delta is held back while it ends inside a character
    (a byte-level token can split one), as servers' incremental detokenizers do."""

    def __init__(self, decode: Callable[[list], str]):
        self.decode, self.ids = decode, []
        self._prefix = self._read = 0      # ids[_prefix:_read] decoded to what was given out

    def feed(self, tok: int) -> str:
        self.ids.append(tok)
        return self._delta(final=False)

    def finish(self) -> str:
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        done = self.decode(self.ids[self._prefix: self._read])
        now = self.decode(self.ids[self._prefix:])
        if len(now) <= len(done) or (now.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(done):]


def tokenize_with_ends(tok) -> Callable[[str], tuple[list, list]]:
    """text -> (ids, ends): ends[i] the character offset where token i ends (what
    IncrementalSpeaker cuts sentences by). Byte-level tokenizers exactly; others by decoding
    each prefix of the ids (clamped to the text, never decreasing)."""
    if getattr(tok, "kind", None) == "bytes":
        def run(text: str):
            ids, ends = [], []
            for i, ch in enumerate(text):
                b = ch.encode("utf-8")
                ids += list(b)
                ends += [i] * (len(b) - 1) + [i + 1]     # a byte inside a character ends before it
            return ids, ends
        return run

    def run(text: str):
        ids, ends, last = list(tok.encode(text)), [], 0
        for i in range(len(ids)):
            last = max(last, min(len(tok.decode(ids[: i + 1])), len(text)))
            ends.append(last)
        return ids, ends
    return run


def sentence_rule(tok, max_tokens: int) -> SentenceRule:
    """Pocket TTS's split rule on `tok`'s ids: sentence ends . ! ? ..., clause ends , ; :
    (each mark that is one token of tok)."""
    def ids(marks):
        out = [tok.encode(m) for m in marks]
        return frozenset(e[0] for e in out if len(e) == 1)
    return SentenceRule(ids((".", "!", "?", "...")), ids((",", ";", ":")), max_tokens, tok.decode)

"""Text out: incremental UTF-8 detokenization and stop strings. Chat templates live in
flashrt.chat (ChatTemplate is imported here for the modules that took it from this one).

A checkpoint without tokenizer files gets flashrt's byte-level tokenizer (ids 0..255 are UTF-8
bytes, other ids decode to "<id>"), so with random weights the text is meaningless but every
byte round-trips.
"""
from __future__ import annotations

from flashrt.chat import ChatTemplate  # noqa: F401


class TextStream:
    """Generated ids -> text deltas that never split a character and never show a stop string.

    Text becomes stable once the ids decoded so far end on a whole character (byte-level
    tokenizers decode by concatenation). ends[k] is the length of the stable text once token k
    is complete (None while it is not): what `delivered_chars` is mapped back through.

    Stop strings are matched by one Knuth-Morris-Pratt automaton each, fed every stable
    character once: the text held back (the longest tail that may still begin a stop string)
    and the first match cost O(1) amortized per character, whatever the stop strings' length,
    so no request's stops can make the engine's single thread slow for everyone.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, [str(s) for s in stops if s]
        self.ids: list[int] = []
        self.text = ""            # stable text of all complete tokens
        self.sent = 0             # chars of self.text handed out
        self.ends: list = []
        self._base = 0            # first id not yet part of self.text
        self.stopped = False
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)   # per stop: its longest prefix the text ends with
        self._scanned = 0                      # chars of self.text fed to the automata
        self._cut = -1                         # where the first stop string begins, once found

    def feed(self, tok: int) -> str:
        """Add one generated id; returns the text that may be sent now ("" if none)."""
        self.ids.append(tok)
        self.ends.append(None)
        piece = self.tok.decode(self.ids[self._base:])
        if not piece.endswith("\ufffd") or len(self.ids) - self._base >= 8:
            self.text += piece    # 8 ids without a whole character: not UTF-8, let it out
            for k in range(self._base, len(self.ids)):
                self.ends[k] = len(self.text)
            self._base = len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: flush text held back for a partial stop-string match."""
        return self._release(final=True)

    def _scan(self) -> None:
        """Feed the new stable characters to every stop's automaton; the earliest match wins
        (the smallest start among all matches completed in this stretch of text)."""
        text, stops, fail, state = self.text, self.stops, self._fail, self._state
        for j in range(self._scanned, len(text)):
            ch = text[j]
            for i, s in enumerate(stops):
                m = state[i]
                while m and s[m] != ch:
                    m = fail[i][m - 1]
                if s[m] == ch:
                    m += 1
                if m == len(s):               # a whole stop string ends at j
                    start = j + 1 - m
                    if self._cut < 0 or start < self._cut:
                        self._cut = start
                    m = fail[i][m - 1]
                state[i] = m
        self._scanned = len(text)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        if self.stops:
            self._scan()
        text, start, cut = self.text, self.sent, self._cut
        if cut >= 0:
            self.stopped = True
            out, self.sent = text[start:max(cut, start)], max(cut, start)
            return out
        hold = 0 if final else max(self._state, default=0)
        end = max(start, len(text) - hold)
        self.sent = end
        return text[start:end]

    def covered(self, chars: int | None = None) -> int:
        """How many leading tokens have their text wholly inside the first `chars` characters
        of the text sent (default: all of it)."""
        limit = self.sent if chars is None else min(chars, self.sent)
        n = 0
        for e in self.ends:
            if e is None or e > limit:
                break
            n += 1
        return n


def _failure(s: str) -> list:
    """KMP failure function: f[k] = the longest proper prefix of s[:k+1] that is also its suffix."""
    f, m = [0] * len(s), 0
    for k in range(1, len(s)):
        while m and s[k] != s[m]:
            m = f[m - 1]
        if s[k] == s[m]:
            m += 1
        f[k] = m
    return f


def max_token_chars(tokenizer, vocab: int) -> int:
    """An upper bound on the characters of input text one token can stand for, so text longer
    than max_seq_len times it cannot fit and is refused before it is tokenized. flashrt's
    byte-level tokenizer: 1 (every character is at least one byte, every byte a token).
    Otherwise the longest token string of the vocabulary (a byte-level BPE token's string has
    one character per byte), times 4 for normalizers that compose characters."""
    if getattr(tokenizer, "kind", None) == "bytes":
        return 1
    inner = getattr(tokenizer, "_tok", None)
    longest = 0
    try:
        pieces = inner.convert_ids_to_tokens(list(range(len(inner))))
        longest = max((len(p) for p in pieces if isinstance(p, str)), default=0)
    except Exception:                                   # noqa: BLE001 (another tokenizer kind)
        try:
            longest = max(len(tokenizer.decode([i])) for i in range(vocab))
        except Exception:                               # noqa: BLE001
            longest = 64
    return 4 * max(longest, 1)

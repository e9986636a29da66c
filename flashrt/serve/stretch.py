"""TimeStretch: `speed` for /v1/audio/speech, a pitch-preserving time stretch of a PCM stream (WSOLA).

Output frames of 30 ms, Hann-windowed, overlap by half (hop 15 ms); frame k is read from the
input near k * hop * speed, at the offset within +-10 ms whose samples best continue the previous
frame's (cross-correlation), so waveforms join in phase and the pitch is kept. A frame is made as
soon as the input it may read has arrived: the output of a stream pushed in pieces of any length
equals that of the stream pushed whole, and finish() makes it round(input / speed) samples long.
"""
from __future__ import annotations

import numpy as np


class TimeStretch:
    def __init__(self, speed: float, rate: int, window_s: float = 0.030, tolerance_s: float = 0.010):
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.speed = speed
        self.n = 2 * max(1, round(window_s * rate / 2))          # frame length (even)
        self.hop, self.tol = self.n // 2, max(1, round(tolerance_s * rate))
        # periodic Hann: frames at half overlap sum to exactly 1
        self.win = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(self.n) / self.n)
        self.buf, self.base = np.zeros(0), 0        # buf[0] is input sample number `base`
        self.k, self.prev = 0, 0                    # frames made; input start of the last one
        self.tail = np.zeros(self.hop)              # the last frame's second half, not yet summed
        self.seen = self.sent = 0                   # input samples pushed, output samples returned

    def _nominal(self, k: int) -> int:
        return round(k * self.hop * self.speed)

    def _seg(self, start: int, length: int) -> np.ndarray:
        return self.buf[start - self.base: start - self.base + length]

    def _frames(self, end: int) -> list:
        """Every frame whose input lies below sample `end`; frees the input none later reads."""
        out = []
        while True:
            pos = self._nominal(self.k)
            lo, hi, cont = max(0, pos - self.tol), pos + self.tol, self.prev + self.hop
            if (self.n if self.k == 0 else max(hi, cont) + self.n) > end:
                return out
            start = 0
            if self.k > 0:                          # the offset that best continues the last frame
                score = np.correlate(self._seg(lo, hi - lo + self.n), self._seg(cont, self.n), "valid")
                start = lo + int(np.argmax(score))
            frame = self._seg(start, self.n) * self.win
            out.append(self.tail + frame[: self.hop])
            self.tail, self.prev, self.k = frame[self.hop:].copy(), start, self.k + 1
            keep = min(max(0, self._nominal(self.k) - self.tol), start + self.hop)
            if keep > self.base:
                self.buf, self.base = self.buf[keep - self.base:], keep

    def push(self, pcm) -> np.ndarray:
        """(n,) samples in -> the output samples they complete, float32 (often none at first)."""
        x = np.asarray(pcm, dtype=np.float64)
        self.buf, self.seen = np.concatenate([self.buf, x]), self.seen + len(x)
        out = self._frames(self.base + len(self.buf))
        y = np.concatenate(out) if out else np.zeros(0)
        self.sent += len(y)
        return y.astype(np.float32)

    def finish(self) -> np.ndarray:
        """The input ended: the rest of the output (zeros read past the end), to round(input / speed)."""
        end = self.seen + self.tol + self.hop + self.n          # room for every frame starting inside
        self.buf = np.concatenate([self.buf, np.zeros(max(0, end - self.base - len(self.buf)))])
        y = np.concatenate(self._frames(end) + [self.tail])
        want = max(0, round(self.seen / self.speed) - self.sent)
        y = np.concatenate([y[:want], np.zeros(max(0, want - len(y)))])
        self.sent += len(y)
        return y.astype(np.float32)

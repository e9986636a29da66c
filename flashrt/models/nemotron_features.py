"""Nemotron Speech Streaming's log-mel front end, computed incrementally from a raw-sample tail.

The reference is transformers' NemotronAsrStreamingFeatureExtractor over a whole utterance
(center=True): preemphasis, a 512-point STFT of a 400-sample symmetric Hann window, hop 160,
power spectrum, a Slaney mel bank, log(x + 2^-24). Mel frame f is centred on sample 160 f and
reads samples [160 f - 199, 160 f + 198] (the window is exactly 0 at both ends).

The tail is one arena buffer, `audio.tail` (conv kind, float32): CONTEXT = n_fft/2 + 1 samples
before the next unread frame's centre (zeros at the start: center=True's left padding, and the
preemphasis predecessor) then `audio.pending` samples not yet turned into frames. A chunk of M
frames reads the tail from its start and drops hop * M samples, so frames never depend on how
the audio was split into pushes.
"""
from __future__ import annotations

import math

import torch
from torch import nn

LOG_GUARD = 2.0 ** -24


def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    # Slaney: linear below 1 kHz, logarithmic above (transformers.audio_utils.hertz_to_mel)
    log = 15.0 + torch.log(f.clamp(min=1e-10) / 1000.0) * (27.0 / math.log(6.4))
    return torch.where(f >= 1000.0, log, 3.0 * f / 200.0)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    log = 1000.0 * torch.exp((math.log(6.4) / 27.0) * (m - 15.0))
    return torch.where(m >= 15.0, log, 200.0 * m / 3.0)


def mel_filters(n_mels: int, n_fft: int, sample_rate: int) -> torch.Tensor:
    """(n_mels, n_fft // 2 + 1) float32 Slaney-normalised triangles on the Slaney scale, made
    as transformers.audio_utils.mel_filter_bank(dtype=float32) does: float64, cast, then scaled."""
    bins, f64 = n_fft // 2 + 1, dict(dtype=torch.float64, device="cpu")   # cpu: also in a meta build
    lo, hi = _hz_to_mel(torch.tensor([0.0, sample_rate / 2], **f64)).tolist()
    edges = _mel_to_hz(torch.linspace(lo, hi, n_mels + 2, **f64))
    fft = torch.linspace(0, sample_rate // 2, bins, **f64)
    slopes = edges[None, :] - fft[:, None]                               # (bins, n_mels + 2)
    diff = edges.diff()
    down, up = -slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]
    tri = torch.clamp(torch.minimum(down, up), min=0.0).float()          # (bins, n_mels)
    enorm = 2.0 / (edges[2: n_mels + 2] - edges[:n_mels])
    return (tri * enorm[None, :]).float().t().contiguous()


class LogMel(nn.Module):
    """Log-mel frames of a sample window; the incremental tail on top (append, take)."""

    def __init__(self, n_mels: int, sample_rate: int = 16000, n_fft: int = 512, hop: int = 160,
                 win: int = 400, preemphasis: float = 0.97, max_pending: int = 0):
        super().__init__()
        self.n_mels, self.sample_rate, self.n_fft, self.hop, self.win = n_mels, sample_rate, n_fft, hop, win
        self.preemphasis = preemphasis
        self.context = n_fft // 2 + 1                 # samples kept before the next frame's centre
        self.tail_len = self.context + max_pending
        self.rebuild("cpu")

    def rebuild(self, device):
        self.register_buffer("window", torch.hann_window(self.win, periodic=False, device=device),
                             persistent=False)
        self.register_buffer("filters", mel_filters(self.n_mels, self.n_fft, self.sample_rate).to(device),
                             persistent=False)

    def needed(self, frames: int) -> int:
        """Pending samples before `frames` more frames can be made without padding."""
        return self.hop * (frames - 1) + self.win // 2

    def frames(self, x: torch.Tensor, pad: int = 0) -> torch.Tensor:
        """x: (hop * (M - 1) + n_fft + 1 - pad,) raw samples, x[0] only the preemphasis
        predecessor of x[1] (the first frame's first sample); pad zeros follow the preemphasis
        (the end of the audio). Returns (M, n_mels) float32, as the reference."""
        y = x[1:] - self.preemphasis * x[:-1]
        if pad:
            y = torch.cat([y, y.new_zeros(pad)])
        spec = torch.stft(y, self.n_fft, hop_length=self.hop, win_length=self.win, window=self.window,
                          return_complex=True, center=False)                # (n_fft/2 + 1, M)
        power = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1)).pow(2)
        return torch.log(self.filters @ power + LOG_GUARD).t()

    # ---- the tail in the arena -------------------------------------------------------------
    def append(self, pcm: torch.Tensor, tail: torch.Tensor, pending: torch.Tensor) -> int:
        """Copy as many samples of pcm (n,) float32 as fit after the pending ones; returns how many."""
        p = int(pending)
        n = min(self.tail_len - self.context - p, pcm.shape[0])
        if n > 0:
            at = self.context + p
            tail[at: at + n].copy_(pcm[:n])
            pending.add_(n)
        return n

    def take(self, frames: int, tail: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        """The next `frames` frames (M, n_mels) from the tail, zeros past the pending samples (at
        the end of the audio: center=True's right padding); drops hop * M samples."""
        have = self.context + int(pending)
        need = self.hop * (frames - 1) + self.n_fft + 1
        mel = self.frames(tail[: min(need, have)], max(0, need - have))
        drop = min(self.hop * frames, have)
        tail[: have - drop].copy_(tail[drop: have].clone())
        tail[have - drop: have].zero_()         # past the pending samples: zeros, whatever the pushes
        pending.sub_(drop).clamp_(min=0)
        return mel

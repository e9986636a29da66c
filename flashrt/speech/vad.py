"""VoiceActivity: a VadModel on a Session with Silero's segmentation rules; all its state is arena
buffers, so a capsule taken between any two pushes (mid-chunk, mid-utterance) continues bitwise.

Rules (VadRules) are those of the silero-vad package: a chunk whose probability is >= threshold
starts speech (or cancels a pending end); while in speech, a chunk below neg_threshold marks a
possible end, confirmed once min_silence_duration_ms of chunks have passed; segments of
min_speech_duration_ms or less are dropped; events are padded by speech_pad_ms. So the events
equal VADIterator's (VadRules(min_speech_duration_ms=0)) and, with finish() at the end, the
segments of get_speech_timestamps on the same audio (default rules), except that
get_speech_timestamps splits a gap under 2 x speech_pad between two segments, which streaming
cannot know when it emits the end (and clamps an end's pad at the audio's end): neither occurs
unless speech_pad_ms exceeds about (min_silence_duration_ms + 32) / 2, as with the defaults.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from flashrt.capsules.types import Capsule
from flashrt.core.arena import BufferSpec
from flashrt.core.layer import SessionLayer
from flashrt.core.session import Session, SessionOptions
from flashrt.models.loader import fingerprint as model_fingerprint
from flashrt.models.protocol import VadModel

from .pcm import mono_samples

_MAX_CHUNKS = 1 << 62      # one session position per chunk; no per-token rows, so no real bound
_SEGMENTER = ("vad.triggered", "vad.confirmed", "vad.start", "vad.temp_end")


@dataclass(frozen=True)
class VadRules:
    """Silero's segmentation parameters (get_speech_timestamps' names and defaults)."""
    threshold: float = 0.5
    neg_threshold: float | None = None      # None: max(threshold - 0.15, 0.01)
    min_silence_duration_ms: float = 100
    speech_pad_ms: float = 30
    min_speech_duration_ms: float = 250

    def __post_init__(self):
        def bad(field, value, want):
            raise ValueError(f"VadRules.{field}={value!r}: expected {want}")
        if not 0.0 <= self.threshold <= 1.0:
            bad("threshold", self.threshold, "a probability in [0, 1]")
        if self.neg_threshold is not None and not 0.0 <= self.neg_threshold <= self.threshold:
            bad("neg_threshold", self.neg_threshold, f"None or a value in [0, threshold={self.threshold}]")
        for f in ("min_silence_duration_ms", "speech_pad_ms", "min_speech_duration_ms"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                bad(f, v, "a finite number of milliseconds >= 0")

    @property
    def neg(self) -> float:
        return max(self.threshold - 0.15, 0.01) if self.neg_threshold is None else self.neg_threshold


@dataclass(frozen=True)
class SpeechStart:
    sample: int           # first sample of the speech, speech_pad earlier (>= 0), from stream start
    chunk: int            # index of the chunk whose probability decided it (known at its end)
    sample_rate: int = 16000

    @property
    def seconds(self) -> float:
        return self.sample / self.sample_rate


@dataclass(frozen=True)
class SpeechEnd:
    sample: int           # end of the speech (exclusive), speech_pad later
    chunk: int
    sample_rate: int = 16000

    @property
    def seconds(self) -> float:
        return self.sample / self.sample_rate


@dataclass(frozen=True)
class VadResult:
    events: tuple         # SpeechStart / SpeechEnd, in stream order
    probs: torch.Tensor   # (n,) float32: the probability of each chunk this call ran
    first_chunk: int      # stream index of probs[0]


def check_vad_model(net) -> None:
    """Refuse a model this layer cannot run, naming the gap (see models.protocol.VadModel)."""
    name = type(net).__name__
    if not isinstance(net, VadModel):
        raise TypeError(f"{name} is not a voice activity model: expected a subclass of "
                        "flashrt.models.protocol.VadModel (models/silero_vad.py is one)")
    missing = [a for a in VadModel.__annotations__ if not hasattr(net, a)]
    if missing:
        raise ValueError(f"{name} does not set VadModel attribute(s) {missing}")
    if "pcm" not in {s.name for s in net.input_specs(torch.float32)}:
        raise ValueError(f"{name} declares no 'pcm' input (see flashrt.models.protocol.VadModel)")


class VoiceActivity(SessionLayer):
    """A voice activity stream (batch 1) over a VadModel's weights; forks share the weights.
    State (what a capsule holds): LSTM, context, pending samples, counters and segmenter.
    net None: the installed silero-vad package's model on CPU (flashrt[speech]).
    fingerprint default: flashrt.models.loader.fingerprint of the parameters as they are."""

    def __init__(self, net=None, rules: VadRules | None = None, fingerprint: dict | None = None,
                 provenance: dict | None = None):
        if net is None:
            from importlib.metadata import version
            from flashrt.models.silero_vad import load_silero_vad
            net, provenance = load_silero_vad(), {"weights": f"silero-vad {version('silero-vad')}",
                                                  **(provenance or {})}
        check_vad_model(net)
        p = next(net.parameters())
        self.net, self.device, self.dtype, self._prov = net, p.device, p.dtype, provenance
        self.rules = rules if rules is not None else VadRules()
        self.sample_rate, self.chunk_samples = net.sample_rate, net.chunk_samples
        self._fp = fingerprint if fingerprint is not None else model_fingerprint(net, self.dtype)
        i64, f32 = torch.int64, torch.float32
        # the partial chunk waiting for more samples, the samples pushed, the segmenter's state
        specs = [BufferSpec("audio.pending", "conv", (net.chunk_samples,), f32),
                 BufferSpec("audio.pending_len", "meta", (1,), i64),
                 BufferSpec("audio.samples", "meta", (1,), i64)]
        specs += [BufferSpec(n, "meta", (1,), i64) for n in _SEGMENTER]
        opts = SessionOptions(max_seq_len=_MAX_CHUNKS, prefill_chunk=_MAX_CHUNKS,
                              checkpoint_every=_MAX_CHUNKS + 1, max_checkpoints=1)
        self.session = Session(net, specs, self.device, self.dtype, self._fp, opts, provenance)
        self.arena = self.session.arena
        self._lock = threading.RLock()

    chunks = property(lambda self: self.session.position, doc="Chunks run since the stream start.")
    samples = property(lambda self: int(self.arena["audio.samples"]), doc="Samples pushed.")
    pending = property(lambda self: int(self.arena["audio.pending_len"]),
                       doc="Samples pushed but not yet run (below one chunk).")

    @property
    def speaking(self) -> bool:
        """Inside a confirmed speech segment (a SpeechStart was emitted, no SpeechEnd yet)."""
        return bool(int(self.arena["vad.confirmed"]))

    # ---- input ----------------------------------------------------------------------------
    # ---- stepping -----------------------------------------------------------------------
    @torch.no_grad()
    def push(self, pcm, sample_rate: int = 16000) -> VadResult:
        """Take PCM of any length (1-D float32 in [-1, 1] or int16, at sample_rate): run every
        chunk it completes, keep the rest in the arena; the events those chunks decided."""
        with self._lock:
            x = mono_samples(pcm, sample_rate, self.sample_rate, self.device)
            return self._run(x, x.numel())

    @torch.no_grad()
    def finish(self) -> VadResult:
        """End of stream: the partial chunk runs zero-padded (get_speech_timestamps pads the last
        one), an open segment long enough ends at the last sample pushed; then reset()."""
        with self._lock:
            k, L = self.pending, self.samples
            res = self._run(torch.zeros(self.chunk_samples - k if k else 0, device=self.device), 0)
            events = list(res.events)
            trig, conf, start, _ = (int(self.arena[n]) for n in _SEGMENTER)
            r, j = self.rules, max(self.chunks - 1, 0)
            if trig and (conf or L - start > self._ms(r.min_speech_duration_ms)):
                if not conf:
                    events.append(SpeechStart(int(max(0, start - self._ms(r.speech_pad_ms))), j,
                                              self.sample_rate))
                events.append(SpeechEnd(L, j, self.sample_rate))
            self.reset()
            return VadResult(tuple(events), res.probs, res.first_chunk)

    def _run(self, x: torch.Tensor, counted: int) -> VadResult:
        a, N = self.arena, self.chunk_samples
        k, first = self.pending, self.session.position
        total = self.samples + counted
        n = (k + x.numel()) // N
        probs = torch.zeros(0)
        if n:
            pcm = torch.cat([a["audio.pending"][:k], x[: n * N - k]]).view(n, N)    # (n, N)
            probs = self.session.step(n, lambda ctx: self.net({"pcm": pcm}, ctx, a, all_positions=True))["prob"]
            x, k = x[n * N - k:], 0
        a["audio.pending"][k: k + x.numel()].copy_(x)
        a["audio.pending_len"].fill_(k + x.numel())
        a["audio.samples"].fill_(total)
        return VadResult(self._segment(probs.tolist(), first, total), probs, first)

    def _ms(self, ms: float) -> float:
        return self.sample_rate * ms / 1000

    def _segment(self, probs: list, first: int, total: int) -> tuple:
        """get_speech_timestamps' state machine over chunk probabilities, one chunk at a time;
        a segment is announced once its length is sure to exceed min_speech (chunk-start times)."""
        a, r, N, sr = self.arena, self.rules, self.chunk_samples, self.sample_rate
        trig, conf, start, temp_end = (int(a[n]) for n in _SEGMENTER)
        thr, neg, pad = r.threshold, r.neg, self._ms(r.speech_pad_ms)
        min_sil, min_speech = self._ms(r.min_silence_duration_ms), self._ms(r.min_speech_duration_ms)
        out = []
        for i, p in enumerate(probs):
            j = first + i
            cur = j * N
            if p >= thr and temp_end:
                temp_end = 0
            if p >= thr and not trig:
                trig, conf, start = 1, 0, cur
            elif p < neg and trig:
                temp_end = temp_end or cur
                if cur - temp_end >= min_sil:
                    if conf or temp_end - start > min_speech:
                        if not conf:
                            out.append(SpeechStart(int(max(0, start - pad)), j, sr))
                        out.append(SpeechEnd(int(temp_end + pad), j, sr))
                    trig = conf = start = temp_end = 0
            # the segment's end is at least temp_end, or the next chunk's start (or stream end)
            if trig and not conf and (temp_end or min(cur + N, total)) - start > min_speech:
                conf = 1
                out.append(SpeechStart(int(max(0, start - pad)), j, sr))
        for n, v in zip(_SEGMENTER, (trig, conf, start, temp_end)):
            a[n].fill_(v)
        return tuple(out)

    # ---- capsules -------------------------------------------------------------------------
    def fork(self, cap: Capsule | None = None, rules: VadRules | None = None) -> "VoiceActivity":
        """An independent stream over the same weights, from `cap` or the live state; rules
        default to this stream's."""
        with self._lock:
            src = cap if cap is not None else self.snapshot()
            child = VoiceActivity(self.net, rules or self.rules, self._fp, self._prov)
            child.restore(src)
            return child

"""StreamingTranscriber: a TranscriberModel on a Session; all its state is arena buffers, so a
capsule taken between any two pushes (mid-utterance, mid-chunk) continues bitwise.

push() takes PCM of any length: samples wait in the model's audio buffer until a chunk of
lookahead + 1 encoder frames is complete, then each chunk is encoded and greedily decoded.
Chunk boundaries depend on the sample count alone, never on how the audio was split.
endpoint() forks the recognizer into a scratch session, flushes the fork with zero lookahead
(what is pending, zero-padded past the end) and returns its tokens at once: the live stream is
untouched, so if the speaker goes on nothing was lost (flushing the live stream would restart
it without its left context).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from flashrt.capsules.types import Capsule
from flashrt.core.layer import SessionLayer
from flashrt.core.session import Session, SessionOptions
from flashrt.models.loader import LoadedModel, load_model
from flashrt.models.loader import fingerprint as model_fingerprint
from flashrt.models.protocol import TranscriberModel

from .pcm import mono_samples

_MAX_FRAMES = 1 << 62      # one session position per encoder frame; no per-token rows, no real bound


@dataclass(frozen=True)
class Transcript:
    """What one call decoded: the tokens (never blank) and the encoder frame each came at."""
    tokens: tuple           # token ids, in order
    frames: tuple           # encoder frame (session position) of each token
    text: str | None        # their text when a tokenizer is present, else None
    end_frame: int          # encoder frames decoded once this call returned
    frame_seconds: float    # audio per encoder frame
    final: bool = False     # endpoint(): the flushed fork's tokens (the live stream had not got them)

    @property
    def times(self) -> tuple:
        """Seconds from the stream start of each token's frame."""
        return tuple(f * self.frame_seconds for f in self.frames)

    @property
    def end_seconds(self) -> float:
        return self.end_frame * self.frame_seconds


def check_transcriber_model(net) -> None:
    """Refuse a model this layer cannot run, naming the gap (see models.protocol.TranscriberModel)."""
    name = type(net).__name__
    if not isinstance(net, TranscriberModel):
        raise TypeError(f"{name} is not a streaming recognizer: expected a subclass of flashrt."
                        "models.protocol.TranscriberModel (models/nemotron_asr_streaming.py is one)")
    missing = [a for a in TranscriberModel.__annotations__ if not hasattr(net, a)]
    if missing:
        raise ValueError(f"{name} does not set TranscriberModel attribute(s) {missing}")


def load_transcriber(path, lookahead: int | None = None, device="cpu", dtype=None,
                     linear_kernel: str = "auto") -> "StreamingTranscriber":
    """A Hugging Face checkpoint directory (model_type nemotron_asr_streaming) -> a transcriber."""
    return StreamingTranscriber(load_model(path, device, dtype, linear_kernel), lookahead)


class StreamingTranscriber(SessionLayer):
    """One audio stream (batch 1) over a TranscriberModel's weights; forks share the weights.
    model: a LoadedModel (its fingerprint and tokenizer used) or the net itself (fingerprint
    default: flashrt.models.loader.fingerprint of the parameters as they are). lookahead: the
    right context in encoder frames, one of the model's (default its first): latency
    (lookahead + 1) frames. State (what a capsule holds): pending samples, encoder windows,
    decoder, counters; a restore keeps this transcriber's lookahead."""

    def __init__(self, model, lookahead: int | None = None, tokenizer=None,
                 fingerprint: dict | None = None, provenance: dict | None = None):
        if isinstance(model, LoadedModel):
            tok = model.tokenizer if getattr(model.tokenizer, "kind", None) == "hf" else None
            tokenizer = tokenizer if tokenizer is not None else tok
            fingerprint = fingerprint if fingerprint is not None else model.fingerprint
            provenance = {"path": str(model.path), **(provenance or {})}
            model = model.net
        check_transcriber_model(model)
        net = model
        look = net.lookaheads[0] if lookahead is None else lookahead
        if isinstance(look, bool) or not isinstance(look, (int, np.integer)) or look not in net.lookaheads:
            raise ValueError(f"lookahead {lookahead!r}: expected one of {list(net.lookaheads)} "
                             "(encoder frames of right context)")
        p = next(net.parameters())
        self.net, self.device, self.dtype, self._prov = net, p.device, p.dtype, provenance
        self.lookahead, self.tokenizer = int(look), tokenizer
        self.sample_rate, self.frame_seconds = net.sample_rate, net.frame_samples / net.sample_rate
        self._fp = fingerprint if fingerprint is not None else model_fingerprint(net, self.dtype)
        self.session = self._session()
        self.arena = self.session.arena
        self._scratch: Session | None = None        # endpoint()'s fork, made on first use
        self._lock = threading.RLock()

    def _session(self) -> Session:
        opts = SessionOptions(max_seq_len=_MAX_FRAMES, prefill_chunk=_MAX_FRAMES,
                              checkpoint_every=_MAX_FRAMES + 1, max_checkpoints=1)
        return Session(self.net, [], self.device, self.dtype, self._fp, opts, self._prov)

    position = property(lambda self: self.session.position, doc="Encoder frames decoded.")
    pending = property(lambda self: self.net.pending_samples(self.arena),
                       doc="Samples pushed but not yet encoded (below one chunk).")
    latency_ms = property(lambda self: round((self.lookahead + 1) * self.frame_seconds * 1000),
                          doc="Audio a chunk waits for: its lookahead + 1 frames.")

    # ---- input ----------------------------------------------------------------------------
    # ---- stepping -----------------------------------------------------------------------
    @torch.no_grad()
    def push(self, pcm, sample_rate: int = 16000) -> Transcript:
        """Take PCM of any length (1-D float32 in [-1, 1] or int16, at sample_rate): decode every
        chunk it completes, keep the rest in the arena; the tokens those chunks emitted."""
        with self._lock:
            x = mono_samples(pcm, sample_rate, self.sample_rate, self.device)
            before, toks, frames, i = self._last(), [], [], 0
            while True:
                i += self.net.accept_audio(x[i:], self.arena)
                self._run(self.session, self.lookahead, False, toks, frames)
                if i >= x.shape[0]:
                    break
            return self._transcript(toks, frames, before, self.position)

    @torch.no_grad()
    def endpoint(self) -> Transcript:
        """End of speech, maybe: fork, flush the fork with zero lookahead (every frame inside the
        audio pushed, as transformers' offline length counts them) and return its tokens, the
        ones this stream has not given yet. The stream itself is left exactly as it was."""
        with self._lock:
            if self._scratch is None:
                self._scratch = self._session()
            fork = self._scratch
            fork.restore(self.session.snapshot())
            toks, frames = [], []
            self._run(fork, 0, True, toks, frames)
            return self._transcript(toks, frames, self._last(), fork.position, final=True)

    def _run(self, session: Session, lookahead: int, final: bool, toks: list, frames: list) -> None:
        net, a = self.net, session.arena
        while T := net.chunk_frames(session.position, net.pending_samples(a), lookahead, final):
            def body(ctx):
                return net.decode(net({"lookahead": lookahead}, ctx, a)["encoded"], ctx, a)
            out = session.step(T, body)
            toks += out["tokens"]
            frames += out["frames"]

    def _last(self) -> int | None:
        """The last token this stream emitted (the text context of the next delta), or None."""
        return int(self.arena["rnnt.last"]) if int(self.arena["rnnt.emitted"]) else None

    def _transcript(self, toks, frames, before, end, final=False) -> Transcript:
        return Transcript(tuple(toks), tuple(frames), self._text(toks, before), end,
                          self.frame_seconds, final)

    def _text(self, toks: list, before: int | None) -> str | None:
        """The delta's text: decoded after the previous token, so a word boundary it opens
        (SentencePiece's leading space) survives."""
        tok = self.tokenizer
        if tok is None or not toks:
            return None if tok is None else ""
        if before is None:
            return tok.decode(toks)
        head, full = tok.decode([before]), tok.decode([before] + toks)
        return full[len(head):] if full.startswith(head) else tok.decode(toks)

    # ---- capsules -------------------------------------------------------------------------
    def fork(self, cap: Capsule | None = None, lookahead: int | None = None) -> "StreamingTranscriber":
        """An independent stream over the same weights, from `cap` or the live state; lookahead
        defaults to this stream's."""
        with self._lock:
            src = cap if cap is not None else self.snapshot()
            child = StreamingTranscriber(self.net, self.lookahead if lookahead is None else lookahead,
                                         self.tokenizer, self._fp, self._prov)
            child.restore(src)
            return child

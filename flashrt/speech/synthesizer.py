"""Synthesizer: a SynthesizerModel (backbone, flow head, end-of-speech rule) and its CodecModel on
one Session, so one capsule holds all of an utterance's state: backbone K/V and latent history
(per position), the flow-noise RNG, the end-of-speech countdown, and the codec decoder's conv
contexts, transposed-conv overlaps and attention window.

make_voice(pcm) encodes a voice prompt and prefills it once: a voice capsule. speak(text_ids,
voice) restores it (or starts cold), prefills the text and streams PCM one frame at a time. A
restore continues bitwise as the run that never left, mid-utterance capsules included.
"""
from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Iterator

import torch

from flashrt.capsules.types import Capsule
from flashrt.core.rng import seed_rng
from flashrt.core.session import Session, SessionOptions
from flashrt.models.loader import assign_weights, fingerprint as model_fingerprint, load_model
from flashrt.models.protocol import CodecModel, SynthesizerModel
from flashrt.models.registry import model_module

CODEC_DIR = "audio_tokenizer"      # where the released checkpoints keep the codec


def load_codec(path, device="cpu", dtype=torch.float32) -> tuple[CodecModel, dict]:
    """A codec checkpoint folder (its own config.json and safetensors) -> (net, fingerprint)."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    mod = model_module(hf)
    with torch.device("meta"):
        net = mod.Model(mod.CONFIG.from_hf(hf))
    digest = assign_weights(net, path, torch.device(device), dtype)
    return net.eval(), model_fingerprint(net, dtype, digest)


def load_synthesizer(path, device="cpu", dtype=None, max_seq_len: int = 1024, **kw) -> "Synthesizer":
    """A TTS checkpoint directory (model at the root, codec in audio_tokenizer/); kw: Synthesizer's."""
    lm = load_model(path, device, dtype)
    codec, codec_fp = load_codec(Path(path) / CODEC_DIR, lm.device, lm.dtype)
    fp = {**lm.fingerprint, "codec": codec_fp["weights"]}
    return Synthesizer(lm.net, codec, fp, max_seq_len, {"path": str(path)}, **kw)


class Synthesizer:
    """One utterance stream (batch 1) over shared TTS and codec weights; make more for forks."""

    def __init__(self, net: SynthesizerModel, codec: CodecModel, fingerprint: dict | None = None,
                 max_seq_len: int = 1024, provenance: dict | None = None, fade_in: float = 0.005):
        if not isinstance(net, SynthesizerModel) or not isinstance(codec, CodecModel):
            raise TypeError(f"Synthesizer takes a SynthesizerModel and a CodecModel, got "
                            f"{type(net).__name__} and {type(codec).__name__}")
        if net.latent_dim != codec.latent_dim:
            raise ValueError(f"latent widths differ: model {net.latent_dim}, codec {codec.latent_dim}")
        p = next(net.parameters())
        self.net, self.codec, self.device, self.dtype = net, codec, p.device, p.dtype
        self.sample_rate, self.frame_size = codec.sample_rate, codec.frame_size
        if fingerprint is None:
            fingerprint = {**model_fingerprint(net, self.dtype),
                           "codec": model_fingerprint(codec, self.dtype)["weights"]}
        codec_specs = codec.state_specs(max_seq_len, self.dtype)
        self._codec_buffers = [s.name for s in codec_specs]
        self.session = Session(net, codec_specs, self.device, self.dtype, fingerprint,
                               SessionOptions(max_seq_len=max_seq_len), provenance)
        self.arena = self.session.arena
        # the processor's fade-in over the first samples: a fresh decoder starts with a click
        self.fade_in, n = fade_in, min(int(fade_in * self.sample_rate), self.frame_size)
        self._fade = torch.linspace(0, 1, n, device=self.device)
        self._lock = threading.RLock()

    fingerprint = property(lambda self: self.session.fingerprint)
    frame = property(lambda self: int(self.arena["tts.frame"]), doc="Frames of this utterance.")

    # ---- prompts ------------------------------------------------------------------------
    @torch.no_grad()
    def make_voice(self, pcm: torch.Tensor) -> Capsule:
        """Voice prompt PCM (N,) float32 at sample_rate -> a capsule of its prefilled prefix
        [audio_prompt_bos, voice latents]; speak(..., voice=) starts from it."""
        with self._lock:
            self._prefill_voice(pcm)
            return self.session.snapshot()

    def _prefill_voice(self, pcm: torch.Tensor) -> None:
        if pcm.dim() != 1 or pcm.dtype != torch.float32:
            raise ValueError(f"pcm: expected 1-D float32 samples, got {tuple(pcm.shape)} {pcm.dtype}")
        latents = self.codec.encode(pcm.to(self.device))                       # (F, latent)
        ids = torch.full((latents.shape[0] + 1,), self.net.prompt_id, device=self.device)
        ids[0] = self.net.prompt_bos_id
        voice = torch.cat([latents.new_zeros(1, latents.shape[1]), latents])
        self.session.reset()
        self._prefill(ids, voice)

    def _prefill(self, ids: torch.Tensor, voice: torch.Tensor | None = None) -> None:
        a, net = self.arena, self.net

        def run(i, k):
            inp = {"ids": ids[i: i + k]} if voice is None else {"ids": ids[i: i + k], "voice": voice[i: i + k]}
            self.session.step(k, lambda ctx: net(inp, ctx, a))
        self.session.advance(ids.shape[0], run)

    @torch.no_grad()
    def start(self, text_ids, voice: Capsule | torch.Tensor | None = None, *, temperature: float = 0.7,
              seed: int = 0, frames_after_eos: int = 2, eos_threshold: float = -4.0,
              min_frames_before_eos: int = 6) -> None:
        """A new utterance: the voice capsule's state (a PCM tensor: encoded and prefilled here,
        the cold path; None: no voice), a fresh codec decoder, the noise stream at `seed`, then
        the text prefilled. frames() streams it."""
        ids = torch.as_tensor(text_ids, dtype=torch.int64).reshape(-1)
        vocab = self.net.config.vocab_size
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"text_ids: expected a non-empty list of ids in [0, {vocab})")
        with self._lock:
            if isinstance(voice, torch.Tensor):
                self._prefill_voice(voice)
            elif voice is not None:
                self.session.restore(voice)
            else:
                self.session.reset()
            for name in self._codec_buffers:
                self.arena[name].zero_()
            seed_rng(self.arena["tts.rng"], seed)
            self.net.begin(self.arena, temperature, frames_after_eos, eos_threshold,
                           min_frames_before_eos)
            self._prefill(ids.to(self.device))

    def budget(self, n_text: int) -> int:
        """transformers' default frame budget for n_text text tokens."""
        return math.ceil((n_text / 3 + 2) * self.net.frame_rate)

    # ---- frames -------------------------------------------------------------------------
    def _frame(self, ctx):
        out = self.net({}, ctx, self.arena)
        pcm = self.codec({"latent": self.net.denormalize(out["latent"])}, ctx, self.arena)["pcm"]
        return {**out, "pcm": pcm[0]}

    @torch.no_grad()
    def frames(self, max_frames: int) -> Iterator[torch.Tensor]:
        """PCM of the next frames, (frame_size,) float32 each, until the end-of-speech rule's
        countdown ends or max_frames."""
        for _ in range(max_frames):
            with self._lock:
                out = self.session.step(1, self._frame)
                pcm, first = out["pcm"], self.frame == 1
            if first and self._fade.numel():
                pcm = torch.cat([pcm[: self._fade.numel()] * self._fade, pcm[self._fade.numel():]])
            yield pcm
            if bool(out["done"]):
                return

    def speak(self, text_ids, voice: Capsule | torch.Tensor | None = None, max_frames: int | None = None,
              **knobs) -> Iterator[torch.Tensor]:
        """start() now, then frames(): a stream of PCM frames (see start for the knobs)."""
        self.start(text_ids, voice, **knobs)
        return self.frames(self.budget(len(text_ids)) if max_frames is None else max_frames)

    # ---- capsules -----------------------------------------------------------------------
    def snapshot(self, into: Capsule | None = None) -> Capsule:
        with self._lock:
            return self.session.snapshot(into=into)

    def restore(self, cap: Capsule) -> None:
        """Back to a capsule of this model pair (a voice, or mid-utterance: frames() continues)."""
        with self._lock:
            self.session.restore(cap)

    def reseed(self, seed: int) -> None:
        """Another noise stream from here on (a fork that samples differently)."""
        with self._lock:
            seed_rng(self.arena["tts.rng"], seed)

    def fork(self) -> "Synthesizer":
        """A new stream over the same weights, at this one's state."""
        with self._lock:
            fp = {k: v for k, v in self.fingerprint.items() if k != "layout"}
            other = Synthesizer(self.net, self.codec, fp, self.session.max_seq_len, fade_in=self.fade_in)
            other.session.restore(self.session.snapshot())
            return other

"""Synthesizer: a SynthesizerModel (backbone, flow head, end-of-speech rule) and its CodecModel on
one Session, so one capsule holds all of an utterance's state: backbone K/V and latent history
(per position), the flow-noise RNG, the end-of-speech countdown, and the codec decoder's conv
contexts, transposed-conv overlaps and attention window.

make_voice(pcm) cuts the prompt as transformers' feature extractor does (the codec's
voice_rules), encodes and prefills it once: a voice capsule (save_capsule / CapsuleStore it);
make_voice(latents=) prefills stored voice latents without the encoder.
A reply is sentences, each started from the voice capsule (never re-prefilled) with one noise
stream running through them: reply(voice, seed), then say(ids) per sentence; speak_long splits
ids as transformers' split_text does; IncrementalSpeaker speaks an LM's text deltas sentence by
sentence. rollback_to_played(samples) puts every buffer back at the last fully played frame
(barge-in) and says how many characters of the reply that covers.
"""
from __future__ import annotations

import json
import math
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from flashrt.capsules.types import Capsule
from flashrt.core.rng import seed_rng
from flashrt.core.session import Session, SessionOptions
from flashrt.models.loader import (assign_weights, fingerprint as model_fingerprint, load_model,
                                   select_linear_kernel)
from flashrt.models.protocol import CodecModel, SynthesizerModel
from flashrt.models.registry import model_module

CODEC_DIR = "audio_tokenizer"      # where the released checkpoints keep the codec


def load_codec(path, device="cpu", dtype=torch.float32, linear_kernel: str = "auto") -> tuple[CodecModel, dict]:
    """A codec checkpoint folder (its own config.json and safetensors) -> (net, fingerprint).
    linear_kernel: its projections' matmul path (flashrt.nn.linear.select_linear_kernel)."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    mod = model_module(hf)
    with torch.device("meta"):
        net = mod.Model(mod.CONFIG.from_hf(hf))
    digest = assign_weights(net, path, torch.device(device), dtype)
    select_linear_kernel(net, torch.device(device), dtype, linear_kernel)
    return net.eval(), model_fingerprint(net, dtype, digest)


def load_synthesizer(path, device="cpu", dtype=None, max_seq_len: int = 1024, linear_kernel: str = "auto",
                     **kw) -> "Synthesizer":
    """A TTS checkpoint directory (model at the root, codec in audio_tokenizer/); kw: Synthesizer's.
    linear_kernel: the projections' matmul path, both models (see flashrt.load)."""
    lm = load_model(path, device, dtype, linear_kernel)
    codec, codec_fp = load_codec(Path(path) / CODEC_DIR, lm.device, lm.dtype, linear_kernel)
    fp = {**lm.fingerprint, "codec": codec_fp["weights"]}
    return Synthesizer(lm.net, codec, fp, max_seq_len, {"path": str(path)}, tokenizer=lm.tokenizer, **kw)


# ---- sentences ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SentenceRule:
    """transformers' PocketTTSProcessor.split_text, on token ids: cut after each run of
    sentence_end_ids (the ids of ".", "!", "...", "?"; not at a decimal point, which needs
    decode: ids -> text, else none is skipped), sentences over max_tokens again after runs of
    clause_end_ids (",", ";", ":"), then pieces grouped greedily up to max_tokens. The ids are
    the prepared text's: the chat template's text preparation is the caller's tokenizer's."""
    sentence_end_ids: frozenset
    clause_end_ids: frozenset = frozenset()
    max_tokens: int = 50
    decode: Callable[[list], str] | None = None


def _cuts(ids: list, ends: frozenset, decode=None) -> list[int]:
    """Starts of the pieces of ids after each run of `ends` (decode: skip decimal points)."""
    def decimal(i):
        pre, post = decode(ids[:i]), decode(ids[i:])
        return len(pre) >= 2 and pre[-1] == "." and pre[-2].isdigit() and post[:1].isdigit()
    return [0] + [i for i in range(1, len(ids)) if ids[i - 1] in ends and ids[i] not in ends
                  and not (decode is not None and decimal(i))]


def sentence_spans(ids: Sequence[int], rule: SentenceRule) -> list[tuple[int, int]]:
    """[start, end) token spans of the sentences (clauses of long ones), not yet grouped."""
    ids, out = list(ids), []
    starts = _cuts(ids, rule.sentence_end_ids, rule.decode) + [len(ids)]
    for a, b in zip(starts, starts[1:]):
        if b - a > rule.max_tokens:
            sub = [a + c for c in _cuts(ids[a:b], rule.clause_end_ids)] + [b]
            out += list(zip(sub, sub[1:]))
        else:
            out.append((a, b))
    return out if ids else []


def split_sentences(ids: Sequence[int], rule: SentenceRule, merge: bool = True) -> list[list[int]]:
    """ids -> the chunks transformers' split_text decodes (merge=False: one per sentence)."""
    ids, chunks = list(ids), []
    for a, b in sentence_spans(ids, rule):
        if chunks and merge and len(chunks[-1]) + b - a <= rule.max_tokens:
            chunks[-1] += ids[a:b]
        else:
            chunks.append(ids[a:b])
    return chunks


@dataclass
class _Sentence:
    """What rollback_to_played needs of one sentence of a reply."""
    ids: torch.Tensor
    chars: int                     # characters of the reply text it covers
    start: int                     # session position of its first frame
    budget: int                    # frames it may take (the estimate's denominator until known)
    n: int = 0                     # frames generated
    total: int | None = None       # its speech frames, once known (EOS frame, or n when closed)
    log: list = field(default_factory=list)     # after frame k + 1: (3,) [rng seed, counter, countdown]
    marks: dict = field(default_factory=dict)   # frame -> session.mark(): fixed state, codec included
    end: Capsule | None = None     # its last frame's state once the next sentence took the arena


@dataclass
class _Reply:
    voice: Capsule | None
    seed: int
    knobs: dict
    sentences: list = field(default_factory=list)


class Synthesizer:
    """One utterance stream (batch 1) over shared TTS and codec weights; make more for forks.

    codec_mark_every: frames between codec marks (fixed state copies) a barge-in rewinds to; it
    then re-decodes at most that many - 1 kept latents, one at a time as they were first decoded
    (same shapes, so bitwise): per-frame marks would copy the codec's window every 80 ms."""

    def __init__(self, net: SynthesizerModel, codec: CodecModel, fingerprint: dict | None = None,
                 max_seq_len: int = 1024, provenance: dict | None = None, fade_in: float = 0.005,
                 voice_rules=None, codec_mark_every: int = 8, tokenizer=None):
        if not isinstance(net, SynthesizerModel) or not isinstance(codec, CodecModel):
            raise TypeError(f"Synthesizer takes a SynthesizerModel and a CodecModel, got "
                            f"{type(net).__name__} and {type(codec).__name__}")
        if net.latent_dim != codec.latent_dim:
            raise ValueError(f"latent widths differ: model {net.latent_dim}, codec {codec.latent_dim}")
        if codec_mark_every < 1:
            raise ValueError(f"codec_mark_every must be >= 1, got {codec_mark_every}")
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
        self.voice_rules = voice_rules if voice_rules is not None else getattr(codec, "voice_rules", None)
        self.codec_mark_every = codec_mark_every
        self.tokenizer = tokenizer     # the checkpoint's (text -> ids), if it was loaded from one
        self._reply: _Reply | None = None
        self._epoch = 0                # bumped when the arena leaves the sentence frames() streams
        self._lock = threading.RLock()

    fingerprint = property(lambda self: self.session.fingerprint)
    frame = property(lambda self: int(self.arena["tts.frame"]), doc="Frames of this utterance.")

    # ---- prompts ------------------------------------------------------------------------
    @torch.no_grad()
    def make_voice(self, pcm: torch.Tensor | None = None, *, latents: torch.Tensor | None = None) -> Capsule:
        """Voice prompt PCM (N,) float32 at sample_rate, or its latents (F, latent_dim) as
        codec.encode gives them (a stored voice) -> a capsule of its prefilled prefix
        [audio_prompt_bos, voice latents]; speak(..., voice=) / reply(voice) start from it."""
        if (pcm is None) == (latents is None):
            raise ValueError("make_voice: pass either pcm or latents")
        if pcm is not None and (pcm.dim() != 1 or pcm.dtype != torch.float32):
            raise ValueError(f"pcm: expected 1-D float32 samples, got {tuple(pcm.shape)} {pcm.dtype}")
        if latents is not None and (latents.dim() != 2 or latents.shape[0] == 0
                                    or latents.shape[1] != self.net.latent_dim):
            raise ValueError(f"latents: expected (frames >= 1, {self.net.latent_dim}), got "
                             f"{tuple(latents.shape)}")
        with self._lock:
            self._forget()
            self._prefill_voice(pcm, latents)
            return self.session.snapshot()

    def _prefill_voice(self, pcm: torch.Tensor | None, latents: torch.Tensor | None = None) -> None:
        if latents is None:
            if self.voice_rules is not None:
                pcm = self.voice_rules.prepare(pcm, self.sample_rate)
            latents = self.codec.encode(pcm.to(self.device))                   # (F, latent)
        latents = latents.to(self.device, torch.float32)
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

    def _ids(self, text_ids) -> torch.Tensor:
        ids = torch.as_tensor(text_ids, dtype=torch.int64).reshape(-1)
        vocab = self.net.config.vocab_size
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"text_ids: expected a non-empty list of ids in [0, {vocab})")
        return ids

    # ---- replies ------------------------------------------------------------------------
    @torch.no_grad()
    def reply(self, voice: Capsule | torch.Tensor | None = None, *, seed: int = 0,
              temperature: float = 0.7, frames_after_eos: int = 2, eos_threshold: float = -4.0,
              min_frames_before_eos: int = 6) -> None:
        """A new reply: every say() starts from `voice` (a capsule; PCM: make_voice here; None:
        no voice) with a fresh codec decoder; one noise stream from `seed` runs through them."""
        with self._lock:
            if isinstance(voice, torch.Tensor):
                voice = self.make_voice(voice)
            knobs = dict(temperature=temperature, frames_after_eos=frames_after_eos,
                         eos_threshold=eos_threshold, min_frames_before_eos=min_frames_before_eos)
            self._forget()
            self._reply = _Reply(voice, seed, knobs)
            self._reply_start()

    def _reply_start(self) -> None:
        self._from_voice()
        seed_rng(self.arena["tts.rng"], self._reply.seed)

    def _from_voice(self) -> None:
        """The voice's state, a fresh decoder and the knobs; the noise stream goes on."""
        r, a = self._reply, self.arena
        rng = a["tts.rng"].clone()
        if r.voice is not None:
            self.session.restore(r.voice)
        else:
            self.session.reset()
        a["tts.rng"].copy_(rng)
        for name in self._codec_buffers:
            a[name].zero_()
        self.net.begin(a, **r.knobs)

    @torch.no_grad()
    def say(self, text_ids, chars: int = 0, max_frames: int | None = None) -> Iterator[torch.Tensor]:
        """One sentence of the reply (covering `chars` characters of its text), from the voice
        capsule: the previous sentence's end is kept (for rollback), then frames() streams."""
        ids = self._ids(text_ids)
        budget = self.budget(ids.numel()) if max_frames is None else max_frames
        self._say(ids, chars, budget)
        return self.frames(budget)

    def _say(self, ids: torch.Tensor, chars: int, budget: int) -> None:
        with self._lock:
            r = self._reply
            if r is None:
                raise RuntimeError("say(): start a reply first (reply(voice, seed=...))")
            if r.sentences:
                self._close(r.sentences[-1])
                self._from_voice()
            self._prefill(ids.to(self.device))
            s = _Sentence(ids, chars, self.session.position, budget)
            s.marks[0] = self.session.mark()
            r.sentences.append(s)
            self._epoch += 1

    def _close(self, s: _Sentence) -> None:
        if s.end is None:        # a delta over the voice: only this sentence's rows are copied
            v = self._reply.voice
            s.end = self.session.snapshot() if v is None else self.session.snapshot(parent=v)
        if s.total is None:
            s.total = s.n

    def speak_long(self, text_ids, voice: Capsule | torch.Tensor | None = None, *,
                   rule: SentenceRule, max_frames: int | None = None, **knobs) -> Iterator[torch.Tensor]:
        """reply(voice, **knobs), then say() each chunk of split_sentences(text_ids, rule)."""
        chunks = split_sentences(self._ids(text_ids).tolist(), rule)
        self.reply(voice, **knobs)
        return (pcm for chunk in chunks for pcm in self.say(chunk, max_frames=max_frames))

    @torch.no_grad()
    def start(self, text_ids, voice: Capsule | torch.Tensor | None = None, *, seed: int = 0,
              **knobs) -> None:
        """A one-sentence reply (see reply for voice and the knobs): the voice's state, a fresh
        codec decoder, the noise stream at `seed`, the text prefilled. frames() streams it."""
        ids = self._ids(text_ids)
        with self._lock:
            self.reply(voice, seed=seed, **knobs)
            self._say(ids, 0, self.budget(ids.numel()))

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
        countdown ends or max_frames; ends early once a say/rollback/restore moved the arena."""
        epoch = self._epoch
        for _ in range(max_frames):
            with self._lock:
                if self._epoch != epoch:
                    return
                out = self.session.step(1, self._frame)
                k, done = self.frame, bool(out["done"])
                self._note(k, done)
                pcm = out["pcm"]
            if k == 1 and self._fade.numel():
                pcm = torch.cat([pcm[: self._fade.numel()] * self._fade, pcm[self._fade.numel():]])
            yield pcm
            if done:
                return

    def _note(self, k: int, done: bool) -> None:
        """Frame k of the reply's sentence is out: its small state, a codec mark every so often."""
        if self._reply is None or not self._reply.sentences:
            return
        s, a = self._reply.sentences[-1], self.arena
        del s.log[k - 1:]
        s.log.append(torch.cat([a["tts.rng"], a["tts.countdown"]]))
        s.n = k
        if k % self.codec_mark_every == 0:
            s.marks[k] = self.session.mark()
        if done:
            s.total = k - self._reply.knobs["frames_after_eos"]   # through the EOS frame

    def speak(self, text_ids, voice: Capsule | torch.Tensor | None = None, max_frames: int | None = None,
              **knobs) -> Iterator[torch.Tensor]:
        """start() now, then frames(): a stream of PCM frames (see start for the knobs)."""
        self.reply(voice, **knobs)
        return self.say(text_ids, max_frames=max_frames)

    # ---- barge-in -----------------------------------------------------------------------
    @torch.no_grad()
    def rollback_to_played(self, samples: int) -> int:
        """The reply's first `samples` PCM samples were played: every buffer (backbone K/V and
        latent rows, codec, RNG, EOS countdown) goes back to the last fully played frame, as
        if no later frame had been made; 0 frames of a sentence is before it was started.
        Returns the characters of the reply text that covers (its LM's delivered_chars):
        whole sentences, plus for a cut one a proportional estimate by frames (no alignment),
        chars * frames / speech frames (known once its EOS fired; else its frame budget, an
        upper bound: the estimate errs low, so the LM repeats a little rather than skips)."""
        with self._lock:
            r = self._reply
            if r is None:
                raise RuntimeError("rollback_to_played(): no reply (reply() / start() first)")
            self._epoch += 1
            left, delivered, j = max(0, int(samples)) // self.frame_size, 0, 0
            while j < len(r.sentences) - 1 and left >= r.sentences[j].n:
                left, delivered, j = left - r.sentences[j].n, delivered + r.sentences[j].chars, j + 1
            if not r.sentences or (j == 0 and left == 0):
                r.sentences.clear()
                self._reply_start()
                return 0
            if left == 0:                       # nothing of sentence j: the end of j - 1
                j -= 1
                delivered -= r.sentences[j].chars
                left = r.sentences[j].n
            s, f = r.sentences[j], min(left, r.sentences[j].n)
            if j < len(r.sentences) - 1:        # a later sentence holds the arena
                del r.sentences[j + 1:]
                self.session.restore(s.end)
            if f < s.n:
                self._rewind(s, f)
            return delivered + self._covered(s, f)

    def _rewind(self, s: _Sentence, f: int) -> None:
        """Sentence s (in the arena, f < s.n frames kept) back to frame f: the codec from its
        last mark by re-decoding kept latent rows; RNG and countdown from the frame log."""
        m = max(k for k in s.marks if k <= f)
        self.session.rewind(s.marks[m])                                # position s.start + m
        hist, a = self.arena[self.net.history], self.arena
        for p in range(s.start + m, s.start + f):
            self.session.step(1, lambda ctx, p=p: self.codec(
                {"latent": self.net.denormalize(hist[p: p + 1])}, ctx, a))
        a["tts.frame"].fill_(f)
        a["tts.rng"].copy_(s.log[f - 1][:2])
        a["tts.countdown"].copy_(s.log[f - 1][2:])
        self.session.invalidate_from(s.start + f)     # rows above are this sentence's no more
        del s.log[f:]
        s.marks = {k: v for k, v in s.marks.items() if k <= f}
        s.n, s.end = f, None

    @staticmethod
    def _covered(s: _Sentence, f: int) -> int:
        denom = s.total if s.total is not None else max(s.budget, s.n)
        return s.chars if f >= denom else s.chars * f // max(denom, 1)

    # ---- capsules -----------------------------------------------------------------------
    def _forget(self) -> None:
        """The arena leaves the reply: no rollback into it, no stream of it goes on."""
        self._reply = None
        self._epoch += 1

    def snapshot(self, into: Capsule | None = None) -> Capsule:
        with self._lock:
            return self.session.snapshot(into=into)

    def restore(self, cap: Capsule) -> None:
        """Back to a capsule of this model pair (a voice, or mid-utterance: frames() continues);
        the reply ends there (rollback_to_played covers say()s after the next reply())."""
        with self._lock:
            self._forget()
            self.session.restore(cap)

    def reseed(self, seed: int) -> None:
        """Another noise stream from here on (a fork that samples differently)."""
        with self._lock:
            seed_rng(self.arena["tts.rng"], seed)

    def fork(self) -> "Synthesizer":
        """A new stream over the same weights, at this one's state."""
        with self._lock:
            fp = {k: v for k, v in self.fingerprint.items() if k != "layout"}
            other = Synthesizer(self.net, self.codec, fp, self.session.max_seq_len, fade_in=self.fade_in,
                                voice_rules=self.voice_rules, codec_mark_every=self.codec_mark_every,
                                tokenizer=self.tokenizer)
            other.session.restore(self.session.snapshot())
            return other


class IncrementalSpeaker:
    """An LM's reply as text deltas in, PCM frames out a sentence at a time as each completes.

    tokenize(text) -> (ids, ends): the injected tokenizer, ends[i] the character offset where
    token i ends (a fast HF tokenizer's offset_mapping[i][1]). The whole pending text is cut
    by `rule` (split_sentences, one sentence per say, not grouped: the first is spoken as soon
    as it ends); a sentence is complete once a token after its end mark arrives, or at flush."""

    def __init__(self, synth: Synthesizer, voice, tokenize: Callable[[str], tuple], rule: SentenceRule,
                 max_frames: int | None = None, **reply_knobs):
        self.synth, self.tokenize, self.rule, self.max_frames = synth, tokenize, rule, max_frames
        self.text, self._cut = "", 0         # the reply so far; characters already in sentences
        self._queue, self._ended = deque(), False
        synth.reply(voice, **reply_knobs)

    def feed(self, delta: str) -> Iterator[torch.Tensor]:
        """Append text; frames of the sentences it completes (and of any queued before)."""
        self._check()
        self.text += delta
        self._queue.extend(self._complete(final=False))
        return self._drain()

    def flush(self) -> Iterator[torch.Tensor]:
        """The text ended: frames of what is left."""
        self._check()
        self._queue.extend(self._complete(final=True))
        return self._drain()

    @property
    def given_chars(self) -> int:
        """Characters of `text` cut into sentences so far (the rest waits for a sentence end)."""
        return self._cut

    def rollback_to_played(self, samples: int) -> int:
        """Barge-in: Synthesizer.rollback_to_played; queued sentences are dropped and the reply
        ends here. Returns the characters of `text` delivered."""
        self._ended = True
        self._queue.clear()
        return self.synth.rollback_to_played(samples)

    def _check(self) -> None:
        if self._ended:
            raise RuntimeError("this reply was rolled back: start a new IncrementalSpeaker")

    def _complete(self, final: bool) -> list:
        rest = self.text[self._cut:]
        ids, ends = self.tokenize(rest)
        spans = sentence_spans(ids, self.rule)
        out, prev = [], 0
        for a, b in spans if final else spans[:-1]:
            end = len(rest) if final and b == len(ids) else ends[b - 1]
            out.append((list(ids[a:b]), end - prev))
            prev = end
        self._cut += prev
        return out

    def _drain(self) -> Iterator[torch.Tensor]:
        while self._queue:
            ids, chars = self._queue.popleft()
            yield from self.synth.say(ids, chars, self.max_frames)

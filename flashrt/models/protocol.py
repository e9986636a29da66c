"""The model protocol: what a model file implements to run on a Session.

A model owns weights and declares its state; it never allocates state itself. A Session gives
it an arena (name -> fixed-address view) and a StepCtx; the model reads and writes its named
buffers in place, so the same forward runs eagerly on CPU and inside a captured CUDA graph.

Required: `state_specs`, `input_specs`, `forward`, and a module-level `CONFIG` with
`from_hf(dict)` in the model file. Everything else below is an optional hook with a default.
A policy model (flashrt.policy) derives from PolicyModel, which adds attributes and buffers.
A voice activity model (flashrt.speech) derives from VadModel, which adds attributes.
A text-to-speech model derives from SynthesizerModel, its audio codec from CodecModel.
A streaming speech recognizer (flashrt.speech.StreamingTranscriber) derives from TranscriberModel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashrt.core.arena import BufferSpec
from flashrt.core.step import StepCtx
from flashrt.errors import ConfigError


@dataclass(frozen=True)
class InputSpec:
    """One named per-position input of a step: a tensor of shape (T, *shape)."""
    name: str
    shape: tuple = ()                   # per-position trailing shape
    dtype: torch.dtype | None = None    # None: the model's activation dtype
    doc: str = ""


class StatefulModel(nn.Module):
    """Base class of every model (language models, policies, speech models)."""
    model_type: str = ""
    fp32_params: tuple = ()             # parameter-name suffixes loaded in float32
    # forward() honours ctx.planes: with it, every fixed (recurrent/conv) buffer's value after
    # each position t is also written to ctx.planes[name][t] (needs all_positions=True)
    state_planes: bool = False

    # ---- required ---------------------------------------------------------------------
    def state_specs(self, capacity: int, dtype: torch.dtype) -> list[BufferSpec]:
        """Named buffers this model reads and writes; capacity = the per-token row count."""
        raise NotImplementedError

    def input_specs(self, dtype: torch.dtype) -> list[InputSpec]:
        """Inputs forward() accepts; a step passes any non-empty subset the model allows."""
        raise NotImplementedError

    def forward(self, inputs: dict, ctx: StepCtx, state, all_positions: bool | str = False) -> dict:
        """Advance the state by ctx.T positions; returns named outputs of the last position, of
        all (True), or for language models "hidden": hidden of all, logits of the last."""
        raise NotImplementedError

    # ---- optional hooks ---------------------------------------------------------------
    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> parameter name; None: known, not used here."""
        return name

    def optional_weights(self, present: set) -> set:
        """Parameters that may be absent from the checkpoint, given the names present."""
        return set()

    def on_weights_loaded(self, present: set) -> None:
        """Called once after weights are assigned (e.g. drop a module whose weights were absent)."""

    def materialize_buffers(self, device) -> None:
        """Recompute non-persistent buffers after a meta-device build (modules with rebuild())."""
        for m in self.modules():
            if m is not self and hasattr(m, "rebuild"):
                m.rebuild(device)

    # ---- optional draft head (speculative decoding) -------------------------------------
    @property
    def has_draft_head(self) -> bool:
        """Whether this model, with the weights it loaded, can draft (draft() works)."""
        return False

    @property
    def draft_hidden(self) -> str | None:
        """The state buffer (hidden,) where forward() leaves the last position's hidden state
        (and its plane, ctx.planes[name], per position): draft()'s `hidden` for the next pair.
        None: the model type has no draft head. A type that has one names it even when a
        checkpoint lacks the head's weights (has_draft_head False; then no buffer exists).
        A subclass overrides it with a class attribute."""
        return None

    def draft(self, ids: torch.Tensor, hidden: torch.Tensor, ctx: StepCtx, state, last_only: bool = False):
        """ids (T,) = tokens at p+1, hidden (T, H) = the model's hidden at p, ctx.positions = p.
        Writes the head's own state rows p; returns ((T, vocab) logits for p+2 (last_only: (1,
        vocab), a prefill writing rows), (T, H) hidden)."""
        raise NotImplementedError(f"{self.model_type} has no draft head")


class PolicyModel(StatefulModel):
    """Base class of a policy model: observations in, a flow-matching action chunk out, run by
    flashrt.policy.Policy (LeRobot's select_action queue). models/tiny_vla.py is the smallest; a
    SmolVLA or pi0 file follows the same. The policy layer checks isinstance, these attributes
    (set in __init__) and the buffers below, naming what is missing.

    state_specs(prefix_len, dtype) declares, besides the model's own buffers (its prefix K/V:
    per-token rows [0, prefix_len), kind kv, rewritten at every chunk):
      actions.queue  (n_action_steps, action_dim) float32, a fixed-size capsule kind: the chunk
                     being handed out (n_action_steps <= chunk_size)
      actions.head   (1,) int64 meta: next queue row to hand out
      actions.count  (1,) int64 meta: rows filled; head == count: empty
      noise.rng      (2,) int64 rng: [seed, counter] of flashrt.core.rng, the noise source
      step           (1,) int64 meta: actions handed out since reset
    forward({**obs, "noise"?}, ctx, state) with ctx over positions [0, prefix_len) writes the
    prefix rows, denoises (drawing noise from noise.rng unless "noise" is given) and returns
    {"actions": (chunk_size, action_dim)}. It never touches the queue buffers: the policy layer
    does. The session's position is the count of valid prefix rows: 0 after reset, prefix_len
    after a chunk. model_type and config (a dataclass) are what the default fingerprint digests,
    with the weights (flashrt.models.loader.fingerprint).

    A processor (optional; LeRobot's pre/postprocessor, e.g. models/smolvla_processor.py) takes
    raw observations instead: preprocess(obs) -> forward's inputs, refusing bad input before any
    state is written; postprocess(actions) -> robot units, applied to what select_action and
    predict_action_chunk return (the queue holds the model's actions, as LeRobot's does).
    """
    prefix_len: int      # rows of prefix K/V one chunk writes (the session's max_seq_len)
    obs_shapes: dict     # {name: shape} of one observation, batch 1 without a batch dim
    noise_shape: tuple   # (chunk_size, noise_dim) of the flow-matching noise
    action_dim: int      # action width <= noise_dim (SmolVLA and pi0 pad the noise to 32)


# ---- config checks for CONFIG.from_hf ------------------------------------------------------
def require(cfg: dict, key: str, model_type: str):
    if key not in cfg:
        raise ConfigError(f"{model_type} config: missing field {key!r}")
    return cfg[key]


def check(cond: bool, model_type: str, field: str, why: str) -> None:
    if not cond:
        raise ConfigError(f"{model_type} config: unsupported {field}: {why}")


def check_rope(cfg: dict, model_type: str) -> dict:
    """rope_parameters (default rope only, as is rope_scaling when present); returns them."""
    rope, scaling = cfg.get("rope_parameters") or {}, cfg.get("rope_scaling")
    check(not scaling or scaling.get("rope_type", scaling.get("type")) == "default", model_type,
          "rope_scaling", f"{scaling} (only default rope is implemented)")
    check(rope.get("rope_type", "default") == "default", model_type, "rope_parameters.rope_type",
          f"{rope.get('rope_type')} (only default rope is implemented)")
    return rope


class VadModel(StatefulModel):
    """Base class of a voice activity model: PCM chunks in, one speech probability per chunk
    out, run by flashrt.speech.VoiceActivity (Silero's VADIterator / get_speech_timestamps
    rules); models/silero_vad.py is one. The speech layer checks isinstance, these attributes
    (set in __init__) and the input below, naming what is missing.

    forward({"pcm": (T, chunk_samples) float32 in [-1, 1]}, ctx, state, all_positions=True)
    runs T consecutive chunks and returns {"prob": (T,) float32}. Every piece of its state is a
    fixed-size arena buffer it declares (recurrent / conv kinds), the context samples it puts
    before each chunk included, so a capsule continues bitwise. One session position is one chunk.
    """
    sample_rate: int         # Hz of the PCM it takes (the speech layer refuses any other)
    chunk_samples: int       # new samples per chunk
    context_samples: int     # samples of the previous chunk each chunk also sees (state)


class SynthesizerModel(StatefulModel):
    """Base class of a text-to-speech model over continuous audio latents: a backbone whose
    flow head samples one latent per frame, and an end-of-speech rule; models/pocket_tts.py is
    one. A CodecModel (its own file and checkpoint folder) turns the latents into PCM; the
    speech layer (flashrt.speech.Synthesizer) runs both on one session, so a capsule holds both.

    One session position is one backbone position: the prompt (voice, then text), then one per
    frame. forward({"ids": (T,) int64, "voice"?: (T, latent_dim) float32}, ctx, state) runs
    prompt positions (voice rows are taken where ids == audio_prompt_token_id) and samples
    nothing. forward({} or {"noise": (1, latent_dim)}, ctx, state) with ctx.T == 1 is one frame:
    its input is the latent of the position before (the learnt BOS latent at frame 0); it samples
    the next latent from noise (given, or drawn from its rng buffer) times the noise scale, applies
    the end-of-speech rule and returns {"latent": (1, latent_dim) normalised, "eos_logit": (1,),
    "done": (1,) bool}. begin() writes an utterance's knobs into the meta buffers; denormalize()
    maps latents to the codec's space. The per-position latent history is the next frame's input,
    so rolling back by position is exact and a codec can replay it.
    """
    latent_dim: int          # width of one latent frame
    frame_rate: float        # frames per second
    prompt_bos_id: int       # token before the voice latents
    prompt_id: int           # placeholder of a voice latent position
    history: str             # the (capacity, latent_dim) buffer of latents sampled per position

    def begin(self, state, temperature: float = 0.7, frames_after_eos: int = 2,
              eos_threshold: float = -4.0, min_frames_before_eos: int = 6) -> None:
        """A new utterance: frame counter 0, no end of speech seen, these knobs."""
        raise NotImplementedError

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class CodecModel(StatefulModel):
    """Base class of a streaming audio codec over continuous latents (models/pocket_tts_codec.py).

    forward({"latent": (T, latent_dim) float32}, ctx, state) decodes T frames and returns
    {"pcm": (T, frame_size) float32}; decoding frame by frame equals decoding them at once. Its
    whole decoder state is fixed-size buffers (conv contexts, transposed-conv overlaps, a
    sliding attention window, a meta step counter): a capsule carries it at any point.
    encode((N,) float32 PCM at sample_rate) -> (ceil(N / frame_size), latent_dim) latents, one
    shot and stateless (a voice prompt).
    """
    sample_rate: int         # Hz of the PCM
    frame_size: int          # samples per latent frame
    latent_dim: int

    def encode(self, pcm: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class TranscriberModel(StatefulModel):
    """Base class of a streaming speech recognizer (a transducer): PCM in, token ids out, run by
    flashrt.speech.StreamingTranscriber; models/nemotron_asr_streaming.py is one. One session
    position is one encoder frame (frame_samples of audio). Every piece of its state, the raw
    samples not yet encoded included, is a fixed-size arena buffer it declares, so a capsule costs
    the same anywhere in an utterance and continues bitwise.

    accept_audio(pcm (n,) float32, state) copies what fits of pcm into its audio buffer and
    returns how many samples it took; pending_samples(state) counts those not yet encoded.
    chunk_frames(position, pending, lookahead, final) is the T of the next step (0: not enough
    audio); final: flush what is pending, zeros past the end. forward({"lookahead": R}, ctx,
    state) encodes ctx.T frames from the pending audio (attention chunks of R + 1 frames) and
    returns {"encoded": (T, J)}; decode(encoded, ctx, state) runs greedy decoding over them and
    returns {"tokens": [...], "frames": [...] (the position of each), "logits": [...] (with
    keep_logits=True: one (vocab,) row per joint step)}. Buffer `rnnt.last` (meta) holds the
    last token emitted, `rnnt.emitted` (meta) how many.
    """
    sample_rate: int         # Hz of the mono PCM it takes (the speech layer refuses any other)
    blank_id: int            # the transducer's blank: never emitted
    lookaheads: tuple        # supported right contexts in encoder frames; the first is the default
    frame_samples: int       # PCM samples per encoder frame (one position)

    def accept_audio(self, pcm: torch.Tensor, state) -> int:
        raise NotImplementedError

    def pending_samples(self, state) -> int:
        raise NotImplementedError

    def chunk_frames(self, position: int, pending: int, lookahead: int, final: bool = False) -> int:
        raise NotImplementedError

    def decode(self, encoded: torch.Tensor, ctx: StepCtx, state, keep_logits: bool = False) -> dict:
        raise NotImplementedError

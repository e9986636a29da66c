"""Pocket TTS (Kyutai): a causal transformer over [voice latents, text, audio latents] whose flow
head samples one 32-dim latent per 80 ms frame, and an end-of-speech head; the codec that turns
latents into 24 kHz PCM is models/pocket_tts_codec.py (the checkpoint's `audio_tokenizer/`).

Order: config -> layers -> block -> model -> weight-name mapping (same in every model file).
A SynthesizerModel (models/protocol.py). Numerics follow transformers' pocket_tts. State, by name:
  layers.{i}.attn.k / .v   kv (capacity, heads, head_dim): backbone K/V rows
  tts.latents              meta (capacity, latent_dim) float32: latent sampled at each position
  tts.rng                  rng (2,) int64: the flow noise (flashrt.core.rng)
  tts.frame                meta (1,) int64: frames generated this utterance
  tts.countdown            meta (1,) int64: frames left after end of speech, -1 before it
  tts.eos_rule             meta (2,) int64: [frames_after_eos, min_frames_before_eos]
  tts.sampling             meta (2,) float32: [noise scale sqrt(temperature), eos threshold]
Beyond the protocol's inputs, forward({"frames": (T, latent_dim)}) re-runs T frames whose
latents are known in one pass (a re-prefill; bench/tts.py's baseline for barge-in rollback).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import (BufferSpec, InputSpec, Linear, Rotary, StepCtx, SynthesizerModel, attend_cached,
                   check, check_rope, normal, require, rotary_tables, rotate)

ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
        "silu": F.silu}


# ---- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PocketTTSConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    layer_norm_eps: float
    attention_bias: bool
    rope_theta: float
    latent_dim: int
    frame_rate: float
    audio_prompt_token_id: int
    audio_latent_token_id: int
    audio_prompt_bos_token_id: int
    audio_bos_token_id: int
    flow_hidden_size: int
    flow_layers: int
    flow_freq_size: int
    flow_act: str
    flow_ln_eps: float
    flow_norm_eps: float
    flow_type: str

    @classmethod
    def from_hf(cls, cfg: dict) -> "PocketTTSConfig":
        t = "pocket_tts"
        rope = check_rope(cfg, t)
        fh = cfg.get("flow_head_config") or {}
        hidden, heads = require(cfg, "hidden_size", t), require(cfg, "num_attention_heads", t)
        kv = cfg.get("num_key_value_heads") or heads
        check(heads % kv == 0, t, "num_key_value_heads", f"{heads} heads not divisible by {kv}")
        for key, act in (("hidden_act", cfg.get("hidden_act", "gelu_pytorch_tanh")),
                         ("flow_head_config.hidden_act", fh.get("hidden_act", "silu"))):
            check(act in ACTS, t, key, f"{act} (implemented: {sorted(ACTS)})")
        flow_type = fh.get("flow_type", "lsd")
        check(flow_type in ("lsd", "drifting"), t, "flow_head_config.flow_type", flow_type)
        latent = cfg.get("latent_dim", 32)
        check(fh.get("latent_dim", latent) == latent and fh.get("condition_dim", hidden) == hidden,
              t, "flow_head_config", "latent_dim / condition_dim differ from the backbone's")
        return cls(
            vocab_size=require(cfg, "vocab_size", t), hidden_size=hidden,
            intermediate_size=require(cfg, "intermediate_size", t),
            num_hidden_layers=require(cfg, "num_hidden_layers", t), num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=cfg.get("head_dim") or hidden // heads,
            hidden_act=cfg.get("hidden_act", "gelu_pytorch_tanh"),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-5),
            attention_bias=bool(cfg.get("attention_bias", False)),
            rope_theta=rope.get("rope_theta", 10000.0), latent_dim=latent,
            frame_rate=cfg.get("frame_rate", 12.5),
            audio_prompt_token_id=cfg.get("audio_prompt_token_id", 4000),
            audio_latent_token_id=cfg.get("audio_latent_token_id", 4001),
            audio_prompt_bos_token_id=cfg.get("audio_prompt_bos_token_id", 4002),
            audio_bos_token_id=cfg.get("audio_bos_token_id", 4003),
            flow_hidden_size=fh.get("hidden_size", 512), flow_layers=fh.get("num_hidden_layers", 6),
            flow_freq_size=fh.get("frequency_embedding_size", 256),
            flow_act=fh.get("hidden_act", "silu"), flow_ln_eps=fh.get("layer_norm_eps", 1e-6),
            flow_norm_eps=fh.get("rms_norm_eps", 1e-5), flow_type=flow_type)


# ---- layers -------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, c: PocketTTSConfig, idx: int):
        super().__init__()
        self.h, self.kv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        b = c.attention_bias
        self.q_proj = Linear(c.hidden_size, self.h * self.d, bias=b)
        self.k_proj = Linear(c.hidden_size, self.kv * self.d, bias=b)
        self.v_proj = Linear(c.hidden_size, self.kv * self.d, bias=b)
        self.o_proj = Linear(self.h * self.d, c.hidden_size, bias=b)
        self.k_name, self.v_name = f"layers.{idx}.attn.k", f"layers.{idx}.attn.v"

    def forward(self, x, ctx: StepCtx, state, rope):
        T = x.shape[0]                                               # x: (T, hidden)
        q = rotate(self.q_proj(x).view(T, self.h, self.d), rope)
        k = rotate(self.k_proj(x).view(T, self.kv, self.d), rope)
        v = self.v_proj(x).view(T, self.kv, self.d)
        o = attend_cached(q, k, v, state[self.k_name], state[self.v_name], ctx, self.d ** -0.5)
        return self.o_proj(o.reshape(T, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, c: PocketTTSConfig):
        super().__init__()
        self.fc1 = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.fc2 = Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act = ACTS[c.hidden_act]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TimestepNorm(nn.Module):
    """x / std(x) (unbiased variance, no centring) times a weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.empty(dim)), eps

    def forward(self, x):
        return x * (self.weight * torch.rsqrt(x.var(-1, keepdim=True) + self.eps))


class TimestepEmbedding(nn.Module):
    def __init__(self, c: PocketTTSConfig):
        super().__init__()
        self.register_buffer("freqs", torch.empty(c.flow_freq_size // 2))     # in the checkpoint
        self.fc1 = Linear(c.flow_freq_size, c.flow_hidden_size)
        self.fc2 = Linear(c.flow_hidden_size, c.flow_hidden_size)
        self.act = ACTS[c.flow_act]
        self.norm = TimestepNorm(c.flow_hidden_size, c.flow_norm_eps)

    def forward(self, t):                                       # t: (B, 1) -> (B, flow_hidden)
        angles = t * self.freqs.to(t.dtype)
        return self.norm(self.fc2(self.act(self.fc1(torch.cat([angles.cos(), angles.sin()], -1)))))


class FlowResBlock(nn.Module):
    def __init__(self, c: PocketTTSConfig):
        super().__init__()
        w = c.flow_hidden_size
        self.norm = nn.LayerNorm(w, eps=c.flow_ln_eps)
        self.fc1, self.fc2 = Linear(w, w), Linear(w, w)
        self.adaln_proj = Linear(w, 3 * w)
        self.act = ACTS[c.flow_act]

    def forward(self, h, cond):                                 # cond: act(condition)
        shift, scale, gate = self.adaln_proj(cond).chunk(3, dim=-1)
        m = F.layer_norm(h, h.shape[-1:], self.norm.weight, self.norm.bias, self.norm.eps)
        return torch.addcmul(h, gate, self.fc2(self.act(self.fc1(torch.addcmul(shift, m, 1 + scale)))))


class FlowFinalLayer(nn.Module):
    def __init__(self, c: PocketTTSConfig):
        super().__init__()
        w = c.flow_hidden_size
        self.adaln_proj = Linear(w, 2 * w)
        self.proj = Linear(w, c.latent_dim)
        self.eps = c.flow_ln_eps

    def forward(self, h, cond):                                 # cond: act(condition)
        shift, scale = self.adaln_proj(cond).chunk(2, dim=-1)
        return self.proj(torch.addcmul(shift, F.layer_norm(h, h.shape[-1:], eps=self.eps), 1 + scale))


class FlowHead(nn.Module):
    """An adaLN MLP: noise latent + backbone hidden (+ flow times, for LSD) -> velocity / latent."""

    def __init__(self, c: PocketTTSConfig):
        super().__init__()
        self.input_proj = Linear(c.latent_dim, c.flow_hidden_size)
        self.cond_proj = Linear(c.hidden_size, c.flow_hidden_size)
        n_times = 2 if c.flow_type == "lsd" else 0                 # start and end of an LSD step
        self.timestep_embeddings = nn.ModuleList(TimestepEmbedding(c) for _ in range(n_times))
        self.layers = nn.ModuleList(FlowResBlock(c) for _ in range(c.flow_layers))
        self.final_layer = FlowFinalLayer(c)
        self.act = ACTS[c.flow_act]

    def forward(self, x, cond, times=()):                       # x (B, latent), cond (B, hidden)
        h, cond = self.input_proj(x), self.cond_proj(cond)
        if times:
            cond = cond + sum(e(t) for e, t in zip(self.timestep_embeddings, times)) / len(times)
        cond = self.act(cond)                       # what every adaLN projection reads: once
        for layer in self.layers:
            h = layer(h, cond)
        return self.final_layer(h, cond)


# ---- block --------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, c: PocketTTSConfig, idx: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = Attention(c, idx)
        self.post_attention_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, ctx, state, rope):
        x = x + self.self_attn(self.input_layernorm(x), ctx, state, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: PocketTTSConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers))
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.audio_prompt_proj = Linear(c.latent_dim, c.hidden_size, bias=False)
        self.audio_latent_proj = Linear(c.latent_dim, c.hidden_size, bias=False)
        self.bos_latent = nn.Parameter(torch.empty(c.latent_dim))


# ---- model --------------------------------------------------------------------------------
class Model(SynthesizerModel):
    model_type = "pocket_tts"
    fp32_params = ("freqs", "latent_mean", "latent_std")
    history = "tts.latents"
    num_flow_steps = 1                 # Euler steps of the LSD sampler (the released default)

    def __init__(self, c: PocketTTSConfig):
        super().__init__()
        self.config = c
        self.latent_dim, self.frame_rate = c.latent_dim, c.frame_rate
        self.prompt_bos_id, self.prompt_id = c.audio_prompt_bos_token_id, c.audio_prompt_token_id
        self.model = Backbone(c)
        self.flow_head = FlowHead(c)
        self.eos_head = Linear(c.hidden_size, 1)
        self.register_buffer("latent_mean", torch.empty(c.latent_dim))
        self.register_buffer("latent_std", torch.empty(c.latent_dim))
        self.rotary = Rotary(c.head_dim, c.rope_theta)

    def state_specs(self, capacity, dtype):
        c = self.config
        shape = (capacity, c.num_key_value_heads, c.head_dim)
        return [BufferSpec(f"layers.{i}.attn.{kv}", "kv", shape, dtype, seq_dim=0)
                for i in range(c.num_hidden_layers) for kv in ("k", "v")] + [
            BufferSpec(self.history, "meta", (capacity, c.latent_dim), torch.float32, seq_dim=0),
            BufferSpec("tts.rng", "rng", (2,), torch.int64),
            BufferSpec("tts.frame", "meta", (1,), torch.int64),
            BufferSpec("tts.countdown", "meta", (1,), torch.int64),
            BufferSpec("tts.eos_rule", "meta", (2,), torch.int64),
            BufferSpec("tts.sampling", "meta", (2,), torch.float32)]

    def input_specs(self, dtype):
        d = self.config.latent_dim
        return [InputSpec("ids", (), torch.int64, "prompt token ids (voice placeholders included)"),
                InputSpec("voice", (d,), torch.float32, "voice latents, read at placeholder ids"),
                InputSpec("noise", (d,), torch.float32, "a frame's standard normal noise")]

    def begin(self, state, temperature=0.7, frames_after_eos=2, eos_threshold=-4.0,
              min_frames_before_eos=6):
        state["tts.frame"].zero_()
        state["tts.countdown"].fill_(-1)
        state["tts.eos_rule"].copy_(torch.tensor([frames_after_eos, min_frames_before_eos]))
        state["tts.sampling"].copy_(torch.tensor([math.sqrt(temperature), eos_threshold]))

    def denormalize(self, latents):
        return latents * self.latent_std + self.latent_mean

    def backbone(self, x, ctx, state, all_positions=False):
        rope = rotary_tables(*self.rotary(ctx.positions, x.dtype))       # x: (T, hidden)
        for layer in self.model.layers:
            x = layer(x, ctx, state, rope)
        return self.model.norm(x if all_positions else x[-1:])           # (T or 1, hidden)

    def sample_latent(self, cond, noise):
        """The flow head from noise (B, latent) already scaled, as transformers' sample_latent."""
        if self.config.flow_type == "drifting":
            return self.flow_head(noise, cond)
        x, n = noise, self.num_flow_steps
        ones = torch.ones((noise.shape[0], 1), dtype=noise.dtype, device=noise.device)
        for s in range(n):
            x = x + self.flow_head(x, cond, (ones * (s / n), ones * ((s + 1) / n))) / n
        return x

    def forward(self, inputs, ctx, state, all_positions=False):
        if "ids" in inputs:
            return self._prompt(inputs, ctx, state, all_positions)
        if "frames" in inputs:
            return self._replay(inputs["frames"], ctx, state)
        return self._frame(inputs.get("noise"), ctx, state)

    def _prompt(self, inputs, ctx, state, all_positions):
        ids, m = inputs["ids"], self.model
        x = m.embed_tokens(ids)                                          # (T, hidden)
        if "voice" in inputs:
            voice = m.audio_prompt_proj(inputs["voice"].to(x.dtype))
            x = torch.where((ids == self.prompt_id)[:, None], voice, x)
        self._write_rows(state[self.history], torch.zeros_like(x[:, : self.latent_dim]).float(), ctx)
        h = self.backbone(x, ctx, state, all_positions)
        return {"hidden": h, "eos_logit": self.eos_head(h)[:, 0].float()}

    def _replay(self, latents, ctx, state):
        """ctx.T frames whose normalised latents (T, latent_dim) are known, in one pass (a
        re-prefill): inputs as _frame's (the latent before; the BOS latent at frame 0), history
        rows written, frame counter advanced; nothing sampled, the end-of-speech rule not run."""
        hist, frame, bos = state[self.history], state["tts.frame"], self.model.bos_latent
        prev = hist.index_select(0, (ctx.positions[:1] - 1).clamp(min=0))            # (1, latent)
        prev = torch.where(frame == 0, bos[None].float(), prev)
        x = torch.cat([prev, latents[:-1].float()]).to(bos.dtype)                     # (T, latent)
        h = self.backbone(self.model.audio_latent_proj(x), ctx, state, all_positions=True)
        self._write_rows(hist, latents.float(), ctx)
        frame.add_(ctx.T)
        return {"hidden": h, "eos_logit": self.eos_head(h)[:, 0].float()}

    def _frame(self, noise, ctx, state):
        if ctx.T != 1:
            raise ValueError(f"a frame step is one position, got {ctx.T}")
        hist, frame = state[self.history], state["tts.frame"]
        prev = hist.index_select(0, (ctx.positions - 1).clamp(min=0))          # (1, latent)
        prev = torch.where(frame == 0, self.model.bos_latent[None].float(), prev)
        h = self.backbone(self.model.audio_latent_proj(prev.to(self.model.bos_latent.dtype)),
                          ctx, state)
        logit = self.eos_head(h)[:, 0].float()                                # (1,)
        if noise is None:
            noise = normal(state["tts.rng"], (1, self.latent_dim)).to(hist.device)
        scale, threshold = state["tts.sampling"][0:1], state["tts.sampling"][1:2]
        latent = self.sample_latent(h, (noise.float() * scale).to(h.dtype)).float()
        self._write_rows(hist, latent, ctx)
        # transformers' PocketTTSEosThresholdCriteria, as tensor ops (no host sync)
        cd, rule = state["tts.countdown"], state["tts.eos_rule"]
        just = (cd < 0) & (logit > threshold) & (frame >= rule[1:2])
        cd.copy_(torch.where(just, rule[0:1], cd))
        done = cd == 0
        cd.copy_(torch.where(cd > 0, cd - 1, cd))
        frame.add_(1)
        return {"latent": latent, "eos_logit": logit, "done": done, "hidden": h}

    @staticmethod
    def _write_rows(buf, rows, ctx):
        if ctx.static:
            buf.index_copy_(0, ctx.positions, rows)
        else:
            buf[ctx.start: ctx.end] = rows

    # ---- weight-name mapping ----------------------------------------------------------
    def map_weight_name(self, name):
        # the LSD loss weighting and the EMA step count are training-only
        if name.startswith("loss_weighting.") or name == "latent_stats_num_updates":
            return None
        return name


CONFIG = PocketTTSConfig

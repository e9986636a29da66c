"""Qwen3 (dense): GQA attention with per-head q/k RMSNorm, SwiGLU MLP, tied or untied head.

Order: config -> layers -> block -> model -> weight-name mapping (same in every model file).
State: one K and one V buffer per layer, kind kv, shape (capacity, n_kv_heads, head_dim).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .base import (BufferSpec, CausalLM, Linear, QKNormAttention, RMSNorm, Rotary, SwiGLU, check,
                   check_rope, require)


# ---- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3Config":
        t = "qwen3"
        rope = check_rope(cfg, t)
        heads = require(cfg, "num_attention_heads", t)
        kv = cfg.get("num_key_value_heads", heads)
        check(heads % kv == 0, t, "num_key_value_heads", f"{heads} heads not divisible by {kv}")
        check(cfg.get("hidden_act", "silu") == "silu", t, "hidden_act", cfg.get("hidden_act"))
        check(not cfg.get("attention_bias", False), t, "attention_bias", "bias is not implemented")
        hidden = require(cfg, "hidden_size", t)
        return cls(
            vocab_size=require(cfg, "vocab_size", t), hidden_size=hidden,
            intermediate_size=require(cfg, "intermediate_size", t),
            num_hidden_layers=require(cfg, "num_hidden_layers", t),
            num_attention_heads=heads, num_key_value_heads=kv,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False))


# ---- layers -------------------------------------------------------------------------------
def Attention(c: Qwen3Config, idx: int) -> QKNormAttention:
    return QKNormAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                           c.rms_norm_eps, idx)


# ---- block --------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, c: Qwen3Config, idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, idx)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, x, ctx, state, cos, sin):
        x, h = self.post_attention_layernorm.add_and_norm(
            x, self.self_attn(self.input_layernorm(x), ctx, state, cos, sin))
        return x + self.mlp(h)


# ---- model --------------------------------------------------------------------------------
class Model(CausalLM):
    model_type = "qwen3"

    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)

    def state_specs(self, max_seq_len, dtype):
        c = self.config
        shape = (max_seq_len, c.num_key_value_heads, c.head_dim)
        return [BufferSpec(f"layers.{i}.attn.{kv}", "kv", shape, dtype, seq_dim=0)
                for i in range(c.num_hidden_layers) for kv in ("k", "v")]

    def hidden(self, x, ctx, state, all_positions=False):
        cos, sin = self.rotary(ctx.positions, x.dtype)           # x: (T, hidden)
        for layer in self.layers:
            x = layer(x, ctx, state, cos, sin)
        return self.norm(x if all_positions else x[-1:])          # (T or 1, hidden)

    # ---- weight-name mapping ----------------------------------------------------------
    # the plain Hugging Face layout: CausalLM.map_weight_name


CONFIG = Qwen3Config

"""LFM2: gated short-convolution layers and GQA attention layers, SwiGLU MLP, tied or untied head.

Order: config -> layers -> block -> model -> weight-name mapping (same in every model file).
State per layer, by layer type:
- full_attention: `layers.{i}.attn.k` / `.v`, kind kv, shape (capacity, n_kv_heads, head_dim).
- conv: `layers.{i}.conv.state`, kind conv, shape (L_cache - 1, hidden): the last L_cache - 1
  inputs of the depthwise conv (B * x), token-major, oldest row first (no transposes). It is
  the conv's left context, so chunked prefill equals one-shot prefill and decode reads the
  same buffer; zero at start (= a causal conv's zero padding); updated in place with copy_.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .base import (BufferSpec, CausalLM, Linear, QKNormAttention, RMSNorm, Rotary, StepCtx,
                   SwiGLU, check, check_rope, depthwise_causal_conv, require)

ATTN, CONV = "full_attention", "conv"


# ---- config -------------------------------------------------------------------------------
def effective_ff_dim(ff: int, auto_adjust: bool, multiplier, multiple_of: int) -> int:
    """transformers' Lfm2MLP width: int(2*ff/3), times the multiplier, rounded up to multiple_of."""
    if not auto_adjust:
        return ff
    ff = int(2 * ff / 3)
    if multiplier is not None:      # transformers rounds only when a multiplier is set
        ff = int(multiplier * ff)
        ff = multiple_of * ((ff + multiple_of - 1) // multiple_of)
    return ff


@dataclass(frozen=True)
class Lfm2Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int           # effective (after block_auto_adjust_ff_dim)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple               # per layer: "full_attention" or "conv"
    conv_L_cache: int
    conv_bias: bool
    norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "Lfm2Config":
        t = "lfm2"
        n = require(cfg, "num_hidden_layers", t)
        hidden = require(cfg, "hidden_size", t)
        heads = require(cfg, "num_attention_heads", t)
        kv = cfg.get("num_key_value_heads") or heads
        check(kv > 0 and heads % kv == 0, t, "num_key_value_heads",
              f"{heads} heads not divisible by {kv}")
        head_dim = cfg.get("head_dim")
        if not head_dim:
            check(hidden % heads == 0, t, "num_attention_heads",
                  f"hidden_size {hidden} not divisible by {heads}")
            head_dim = hidden // heads
        # layer types: layer_types if present, else full_attn_idxs (absent: all attention)
        types = cfg.get("layer_types")
        if types is None:
            idxs = cfg.get("full_attn_idxs")
            idxs = range(n) if idxs is None else idxs
            check(all(isinstance(i, int) and 0 <= i < n for i in idxs), t, "full_attn_idxs",
                  f"{list(idxs)} (indices must lie in [0, {n}))")
            types = [ATTN if i in idxs else CONV for i in range(n)]
        check(len(types) == n, t, "layer_types", f"{len(types)} entries for {n} layers")
        bad = sorted({x for x in types if x not in (ATTN, CONV)})
        check(not bad, t, "layer_types", f"{bad} (supported: {ATTN!r}, {CONV!r})")
        # feed-forward width: transformers reads block_ff_dim over intermediate_size
        ff = cfg.get("block_ff_dim", cfg.get("intermediate_size"))
        check(ff is not None, t, "block_ff_dim", "missing (and no intermediate_size)")
        mult = cfg.get("block_ffn_dim_multiplier", 1.0)
        ff = effective_ff_dim(ff, cfg.get("block_auto_adjust_ff_dim", True), mult,
                              cfg.get("block_multiple_of", 256))
        check(cfg.get("block_use_swiglu", True), t, "block_use_swiglu",
              "only the SwiGLU MLP is implemented")
        for f in ("conv_dim", "conv_dim_out"):
            check(cfg.get(f, hidden) == hidden, t, f, f"{cfg.get(f)} != hidden_size {hidden}")
        L = cfg.get("conv_L_cache", 3)
        check(isinstance(L, int) and L >= 1, t, "conv_L_cache", f"{L} (must be an int >= 1)")
        rope = check_rope(cfg, t)
        return cls(
            vocab_size=require(cfg, "vocab_size", t), hidden_size=hidden, intermediate_size=ff,
            num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv,
            head_dim=head_dim, layer_types=tuple(types), conv_L_cache=L,
            conv_bias=bool(cfg.get("conv_bias", False)), norm_eps=cfg.get("norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 1000000.0)),
            tie_word_embeddings=cfg.get("tie_embedding", cfg.get("tie_word_embeddings", True)))


# ---- layers -------------------------------------------------------------------------------
def Attention(c: Lfm2Config, idx: int) -> QKNormAttention:
    return QKNormAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                           c.norm_eps, idx, out_name="out_proj",
                           norm_names=("q_layernorm", "k_layernorm"))


class ShortConv(nn.Module):
    """in_proj -> B, C, x; y = C * causal_depthwise_conv(B * x); out_proj(y)."""

    def __init__(self, c: Lfm2Config, idx: int):
        super().__init__()
        h, L = c.hidden_size, c.conv_L_cache
        self.h, self.L = h, L
        self.conv = nn.Conv1d(h, h, L, groups=h, bias=c.conv_bias)     # weight: (h, 1, L)
        self.in_proj = Linear(h, 3 * h, bias=c.conv_bias)
        self.out_proj = Linear(h, h, bias=c.conv_bias)
        self.state_name = f"layers.{idx}.conv.state"

    def forward(self, x, ctx: StepCtx, state):
        h = self.h
        bcx = self.in_proj(x)                                    # (T, 3h): B | C | x
        B, C, xs = bcx[:, :h], bcx[:, h: 2 * h], bcx[:, 2 * h:]
        y = depthwise_causal_conv(B * xs, state[self.state_name], self.conv.weight[:, 0],
                                  self.conv.bias,                # state: (L-1, h) left context
                                  (ctx.planes or {}).get(self.state_name))
        return self.out_proj(C * y)                              # (T, hidden)


# ---- block --------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, c: Lfm2Config, idx: int):
        super().__init__()
        self.is_attn = c.layer_types[idx] == ATTN
        if self.is_attn:
            self.self_attn = Attention(c, idx)
        else:
            self.conv = ShortConv(c, idx)
        self.operator_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.feed_forward = SwiGLU(c.hidden_size, c.intermediate_size, names=("w1", "w3", "w2"))

    def forward(self, x, ctx, state, cos, sin):
        h = self.operator_norm(x)
        h = self.self_attn(h, ctx, state, cos, sin) if self.is_attn else self.conv(h, ctx, state)
        x, h = self.ffn_norm.add_and_norm(x, h)
        return x + self.feed_forward(h)


# ---- model --------------------------------------------------------------------------------
class Model(CausalLM):
    model_type = "lfm2"
    state_planes = True

    def __init__(self, c: Lfm2Config):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers))
        self.embedding_norm = RMSNorm(c.hidden_size, c.norm_eps)    # the final norm, despite the name
        self.rotary = Rotary(c.head_dim, c.rope_theta)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)

    def state_specs(self, max_seq_len, dtype):
        c, specs = self.config, []
        kv_shape = (max_seq_len, c.num_key_value_heads, c.head_dim)
        for i, kind in enumerate(c.layer_types):
            if kind == ATTN:
                specs += [BufferSpec(f"layers.{i}.attn.{n}", "kv", kv_shape, dtype, seq_dim=0)
                          for n in ("k", "v")]
            else:
                specs.append(BufferSpec(f"layers.{i}.conv.state", "conv",
                                        (c.conv_L_cache - 1, c.hidden_size), dtype))
        return specs

    def hidden(self, x, ctx, state, all_positions=False):
        cos, sin = self.rotary(ctx.positions, x.dtype)           # x: (T, hidden)
        for layer in self.layers:
            x = layer(x, ctx, state, cos, sin)
        return self.embedding_norm(x if all_positions else x[-1:])   # (T or 1, hidden)

    # ---- weight-name mapping ----------------------------------------------------------
    # the plain Hugging Face layout: CausalLM.map_weight_name


CONFIG = Lfm2Config

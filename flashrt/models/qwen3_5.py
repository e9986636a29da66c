"""Qwen3.5 (dense text decoder): Gated DeltaNet + gated full attention, optional MTP layer.

Order: config -> layers -> block -> model -> weight-name mapping (same in every model file).
State (arena names, batch 1):
- full-attention layer i: `layers.{i}.attn.k` / `.v`, kv, (capacity, n_kv, head_dim), seq_dim 0;
- linear-attention layer i: `layers.{i}.gdn.conv`, conv, (conv_dim, kernel-1): the last kernel-1
  in_proj_qkv outputs (pre-conv), oldest first; `layers.{i}.gdn.recurrent`, recurrent,
  (n_v_heads, k_head_dim, v_head_dim), always float32;
- MTP (when the checkpoint has mtp.* weights): `mtp.attn.k` / `.v`, mtp, (capacity, n_kv, head_dim),
  seq_dim 0; `mtp.hidden`, mtp, (hidden,): the main model's last hidden state after the final
  norm (what vLLM's Qwen3.5 MTP consumes: the target model's output hidden states).
MTP positions: the pair (hidden at position p, token at p+1) is MTP position p (its rope
position and its MTP KV row); it predicts the token at p+2.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .base import (BufferSpec, CausalLM, InputSpec, Linear, LinearPack, RMSNorm, Rotary, StepCtx, SwiGLU,
                   apply_rotary, attend_cached, causal_conv, check, chunk_gated_delta_rule,
                   fast_kernels, gated_delta_block, gated_step_runs, recurrent_gated_delta_rule,
                   require)

LAYER_TYPES = ("linear_attention", "full_attention")


# ---- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Qwen3_5Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rot_dim: int
    attn_output_gate: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int
    mrope_section: tuple | None = None     # (t, h, w) frequencies of the multimodal rope

    @classmethod
    def from_hf(cls, cfg: dict) -> "Qwen3_5Config":
        """Reads `text_config` (model_type qwen3_5) or the top level (qwen3_5_text)."""
        t = "qwen3_5"
        text = cfg.get("text_config") or cfg
        # the wrapper's own flag decides tying in transformers (default False there)
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        hidden, n_layers = require(text, "hidden_size", t), require(text, "num_hidden_layers", t)
        heads = require(text, "num_attention_heads", t)
        kv = text.get("num_key_value_heads", heads)
        check(heads % kv == 0, t, "num_key_value_heads", f"{heads} heads not divisible by {kv}")
        check(text.get("hidden_act", "silu") == "silu", t, "hidden_act", text.get("hidden_act"))
        check(not text.get("attention_bias", False), t, "attention_bias", "bias is not implemented")
        every = text.get("full_attention_interval", 4)
        types = text.get("layer_types") or [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
        check(len(types) == n_layers, t, "layer_types", f"{len(types)} entries for {n_layers} layers")
        bad = sorted({x for x in types if x not in LAYER_TYPES})
        check(not bad, t, "layer_types", f"{bad} (supported: {list(LAYER_TYPES)})")
        kh, vh = text.get("linear_num_key_heads", 16), text.get("linear_num_value_heads", 32)
        check(vh % kh == 0, t, "linear_num_value_heads",
              f"{vh} value heads not a multiple of linear_num_key_heads {kh}")
        kernel = text.get("linear_conv_kernel_dim", 4)
        check(kernel >= 2, t, "linear_conv_kernel_dim", f"{kernel} (needs >= 2)")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rtype = rope.get("rope_type", rope.get("type", "default"))
        check(rtype == "default", t, "rope_parameters.rope_type",
              f"{rtype} (only default rope is implemented; text-only mrope is default rope)")
        head_dim = text.get("head_dim") or 256
        prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        rot = int(head_dim * prf)
        check(0 < rot <= head_dim and rot % 2 == 0, t, "partial_rotary_factor",
              f"{prf} gives rotary dim {rot} for head_dim {head_dim}")
        sec = rope.get("mrope_section")
        check(sec is None or (len(sec) == 3 and sum(sec) == rot // 2), t, "mrope_section",
              f"{sec}: three parts summing to rotary_dim/2 = {rot // 2}")
        mtp = text.get("mtp_num_hidden_layers", 1)   # 1: enabled iff the checkpoint has mtp.*
        check(mtp in (0, 1), t, "mtp_num_hidden_layers", f"{mtp} (0 or 1 supported)")
        check(not text.get("mtp_use_dedicated_embeddings", False), t, "mtp_use_dedicated_embeddings",
              "dedicated MTP embeddings are not implemented")
        return cls(
            vocab_size=require(text, "vocab_size", t), hidden_size=hidden,
            intermediate_size=require(text, "intermediate_size", t), num_hidden_layers=n_layers,
            layer_types=tuple(types), num_attention_heads=heads, num_key_value_heads=kv,
            head_dim=head_dim, rot_dim=rot, attn_output_gate=text.get("attn_output_gate", True),
            linear_num_key_heads=kh, linear_num_value_heads=vh,
            linear_key_head_dim=text.get("linear_key_head_dim", 128),
            linear_value_head_dim=text.get("linear_value_head_dim", 128),
            linear_conv_kernel_dim=kernel, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
            tie_word_embeddings=tie, mtp_num_hidden_layers=mtp,
            mrope_section=tuple(sec) if sec is not None else None)


# ---- layers -------------------------------------------------------------------------------
class Attention(nn.Module):
    """GQA with zero-centred q/k norms, partial rope, and a sigmoid output gate from q_proj."""

    def __init__(self, c: Qwen3_5Config, prefix: str):
        super().__init__()
        self.h, self.kv, self.d, self.gated = (c.num_attention_heads, c.num_key_value_heads,
                                               c.head_dim, c.attn_output_gate)
        self.q_proj = Linear(c.hidden_size, self.h * self.d * (2 if self.gated else 1), bias=False)
        self.k_proj = Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.v_proj = Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.qkv = LinearPack(self.q_proj, self.k_proj, self.v_proj)
        self.o_proj = Linear(self.h * self.d, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, c.rms_norm_eps, zero_centred=True)
        self.k_norm = RMSNorm(self.d, c.rms_norm_eps, zero_centred=True)
        self.k_name, self.v_name = f"{prefix}.k", f"{prefix}.v"

    def forward(self, x, ctx: StepCtx, state, cos, sin):
        T = x.shape[0]                                           # x: (T, hidden)
        q, k, v = self.qkv(x)
        if self.gated:   # per head: [query (d) | gate (d)]
            q, gate = q.view(T, self.h, 2 * self.d).chunk(2, dim=-1)
        q = self.q_norm(q.reshape(T, self.h, self.d))
        k = self.k_norm(k.view(T, self.kv, self.d))
        v = v.view(T, self.kv, self.d)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attend_cached(q, k, v, state[self.k_name], state[self.v_name], ctx, self.d ** -0.5)
        o = o.reshape(T, self.h * self.d)
        if self.gated:
            o = o * torch.sigmoid(gate.reshape(T, self.h * self.d))
        return self.o_proj(o)


class GatedDeltaNet(nn.Module):
    """Conv(qkv) -> l2-normed gated delta rule -> gated RMSNorm(z) -> out_proj."""

    def __init__(self, c: Qwen3_5Config, idx: int):
        super().__init__()
        self.hk, self.hv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim, K = 2 * self.key_dim + self.value_dim, c.linear_conv_kernel_dim
        self.in_proj_qkv = Linear(c.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = Linear(c.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = Linear(c.hidden_size, self.hv, bias=False)
        self.in_proj_a = Linear(c.hidden_size, self.hv, bias=False)
        self.in_proj = LinearPack(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, K, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.hv))          # fp32 (Model.fp32_params)
        self.dt_bias = nn.Parameter(torch.empty(self.hv))        # fp32
        self.norm = RMSNorm(self.dv, c.rms_norm_eps)             # gated, not zero-centred
        self.out_proj = Linear(self.value_dim, c.hidden_size, bias=False)
        self.conv_name, self.rec_name = f"layers.{idx}.gdn.conv", f"layers.{idx}.gdn.recurrent"
        self.fast_conv = self.fast_rule = False                  # CUDA kernels, set by rebuild()

    def rebuild(self, device):
        fla, conv = fast_kernels() if torch.device(device).type == "cuda" else (None, None)
        self.fast_rule, self.fast_conv = fla is not None, conv is not None

    def forward(self, x, ctx: StepCtx, state):
        T, planes = x.shape[0], ctx.planes or {}                 # x: (T, hidden)
        qkv, z, b, a = self.in_proj(x)
        qkv = causal_conv(qkv, state[self.conv_name], self.conv1d.weight[:, 0],
                          self.fast_conv, planes.get(self.conv_name))   # (T, conv_dim)
        rec = state[self.rec_name]
        if (T == 1 or self.rec_name in planes) and gated_step_runs(rec, self.fast_rule) \
                and self.norm.weight.dtype == qkv.dtype:
            # per token on the CPU: decay, beta, rule and gated norm in one extension call
            o = gated_delta_block(qkv, a, b, z, self.A_log, self.dt_bias, self.norm,
                                  (self.hk, self.hv, self.dk, self.dv), rec, planes.get(self.rec_name))
            return self.out_proj(o)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(T, self.hk, self.dk), k.reshape(T, self.hk, self.dk)
        v = v.reshape(T, self.hv, self.dv)
        beta = b.sigmoid()                                       # (T, hv)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if T == 1 or self.rec_name in planes:     # per token: the state after each one exists
            o = recurrent_gated_delta_rule(q, k, v, g, beta, rec, self.fast_rule, planes.get(self.rec_name))
        else:
            o = chunk_gated_delta_rule(q, k, v, g, beta, rec, fast=self.fast_rule)   # (T, hv, dv)
        z = z.view(T, self.hv, self.dv)
        o = (self.norm(o) * F.silu(z.float())).to(x.dtype)      # norm(o) * silu(z), fp32 gate
        return self.out_proj(o.reshape(T, self.value_dim))


# ---- block --------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm decoder layer; the mixer is `linear_attn` (GDN) or `self_attn` (full attention)."""

    def __init__(self, c: Qwen3_5Config, kind: str, idx: int, kv_prefix: str | None = None):
        super().__init__()
        eps, h = c.rms_norm_eps, c.hidden_size
        self.input_layernorm = RMSNorm(h, eps, zero_centred=True)
        self.linear = kind == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(c, idx)
        else:
            self.self_attn = Attention(c, kv_prefix or f"layers.{idx}.attn")
        self.post_attention_layernorm = RMSNorm(h, eps, zero_centred=True)
        self.mlp = SwiGLU(h, c.intermediate_size)

    def forward(self, x, ctx, state, cos, sin):
        h = self.input_layernorm(x)
        h = self.linear_attn(h, ctx, state) if self.linear else self.self_attn(h, ctx, state, cos, sin)
        x, h = self.post_attention_layernorm.add_and_norm(x, h)
        return x + self.mlp(h)


class MTP(nn.Module):
    """One multi-token-prediction layer: fc([norm(embed(next)), norm(hidden)]) -> block -> norm."""

    def __init__(self, c: Qwen3_5Config):
        super().__init__()
        h, eps = c.hidden_size, c.rms_norm_eps
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zero_centred=True)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zero_centred=True)
        self.layers = nn.ModuleList([Block(c, "full_attention", 0, kv_prefix="mtp.attn")])
        self.norm = RMSNorm(h, eps, zero_centred=True)


# ---- model --------------------------------------------------------------------------------
class Model(CausalLM):
    model_type = "qwen3_5"
    fp32_params = ("linear_attn.A_log", "linear_attn.dt_bias")
    draft_hidden = "mtp.hidden"     # StatefulModel.draft_hidden: hidden() writes it
    state_planes = True

    def __init__(self, c: Qwen3_5Config):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, kind, i) for i, kind in enumerate(c.layer_types))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centred=True)
        self.rotary = Rotary(c.rot_dim, c.rope_theta, c.mrope_section)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        self.has_mtp = c.mtp_num_hidden_layers > 0
        if self.has_mtp:
            self.mtp = MTP(c)

    def state_specs(self, max_seq_len, dtype):
        c, specs = self.config, []
        kv_shape = (max_seq_len, c.num_key_value_heads, c.head_dim)
        for i, layer in enumerate(self.layers):
            if layer.linear:
                g = layer.linear_attn
                specs += [BufferSpec(g.conv_name, "conv", (g.conv_dim, c.linear_conv_kernel_dim - 1), dtype),
                          BufferSpec(g.rec_name, "recurrent", (g.hv, g.dk, g.dv), torch.float32)]
            else:
                specs += [BufferSpec(f"layers.{i}.attn.{n}", "kv", kv_shape, dtype, seq_dim=0)
                          for n in ("k", "v")]
        # rotary position minus sequence position after a multimodal segment (0 for text)
        specs.append(BufferSpec("rope.delta", "meta", (1,), torch.int64))
        if self.has_mtp:
            # the draft head's KV, and the last main hidden state it drafts from
            specs += [BufferSpec(f"mtp.attn.{n}", "kv", kv_shape, dtype, seq_dim=0) for n in ("k", "v")]
            specs.append(BufferSpec("mtp.hidden", "recurrent", (c.hidden_size,), dtype))
        return specs

    def input_specs(self, dtype):
        return super().input_specs(dtype) + [InputSpec(
            "position_ids", (3,), torch.int64, "multimodal rope positions (t, h, w) of a segment")]

    def forward(self, inputs, ctx, state, all_positions=False):
        """position_ids (T, 3): a multimodal segment's rope positions; the positions after it
        continue from its largest (rope.delta = rope minus sequence position)."""
        pid, delta = inputs.get("position_ids"), state["rope.delta"]
        if pid is None:
            rope = ctx.positions + delta
        else:
            rope = pid.t()                                          # (3, T)
            delta.copy_(rope.max().reshape(1) - ctx.positions[-1:])
        return super().forward(inputs, replace(ctx, rope=rope), state, all_positions)

    def hidden(self, x, ctx, state, all_positions=False):
        """(T, hidden) embeddings -> (T or 1, hidden) after the final norm. Stores mtp.hidden."""
        cos, sin = self.rotary(ctx.rope if ctx.rope is not None else ctx.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, ctx, state, cos, sin)
        x = self.norm(x if all_positions or ctx.planes is not None else x[-1:])
        if self.has_mtp:
            state["mtp.hidden"].copy_(x[-1])
            if ctx.planes is not None:
                ctx.planes["mtp.hidden"].copy_(x)
        return x if all_positions else x[-1:]

    # ---- the MTP layer as the draft head -------------------------------------------------
    @property
    def has_draft_head(self) -> bool:
        return self.has_mtp

    def draft(self, ids, hidden, ctx: StepCtx, state, last_only=False):
        """ids (T,) = tokens at p+1, hidden (T, hidden) = main hidden at p, ctx.positions = p.
        Writes MTP KV rows p; returns ((T, vocab) logits for p+2, (T, hidden) post-norm)."""
        m = self.mtp
        e = m.pre_fc_norm_embedding(self.embed_tokens(ids))
        x = m.fc(torch.cat([e, m.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
        cos, sin = self.rotary(ctx.positions + state["rope.delta"], x.dtype)
        h = m.norm(m.layers[0](x, ctx, state, cos, sin))
        return self.head(h[-1:] if last_only else h), h

    # ---- optional MTP weights ---------------------------------------------------------------
    def _mtp_names(self) -> set[str]:
        return {n for n in self.state_dict() if n.startswith("mtp.")}

    def optional_weights(self, present):
        if self.has_mtp and not any(n.startswith("mtp.") for n in present):
            return self._mtp_names()
        return set()

    def on_weights_loaded(self, present):
        if self.has_mtp and not any(n.startswith("mtp.") for n in present):
            del self.mtp
            self.has_mtp = False
            warnings.warn("qwen3_5: checkpoint has no MTP weights; MTP disabled", stacklevel=2)

    # ---- weight-name mapping ----------------------------------------------------------
    def map_weight_name(self, name: str) -> str | None:
        if name.startswith(("model.visual.", "visual.")):
            return None                     # vision tower: not part of the text decoder
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None                     # a tied head saved anyway duplicates embed_tokens
        if name.startswith("mtp."):
            return name if self.has_mtp else None
        for p in ("model.language_model.", "model."):
            if name.startswith(p):
                return name[len(p):]
        return name


CONFIG = Qwen3_5Config

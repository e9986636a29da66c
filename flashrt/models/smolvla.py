"""SmolVLA (LeRobot): SmolVLM prefix (SigLIP tower + pixel-shuffle connector + the first
num_vlm_layers Llama layers) and an action expert that denoises a chunk by flow matching.

Order: config -> layers -> block -> model -> weight-name mapping (same in every model file).
Batch 1 (a robot loop). All state is named buffers (`state_specs`) handed in as `state`
(name -> tensor) and written in place, per PolicyModel's contract (models/protocol.py; the
policy layer owns the queue). Numerics follow lerobot/policies/smolvla (RoPE base 10000, fp32
attention scores).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import (BufferSpec, InputSpec, Linear, PolicyModel, RMSNorm, StepCtx, SwiGLU, check,
                   normal, require)


# ---- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class SmolVLAConfig:
    hidden: int; inter: int; heads: int; kv_heads: int; head_dim: int; eps: float; vocab: int
    vlm_layers: int
    v_hidden: int; v_inter: int; v_layers: int; v_heads: int; image_size: int; patch: int
    v_eps: float; scale_factor: int
    e_hidden: int; e_inter: int; sa_every: int
    chunk_size: int; n_action_steps: int; max_state_dim: int; max_action_dim: int
    num_steps: int; min_period: float; max_period: float
    cameras: tuple; state_dim: int; action_dim: int; tokenizer_max_length: int

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch // self.scale_factor) ** 2

    @property
    def prefix_capacity(self) -> int:     # images, task tokens, one state token
        return len(self.cameras) * self.image_tokens + self.tokenizer_max_length + 1

    @classmethod
    def from_lerobot(cls, pol: dict, vlm: dict) -> "SmolVLAConfig":
        t = "smolvla"
        check(pol.get("type") == "smolvla", t, "type", f"{pol.get('type')!r} (expected 'smolvla')")
        check(pol.get("attention_mode", "cross_attn") == "cross_attn", t, "attention_mode",
              f"{pol.get('attention_mode')!r} (only 'cross_attn' is implemented)")
        check(not pol.get("add_image_special_tokens", False), t, "add_image_special_tokens", "True")
        check(pol.get("prefix_length", -1) <= 0, t, "prefix_length", "fixed prefix padding")
        check(not pol.get("adapt_to_pi_aloha", False), t, "adapt_to_pi_aloha", "True")
        check(pol.get("rtc_config") is None, t, "rtc_config", "real-time chunking is not implemented")
        check(pol.get("empty_cameras", 0) == 0, t, "empty_cameras", str(pol.get("empty_cameras")))
        tc, vc = require(vlm, "text_config", t), require(vlm, "vision_config", t)
        n_vlm = min(pol.get("num_vlm_layers", -1), tc["num_hidden_layers"])
        n_vlm = tc["num_hidden_layers"] if n_vlm <= 0 else n_vlm
        check(pol.get("num_expert_layers", -1) in (-1, 0, n_vlm), t, "num_expert_layers",
              f"{pol.get('num_expert_layers')} (only as many expert layers as VLM layers)")
        heads, hidden = tc["num_attention_heads"], tc["hidden_size"]
        e_hidden = int(hidden * pol.get("expert_width_multiplier", 0.75))
        feats = require(pol, "input_features", t)
        cams = tuple((k, tuple(v["shape"])) for k, v in feats.items() if v["type"] == "VISUAL")
        check(len(cams) > 0, t, "input_features", "no VISUAL feature (at least one camera)")
        w, h = pol.get("resize_imgs_with_padding") or (0, 0)
        check(w == h == vc["image_size"], t, "resize_imgs_with_padding",
              f"{(w, h)} (must equal the vision tower's image_size {vc['image_size']})")
        return cls(
            hidden=hidden, inter=tc["intermediate_size"], heads=heads,
            kv_heads=tc.get("num_key_value_heads", heads), head_dim=tc.get("head_dim") or hidden // heads,
            eps=tc.get("rms_norm_eps", 1e-5), vocab=tc["vocab_size"], vlm_layers=n_vlm,
            v_hidden=vc["hidden_size"], v_inter=vc["intermediate_size"], v_layers=vc["num_hidden_layers"],
            v_heads=vc["num_attention_heads"], image_size=vc["image_size"], patch=vc["patch_size"],
            v_eps=vc.get("layer_norm_eps", 1e-6), scale_factor=vlm.get("scale_factor", 2),
            e_hidden=e_hidden, e_inter=_expert_intermediate(e_hidden),
            sa_every=pol.get("self_attn_every_n_layers", 2),
            chunk_size=pol["chunk_size"], n_action_steps=pol["n_action_steps"],
            max_state_dim=pol["max_state_dim"], max_action_dim=pol["max_action_dim"],
            num_steps=pol["num_steps"], min_period=pol["min_period"], max_period=pol["max_period"],
            cameras=cams, state_dim=feats["observation.state"]["shape"][0],
            action_dim=pol["output_features"]["action"]["shape"][0],
            tokenizer_max_length=pol["tokenizer_max_length"])


def _expert_intermediate(h: int, mult: int = 4, multiple_of: int = 256) -> int:
    h = int(mult * int(2 * h / 3))          # LeRobot's get_intermediate_size
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


# ---- layers -------------------------------------------------------------------------------
def apply_rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """LeRobot's RoPE (base 10000, halves rotated, fp32). x: (T, H, D); pos: (T,)."""
    half = x.shape[-1] // 2
    xf = x.float()
    exps = (2.0 / x.shape[-1]) * torch.arange(half, dtype=torch.float32, device=x.device)
    rad = (pos[:, None].float() / (10_000 ** exps)[None, :])[:, None, :]       # (T, 1, D/2)
    sin, cos = torch.sin(rad), torch.cos(rad)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def attend(q, k, v, mask, scale):
    """Eager GQA attention as LeRobot computes it (fp32 scores, finfo.min fill).
    q: (T, H, D); k, v: (L, KV, D); mask: (T, L) bool. Returns (T, H*D)."""
    g = q.shape[1] // k.shape[1]
    qh = q.float().transpose(0, 1)                                   # (H, T, D)
    kh = k.float().repeat_interleave(g, dim=1).transpose(0, 1)       # (H, L, D)
    vh = v.repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.matmul(qh, kh.transpose(1, 2)) * scale
    s = torch.where(mask[None], s, torch.finfo(torch.float32).min)
    o = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), vh)      # (H, T, D)
    return o.transpose(0, 1).reshape(q.shape[0], -1)


class SelfAttn(nn.Module):
    """Llama attention projections; kv_in != hidden for the expert's cross-attention layers,
    whose k/v re-project the prefix K/V (kv_heads * head_dim wide)."""

    def __init__(self, hidden, heads, kv_heads, head_dim, kv_in=None):
        super().__init__()
        self.h, self.kv, self.d = heads, kv_heads, head_dim
        self.q_proj = Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = Linear(kv_in or hidden, kv_heads * head_dim, bias=False)
        self.v_proj = Linear(kv_in or hidden, kv_heads * head_dim, bias=False)
        self.o_proj = Linear(heads * head_dim, hidden, bias=False)

    def qkv(self, x):                                     # (T, hidden) -> (T, heads | kv_heads, D)
        return tuple(p(x).unflatten(-1, (n, self.d)) for p, n in
                     ((self.q_proj, self.h), (self.k_proj, self.kv), (self.v_proj, self.kv)))


class VisionBlock(nn.Module):
    """SigLIP encoder layer (pre-LayerNorm, biased projections, tanh-GELU MLP)."""

    def __init__(self, c: SmolVLAConfig):
        super().__init__()
        d = c.v_hidden
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(d, eps=c.v_eps), nn.LayerNorm(d, eps=c.v_eps)
        self.self_attn = nn.Module()
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, n, Linear(d, d))
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = Linear(d, c.v_inter), Linear(c.v_inter, d)
        self.heads = c.v_heads

    def forward(self, x):                                            # x: (N, P, d)
        N, P, d = x.shape
        a = self.self_attn
        h = self.layer_norm1(x)
        q, k, v = (p(h).view(N, P, self.heads, -1).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(N, P, d)
        x = x + a.out_proj(o)
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.layer_norm2(x)), approximate="tanh"))


class VisionTower(nn.Module):
    def __init__(self, c: SmolVLAConfig):
        super().__init__()
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(3, c.v_hidden, c.patch, stride=c.patch)
        self.embeddings.position_embedding = nn.Embedding((c.image_size // c.patch) ** 2, c.v_hidden)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionBlock(c) for _ in range(c.v_layers))
        self.post_layernorm = nn.LayerNorm(c.v_hidden, eps=c.v_eps)
        self.side, self.patch = c.image_size // c.patch, c.patch

    def forward(self, pixels):                                       # (N, 3, H, W) in [-1, 1]
        e = self.embeddings
        x = e.patch_embedding(pixels.to(e.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = x + e.position_embedding(self.position_ids(*pixels.shape[2:], pixels.device))
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)                                # (N, P, v_hidden)

    def position_ids(self, height, width, device):
        # transformers' bucketing of fractional patch coordinates (identity at image_size)
        b = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device)
        ih, iw = (torch.bucketize(torch.arange(n, device=device, dtype=torch.float32) / n * (1 - 1e-6), b,
                                  right=True) for n in (height // self.patch, width // self.patch))
        return (ih[:, None] * self.side + iw).flatten()


class Connector(nn.Module):
    """Pixel shuffle (scale s: s*s neighbouring patches -> one token) then a linear projection."""

    def __init__(self, c: SmolVLAConfig):
        super().__init__()
        self.s = c.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = Linear(c.v_hidden * c.scale_factor ** 2, c.hidden, bias=False)

    def forward(self, x):                                            # (N, P, d) -> (N, P/s^2, hidden)
        N, P, d = x.shape
        s, side = self.s, int(P ** 0.5)
        x = x.view(N, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(N, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(N, P // (s * s), d * s * s))


# ---- block --------------------------------------------------------------------------------
class Block(nn.Module):
    """A Llama layer: the VLM's (kv_in None) or the expert's (narrower; cross layers re-project)."""

    def __init__(self, hidden, inter, c: SmolVLAConfig, kv_in=None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, c.eps)
        self.self_attn = SelfAttn(hidden, c.heads, c.kv_heads, c.head_dim, kv_in)
        self.post_attention_layernorm = RMSNorm(hidden, c.eps)
        self.mlp = SwiGLU(hidden, inter)

    def finish(self, x, o):
        x = x + self.self_attn.o_proj(o)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---- model --------------------------------------------------------------------------------
class Model(PolicyModel):
    model_type = "smolvla"

    def __init__(self, c: SmolVLAConfig):
        super().__init__()
        self.config = c
        # PolicyModel's attributes: prefix rows per chunk, raw observation shapes, padded noise
        self.prefix_len, self.action_dim = c.prefix_capacity, c.action_dim
        self.obs_shapes = dict(c.cameras, **{"observation.state": (c.state_dim,)})
        self.noise_shape = (c.chunk_size, c.max_action_dim)
        self.vision_model = VisionTower(c)
        self.connector = Connector(c)
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Block(c.hidden, c.inter, c) for _ in range(c.vlm_layers))
        kv_w = c.kv_heads * c.head_dim
        self.expert = nn.ModuleList(Block(c.e_hidden, c.e_inter, c, None if self.is_self(i) else kv_w)
                                    for i in range(c.vlm_layers))
        self.expert_norm = RMSNorm(c.e_hidden, c.eps)
        self.state_proj = Linear(c.max_state_dim, c.hidden)
        self.action_in_proj = Linear(c.max_action_dim, c.e_hidden)
        self.action_out_proj = Linear(c.e_hidden, c.max_action_dim)
        self.action_time_mlp_in = Linear(2 * c.e_hidden, c.e_hidden)
        self.action_time_mlp_out = Linear(c.e_hidden, c.e_hidden)

    def is_self(self, i: int) -> bool:
        """Expert layer i attends over prefix + suffix (else: cross-attention to the prefix)."""
        return self.config.sa_every > 0 and i % self.config.sa_every == 0

    def state_specs(self, capacity: int, dtype: torch.dtype) -> list[BufferSpec]:
        c, i64 = self.config, torch.int64
        kv = (capacity, c.kv_heads, c.head_dim)
        specs = [BufferSpec(f"prefix.{i}.{n}", "kv", kv, dtype, seq_dim=0)
                 for i in range(c.vlm_layers) for n in ("k", "v")]
        specs += [BufferSpec(f"expert.{i}.{n}", "kv", kv, dtype, seq_dim=0)
                  for i in range(c.vlm_layers) if not self.is_self(i) for n in ("k", "v")]
        return specs + [
            BufferSpec("prefix.mask", "meta", (capacity,), torch.uint8),  # valid prefix rows
            BufferSpec("prefix.len", "meta", (1,), i64),                 # rows written
            BufferSpec("actions.queue", "recurrent", (c.n_action_steps, c.action_dim), torch.float32),
            BufferSpec("actions.head", "meta", (1,), i64),    # next queue row to hand out
            BufferSpec("actions.count", "meta", (1,), i64),   # rows filled; head == count: empty
            BufferSpec("noise.rng", "rng", (2,), i64),        # flashrt.core.rng's [seed, counter]
            BufferSpec("step", "meta", (1,), i64),            # control steps since reset
            BufferSpec("denoise.x", "scratch", (c.chunk_size, c.max_action_dim), torch.float32)]

    def input_specs(self, dtype: torch.dtype) -> list[InputSpec]:
        c = self.config        # what Processor.preprocess returns, plus optional noise
        return [InputSpec("pixels", (3, c.image_size, c.image_size), torch.float32, "cams, in [-1, 1]"),
                InputSpec("tokens", (), torch.int64, "task tokens"),
                InputSpec("token_mask", (), torch.bool, "valid tokens"),
                InputSpec("state", (c.max_state_dim,), torch.float32, "normalised, padded"),
                InputSpec("noise", (c.max_action_dim,), torch.float32, "chunk_size rows")]

    # -- prefix: images, task, state -> K/V of every layer, once per chunk ---------------
    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """(cams, 3, S, S) in [-1, 1] -> (cams, image_tokens, hidden)."""
        return self.connector(self.vision_model(pixels))

    def embed_prefix(self, img_emb, tokens, token_mask, state_vec):
        """-> (L, hidden) embeddings and (L,) validity: images, task tokens, one state token."""
        c = self.config
        img = img_emb.reshape(-1, c.hidden) * torch.tensor(c.hidden ** 0.5, dtype=img_emb.dtype)
        lang = self.embed_tokens(tokens) * math.sqrt(c.hidden)
        x = torch.cat((img, lang, self.state_proj(state_vec.to(img.dtype)[None])))
        ones = torch.ones(img.shape[0], dtype=torch.bool, device=x.device)
        return x, torch.cat((ones, token_mask.bool(), ones[:1]))

    def fill_prefix(self, img_emb, tokens, token_mask, state_vec, state) -> int:
        c = self.config
        x, valid = self.embed_prefix(img_emb, tokens, token_mask, state_vec)
        L = x.shape[0]
        pos = torch.cumsum(valid, 0) - 1
        block = torch.zeros(L, dtype=torch.long, device=x.device)
        block[-1] = 1       # images + text see each other; the state token sees all of them
        mask = (block[None, :] <= block[:, None]) & valid[None, :] & valid[:, None]
        for i, blk in enumerate(self.layers):
            q, k, v = blk.self_attn.qkv(blk.input_layernorm(x))
            k = apply_rope(k, pos)
            state[f"prefix.{i}.k"][:L] = k
            state[f"prefix.{i}.v"][:L] = v
            if i + 1 < len(self.layers):   # the last layer's output feeds nothing the policy uses
                x = blk.finish(x, attend(apply_rope(q, pos), k, v, mask, c.head_dim ** -0.5))
        for i, blk in enumerate(self.expert):
            if not self.is_self(i):        # re-projected prefix K/V: fixed for the whole chunk
                for n, proj in (("k", blk.self_attn.k_proj), ("v", blk.self_attn.v_proj)):
                    src = state[f"prefix.{i}.{n}"][:L].reshape(L, -1)
                    state[f"expert.{i}.{n}"][:L] = proj(src).view(L, c.kv_heads, c.head_dim)
        state["prefix.mask"].zero_()
        state["prefix.mask"][:L] = valid
        state["prefix.len"].fill_(L)
        return L

    # -- suffix: flow matching over the action chunk -------------------------------------
    def time_embedding(self, t: float, device) -> torch.Tensor:
        c = self.config        # float64 as LeRobot computes it, then the model dtype
        frac = torch.linspace(0.0, 1.0, c.e_hidden // 2, dtype=torch.float64, device=device)
        period = c.min_period * (c.max_period / c.min_period) ** frac
        arg = (1.0 / period * 2 * math.pi) * torch.tensor(t, dtype=torch.float32, device=device).double()
        return torch.cat((torch.sin(arg), torch.cos(arg)))[None]       # (1, e_hidden)

    def velocity(self, x, t, L, masks, state):
        c, (m_self, m_cross, pos_self, pos_cross) = self.config, masks
        a = self.action_in_proj(x.to(self.action_in_proj.weight.dtype))            # (T, e)
        te = self.time_embedding(t, x.device).to(a.dtype).expand_as(a)
        h = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat((a, te), -1))))
        scale = c.head_dim ** -0.5
        for i, blk in enumerate(self.expert):
            hn = blk.input_layernorm(h)
            if self.is_self(i):
                q, k, v = blk.self_attn.qkv(hn)
                K = torch.cat((state[f"prefix.{i}.k"][:L], apply_rope(k, pos_self)))
                V = torch.cat((state[f"prefix.{i}.v"][:L], v))
                o = attend(apply_rope(q, pos_self), K, V, m_self, scale)
            else:
                q = blk.self_attn.q_proj(hn).view(hn.shape[0], c.heads, c.head_dim)
                o = attend(apply_rope(q, pos_cross), state[f"expert.{i}.k"][:L],
                           state[f"expert.{i}.v"][:L], m_cross, scale)
            h = blk.finish(h, o)
        h = self.expert_norm(h)
        return self.action_out_proj(h.to(self.action_out_proj.weight.dtype)).float()

    def denoise(self, noise: torch.Tensor, state) -> torch.Tensor:
        """Euler from t=1 (noise) to t=0 in num_steps; noise (chunk, max_action_dim) fp32."""
        c = self.config
        L = int(state["prefix.len"])
        valid = state["prefix.mask"][:L].bool()
        T, dev = c.chunk_size, noise.device
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        m_cross = valid[None].expand(T, L)
        masks = (torch.cat((m_cross, causal), 1), m_cross,
                 int(valid.sum()) + torch.arange(T, device=dev), torch.arange(T, device=dev))
        x = state["denoise.x"]
        x.copy_(noise)
        dt = -1.0 / c.num_steps
        for step in range(c.num_steps):
            x.add_(dt * self.velocity(x, 1.0 + step * dt, L, masks, state))
        return x

    # -- the policy step -------------------------------------------------------------------
    def forward(self, inputs: dict, ctx: StepCtx, state, all_positions: bool = False) -> dict:
        """One chunk from processor outputs (+ optional "noise" (chunk, max_action_dim); else
        drawn from noise.rng): prefix rows [0, L <= ctx.end) rewritten, then flow matching.
        Returns {"actions": (chunk_size, action_dim)} normalised."""
        c = self.config
        L = inputs["pixels"].shape[0] * c.image_tokens + inputs["tokens"].shape[0] + 1
        if L > ctx.end:       # the processor truncates the task: only a foreign caller gets here
            raise ValueError(f"smolvla: a prefix of {L} rows exceeds the {ctx.end} given")
        noise = inputs.get("noise")
        noise = normal(state["noise.rng"], self.noise_shape) if noise is None else noise
        img = self.embed_images(inputs["pixels"])
        self.fill_prefix(img, inputs["tokens"], inputs["token_mask"], inputs["state"], state)
        x = self.denoise(noise.reshape(c.chunk_size, -1).float(), state)
        return {"actions": x[:, :c.action_dim]}

    # ---- weight-name mapping ----------------------------------------------------------
    _PREFIXES = (("model.vlm_with_expert.vlm.model.text_model.layers.", "layers."),
                 ("model.vlm_with_expert.vlm.model.text_model.embed_tokens.", "embed_tokens."),
                 ("model.vlm_with_expert.vlm.model.vision_model.", "vision_model."),
                 ("model.vlm_with_expert.vlm.model.connector.", "connector."),
                 ("model.vlm_with_expert.lm_expert.layers.", "expert."),
                 ("model.vlm_with_expert.lm_expert.norm.", "expert_norm."),
                 ("model.", ""))
    # saved by LeRobot, unused for actions: the VLM's LM head and final norm
    IGNORED = ("model.vlm_with_expert.vlm.lm_head.weight",
               "model.vlm_with_expert.vlm.model.text_model.norm.weight")

    def map_weight_name(self, name: str) -> str | None:
        """LeRobot parameter name -> ours; None: known and unused (VLM layers past vlm_layers too)."""
        if name in self.IGNORED:
            return None
        for theirs, ours in self._PREFIXES:
            if name.startswith(theirs):
                ours += name[len(theirs):]
                deep = ours.startswith("layers.") and int(ours.split(".")[1]) >= self.config.vlm_layers
                return None if deep else ours
        return name

    def lerobot_name(self, ours: str) -> str:
        """Ours -> LeRobot's (checkpoint writing)."""
        for theirs, mine in self._PREFIXES[:-1]:
            if ours.startswith(mine):
                return theirs + ours[len(mine):]
        return "model." + ours

CONFIG = SmolVLAConfig

"""TinyVLA: a miniature vision-language-action policy in SmolVLA's shape (random weights only).

Per chunk, embedded observations (image features + a state vector) become a prefix whose K/V,
projected by each expert layer, overwrite the last chunk's rows; `num_steps` flow-matching Euler
steps of a small action expert read them to turn noise into an action chunk: the smallest
PolicyModel (models/protocol.py; the policy layer owns the queue semantics). State, by name:
  prefix.{i}.k/.v  kv, (capacity, heads, head_dim): rows [0, prefix_len) rewritten per chunk
  actions.queue    recurrent, (n_action_steps, action_dim): the chunk being handed out
  actions.head/.count, step   meta: next queue row, rows filled, actions handed out
  noise.rng        rng, [seed, counter]: flashrt.core.rng's counter RNG draws the noise
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from .base import BufferSpec, InputSpec, Linear, PolicyModel, RMSNorm, StepCtx, check, normal


# ---- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TinyVLAConfig:
    obs_dim: int = 32            # width of the given image-feature embeddings
    n_image_tokens: int = 6
    state_dim: int = 6
    hidden_size: int = 32        # action expert width
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 16
    action_dim: int = 4
    chunk_size: int = 8
    n_action_steps: int = 5      # actions queued per chunk (LeRobot's n_action_steps)
    num_steps: int = 4           # Euler steps from t=1 (noise) to t=0 (actions)
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_hf(cls, cfg: dict) -> "TinyVLAConfig":
        c = cls(**{f.name: cfg[f.name] for f in fields(cls) if f.name in cfg})
        check(0 < c.n_action_steps <= c.chunk_size, "tiny_vla", "n_action_steps",
              f"{c.n_action_steps} must be in [1, chunk_size={c.chunk_size}]")
        return c


# ---- layers -------------------------------------------------------------------------------
class ExpertLayer(nn.Module):
    """Action tokens attend over [own prefix K/V ; their K/V] (SmolVLA's self-attn layers); MLP."""

    def __init__(self, c: TinyVLAConfig):
        super().__init__()
        H, hd, self.shape = c.hidden_size, c.num_heads * c.head_dim, (c.num_heads, c.head_dim)
        self.prefix_k, self.prefix_v = Linear(c.obs_dim, hd, bias=False), Linear(c.obs_dim, hd, bias=False)
        self.norm1, self.norm2 = RMSNorm(H, c.rms_norm_eps), RMSNorm(H, c.rms_norm_eps)
        self.q, self.k, self.v = (Linear(H, hd, bias=False) for _ in range(3))
        self.o = Linear(hd, H, bias=False)
        self.up, self.down = Linear(H, 4 * H), Linear(4 * H, H)

    def fill(self, x: torch.Tensor, ctx: StepCtx, k_buf: torch.Tensor, v_buf: torch.Tensor):
        # x (T, obs_dim) -> rows ctx.positions of (capacity, heads, head_dim), in place
        k_buf.index_copy_(0, ctx.positions, self.prefix_k(x).view(ctx.T, *self.shape))
        v_buf.index_copy_(0, ctx.positions, self.prefix_v(x).view(ctx.T, *self.shape))

    def forward(self, x, pk, pv):                  # x (C, H); pk, pv (P, heads, head_dim)
        h, C = self.norm1(x), x.shape[0]
        q = self.q(h).view(C, *self.shape)
        k = torch.cat([pk, self.k(h).view(C, *self.shape)])
        v = torch.cat([pv, self.v(h).view(C, *self.shape)])
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + self.o(o.transpose(0, 1).reshape(C, -1))
        return x + self.down(F.silu(self.up(self.norm2(x))))


# ---- model --------------------------------------------------------------------------------
class Model(PolicyModel):
    model_type = "tiny_vla"

    def __init__(self, c: TinyVLAConfig):
        super().__init__()
        self.config = c
        self.prefix_len = c.n_image_tokens + 1                       # image rows + one state row
        self.noise_shape, self.action_dim = (c.chunk_size, c.action_dim), c.action_dim
        self.obs_shapes = {"image": (c.n_image_tokens, c.obs_dim), "state": (c.state_dim,)}
        self.pos = nn.Parameter(torch.empty(self.prefix_len, c.obs_dim))   # learned prefix positions
        self.state_in = Linear(c.state_dim, c.obs_dim)
        H = c.hidden_size      # action_in: noisy actions -> expert; time_in: sinusoidal time
        self.action_in, self.time_in = Linear(c.action_dim, H), Linear(H, H)
        self.action_out = Linear(H, c.action_dim)
        self.layers = nn.ModuleList(ExpertLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps)

    def state_specs(self, capacity: int, dtype: torch.dtype) -> list[BufferSpec]:
        c, i64 = self.config, torch.int64
        kv = (capacity, c.num_heads, c.head_dim)
        specs = [BufferSpec(f"prefix.{i}.{n}", "kv", kv, dtype, seq_dim=0)
                 for i in range(c.num_layers) for n in "kv"]
        return specs + [
            BufferSpec("actions.queue", "recurrent", (c.n_action_steps, c.action_dim), torch.float32),
            BufferSpec("actions.head", "meta", (1,), i64),
            BufferSpec("actions.count", "meta", (1,), i64),
            BufferSpec("noise.rng", "rng", (2,), i64),
            BufferSpec("step", "meta", (1,), i64)]

    def input_specs(self, dtype: torch.dtype) -> list[InputSpec]:
        c = self.config                    # noise (optional) has chunk_size rows, not prefix rows
        return [InputSpec("image", (c.obs_dim,), dtype), InputSpec("state", (c.state_dim,), dtype),
                InputSpec("noise", (c.action_dim,), torch.float32)]

    def velocity(self, x_t: torch.Tensor, t: float, kv: list) -> torch.Tensor:
        half, w = self.config.hidden_size // 2, self.action_in.weight.dtype   # sinusoidal time
        f = torch.exp(torch.arange(half, device=x_t.device) * (-math.log(1e4) / half)) * (1e3 * t)
        x = self.action_in(x_t.to(w)) + self.time_in(torch.cat([f.sin(), f.cos()]).to(w))
        for layer, (pk, pv) in zip(self.layers, kv):
            x = layer(x, pk, pv)
        return self.action_out(self.norm(x)).float()

    def forward(self, inputs: dict, ctx: StepCtx, state, all_positions: bool = False) -> dict:
        """One chunk: ctx covers prefix rows [0, prefix_len); returns {"actions": (chunk, action_dim)}."""
        x = torch.cat([inputs["image"], self.state_in(inputs["state"])[None]]) + self.pos[ctx.positions]
        for i, layer in enumerate(self.layers):
            layer.fill(x, ctx, state[f"prefix.{i}.k"], state[f"prefix.{i}.v"])
        kv = [tuple(state[f"prefix.{i}.{n}"][: ctx.end] for n in "kv") for i in range(len(self.layers))]
        noise = inputs.get("noise")
        x_t = normal(state["noise.rng"], self.noise_shape) if noise is None else noise.float()
        dt = -1.0 / self.config.num_steps                # x_t = t * noise + (1 - t) * actions
        for s in range(self.config.num_steps):
            x_t = x_t + dt * self.velocity(x_t, 1.0 + s * dt, kv)
        return {"actions": x_t}


def random_model(c: TinyVLAConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Model:
    """Random weights (std 1/sqrt(fan_in); norms at 1), seeded: the only weights this model has."""
    g, net = torch.Generator().manual_seed(seed), Model(c)
    with torch.no_grad():
        for name, p in net.named_parameters():
            r = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1] if p.dim() > 1 else 1)
            p.copy_(torch.ones_like(p) if "norm" in name else r)
    return net.to(dtype).eval()


CONFIG = TinyVLAConfig      # the loader's config class (from_hf)

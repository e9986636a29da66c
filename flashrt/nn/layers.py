"""Building blocks shared by the model files: norms, rotary embedding, attention over arena KV.

Two execution paths share every op:
- eager: the host knows the committed position and slices KV to [0, position + T);
- static (CUDA-graph safe): positions are device tensors. On CUDA a Triton kernel reads only the
  live rows [0, position] (flashrt/kernels/decode_attention.py); the pure-torch body spans the
  whole capacity and removes stale rows with `where` on both scores and values, because a mask
  added before softmax does not stop NaN in stale K (NaN + -inf = NaN), and 0 * NaN in V is NaN.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from flashrt import native
from flashrt.core.step import StepCtx

from .linear import Linear, LinearPack

class RMSNorm(nn.Module):
    """RMSNorm in fp32. zero_centred: weight stored as w - 1 (Qwen3.5), scale applied in fp32."""

    def __init__(self, dim: int, eps: float, zero_centred: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.zero_centred = zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, w = x.dtype, self.weight
        if self._kernel_takes(x):   # the same form in one extension call (x: (..., dim) as rows)
            return native.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), w, self.eps,
                                   self.zero_centred).view(x.shape)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)

    def add_and_norm(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's residual add and this norm: (x + h, self(x + h)), in one extension call on
        the CPU (the sum rounded once in x's dtype, as torch's add)."""
        if self._kernel_takes(x) and h.dtype == x.dtype and h.shape == x.shape:
            s, y = native.add_rms_norm(x.reshape(-1, x.shape[-1]).contiguous(),
                                       h.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.eps,
                                       self.zero_centred)
            return s.view(x.shape), y.view(x.shape)
        x = x + h
        return x, self(x)

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        return (native.RMS_NORM and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                and self.weight.dtype == x.dtype and not torch.compiler.is_compiling())


class Rotary(nn.Module):
    """Rotary embedding over the first `rot_dim` dims of each head (partial rotary when < head_dim).
    sections (t, h, w): interleaved multimodal rope; frequency i follows axis 1 (h) when
    i % 3 == 1 and i < 3 * h, axis 2 (w) when i % 3 == 2 and i < 3 * w, else axis 0 (t)."""

    def __init__(self, rot_dim: int, theta: float, sections: tuple | None = None):
        super().__init__()
        self.rot_dim, self.theta, self.sections = rot_dim, theta, sections
        self.rebuild("cpu")

    def rebuild(self, device):
        # Same formula as transformers' default rope, so fp32 bits match.
        exps = torch.arange(0, self.rot_dim, 2, dtype=torch.int64, device=device).float() / self.rot_dim
        self.register_buffer("inv_freq", 1.0 / (self.theta ** exps), persistent=False)
        i = torch.arange(self.rot_dim // 2, device=device)
        axis = torch.zeros_like(i)
        if self.sections is not None:
            _, h, w = self.sections
            axis = torch.where((i % 3 == 1) & (i < 3 * h), 1, torch.where((i % 3 == 2) & (i < 3 * w), 2, 0))
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions (T,), or (3, T) per axis (t, h, w)."""
        if positions.dim() == 2:                                       # (3, T) -> (T, rot/2)
            pos = positions.gather(0, self.axis[:, None].expand(-1, positions.shape[1])).t()
            freqs = pos.float() * self.inv_freq[None, :]
        else:
            freqs = positions[:, None].float() * self.inv_freq[None, :]   # (T, rot/2)
        emb = torch.cat((freqs, freqs), dim=-1)                        # (T, rot)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D); cos/sin: (T, rot). Rotates the first rot dims, passes the rest through."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    out = xr * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, xp), dim=-1) if xp.shape[-1] else out


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, D) of a full-width rope -> (cos, sin with its first half negated), each
    (T, 1, D): what rotate() takes, built once per step."""
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat([-sin[:, :half], sin[:, half:]], -1)[:, None]


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """apply_rotary of a full-width rope in 4 ops instead of 11: rotate_half(x) * sin equals
    x.roll(D / 2) * sin_signed product for product, so the result is bitwise apply_rotary's.
    x (T, H, D); tables: rotary_tables(cos, sin)."""
    cos, sin_signed = tables
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def attend_cached(q, k, v, k_cache, v_cache, ctx: StepCtx, scale: float) -> torch.Tensor:
    """Write this step's K/V into the arena at ctx.positions, then attend causally.

    q: (T, Hq, D); k, v: (T, Hkv, D); k_cache, v_cache: (capacity, Hkv, D) arena views.
    Returns (T, Hq, D).
    """
    if ctx.static:
        k_cache.index_copy_(0, ctx.positions, k)
        v_cache.index_copy_(0, ctx.positions, v)
        return attend_static(q, k_cache, v_cache, ctx.positions, scale)
    k_cache[ctx.start: ctx.end] = k
    v_cache[ctx.start: ctx.end] = v
    K, V = k_cache[: ctx.end], v_cache[: ctx.end]      # only committed + new rows: stale rows unread
    if (ctx.T == 1 and native.DECODE_ATTENTION and q.device.type == "cpu" and q.shape[-1] % 8 == 0
            and K.dtype in (torch.float32, torch.bfloat16) and K.is_contiguous() and V.is_contiguous()
            and not torch.compiler.is_compiling()):
        # one query: the extension reads float32 or bf16 rows in place (torch's SDPA: a fraction of
        # memory speed, and a float32 copy of a bf16 cache first)
        return native.decode_attention(q[0].float(), K, V, scale).to(q.dtype)[None]
    qh = q.transpose(0, 1).unsqueeze(0)                 # (1, Hq, T, D)
    kh = K.permute(1, 0, 2).unsqueeze(0)                # (1, Hkv, L, D)
    vh = V.permute(1, 0, 2).unsqueeze(0)
    gqa = kh.shape[1] != qh.shape[1]
    if ctx.T > 1 and ctx.start > 0:   # query i sits at start + i and sees keys <= start + i
        out = prefix_chunk_attention(qh, kh, vh, scale, chunk_attention_mode(qh, kh, vh))
    elif ctx.T == 1 and qh.dtype == torch.bfloat16 and qh.device.type == "cpu":
        # one query in bf16: torch's CPU SDPA is several times slower than in float32, so widen
        # q (1, Hq, 1, D) and K/V (1, Hkv, L, D) and attend in float32
        out = F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), scale=scale,
                                             enable_gqa=gqa).to(qh.dtype)
    else:                             # one token sees every key; a first chunk is square causal
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=ctx.T > 1, scale=scale,
                                             enable_gqa=gqa)
    return out[0].transpose(0, 1)


def chunk_attention_mode(qh, kh, vh) -> str:
    """How a chunk after a prefix keeps a fused SDPA kernel. "mask": CPU, whose flash kernel takes
    a boolean mask with GQA; "bias": CUDA flash (fp16/bf16) with a lower-right causal bias and
    GQA; "expand": K/V heads repeated so the memory-efficient kernel (fp32, no GQA) takes the bias.
    An explicit mask with enable_gqa on CUDA falls to the math path: fp32 scores (Hq, T, L)."""
    if qh.device.type != "cuda":
        return "mask"
    if kh.shape[1] == qh.shape[1]:
        return "bias"
    from torch.backends.cuda import SDPAParams, can_use_flash_attention
    return "bias" if can_use_flash_attention(SDPAParams(qh, kh, vh, None, 0.0, False, True)) else "expand"


def prefix_chunk_attention(qh, kh, vh, scale, mode: str) -> torch.Tensor:
    """Causal attention of T queries that are the last T of L keys (L > T), bottom-right aligned.
    qh: (1, Hq, T, D); kh, vh: (1, Hkv, L, D). Returns (1, Hq, T, D)."""
    T, L, g = qh.shape[2], kh.shape[2], qh.shape[1] // kh.shape[1]
    if mode == "mask":
        kpos = torch.arange(L, device=qh.device)
        mask = kpos[None, :] <= torch.arange(L - T, L, device=qh.device)[:, None]     # (T, L)
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                              enable_gqa=g > 1)
    if mode == "expand" and g > 1:
        kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
    elif mode not in ("bias", "expand"):
        raise ValueError(f"chunk attention mode {mode!r}: expected mask, bias or expand")
    # imported here: torch.nn.attention.bias pulls in dynamo (and Triton) for every CPU user
    from torch.nn.attention.bias import causal_lower_right
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(T, L), scale=scale,
                                          enable_gqa=kh.shape[1] != qh.shape[1])


def attend_static(q, K, V, positions, scale, kernel: str = "auto"):
    """Graph-safe attention of q (T, Hq, D) over K, V (cap, Hkv, D); query t sees keys
    [0, positions[t]]. kernel "triton": length-aware, native dtype (auto on CUDA when Triton
    imports); "torch": fp32 over the whole capacity (shapes fixed, one graph per T either way)."""
    if kernel == "auto":
        kernel = "triton" if q.is_cuda and _triton_attention() is not None else "torch"
    if kernel == "triton":
        return _triton_attention()(q, K, V, positions, scale)
    if kernel != "torch":
        raise ValueError(f"attention kernel {kernel!r}: expected auto, triton or torch")
    T, Hq, D = q.shape
    cap, Hkv, _ = K.shape
    g = Hq // Hkv
    kpos = torch.arange(cap, device=q.device)
    visible = kpos[None, :] <= positions[:, None]                       # (T, cap)
    live = kpos <= positions[-1]                                        # (cap,)
    qh = q.reshape(T, Hkv, g, D).permute(1, 2, 0, 3).float()           # (Hkv, g, T, D)
    kh = K.permute(1, 0, 2).float()                                     # (Hkv, cap, D)
    vh = torch.where(live[:, None, None], V, torch.zeros((), dtype=V.dtype, device=V.device))
    vh = vh.permute(1, 0, 2).float()
    scores = torch.einsum("hgtd,hcd->hgtc", qh, kh) * scale
    scores = torch.where(visible, scores, torch.full((), float("-inf"), device=q.device))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgtc,hcd->hgtd", probs, vh)                     # (Hkv, g, T, D)
    return out.permute(2, 0, 1, 3).reshape(T, Hq, D).to(q.dtype)


@functools.lru_cache(maxsize=None)
def _triton_attention():
    """The Triton decode-attention wrapper, or None where Triton does not import (CPU builds)."""
    try:
        from flashrt.kernels.decode_attention import decode_attention
    except Exception:       # not installed, or a Triton that fails to import here
        return None
    return decode_attention


def depthwise_causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None,
                          planes: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv with `state` as left context, advanced in place.

    x: (T, C); state: (K-1, C) (a transposed view is fine); weight: (C, K). Returns (T, C) in
    weight's dtype. K shifted multiply-adds: memory-bound, and 4-5x cheaper on CPU than
    F.conv1d's depthwise path at T=1 and T=512. planes (T, K-1, C): the state after each t."""
    T, K = x.shape[0], weight.shape[1]
    xx = torch.cat([state.to(x.dtype), x]).to(weight.dtype)             # (K-1+T, C)
    if K > 1:
        if planes is not None:       # state after t = inputs t+1 .. t+K-1 of xx
            planes.copy_(xx[1:].unfold(0, K - 1, 1).transpose(1, 2))
        state.copy_(xx[T:])                                            # the last K-1 inputs
    out = xx[:T] * weight[:, 0]
    for j in range(1, K):
        out.addcmul_(xx[j: j + T], weight[:, j])
    return out if bias is None else out + bias


class QKNormAttention(nn.Module):
    """GQA attention with per-head RMSNorm on q and k (Qwen3, LFM2); KV in the arena.

    Parameter names differ between families, so they are passed in (checkpoint names map 1:1).
    """

    def __init__(self, hidden, heads, kv_heads, head_dim, eps, idx,
                 out_name="o_proj", norm_names=("q_norm", "k_norm")):
        super().__init__()
        self.h, self.kv, self.d = heads, kv_heads, head_dim
        self.q_proj = Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=False)
        self.qkv = LinearPack(self.q_proj, self.k_proj, self.v_proj)
        setattr(self, out_name, Linear(heads * head_dim, hidden, bias=False))
        for n in norm_names:
            setattr(self, n, RMSNorm(head_dim, eps))
        self.names = (out_name,) + tuple(norm_names)
        self.k_name, self.v_name = f"layers.{idx}.attn.k", f"layers.{idx}.attn.v"

    def forward(self, x, ctx: StepCtx, state, cos, sin):
        T = x.shape[0]                                           # x: (T, hidden)
        out, qn, kn = (getattr(self, n) for n in self.names)
        q, k, v = self.qkv(x)
        q, k = qn(q.view(T, self.h, self.d)), kn(k.view(T, self.kv, self.d))
        v = v.view(T, self.kv, self.d)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = attend_cached(q, k, v, state[self.k_name], state[self.v_name], ctx, self.d ** -0.5)
        return out(o.reshape(T, self.h * self.d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, names=("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = names
        for n, (i, o) in zip(names, ((dim, hidden), (dim, hidden), (hidden, dim))):
            setattr(self, n, Linear(i, o, bias=False))
        self.gate_up = LinearPack(getattr(self, names[0]), getattr(self, names[1]))

    def forward(self, x):
        gate, up = self.gate_up(x)
        if (native.SILU_MUL and gate.device.type == "cpu" and gate.dim() == 2 and gate.dtype in
                (torch.float32, torch.bfloat16) and not torch.compiler.is_compiling()):
            h = native.silu_mul(gate, up)             # one pass, gate and up where they lie
        else:
            h = F.silu(gate) * up
        return getattr(self, self.names[2])(h)

"""Gated DeltaNet math shared by hybrid models: causal depthwise conv and the gated delta rule.

Batch 1, no batch dim. All state is updated in place (fixed arena addresses, graph-safe):
- conv state (C, K-1): the last K-1 conv inputs, oldest first;
- recurrent state (Hv, Dk, Dv) float32, whatever the activation dtype.
The pure-torch paths follow transformers' torch_chunk_gated_delta_rule /
torch_recurrent_gated_delta_rule (fp32 parity ~1e-6); the chunk rule solves both right-hand
sides at once and updates the state in place. Optional CUDA kernels
(flash-linear-attention, causal-conv1d) are used when `fast_kernels()` finds them;
flash-linear-attention only for bf16/fp16 activations (`use_fla`): it asserts on float32.
On the CPU the token-by-token rule runs the extension's kernel where it is built
(native.GDN_RULE): every eager decode and verify step then takes that one path.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from flashrt import native

from .layers import depthwise_causal_conv


@functools.lru_cache(maxsize=None)
def fast_kernels():
    """(fla_ops, conv_ops) or None each: (chunk, fused_recurrent) and (conv_fn, conv_update)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        fla = (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)
    except Exception:       # not installed, or no triton/CUDA
        fla = None
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
        conv = (causal_conv1d_fn, causal_conv1d_update)
    except Exception:
        conv = None
    return fla, conv


FLA_DTYPES = (torch.bfloat16, torch.float16)


def use_fla(fast: bool, dtype: torch.dtype) -> bool:
    """Whether a gated-delta-rule call goes to flash-linear-attention: asked for (the model found
    it on CUDA) and a half dtype; float32 stays on the torch path, which keeps fp32 parity."""
    return fast and dtype in FLA_DTYPES


# ---- causal depthwise conv ---------------------------------------------------------------
def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, fast: bool = False,
                planes: torch.Tensor | None = None):
    """silu(depthwise causal conv) with `state` as left context; state advanced in place.

    x: (T, C); state: (C, K-1); weight: (C, K). Returns (T, C). Chunked prefill == one shot.
    planes (T, C, K-1): also the state after each position (torch path).
    """
    T = x.shape[0]
    if fast and planes is None:
        conv_fn, conv_update = fast_kernels()[1]
        if T == 1:   # kernel shifts state in place: (1, C, K-1)
            return conv_update(x.unsqueeze(-1), state.unsqueeze(0), weight, None, "silu").squeeze(-1)
        xc = x.t().unsqueeze(0)                               # (1, C, T) channel-last view
        init = state.t().contiguous().t().unsqueeze(0)        # channel-last (1, C, K-1)
        out, final = conv_fn(xc, weight, None, initial_states=init, return_final_states=True,
                             activation="silu")
        state.copy_(final[0])
        return out[0].t()
    if (native.CAUSAL_CONV and x.device.type == "cpu" and not torch.compiler.is_compiling()
            and x.dtype in (torch.float32, torch.bfloat16) and state.dtype == weight.dtype == x.dtype
            and state.is_contiguous() and (planes is None or planes.is_contiguous())):
        # the same form in one extension call (~10 torch ops otherwise)
        return native.causal_conv(x.contiguous(), state, weight.contiguous(), planes)
    pl = None if planes is None else planes.transpose(1, 2)                 # (T, K-1, C) view
    return F.silu(depthwise_causal_conv(x, state.t(), weight, None, pl)).to(x.dtype)   # (T, C)


# ---- gated delta rule --------------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep(q, k, v, beta, g):
    """GVA repeat, fp32, head-major, l2norm(q, k), q scaled. Shapes -> (H, T, D) / (H, T)."""
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    q, k, v, beta, g = (t.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, beta, g


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64, fast: bool = False):
    """Prefill. q, k: (T, Hk, Dk); v: (T, Hv, Dv); g (log decay), beta: (T, Hv);
    state: (Hv, Dk, Dv) fp32, read as the initial state and overwritten with the final one.
    Returns (T, Hv, Dv) in v's dtype."""
    dtype, T = v.dtype, v.shape[0]
    if use_fla(fast, dtype):
        op = fast_kernels()[0][0]
        q, k = _gva(q, k, v)
        o, final = op(q[None], k[None], v[None], g[None].float(), beta[None],
                      initial_state=state[None], output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
        state.copy_(final[0])
        return o[0].to(dtype)
    q, k, v, beta, g = _prep(q, k, v, beta, g)                # (H, T, D), (H, T)
    H = v.shape[0]
    # a step shorter than a chunk (a user turn, a speculative verify) is one chunk of its own
    # length: padding 16 tokens to 64 made the (c, c) products and solves 16x the work
    chunk = min(chunk, T)
    pad = (chunk - T % chunk) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n = (T + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(H, n, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(H, n, chunk).cumsum(-1)                     # cumulative log decay in a chunk
    # exp(g_i - g_j) for j <= i; above the diagonal (j > i, where it may overflow) zeroed
    decay = (g[..., :, None] - g[..., None, :]).exp().tril()
    ut = (k_beta @ k.transpose(-1, -2)) * decay               # (H, n, c, c) strictly-lower + diag
    attn = (q @ k.transpose(-1, -2)) * decay
    # one solve for both right-hand sides: (H, n, c, Dv + Dk)
    uw = torch.linalg.solve_triangular(ut, torch.cat([v_beta, k_beta * g.exp()[..., None]], -1),
                                       upper=False, unitriangular=True)
    u, w = uw.split([v_beta.shape[-1], k_beta.shape[-1]], dim=-1)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]           # (H, n, 1, 1)
    S = state                                                 # (H, Dk, Dv) fp32, updated in place
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ S
        out[:, i] = torch.baddbmm(q[:, i] @ S, attn[:, i], v_new)
        S.mul_(chunk_decay[:, i]).baddbmm_(k[:, i].transpose(-1, -2), v_new)
    return out.reshape(H, -1, out.shape[-1])[:, :T].transpose(0, 1).to(dtype)


def recurrent_gated_delta_rule(q, k, v, g, beta, state, fast: bool = False, planes=None):
    """Decode (any T, one token at a time). Same shapes as chunk_gated_delta_rule.
    planes (T, Hv, Dk, Dv): also the state after each token (torch path)."""
    dtype, T = v.dtype, v.shape[0]
    if use_fla(fast, dtype) and planes is None:
        op = fast_kernels()[0][1]
        q, k = _gva(q, k, v)
        o, final = op(q[None], k[None], v[None], g=g[None].float(), beta=beta[None],
                      initial_state=state[None], output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
        state.copy_(final[0])
        return o[0].to(dtype)
    if native.GDN_RULE and state.device.type == "cpu" and not torch.compiler.is_compiling():
        # q, k, v side by side in float32 (T, 2*hk*dk + hv*dv): a few KiB per token. Compiled
        # bodies keep the torch form, which inductor fuses (the kernel is opaque to it)
        qkv = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), 1).float()
        heads = (k.shape[1], v.shape[1], k.shape[2], v.shape[2])
        out = native.gated_delta_rule(qkv, heads, g.float().contiguous(), beta.float().contiguous(),
                                      state, planes)
        return out.to(dtype)
    q, k, v, beta, g = _prep(q, k, v, beta, g)                # (H, T, D), (H, T)
    out = torch.empty_like(v)
    for t in range(T):                                        # in place on the arena state
        kt, qt = k[:, t, None, :], q[:, t, None, :]           # (H, 1, Dk)
        state.mul_(g[:, t].exp()[:, None, None])
        delta = (v[:, t, None] - torch.bmm(kt, state)) * beta[:, t, None, None]   # (H, 1, Dv)
        state.baddbmm_(kt.transpose(1, 2), delta)             # S += k delta^T
        out[:, t] = torch.bmm(qt, state)[:, 0]
        if planes is not None:
            planes[t].copy_(state)
    return out.transpose(0, 1).to(dtype)


def gated_step_runs(state: torch.Tensor, fast: bool) -> bool:
    """Whether gated_delta_block runs here: the extension's gated kernel on the CPU, eager."""
    return native.GDN_STEP and state.device.type == "cpu" and not fast and not torch.compiler.is_compiling()


def gated_delta_block(qkv, a, b, z, A_log, dt_bias, norm, heads: tuple, state, planes=None):
    """A Gated DeltaNet block after its conv, token by token (callers check gated_step_runs):
    beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the l2-normed rule, then norm(o) *
    silu(z) (norm: an RMSNorm, not zero-centred, in qkv's dtype). qkv (T, 2*hk*dk + hv*dv), a, b
    (T, hv), z (T, hv*dv) in the model's dtype; heads (hk, hv, dk, dv); state, planes as
    recurrent_gated_delta_rule's. Returns (T, hv*dv) in qkv's dtype, rounded where the torch
    form rounds (bf16), so the two differ only in the last bits of their sums."""
    T, dtype = qkv.shape[0], qkv.dtype
    # a bf16 model's tensors go in as they are; anything else in float32 (exact for bf16 values)
    io = dtype if dtype == torch.bfloat16 and norm.weight.dtype == a.dtype == b.dtype == z.dtype == dtype \
        else torch.float32
    cast = lambda t, d=io: t.to(d).contiguous()     # noqa: E731
    out = native.gated_delta_step(cast(qkv), heads, cast(a), cast(b), state, planes, cast(A_log, torch.float32),
                                  cast(dt_bias, torch.float32), cast(z.reshape(T, -1)), cast(norm.weight),
                                  norm.eps, round_bf16=dtype == torch.bfloat16)
    return out.view(T, -1).to(dtype)


def _gva(q, k, v):
    rep = v.shape[1] // k.shape[1]
    if rep > 1:   # older fla releases need equal q/k/v head counts
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q.contiguous(), k.contiguous()

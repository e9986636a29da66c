"""Gated DeltaNet's rule token by token on the CPU (csrc/gdn_cpu.cpp): a decode step's, or a
speculative verify's with the state after each token, in one call per layer instead of ~25
torch ops a token; gated_delta_step also takes the decay, beta and the output gated norm.
causal_conv: the block's silu(conv) before the rule, its conv state advanced, in one call."""
from __future__ import annotations

import torch

from . import _ext as ext

GDN_RULE: bool = ext.cpu_kernel_runs("gated_delta_rule")
GDN_STEP: bool = GDN_RULE and hasattr(ext.C, "gated_delta_step")     # the gated form


def _check_rule(fn, qkv, heads, g, beta, state, planes, io=(torch.float32,)) -> None:
    hk, hv, dk, dv = heads
    ext.check_tensor(fn, "qkv", qkv, io)
    T, width = qkv.shape
    if width != 2 * hk * dk + hv * dv:
        raise ValueError(f"{fn}: qkv rows of {width} floats, expected 2*{hk}*{dk} + {hv}*{dv}")
    for name, t in (("g", g), ("beta", beta)):
        ext.check_tensor(fn, name, t, (qkv.dtype,))
        if tuple(t.shape) != (T, hv):
            raise ValueError(f"{fn}: {name} of shape {tuple(t.shape)}, expected ({T}, {hv})")
    ext.check_tensor(fn, "state", state, (torch.float32,), dim=3)
    if tuple(state.shape) != (hv, dk, dv):
        raise ValueError(f"{fn}: state of shape {tuple(state.shape)}, expected ({hv}, {dk}, {dv})")
    if planes is not None:
        ext.check_tensor(fn, "planes", planes, (torch.float32,), dim=4)
        if tuple(planes.shape) != (T, hv, dk, dv):
            raise ValueError(f"{fn}: planes of shape {tuple(planes.shape)}, expected ({T}, {hv}, {dk}, {dv})")


def gated_delta_rule(qkv: torch.Tensor, heads: tuple, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, planes: torch.Tensor | None = None) -> torch.Tensor:
    """qkv (T, hk*dk + hk*dk + hv*dv): q, k, v of T tokens side by side; heads (hk, hv, dk, dv);
    g (log decay) and beta (T, hv); state (hv, dk, dv), advanced in place; planes (T, hv, dk, dv):
    also the state after each token. All float32, contiguous, on the CPU. Returns out (T, hv, dv)
    float32: per token q and k l2-normed (q also by dk^-1/2), S *= exp(g), S += k^T (v - k S) beta,
    o = q S. Callers check GDN_RULE. ValueError names a bad argument."""
    if not GDN_RULE:
        raise RuntimeError(f"gated_delta_rule unavailable: {ext.ext_status()}")
    hk, hv, dk, dv = heads
    _check_rule("gated_delta_rule", qkv, heads, g, beta, state, planes)
    T, width = qkv.shape
    out = torch.empty(T, hv, dv, dtype=torch.float32, device=qkv.device)
    ext.C.gated_delta_rule(qkv.data_ptr(), width, 0, hk * dk, 2 * hk * dk, g.data_ptr(), beta.data_ptr(),
                           state.data_ptr(), out.data_ptr(), 0 if planes is None else planes.data_ptr(),
                           T, hk, hv, dk, dv)
    return out


def gated_delta_step(qkv: torch.Tensor, heads: tuple, a: torch.Tensor, b: torch.Tensor,
                     state: torch.Tensor, planes: torch.Tensor | None, a_log: torch.Tensor,
                     dt_bias: torch.Tensor, z: torch.Tensor, norm_w: torch.Tensor, eps: float,
                     round_bf16: bool = False) -> torch.Tensor:
    """gated_delta_rule's gated form (Qwen3.5's block after its conv): a, b (T, hv) the raw
    projections, beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias) (a_log, dt_bias
    (hv,)); returns (T, hv, dv) = rmsnorm(o, eps) * norm_w (dv,) * silu(z), z (T, hv*dv).
    round_bf16: rounded to bf16 where a bf16 model's torch form rounds. qkv, a, b, z, norm_w and
    the output: float32, or all bfloat16 (a bf16 model's own tensors; round_bf16 then holds);
    state, a_log, dt_bias float32. Contiguous, CPU. Callers check GDN_STEP. ValueError names a
    bad argument."""
    if not GDN_STEP:
        raise RuntimeError(f"gated_delta_step unavailable: {ext.ext_status()}")
    hk, hv, dk, dv = heads
    fn = "gated_delta_step"
    _check_rule(fn, qkv, heads, a, b, state, planes, io=(torch.float32, torch.bfloat16))
    T, width = qkv.shape
    bf16 = qkv.dtype == torch.bfloat16
    if bf16 and not round_bf16:
        raise ValueError(f"{fn}: bfloat16 inputs take round_bf16=True (a bf16 model rounds as it goes)")
    f32 = torch.float32
    for name, t, shape, dtype in (("a_log", a_log, (hv,), f32), ("dt_bias", dt_bias, (hv,), f32),
                                  ("z", z, (T, hv * dv), qkv.dtype), ("norm_w", norm_w, (dv,), qkv.dtype)):
        ext.check_tensor(fn, name, t, (dtype,), dim=len(shape))
        if tuple(t.shape) != shape:
            raise ValueError(f"{fn}: {name} of shape {tuple(t.shape)}, expected {shape}")
    out = torch.empty(T, hv, dv, dtype=qkv.dtype, device=qkv.device)
    ext.C.gated_delta_step(qkv.data_ptr(), width, 0, hk * dk, 2 * hk * dk, a.data_ptr(), b.data_ptr(),
                           state.data_ptr(), out.data_ptr(), 0 if planes is None else planes.data_ptr(),
                           T, hk, hv, dk, dv, a_log.data_ptr(), dt_bias.data_ptr(), z.data_ptr(),
                           norm_w.data_ptr(), float(eps), round_bf16=round_bf16, bf16_io=bf16)
    return out


# silu(causal conv) in one call: as GDN_RULE, with the kernel in the build
CAUSAL_CONV: bool = GDN_RULE and hasattr(ext.C, "causal_conv")


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                planes: torch.Tensor | None = None) -> torch.Tensor:
    """silu(depthwise causal conv) of x (T, C) with weight (C, K), state (C, K-1) the left context,
    advanced in place; planes (T, C, K-1) or None: also the state after each row. One dtype for
    all, float32 or bfloat16 (rounded where nn.linear_attn.causal_conv's torch form rounds),
    contiguous CPU tensors. Returns (T, C). Callers check CAUSAL_CONV. ValueError names a bad
    argument."""
    if not CAUSAL_CONV:
        raise RuntimeError(f"causal_conv unavailable: {ext.ext_status()}")
    fn = "causal_conv"
    ext.check_tensor(fn, "x", x, (torch.float32, torch.bfloat16))
    for name, t, dim in (("weight", weight, 2), ("state", state, 2)) + (
            (("planes", planes, 3),) if planes is not None else ()):
        ext.check_tensor(fn, name, t, (x.dtype,), dim=dim)
    (T, C), K = x.shape, weight.shape[1]
    if (T == 0 or K < 2 or tuple(weight.shape) != (C, K) or tuple(state.shape) != (C, K - 1)
            or (planes is not None and tuple(planes.shape) != (T, C, K - 1))):
        raise ValueError(f"{fn}: x {tuple(x.shape)}, weight {tuple(weight.shape)}, state "
                         f"{tuple(state.shape)}{'' if planes is None else ', planes ' + str(tuple(planes.shape))}"
                         " do not fit: expected x (T, C), T > 0, weight (C, K), K >= 2, state (C, K-1), "
                         "planes (T, C, K-1)")
    y = torch.empty_like(x)
    ext.C.causal_conv(x.data_ptr(), weight.data_ptr(), state.data_ptr(),
                      0 if planes is None else planes.data_ptr(), y.data_ptr(), T, C, K,
                      bf16=x.dtype == torch.bfloat16)
    return y

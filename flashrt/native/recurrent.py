"""Gated DeltaNet's rule token by token on the CPU (csrc/gdn_cpu.cpp): a decode step's, or a
speculative verify's with the state after each token, in one call per layer instead of ~25
torch ops a token."""
from __future__ import annotations

import torch

from . import _ext as ext

# Built (x86-64), the CPU has AVX2 + FMA, the build has the kernel (older sources lack it), and
# its threads are torch's.
GDN_RULE: bool = (ext.HAVE_EXT and bool(ext.C.small_m_linear_isa()) and ext.COPIES_ON_TORCH_THREADS
                  and hasattr(ext.C, "gated_delta_rule"))


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
    fn = "gated_delta_rule"
    ext.check_tensor(fn, "qkv", qkv, (torch.float32,))
    T, width = qkv.shape
    if width != 2 * hk * dk + hv * dv:
        raise ValueError(f"{fn}: qkv rows of {width} floats, expected 2*{hk}*{dk} + {hv}*{dv}")
    for name, t in (("g", g), ("beta", beta)):
        ext.check_tensor(fn, name, t, (torch.float32,))
        if tuple(t.shape) != (T, hv):
            raise ValueError(f"{fn}: {name} of shape {tuple(t.shape)}, expected ({T}, {hv})")
    ext.check_tensor(fn, "state", state, (torch.float32,), dim=3)
    if tuple(state.shape) != (hv, dk, dv):
        raise ValueError(f"{fn}: state of shape {tuple(state.shape)}, expected ({hv}, {dk}, {dv})")
    if planes is not None:
        ext.check_tensor(fn, "planes", planes, (torch.float32,), dim=4)
        if tuple(planes.shape) != (T, hv, dk, dv):
            raise ValueError(f"{fn}: planes of shape {tuple(planes.shape)}, expected ({T}, {hv}, {dk}, {dv})")
    out = torch.empty(T, hv, dv, dtype=torch.float32, device=qkv.device)
    ext.C.gated_delta_rule(qkv.data_ptr(), width, 0, hk * dk, 2 * hk * dk, g.data_ptr(), beta.data_ptr(),
                           state.data_ptr(), out.data_ptr(), 0 if planes is None else planes.data_ptr(),
                           T, hk, hv, dk, dv)
    return out

"""RMSNorm over rows on the CPU (csrc/norm_cpu.cpp): nn.layers.RMSNorm's torch form in one call,
for a step's rows, where that form is about ten ops of a few microseconds each."""
from __future__ import annotations

import torch

from . import _ext as ext

RMS_NORM: bool = ext.cpu_kernel_runs("rms_norm")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """x (M, D) float32 or bfloat16, w (D,) float32 or x's dtype, contiguous CPU tensors. Returns
    (M, D) in x's dtype: x / sqrt(mean(x^2) + eps) times (1 + w) (zero_centred) or w, in float32
    and rounded to bf16 where the torch form rounds (plain: x / rms before the product). Callers
    check RMS_NORM. ValueError names a bad argument."""
    return _norm("rms_norm", x, None, w, eps, zero_centred)[1]


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float,
                 zero_centred: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's residual add and the next norm in one pass: s = x + r in x's dtype (torch's add,
    one rounding), then (s, rms_norm(s, w, eps, zero_centred)). x, r (M, D) of one dtype; w as
    rms_norm's. Callers check RMS_NORM. ValueError names a bad argument."""
    return _norm("add_rms_norm", x, r, w, eps, zero_centred)


def _norm(fn, x, r, w, eps, zero_centred):
    """(x + r or None, the norm of x + r, or of x without r): the checks and the one call."""
    if not RMS_NORM:
        raise RuntimeError(f"{fn} unavailable: {ext.ext_status()}")
    ext.check_tensor(fn, "x", x, (torch.float32, torch.bfloat16))
    if r is not None:
        ext.check_tensor(fn, "r", r, (x.dtype,))
    ext.check_tensor(fn, "w", w, tuple({torch.float32, x.dtype}), dim=1)
    if (r is not None and tuple(r.shape) != tuple(x.shape)) or w.shape[0] != x.shape[1] or 0 in x.shape:
        raise ValueError(f"{fn}: x {tuple(x.shape)}{'' if r is None else f', r {tuple(r.shape)}'} and w "
                         f"{tuple(w.shape)} do not fit: expected x{'' if r is None else ' and r'} (M, D) "
                         "with M, D > 0 and w (D,)")
    s = None if r is None else torch.empty_like(x)
    y = torch.empty_like(x)
    ext.C.rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], float(eps),
                   bool(zero_centred), bf16_x=x.dtype == torch.bfloat16, bf16_w=w.dtype == torch.bfloat16,
                   r=0 if r is None else r.data_ptr(), s=0 if s is None else s.data_ptr())
    return s, y

"""The small-M projection kernel (csrc/linear_cpu.cpp): x (M, K) @ w (N, K).T for a few rows,
streaming the weights once at memory bandwidth."""
from __future__ import annotations

import torch

from . import _ext as ext

# The small-M projection kernel runs here: built (x86-64), the CPU has AVX2 + FMA, and
# its threads are torch's (a second OpenMP pool would fight torch's spinning workers).
SMALL_M_LINEAR: bool = ext.HAVE_EXT and bool(ext.C.small_m_linear_isa()) and ext.COPIES_ON_TORCH_THREADS
SMALL_M_MAX = 32      # measured: 1.3-1.8x oneDNN at M = 2..32; oneDNN's blocked GEMM wins above
# bf16 weights: 1.2-1.7x oneDNN's bf16 inner product at M = 1..8 (its AVX512-BF16 dot products
# win from ~10 rows on: bench/linear.py --dtype bfloat16)
SMALL_M_MAX_BF16 = 8


def small_m_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ w (N, K).T as float32 (M, N) with the extension's small-M kernel (see
    csrc/linear_cpu.cpp; callers check SMALL_M_LINEAR). x is float32; w float32 or bfloat16
    (widened in registers). ValueError names a bad argument."""
    if not (ext.HAVE_EXT and ext.C.small_m_linear_isa()):
        raise RuntimeError(f"small_m_linear unavailable: {ext.ext_status()}")
    for name, t, dtypes in (("x", x, (torch.float32,)), ("w", w, (torch.float32, torch.bfloat16))):
        if t.dtype not in dtypes or t.dim() != 2 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"small_m_linear: {name} must be a contiguous 2-D "
                             f"{' or '.join(str(d)[6:] for d in dtypes)} CPU tensor, got "
                             f"{t.dtype}, shape {tuple(t.shape)}, strides {t.stride()}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}, {t.device}")
    (m, k), (n, k2) = x.shape, w.shape
    if k != k2 or m == 0 or n == 0 or k == 0:
        raise ValueError(f"small_m_linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (m, n) or not out.is_contiguous() \
            or out.device.type != "cpu":
        raise ValueError(f"small_m_linear: out must be a contiguous float32 CPU ({m}, {n}) tensor")
    ext.C.small_m_linear(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k,
                      bf16_weights=w.dtype == torch.bfloat16)
    return out


"""The small-M projection kernel (csrc/linear_cpu.cpp): x (M, K) @ w (N, K).T for a few rows
(one row: a GEMV), streaming the weights once at memory bandwidth; float32, bf16 or int8
weights (a per-row scale)."""
from __future__ import annotations

import torch

from . import _ext as ext

# The small-M projection kernel runs here: built (x86-64), the CPU has AVX2 + FMA, and
# its threads are torch's (a second OpenMP pool would fight torch's spinning workers).
SMALL_M_LINEAR: bool = ext.cpu_kernel_runs()
SMALL_M_MAX = 32      # measured: 1.3-1.8x oneDNN at M = 2..32; oneDNN's blocked GEMM wins above
# one row (the GEMV): 1.1x oneDNN's float32 inner product over a Qwen3.5-0.8B step's weights
# bf16 weights: 1.2-1.7x oneDNN's bf16 inner product at M = 1..8 (its AVX512-BF16 dot products
# win from ~10 rows on: bench/linear.py --dtype bfloat16)
SMALL_M_MAX_BF16 = 8
# int8 weights (an Int8Weight; the build has the int8 kernel: older sources lack it): 1.3-1.7x
# torch's int8 weight-only kernel at M = 1..32 (bench/linear.py --weights int8)
SMALL_M_INT8: bool = SMALL_M_LINEAR and "int8" in ext.C.small_m_linear_weight_dtypes()
SMALL_M_MAX_INT8 = 32
# one row of a bf16 model, bf16 in and out (the build has it: older sources lack it)
GEMV_BF16: bool = SMALL_M_LINEAR and hasattr(ext.C, "gemv_bf16")


def _out(fn: str, out: torch.Tensor | None, m: int, n: int) -> torch.Tensor:
    if out is None:
        return torch.empty(m, n, dtype=torch.float32)
    if out.dtype != torch.float32 or tuple(out.shape) != (m, n) or not out.is_contiguous() \
            or out.device.type != "cpu":
        raise ValueError(f"{fn}: out must be a contiguous float32 CPU ({m}, {n}) tensor")
    return out


def small_m_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ w (N, K).T as float32 (M, N) with the extension's small-M kernel (see
    csrc/linear_cpu.cpp; callers check SMALL_M_LINEAR). x is float32; w float32 or bfloat16
    (widened in registers). ValueError names a bad argument."""
    if not (ext.HAVE_EXT and ext.C.small_m_linear_isa()):
        raise RuntimeError(f"small_m_linear unavailable: {ext.ext_status()}")
    ext.check_tensor("small_m_linear", "x", x, (torch.float32,))
    ext.check_tensor("small_m_linear", "w", w, (torch.float32, torch.bfloat16))
    (m, k), (n, k2) = x.shape, w.shape
    if k != k2 or m == 0 or n == 0 or k == 0:
        raise ValueError(f"small_m_linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply")
    out = _out("small_m_linear", out, m, n)
    ext.C.small_m_linear(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k,
                      bf16_weights=w.dtype == torch.bfloat16)
    return out


def small_m_linear_int8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """(x (M, K) @ w (N, K).T) * scale (N,) as float32 (M, N): x float32, w int8 (widened in
    registers, each output one float32 sum as small_m_linear's), scale bf16, applied once per
    output. Callers check SMALL_M_INT8. ValueError names a bad argument."""
    if not (ext.HAVE_EXT and ext.C.small_m_linear_isa() and "int8" in ext.C.small_m_linear_weight_dtypes()):
        raise RuntimeError(f"small_m_linear_int8 unavailable: {ext.ext_status()}")
    ext.check_tensor("small_m_linear_int8", "x", x, (torch.float32,))
    ext.check_tensor("small_m_linear_int8", "w", w, (torch.int8,))
    ext.check_tensor("small_m_linear_int8", "scale", scale, (torch.bfloat16,), dim=1)
    (m, k), (n, k2) = x.shape, w.shape
    if k != k2 or m == 0 or n == 0 or k == 0 or scale.shape[0] != n:
        raise ValueError(f"small_m_linear_int8: x {tuple(x.shape)}, w {tuple(w.shape)} and scale "
                         f"{tuple(scale.shape)} do not multiply")
    out = _out("small_m_linear_int8", out, m, n)
    ext.C.small_m_linear_int8(x.data_ptr(), w.data_ptr(), scale.data_ptr(), out.data_ptr(), m, n, k)
    return out



def gemv_bf16(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (1, K) @ w (N, K).T as bf16 (1, N), x and w bf16: the bits of
    small_m_linear(x.float(), w).to(torch.bfloat16) without the two float32 copies (x widened and
    y rounded to nearest even inside). Callers check GEMV_BF16. ValueError names a bad argument."""
    if not GEMV_BF16:
        raise RuntimeError(f"gemv_bf16 unavailable: {ext.ext_status()}")
    ext.check_tensor("gemv_bf16", "x", x, (torch.bfloat16,))
    ext.check_tensor("gemv_bf16", "w", w, (torch.bfloat16,))
    (m, k), (n, k2) = x.shape, w.shape
    if m != 1 or k != k2 or n == 0 or k == 0:
        raise ValueError(f"gemv_bf16: x {tuple(x.shape)} and w {tuple(w.shape)}: expected x (1, K), w (N, K)")
    if out is None:
        out = torch.empty(1, n, dtype=torch.bfloat16, device=x.device)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (1, n) or not out.is_contiguous() \
            or out.device.type != "cpu":
        raise ValueError(f"gemv_bf16: out must be a contiguous bfloat16 CPU (1, {n}) tensor")
    ext.C.gemv_bf16(x.data_ptr(), w.data_ptr(), out.data_ptr(), n, k)
    return out

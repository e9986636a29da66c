"""SwiGLU's silu(gate) * up on the CPU (csrc/activation_cpu.cpp): two torch ops and their two
outputs in one pass over a step's rows, reading gate and up where a LinearPack's one matmul
left them (rows of one (M, 2N) output: a row stride, no copies)."""
from __future__ import annotations

import torch

from . import _ext as ext

SILU_MUL: bool = ext.cpu_kernel_runs("silu_mul")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up (M, N) float32 or bfloat16 CPU tensors, the same shape and dtype, each row
    contiguous (rows may be further apart). Returns (M, N) in their dtype: silu(gate) * up,
    rounded to bf16 where the torch form rounds (after silu, after the product). Callers check
    SILU_MUL. ValueError names a bad argument."""
    if not SILU_MUL:
        raise RuntimeError(f"silu_mul unavailable: {ext.ext_status()}")
    fn = "silu_mul"
    for name, t in (("gate", gate), ("up", up)):
        if (t.dtype not in (torch.float32, torch.bfloat16) or t.dim() != 2 or t.device.type != "cpu"
                or (t.shape[1] > 1 and t.stride(1) != 1) or t.stride(0) < t.shape[1]):
            raise ValueError(f"{fn}: {name} must be a 2-D float32 or bfloat16 CPU tensor with "
                             f"contiguous rows, got {t.dtype}, shape {tuple(t.shape)}, strides "
                             f"{t.stride()}, {t.device}")
    if up.dtype != gate.dtype or tuple(up.shape) != tuple(gate.shape) or 0 in gate.shape:
        raise ValueError(f"{fn}: gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} "
                         f"{tuple(up.shape)} do not fit: expected one dtype and shape (M, N), M, N > 0")
    M, N = gate.shape
    y = torch.empty(M, N, dtype=gate.dtype, device=gate.device)
    ext.C.silu_mul(gate.data_ptr(), up.data_ptr(), y.data_ptr(), M, N, gate.stride(0), up.stride(0),
                   bf16=gate.dtype == torch.bfloat16)
    return y

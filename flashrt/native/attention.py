"""One query's attention over the KV cache on the CPU (csrc/attention_cpu.cpp): a decode step's,
with float32 or bf16 K/V rows read in place (torch's one-query SDPA runs at a fraction of memory
speed here, and in bf16 wants the cache widened first)."""
from __future__ import annotations

import torch

from . import _ext as ext

DECODE_ATTENTION: bool = ext.cpu_kernel_runs("decode_attention")


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (hq, d) float32; k, v (L, hkv, d) float32 or bfloat16 (both the same), contiguous, d a
    multiple of 8, hq a multiple of hkv. Returns (hq, d) float32: softmax(scale q K^T) V per query
    head, query head h on kv head h // (hq // hkv). Callers check DECODE_ATTENTION. ValueError
    names a bad argument."""
    if not DECODE_ATTENTION:
        raise RuntimeError(f"decode_attention unavailable: {ext.ext_status()}")
    fn = "decode_attention"
    ext.check_tensor(fn, "q", q, (torch.float32,))
    ext.check_tensor(fn, "k", k, (torch.float32, torch.bfloat16), dim=3)
    ext.check_tensor(fn, "v", v, (k.dtype,), dim=3)
    (hq, d), (L, hkv, d2) = q.shape, k.shape
    if tuple(v.shape) != tuple(k.shape) or d2 != d or d % 8 or hq % hkv:
        raise ValueError(f"{fn}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not "
                         "fit: expected k and v (L, hkv, d), q (hq, d), hq a multiple of hkv, d of 8")
    out = torch.empty(hq, d, dtype=torch.float32, device=q.device)
    ext.C.decode_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), L, hq, hkv, d,
                           float(scale), bf16_kv=k.dtype == torch.bfloat16)
    return out

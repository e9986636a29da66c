"""Eager prefill chunks after a prefix (T > 1 queries, L > T keys): the lower-right causal bias
("bias", CUDA flash with GQA) and the head-expanded bias ("expand", CUDA memory-efficient kernel)
give what the boolean-mask path gives ("mask", CPU), and all three match per-query sliced
attention. On CUDA an explicit mask with enable_gqa sends SDPA to its math path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashrt.core.step import StepCtx
from flashrt.nn.layers import attend_cached, chunk_attention_mode, prefix_chunk_attention


def _qkv(Hq, Hkv, T, L, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, Hq, T, D, generator=g).to(dtype), torch.randn(1, Hkv, L, D, generator=g).to(dtype),
            torch.randn(1, Hkv, L, D, generator=g).to(dtype))


def _sliced(qh, kh, vh, scale):
    """Query i (absolute position L - T + i) over keys [0, L - T + i], one at a time, fp32."""
    T, L, g = qh.shape[2], kh.shape[2], qh.shape[1] // kh.shape[1]
    k, v = kh[0].float().repeat_interleave(g, 0), vh[0].float().repeat_interleave(g, 0)
    rows = [F.scaled_dot_product_attention(qh[0, :, i:i + 1].float(), k[:, : L - T + i + 1],
                                           v[:, : L - T + i + 1], scale=scale) for i in range(T)]
    return torch.cat(rows, dim=1)[None]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("Hq,Hkv,D", [(8, 8, 64), (8, 2, 64), (16, 2, 80), (8, 1, 256)])
@pytest.mark.parametrize("T,L", [(2, 3), (16, 40), (16, 16 + 97)])
def test_modes_agree(dtype, tol, Hq, Hkv, D, T, L):
    qh, kh, vh = _qkv(Hq, Hkv, T, L, D, dtype, seed=T * L + Hkv)
    scale = D ** -0.5
    ref = _sliced(qh, kh, vh, scale)
    outs = {m: prefix_chunk_attention(qh, kh, vh, scale, m) for m in ("mask", "bias", "expand")}
    for m, out in outs.items():
        assert out.shape == qh.shape and out.dtype == dtype
        assert (out.float() - ref).abs().max() <= tol, m
    assert (outs["bias"].float() - outs["mask"].float()).abs().max() <= tol
    assert (outs["expand"].float() - outs["mask"].float()).abs().max() <= tol


def test_mode_choice_and_refusal():
    qh, kh, vh = _qkv(8, 2, 4, 9, 64, torch.float32)
    assert chunk_attention_mode(qh, kh, vh) == "mask"     # CPU: its flash kernel takes the mask
    with pytest.raises(ValueError, match="expected mask, bias or expand"):
        prefix_chunk_attention(qh, kh, vh, 0.125, "flash")


def test_attend_cached_chunk_after_prefix():
    """The arena path: a 5-token prefix, then a 6-token chunk, equals sliced attention over the
    cache rows it wrote (rows past the chunk hold NaN and are never read)."""
    Hq, Hkv, D, cap = 8, 2, 64, 32
    kc, vc = torch.full((cap, Hkv, D), float("nan")), torch.full((cap, Hkv, D), float("nan"))
    g = torch.Generator().manual_seed(3)
    outs = []
    for start, T in ((0, 5), (5, 6)):
        q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
        ctx = StepCtx(T, torch.arange(start, start + T), start=start)
        outs.append((attend_cached(q, k, v, kc, vc, ctx, D ** -0.5), q))
    out, q = outs[1]
    ref = _sliced(q.transpose(0, 1)[None], kc[:11].permute(1, 0, 2)[None], vc[:11].permute(1, 0, 2)[None],
                  D ** -0.5)
    assert (out - ref[0].transpose(0, 1)).abs().max() <= 1e-5

"""flashrt.native and its flashrt.native._C extension: segmented copy and XXH64.

Copy tests run on every available backend: "ext" (the compiled kernels; skipped
with the import error as reason when flashrt.native._C is missing) and "torch" (the
fallback, forced by hiding the extension).
"""
import glob
import os
import random
import signal
import struct
import time
import warnings

import numpy as np
import pytest
import torch

from flashrt import native
from flashrt.native import _ext
from flashrt.native.hash_fallback import xxh3_py, xxh64_py

needs_ext = pytest.mark.skipif(not native.HAVE_EXT, reason=native.ext_status())
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(params=["ext", "torch"])
def backend(request, monkeypatch):
    if request.param == "ext":
        if not native.HAVE_EXT:
            pytest.skip(native.ext_status())
    else:
        monkeypatch.setattr(_ext, "HAVE_EXT", False)
        monkeypatch.setattr(_ext, "HAVE_CUDA_EXT", False)
        monkeypatch.setattr(_ext, "warn_fallback", lambda: None)  # tested on its own
    return request.param


def random_segments(rng, nbytes_total, nseg, max_len, device="cpu", align=1):
    """Non-overlapping random (src, dst) views into two big buffers, plus the
    dst buffer and its expected contents computed with plain torch copies.
    Lengths and gaps are multiples of `align` (1: arbitrary misalignment)."""
    noise = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, nbytes_total, np.uint8)
    src_buf = torch.from_numpy(noise).to(device)
    dst_buf = torch.zeros(nbytes_total, dtype=torch.uint8, device=device)
    lens = [0 if rng.random() < 0.1 else rng.randint(1, max_len) // align * align
            for _ in range(nseg)]
    gaps = [rng.randint(0, 40) // align * align for _ in range(nseg)]
    assert sum(lens) + sum(gaps) <= nbytes_total
    src_off, o = [], 0
    for n, g in zip(lens, gaps):
        src_off.append(o + g)
        o += g + n
    order = list(range(nseg))
    rng.shuffle(order)  # dst blocks in another order than src blocks
    dst_off, o = [0] * nseg, 0
    for i in order:
        dst_off[i] = o + gaps[i]
        o += gaps[i] + lens[i]
    pairs = [(src_buf[s:s + n], dst_buf[d:d + n]) for s, d, n in zip(src_off, dst_off, lens)]
    expected = dst_buf.clone()
    for (s, _), d, n in zip(pairs, dst_off, lens):
        expected[d:d + n].copy_(s)
    return pairs, dst_buf, expected


# --------------------------------------------------------------------------- small-M linear

needs_small_m = pytest.mark.skipif(not (native.HAVE_EXT and native._C.small_m_linear_isa()),
                                   reason="small-M linear needs the extension on x86-64 AVX2 + FMA")


@needs_small_m
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 31, 32, 33])
@pytest.mark.parametrize("n, k", [(1, 1), (5, 7), (13, 64), (16, 9), (67, 1000), (130, 2051)])
def test_small_m_linear_matches_a_double_reference(m, n, k, wdtype):
    """Every tile shape (3-row and 2/1-row remainders, 4..1-column blocks) and K tails under 8
    against a float64 reference (of the bf16 values, for bf16 weights: widening is exact);
    1 or 2 threads give the same bits (each output is one sum)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(wdtype)
    ref = (x.double() @ w.double().T).float()
    got = native.small_m_linear(x, w)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.small_m_linear(x, w, out=torch.full((m, n), float("nan")))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, got)


@needs_small_m
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(9, 4100), (64, 1031)])
def test_small_m_linear_rows_do_not_depend_on_the_batch(n, k, wdtype):
    """The k loop runs in chunks sized by M (and rows in groups of 32), with vector partial sums
    kept between chunks: each row must come out bitwise as it does alone or in any batch."""
    g = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(40, k, generator=g), torch.randn(n, k, generator=g).to(wdtype)
    full = native.small_m_linear(x, w)
    for lo, hi in [(0, 1), (5, 7), (3, 19), (8, 40)]:
        assert torch.equal(native.small_m_linear(x[lo:hi].contiguous(), w), full[lo:hi])


@needs_small_m
@pytest.mark.parametrize("n, k", [(1, 1), (5, 7), (13, 64), (67, 1000), (300, 2051)])
def test_gemv_bf16_is_the_float32_call_and_torch_casts(n, k):
    """bf16 in and out: the bits of small_m_linear(x.float(), w).to(bfloat16), the rounding of
    torch's cast included (ties to even, overflow to inf, NaN stays NaN)."""
    g = torch.Generator().manual_seed(n + k)
    x, w = (torch.randn(1, k, generator=g) * 3).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    if n >= 5:                                   # rows that overflow, carry a NaN, and sum to 0
        w[0], w[1], w[2] = 3e38, float("nan"), 0.0
        x[0, 0] = 3e38
    want = native.small_m_linear(x.float(), w).to(torch.bfloat16)
    got = native.gemv_bf16(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (1, n)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_small_m
def test_gemv_bf16_refuses_bad_arguments():
    x, w = torch.randn(1, 8).bfloat16(), torch.randn(6, 8).bfloat16()
    for bad, msg in [((x.float(), w), "x must be"), ((x, w.float()), "w must be"),
                     ((torch.randn(2, 8).bfloat16(), w), "expected x"), ((x, w[:, :7].contiguous()), "expected x")]:
        with pytest.raises(ValueError, match=msg):
            native.gemv_bf16(*bad)
    with pytest.raises(ValueError, match="out must be"):
        native.gemv_bf16(x, w, out=torch.empty(1, 6))


@needs_small_m
def test_small_m_linear_refuses_bad_arguments():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(6, 8, generator=g)
    for bad, msg in [((x.double(), w), "x must be"), ((x, w.t()), "w must be"),
                     ((x.bfloat16(), w.bfloat16()), "x must be"), ((x, w.half()), "w must be"),
                     ((x, torch.randn(6, 9, generator=g)), "do not multiply"), ((x[:, :0], w[:, :0]), "do not multiply")]:
        with pytest.raises(ValueError, match=msg):
            native.small_m_linear(*bad)
    with pytest.raises(ValueError, match="out must be"):
        native.small_m_linear(x, w, out=torch.empty(4, 5))
    with pytest.raises(ValueError, match="positive"):
        native._C.small_m_linear(x.data_ptr(), w.data_ptr(), x.data_ptr(), 0, 6, 8)
    with pytest.raises(ValueError, match="null address"):
        native._C.small_m_linear(0, w.data_ptr(), x.data_ptr(), 4, 6, 8)


# --------------------------------------------------------------------------- Gated DeltaNet rule

needs_gdn = pytest.mark.skipif(not native.GDN_RULE, reason="the GDN rule kernel needs the extension "
                               "on x86-64 AVX2 + FMA")


def _gdn_inputs(T, hk, hv, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, 2 * hk * dk + hv * dv, generator=g)
    decay, beta = -torch.rand(T, hv, generator=g) * 2, torch.rand(T, hv, generator=g)
    return qkv, decay, beta, torch.randn(hv, dk, dv, generator=g) * 0.3


def _gdn_reference(qkv, heads, decay, beta, state):
    """The rule as written (transformers' torch_recurrent_gated_delta_rule), in float64."""
    hk, hv, dk, dv = heads
    S, outs, planes = state.double().clone(), [], []
    for t in range(qkv.shape[0]):
        q, k, v = qkv[t].double().split([hk * dk, hk * dk, hv * dv])
        q, k = (x.view(hk, dk).repeat_interleave(hv // hk, 0) for x in (q, k))
        q, k = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * dk ** -0.5, k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
        S = S * decay[t].double().exp()[:, None, None]
        delta = (v.view(hv, dv) - torch.einsum("hi,hij->hj", k, S)) * beta[t].double()[:, None]
        S = S + k[:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hi,hij->hj", q, S))
        planes.append(S.clone())
    return torch.stack(outs).float(), S.float(), torch.stack(planes).float()


@needs_gdn
@pytest.mark.parametrize("T, hk, hv, dk, dv", [(1, 16, 16, 128, 128), (1, 2, 4, 16, 8),
                                               (5, 4, 8, 32, 64), (3, 1, 3, 7, 5)])
def test_gated_delta_rule_matches_a_double_reference(T, hk, hv, dk, dv):
    """Shared k heads (hv a multiple of hk), odd head dims, T tokens with the state after each;
    1 or 2 threads give the same bits (threads split heads)."""
    heads = (hk, hv, dk, dv)
    qkv, decay, beta, state = _gdn_inputs(T, hk, hv, dk, dv, seed=T * 100 + dk)
    ref_out, ref_state, ref_planes = _gdn_reference(qkv, heads, decay, beta, state)
    s, planes = state.clone(), torch.full((T, hv, dk, dv), float("nan"))
    out = native.gated_delta_rule(qkv, heads, decay, beta, s, planes)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, ref_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(planes, ref_planes, rtol=1e-5, atol=1e-5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        s1 = state.clone()
        one = native.gated_delta_rule(qkv, heads, decay, beta, s1)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, out) and torch.equal(s1, s)


@needs_gdn
def test_gated_delta_rule_tokens_in_one_call_equal_tokens_one_by_one():
    """A verify step (T tokens, planes) and T decode steps take the same path: the same bits, so
    a speculative round's accepted prefix is the state plain decoding reaches."""
    heads, T = (2, 4, 32, 16), 6
    qkv, decay, beta, state = _gdn_inputs(T, *heads, seed=7)
    s_all, planes = state.clone(), torch.empty(T, heads[1], heads[2], heads[3])
    out_all = native.gated_delta_rule(qkv, heads, decay, beta, s_all, planes)
    s_one = state.clone()
    for t in range(T):
        out = native.gated_delta_rule(qkv[t:t + 1].contiguous(), heads, decay[t:t + 1].contiguous(),
                                      beta[t:t + 1].contiguous(), s_one)
        assert torch.equal(out[0], out_all[t]) and torch.equal(s_one, planes[t])
    assert torch.equal(s_one, s_all)


@pytest.mark.skipif(not native.GDN_STEP, reason="the gated GDN kernel needs the extension on x86-64 AVX2 + FMA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_step_matches_the_torch_form(dtype):
    """The gated form against Qwen3.5's block written in torch (the rule's torch path, then
    norm(o) * silu(z)) in the model's dtype: float32 within 1e-5; bf16, whose form rounds at
    each step, within a bf16 rounding (the kernel rounds at the same steps); the state within
    1e-5 either way. T = 3 tokens with the state after each."""
    from flashrt.nn import linear_attn as LA
    from flashrt.nn.layers import RMSNorm
    hk, hv, dk, dv, T = 2, 4, 16, 8, 3
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, 2 * hk * dk + hv * dv, generator=g).to(dtype)
    a, b = (torch.randn(T, hv, generator=g).to(dtype) for _ in range(2))
    z = torch.randn(T, hv * dv, generator=g).to(dtype)
    a_log, dt_bias = torch.rand(hv, generator=g), torch.randn(hv, generator=g)
    norm = RMSNorm(dv, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(dv, generator=g)).to(dtype)
    state = torch.randn(hv, dk, dv, generator=g) * 0.3
    # the torch form (qwen3_5.GatedDeltaNet.forward without the kernel)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    beta = b.sigmoid()
    decay = -a_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    s_ref, p_ref = state.clone(), torch.empty(T, hv, dk, dv)
    rule = native.GDN_RULE
    try:
        native.GDN_RULE = False
        o = LA.recurrent_gated_delta_rule(q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv),
                                          decay, beta, s_ref, planes=p_ref)
    finally:
        native.GDN_RULE = rule
    ref = (norm(o) * torch.nn.functional.silu(z.view(T, hv, dv).float())).to(dtype).reshape(T, -1)
    s_got, p_got = state.clone(), torch.empty(T, hv, dk, dv)
    got = LA.gated_delta_block(qkv, a, b, z, a_log, dt_bias, norm, (hk, hv, dk, dv), s_got, p_got)
    assert got.dtype == dtype and got.shape == (T, hv * dv)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(s_got, s_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p_got, p_ref, rtol=1e-5, atol=1e-5)
    if dtype == torch.bfloat16:                  # rounded at the same steps: nearly every value equal
        assert (got == ref).float().mean() > 0.9


@pytest.mark.skipif(not native.GDN_STEP, reason="the gated GDN kernel needs the extension on x86-64 AVX2 + FMA")
def test_gated_delta_step_takes_a_bf16_model_tensors_as_they_are():
    """bf16 qkv, a, b, z and norm weight in, bf16 out (no float32 copies): bitwise the float32
    call on the same values under round_bf16, its output cast to bf16, state and planes too."""
    hk, hv, dk, dv, T = 2, 4, 16, 8, 3
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(T, 2 * hk * dk + hv * dv, generator=g).bfloat16()
    a, b = (torch.randn(T, hv, generator=g).bfloat16() for _ in range(2))
    z = torch.randn(T, hv * dv, generator=g).bfloat16()
    a_log, dt_bias = torch.rand(hv, generator=g), torch.randn(hv, generator=g)
    w = (1 + 0.1 * torch.randn(dv, generator=g)).bfloat16()
    state = torch.randn(hv, dk, dv, generator=g) * 0.3
    heads = (hk, hv, dk, dv)
    s16, p16 = state.clone(), torch.empty(T, hv, dk, dv)
    got = native.gated_delta_step(qkv, heads, a, b, s16, p16, a_log, dt_bias, z, w, 1e-6, round_bf16=True)
    s32, p32 = state.clone(), torch.empty(T, hv, dk, dv)
    ref = native.gated_delta_step(qkv.float(), heads, a.float(), b.float(), s32, p32, a_log, dt_bias,
                                  z.float(), w.float(), 1e-6, round_bf16=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref.bfloat16()) and torch.equal(got.float(), ref)
    assert torch.equal(s16, s32) and torch.equal(p16, p32)
    with pytest.raises(ValueError, match="round_bf16=True"):
        native.gated_delta_step(qkv, heads, a, b, state, None, a_log, dt_bias, z, w, 1e-6)
    with pytest.raises(ValueError, match="z must be"):
        native.gated_delta_step(qkv, heads, a, b, state, None, a_log, dt_bias, z.float(), w, 1e-6, round_bf16=True)
    with pytest.raises(ValueError, match="g must be"):
        native.gated_delta_step(qkv, heads, a.float(), b, state, None, a_log, dt_bias, z, w, 1e-6, round_bf16=True)


@needs_gdn
def test_gated_delta_rule_refuses_bad_arguments():
    heads = (2, 4, 8, 8)
    qkv, decay, beta, state = _gdn_inputs(2, *heads, seed=1)
    before = state.clone()
    for args, msg in [((qkv[:, :-1].contiguous(), heads, decay, beta, state), "qkv rows of"),
                      ((qkv.double(), heads, decay, beta, state), "qkv must be"),
                      ((qkv, heads, decay[:1].contiguous(), beta, state), "g of shape"),
                      ((qkv, heads, decay, beta.bfloat16(), state), "beta must be"),
                      ((qkv, heads, decay, beta, state[:3].contiguous()), "state of shape"),
                      ((qkv, heads, decay, beta, state.transpose(1, 2)), "not contiguous"),
                      ((qkv, heads, decay, beta, state, torch.empty(1, 4, 8, 8)), "planes of shape")]:
        with pytest.raises(ValueError, match=msg):
            native.gated_delta_rule(*args)
    assert torch.equal(state, before)          # nothing ran
    if native.GDN_STEP:                          # the gated form checks its own arguments too
        hv_, dv_ = heads[1], heads[3]
        gate = dict(a_log=torch.zeros(hv_), dt_bias=torch.zeros(hv_), z=torch.zeros(2, hv_ * dv_),
                    norm_w=torch.ones(dv_), eps=1e-6)
        for name, bad, msg in [("z", torch.zeros(2, hv_ * dv_ + 1), "z of shape"),
                               ("norm_w", torch.ones(dv_).double(), "norm_w must be"),
                               ("a_log", torch.zeros(hv_ + 1), "a_log of shape")]:
            with pytest.raises(ValueError, match=msg):
                native.gated_delta_step(qkv, heads, decay, beta, state, None, **{**gate, name: bad})
        assert torch.equal(state, before)
    with pytest.raises(ValueError, match="multiple of hk"):
        native._C.gated_delta_rule(qkv.data_ptr(), 48, 0, 16, 32, decay.data_ptr(), beta.data_ptr(),
                                   state.data_ptr(), qkv.data_ptr(), 0, 2, 3, 4, 8, 8)
    with pytest.raises(ValueError, match="do not fit"):
        native._C.gated_delta_rule(qkv.data_ptr(), 40, 0, 16, 32, decay.data_ptr(), beta.data_ptr(),
                                   state.data_ptr(), qkv.data_ptr(), 0, 2, 2, 4, 8, 8)


# --------------------------------------------------------------------------- one query's attention

needs_attention = pytest.mark.skipif(not native.DECODE_ATTENTION, reason="decode attention needs the "
                                     "extension on x86-64 AVX2 + FMA")


@needs_attention
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L, hq, hkv, d", [(1, 1, 1, 8), (513, 8, 2, 256), (33, 6, 2, 24), (70, 6, 3, 16),
                                           (9, 4, 4, 64)])
def test_decode_attention_matches_a_double_reference(L, hq, hkv, d, kv_dtype):
    """Query heads 1, 2 or 4 to a work item (hq / hkv of 1, 2, 3, 4), K/V read as stored (bf16
    widened exactly) against float64 SDPA; 1 or 2 threads give the same bits."""
    g = torch.Generator().manual_seed(L * 10 + d)
    q = torch.randn(hq, d, generator=g)
    k, v = (torch.randn(L, hkv, d, generator=g).to(kv_dtype) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[None, :, None].double(), k.permute(1, 0, 2)[None].double(), v.permute(1, 0, 2)[None].double(),
        scale=d ** -0.5, enable_gqa=hq != hkv)[0, :, 0].float()
    got = native.decode_attention(q, k, v, d ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.decode_attention(q, k, v, d ** -0.5)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, got)


@needs_attention
def test_decode_attention_refuses_bad_arguments():
    q, k = torch.randn(4, 16), torch.randn(5, 2, 16)
    for args, msg in [((q.double(), k, k), "q must be"), ((q, k.half(), k.half()), "k must be"),
                      ((q, k, k.bfloat16()), "v must be"), ((q, k, k[:4].contiguous()), "do not fit"),
                      ((q[:, :12].contiguous(), k[..., :12].contiguous(), k[..., :12].contiguous()), "do not fit"),
                      ((q[:3].contiguous(), k, k), "do not fit"), ((q, k.transpose(0, 1), k), "not contiguous")]:
        with pytest.raises(ValueError, match=msg):
            native.decode_attention(*args, 0.25)
    with pytest.raises(ValueError, match="multiple of hkv"):
        native._C.decode_attention(q.data_ptr(), k.data_ptr(), k.data_ptr(), q.data_ptr(), 5, 3, 2, 16, 0.25)
    with pytest.raises(ValueError, match="multiple of 8"):
        native._C.decode_attention(q.data_ptr(), k.data_ptr(), k.data_ptr(), q.data_ptr(), 5, 4, 2, 12, 0.25)


# --------------------------------------------------------------------------- RMSNorm over rows

needs_norm = pytest.mark.skipif(not native.RMS_NORM, reason="the RMSNorm kernel needs the extension "
                                "on x86-64 AVX2 + FMA")


def _norm_torch_form(x, w, eps, zero_centred):
    """nn.layers.RMSNorm's torch form (the kernel off)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).to(x.dtype) if zero_centred else w * h.to(x.dtype)


@needs_norm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("m, d", [(1, 1024), (3, 37), (300, 256)])
def test_rms_norm_matches_the_torch_form(dtype, zero_centred, m, d):
    """Against the torch form in the same dtype: float32 within 2 ulps (only the sum of squares
    is added in another order); bf16, rounded at the same steps, within one bf16 rounding and
    nearly every value equal. The rows do not depend on the thread count (300 rows: split)."""
    g = torch.Generator().manual_seed(m * d)
    x = (torch.randn(m, d, generator=g) * torch.logspace(-3, 2, m)[:, None]).to(dtype)
    w = (0.1 * torch.randn(d, generator=g) + (0 if zero_centred else 1)).to(dtype)
    got, ref = native.rms_norm(x, w, 1e-6, zero_centred), _norm_torch_form(x, w, 1e-6, zero_centred)
    assert got.dtype == dtype and got.shape == (m, d)
    tol = 3e-7 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max()))
    if dtype == torch.bfloat16:
        assert (got == ref).float().mean() > 0.95
    one = torch.empty_like(x)
    native._C.rms_norm(x.data_ptr(), w.data_ptr(), one.data_ptr(), m, d, 1e-6, zero_centred,
                       dtype == torch.bfloat16, dtype == torch.bfloat16, num_threads=1)
    assert torch.equal(one, got)
    assert torch.equal(native.rms_norm(x[:1].contiguous(), w, 1e-6, zero_centred), got[:1])


@needs_norm
def test_rms_norm_module_takes_the_kernel_for_cpu_rows(monkeypatch):
    """RMSNorm.forward: float32 and bf16 rows on the CPU go to the kernel (counted), any leading
    shape; the module's torch form (kernel off) agrees."""
    from flashrt.nn.layers import RMSNorm
    calls = []
    kernel = native.rms_norm
    monkeypatch.setattr(native, "rms_norm", lambda x, *a: calls.append(tuple(x.shape)) or kernel(x, *a))
    norm = RMSNorm(16, 1e-6, zero_centred=True)
    norm.weight.data = torch.randn(16, generator=torch.Generator().manual_seed(2))
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(3))
    y = norm(x)
    assert calls == [(6, 16)] and y.shape == x.shape
    monkeypatch.setattr(native, "RMS_NORM", False)
    torch.testing.assert_close(y, norm(x), rtol=3e-7, atol=1e-6)
    assert calls == [(6, 16)]


@needs_norm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(dtype):
    """x + r (torch's add: one rounding in the dtype) written out, then normed: bitwise the add
    followed by rms_norm; RMSNorm.add_and_norm gives the same, and its torch form agrees."""
    from flashrt.nn.layers import RMSNorm
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(3, 40, generator=g).to(dtype) for _ in range(2))
    w = (0.1 * torch.randn(40, generator=g)).to(dtype)
    s, y = native.add_rms_norm(x, r, w, 1e-6, True)
    assert torch.equal(s, x + r) and torch.equal(y, native.rms_norm(x + r, w, 1e-6, True))
    norm = RMSNorm(40, 1e-6, zero_centred=True)
    norm.weight.data = w
    s2, y2 = norm.add_and_norm(x[None], r[None])
    assert s2.shape == (1, 3, 40) and torch.equal(s2[0], s) and torch.equal(y2[0], y)
    was = native.RMS_NORM
    try:
        native.RMS_NORM = False
        s3, y3 = norm.add_and_norm(x, r)
    finally:
        native.RMS_NORM = was
    tol = 3e-7 if dtype == torch.float32 else 2 ** -7
    assert torch.equal(s3, s)
    torch.testing.assert_close(y3.float(), y.float(), rtol=tol, atol=tol * float(y.float().abs().max()))
    with pytest.raises(ValueError, match="r must be"):
        native.add_rms_norm(x, r.double(), w, 1e-6, True)
    with pytest.raises(ValueError, match="do not fit"):
        native.add_rms_norm(x, r[:2].contiguous(), w, 1e-6, True)
    with pytest.raises(ValueError, match="r and s"):
        native._C.rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), 3, 40, 1e-6, True, r=x.data_ptr())


@needs_norm
def test_rms_norm_refuses_bad_arguments():
    x, w = torch.randn(2, 8), torch.ones(8)
    for args, msg in [((x.double(), w), "x must be"), ((x, w.bfloat16()), "w must be"),
                      ((x, torch.ones(9)), "do not fit"), ((x.t(), w), "not contiguous"),
                      ((x[:0], w), "do not fit"), ((x.bfloat16(), w.half()), "w must be")]:
        with pytest.raises(ValueError, match=msg):
            native.rms_norm(*args, 1e-6, False)
    with pytest.raises(ValueError, match="eps must be"):
        native._C.rms_norm(x.data_ptr(), w.data_ptr(), x.data_ptr(), 2, 8, -1.0, False)
    with pytest.raises(ValueError, match="M and D must be positive"):
        native._C.rms_norm(x.data_ptr(), w.data_ptr(), x.data_ptr(), 0, 8, 1e-6, False)


# --------------------------------------------------------------------------- causal conv

needs_conv = pytest.mark.skipif(not native.CAUSAL_CONV, reason=native.ext_status())


@needs_conv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, K", [(1, 4), (3, 4), (5, 2)])
def test_causal_conv_matches_the_torch_form(dtype, T, K):
    """silu(conv) against nn.linear_attn.causal_conv's torch form (the kernel off), in the
    model's dtype: float32 within 1e-6 (silu's exp is another library's), bf16 rounded at the
    same steps: within one rounding, nearly every value equal; the state and the planes (the
    inputs moved along) bitwise. T rows in one call are T calls of one row, bit for bit."""
    from flashrt.nn import linear_attn as LA
    C = 45      # a decode row's 8-channel groups (K = 4), then a tail of 5
    g = torch.Generator().manual_seed(T * K)
    x = torch.randn(T, C, generator=g).to(dtype)
    w = (0.5 * torch.randn(C, K, generator=g)).to(dtype)
    state = torch.randn(C, K - 1, generator=g).to(dtype)
    s_ref, p_ref = state.clone(), torch.empty(T, C, K - 1, dtype=dtype)
    was = native.CAUSAL_CONV
    try:
        native.CAUSAL_CONV = False
        ref = LA.causal_conv(x, s_ref, w, planes=p_ref)
    finally:
        native.CAUSAL_CONV = was
    s_got, p_got = state.clone(), torch.empty(T, C, K - 1, dtype=dtype)
    got = LA.causal_conv(x, s_got, w, planes=p_got)
    assert got.dtype == dtype and got.shape == (T, C)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:
        assert (got == ref).float().mean() > 0.95
    assert torch.equal(s_got, s_ref) and torch.equal(p_got, p_ref)
    s_one = state.clone()
    rows = [native.causal_conv(x[t:t + 1].contiguous(), s_one, w) for t in range(T)]
    assert torch.equal(torch.cat(rows), got) and torch.equal(s_one, s_got)


@needs_conv
def test_causal_conv_refuses_bad_arguments():
    x, w, state = torch.randn(2, 8), torch.randn(8, 4), torch.randn(8, 3)
    before = state.clone()
    for args, msg in [((x.double(), state, w), "x must be"), ((x, state.bfloat16(), w), "state must be"),
                      ((x, state, w[:, :1].contiguous()), "do not fit"),
                      ((x, state[:, :2].contiguous(), w), "do not fit"),
                      ((x, state, w, torch.empty(3, 8, 3)), "do not fit"), ((x[:0], state, w), "do not fit"),
                      ((x, state.t().contiguous().t(), w), "not contiguous")]:
        with pytest.raises(ValueError, match=msg):
            native.causal_conv(*args)
    assert torch.equal(state, before)
    with pytest.raises(ValueError, match="K in 2..64"):
        native._C.causal_conv(x.data_ptr(), w.data_ptr(), state.data_ptr(), 0, x.data_ptr(), 2, 8, 1)


# --------------------------------------------------------------------------- silu(gate) * up

needs_silu_mul = pytest.mark.skipif(not native.SILU_MUL, reason="the silu*mul kernel needs the "
                                    "extension on x86-64 AVX2 + FMA")


@needs_silu_mul
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n", [(1, 3584), (3, 21), (2, 8)])
def test_silu_mul_matches_the_torch_form(dtype, m, n):
    """Against F.silu(gate) * up in the same dtype, gate and up halves of one (m, 2n) output (a
    row stride, as a LinearPack leaves them): float32 within 1e-6 (another exp), bf16 rounded at
    the same two steps: within one rounding, nearly every value equal; large |gate| and NaN as
    torch gives them. Rows alone give the same bits."""
    g = torch.Generator().manual_seed(m * n)
    both = (torch.randn(m, 2 * n, generator=g) * 4).to(dtype)
    both[0, 0], both[0, 1] = -100.0, 100.0                     # exp under- and overflow
    both[-1, n - 1] = float("nan")
    gate, up = both[:, :n], both[:, n:]
    got = native.silu_mul(gate, up)
    ref = torch.nn.functional.silu(gate) * up
    assert got.dtype == dtype and got.shape == (m, n) and got.is_contiguous()
    assert torch.isnan(got[-1, n - 1]) and torch.isnan(ref[-1, n - 1])
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol, equal_nan=True)
    if dtype == torch.bfloat16 and m * n >= 64:
        assert (got == ref).float().mean() > 0.95
    rows = torch.cat([native.silu_mul(gate[i:i + 1], up[i:i + 1]) for i in range(m)])
    bits = torch.int32 if dtype == torch.float32 else torch.int16     # NaN included
    assert torch.equal(rows.view(bits), got.view(bits))


@needs_silu_mul
def test_silu_mul_refuses_bad_arguments():
    a = torch.randn(2, 8)
    for args, msg in [((a.double(), a), "gate must be"), ((a, a.bfloat16()), "do not fit"),
                      ((a, a[:, :4]), "do not fit"), ((a.t(), a.t()), "contiguous rows"),
                      ((a[:0], a[:0]), "do not fit"), ((a[0], a[0]), "gate must be")]:
        with pytest.raises(ValueError, match=msg):
            native.silu_mul(*args)
    with pytest.raises(ValueError, match="row strides at least N"):
        native._C.silu_mul(a.data_ptr(), a.data_ptr(), a.data_ptr(), 2, 8, 4, 8)


def _int8_weight(n, k, g):
    """(q int8 (n, k), scale bf16 (n,), the float64 weights they stand for), any k."""
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]
    scale = (w.abs().amax(1) / 127).bfloat16()
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale, q.double() * scale.double()[:, None]


def _small_m(x, w, threads):
    """The kernel on `threads` threads (raw binding: 0 = OpenMP's count), w float32, bf16 or
    an int8 (q, scale) pair."""
    y = torch.full((x.shape[0], (w[0] if isinstance(w, tuple) else w).shape[0]), float("nan"))
    (m, k), n = x.shape, y.shape[1]
    if isinstance(w, tuple):
        native._C.small_m_linear_int8(x.data_ptr(), w[0].data_ptr(), w[1].data_ptr(), y.data_ptr(),
                                      m, n, k, threads)
    else:
        native._C.small_m_linear(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, threads,
                                 w.dtype == torch.bfloat16)
    return y


@needs_small_m
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("n, k", [(1, 1), (3, 7), (17, 9), (20, 16411), (67, 1000), (130, 2051),
                                  (4099, 300), (1031, 1024)])
def test_gemv_one_row(n, k, wdtype):
    """One row (the GEMV: row runs split over threads at multiples of 16 rows, 4-row tiles and
    1-row remainders, k tails under 8 and under a cache line) against a float64 reference;
    bitwise the same on 1 and 2 threads, and the same as that row inside a batch."""
    g = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(5, k, generator=g)
    if wdtype == "int8":
        q, scale, ref_w = _int8_weight(n, k, g)
        w, got = (q, scale), native.small_m_linear_int8(x[:1].contiguous(), q, scale)
    else:
        w = torch.randn(n, k, generator=g).to(getattr(torch, wdtype))
        ref_w, got = w.double(), native.small_m_linear(x[:1].contiguous(), w)
    ref = x[:1].double() @ ref_w.T
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-5 * k ** 0.5 * float(ref_w.abs().max()))
    one, two = _small_m(x[:1].contiguous(), w, 1), _small_m(x[:1].contiguous(), w, 2)
    assert torch.equal(one, got) and torch.equal(two, got)
    assert torch.equal(_small_m(x, w, 2)[:1], got)                 # the tile path's row 0


@needs_small_m
@pytest.mark.parametrize("m", [2, 3, 4, 16, 31, 32, 33])
@pytest.mark.parametrize("n, k", [(5, 7), (13, 64), (67, 1000), (130, 2051)])
def test_small_m_linear_int8_matches_a_double_reference(m, n, k):
    """int8 weights at 2..33 rows (3-row tiles and remainders, 4..1-column blocks, k tails):
    one float32 sum per output times the row's scale; 1 or 2 threads give the same bits, and
    each row is bitwise its own GEMV."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    q, scale, ref_w = _int8_weight(n, k, g)
    x = torch.randn(m, k, generator=g)
    got = native.small_m_linear_int8(x, q, scale)
    ref = (x.double() @ ref_w.T).float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * k ** 0.5 * float(ref_w.abs().max()))
    assert torch.equal(_small_m(x, (q, scale), 1), got) and torch.equal(_small_m(x, (q, scale), 2), got)
    for i in (0, m - 1):
        assert torch.equal(native.small_m_linear_int8(x[i:i + 1].contiguous(), q, scale), got[i:i + 1])


@needs_small_m
def test_small_m_linear_int8_refuses_bad_arguments():
    g = torch.Generator().manual_seed(0)
    q, scale, _ = _int8_weight(6, 32, g)
    x = torch.randn(4, 32, generator=g)
    for bad, msg in [((x.double(), q, scale), "x must be a contiguous 2-D float32"),
                     ((x.t().contiguous().t(), q, scale), "x must be.*not contiguous"),
                     ((x, q.float(), scale), "w must be a contiguous 2-D int8"),
                     ((x, torch.zeros(6, 64, dtype=torch.int8)[:, ::2], scale), "w must be.*not contiguous"),
                     ((x, q, scale.float()), "scale must be a contiguous 1-D bfloat16"),
                     ((x, q, scale[:5]), "do not multiply"),
                     ((x[:, :16].contiguous(), q, scale), "do not multiply")]:
        with pytest.raises(ValueError, match=msg):
            native.small_m_linear_int8(*bad)
    y = torch.empty(4, 6)
    with pytest.raises(ValueError, match="out must be"):
        native.small_m_linear_int8(x, q, scale, out=torch.empty(4, 5))
    with pytest.raises(ValueError, match="small_m_linear_int8: null scale"):
        native._C.small_m_linear_int8(x.data_ptr(), q.data_ptr(), 0, y.data_ptr(), 4, 6, 32)
    with pytest.raises(ValueError, match="small_m_linear_int8: m, n, k must be positive"):
        native._C.small_m_linear_int8(x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), 4, 0, 32)
    with pytest.raises(ValueError, match="num_threads"):
        native._C.small_m_linear_int8(x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), 4, 6, 32, -1)


# --------------------------------------------------------------------------- CPU copies

@pytest.mark.parametrize("num_threads", [1, 2])
def test_many_small_segments(backend, num_threads):
    pairs, dst, expected = random_segments(random.Random(1), 1 << 20, 500, 1500)
    native.copy_segments(pairs, num_threads=num_threads)
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("num_threads", [1, 2, 3, None])
def test_huge_segment_split_across_threads(backend, num_threads):
    # 5 MiB + 77 B: one segment past the 2 MiB parallel threshold, uneven split.
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, 256, (5 * (1 << 20) + 77,), dtype=torch.uint8, generator=g)
    dst = torch.zeros_like(src)
    small_src = torch.randint(0, 256, (333,), dtype=torch.uint8, generator=g)
    small_dst = torch.zeros_like(small_src)
    native.copy_segments([(small_src, small_dst), (src[1:], dst[1:]), (src[:0], dst[:0])],
                         num_threads=num_threads)
    assert dst[0] == 0 and torch.equal(dst[1:], src[1:]) and torch.equal(small_dst, small_src)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_random_mixed_sizes(backend, num_threads):
    rng = random.Random(2)
    for _ in range(2):
        pairs, dst, expected = random_segments(rng, 8 << 20, 40, 300_000)
        native.copy_segments(pairs, num_threads=num_threads)
        assert torch.equal(dst, expected)


@needs_ext
def test_parallel_copies_from_many_threads():
    """Python threads share the extension's copy pool (one job at a time, the GIL released):
    every caller's bytes land where they should."""
    import threading
    jobs = [random_segments(random.Random(10 + i), 4 << 20, 30, 250_000) for i in range(6)]
    errors, runs = [], [0] * len(jobs)

    def work(i):
        try:
            pairs, dst, expected = jobs[i]
            plan = native.SegmentPlan(pairs, num_threads=4)
            for _ in range(20):
                dst.zero_()
                plan.run()
                if not torch.equal(dst, expected):
                    errors.append((i, "wrong bytes"))
                    return
                runs[i] += 1
        except BaseException as e:           # a raise in a thread would otherwise only warn
            errors.append((i, repr(e)))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and runs == [20] * len(jobs), (errors, runs)


@needs_ext
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork()")
def test_parallel_copy_after_fork():
    """A forked child has none of the parent's pool threads (WorkPool's or OpenMP's); its
    parallel copies and small-M projections still run. (The child touches tensors through numpy only: torch's own
    OpenMP pool may hang after fork.)"""
    src = torch.from_numpy(np.random.default_rng(0).integers(0, 256, 3 << 20, np.uint8))
    dst = torch.zeros_like(src)
    native.copy_segments([(src, dst)], num_threads=2)      # the parent's pool exists now
    small_m = native.HAVE_EXT and bool(native._C.small_m_linear_isa())
    if small_m:                                            # and so does the linear's region
        g = torch.Generator().manual_seed(2)
        x, w = torch.randn(16, 256, generator=g), torch.randn(300, 256, generator=g)
        want, y = native.small_m_linear(x, w), torch.zeros(16, 300)
    pid = os.fork()
    if pid == 0:                                           # child: exit code says it all
        ok = False
        try:
            dst.numpy()[:] = 0
            native.copy_segments([(src, dst)], num_threads=2)
            ok = bool((src.numpy() == dst.numpy()).all())
            if small_m:
                native._C.small_m_linear(x.data_ptr(), w.data_ptr(), y.data_ptr(), 16, 300, 256, 2)
                ok = ok and bool((y.numpy() == want.numpy()).all())
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60       # a hung child (a pool waiting for threads the fork
    while True:                            # did not copy) fails the test instead of CI
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("parallel copy or projection in a forked child hung")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("spacing", ["even", "uneven"])
def test_equally_spaced_segments_coalesce_into_strided_copies(backend, spacing, monkeypatch):
    """A capsule-like copy (one fixed block, then rows [0, P) of equally spaced per-token
    buffers packed into the destination) runs as a few 2-D strided torch copies; any break in
    the spacing starts a new run; explicit num_threads keeps the native path."""
    monkeypatch.setattr(_ext, "COPIES_ON_TORCH_THREADS", False)   # an extension with its own pool
    g = torch.Generator().manual_seed(4)
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g)
    dst = torch.zeros(2 << 20, dtype=torch.uint8)
    pairs = [(src[:600_000], dst[:600_000])]
    for i in range(10):
        so = (1 << 20) + i * 100_000 + (5_000 if spacing == "uneven" and i >= 6 else 0)
        pairs.append((src[so:so + 40_000], dst[600_000 + i * 40_064: 600_000 + i * 40_064 + 40_000]))
    pairs.append((src[7:19], dst[-12:]))
    expected = dst.clone()
    for a, b in pairs:
        expected[b.storage_offset(): b.storage_offset() + b.numel()] = a
    plan = native.SegmentPlan(pairs)
    assert plan.mode == "strided"
    assert len(plan) == (3 if spacing == "even" else 4)
    plan.run()
    assert torch.equal(dst, expected)
    assert native.SegmentPlan(pairs, num_threads=1).mode == ("cpu" if backend == "ext" else "torch")
    assert native.SegmentPlan(pairs[1:4]).mode != "strided"       # 120 kB: below the threshold


@needs_ext
def test_cpu_copies_run_on_torch_openmp_threads():
    """Built with OpenMP and imported after torch, the extension binds to the OpenMP runtime
    torch loaded, so its parallel copies run on torch's threads, and a large capsule-like plan
    is one native call (not strided torch copies)."""
    path = native._C.openmp_runtime()
    if not path:
        pytest.skip("extension built without OpenMP: its own thread pool copies")
    torch_rt = {os.path.realpath(p) for p in
                glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "lib*omp*.so*"))}
    if torch_rt:                      # torch ships its runtime (pip wheels): it must be that one
        assert os.path.realpath(path) in torch_rt
        assert native.COPIES_ON_TORCH_THREADS
    theirs = _ext._torch_openmp_runtime()
    assert native.COPIES_ON_TORCH_THREADS == (
        theirs is not None and os.path.realpath(theirs) == os.path.realpath(path))
    assert ("torch's OpenMP threads" in native.ext_status()) == native.COPIES_ON_TORCH_THREADS
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    dst = torch.zeros(3 << 20, dtype=torch.uint8)
    pairs = [(src[:1 << 20], dst[:1 << 20])] + [
        (src[(2 << 20) + i * 40_000: (2 << 20) + i * 40_000 + 30_000],
         dst[(1 << 20) + i * 30_000: (1 << 20) + (i + 1) * 30_000]) for i in range(20)]
    plan = native.SegmentPlan(pairs)
    assert plan.mode == ("cpu" if native.COPIES_ON_TORCH_THREADS else "strided")
    plan.run()
    for a, b in pairs:
        assert torch.equal(a, b)


def test_empty_and_zero_length(backend):
    native.copy_segments([])
    z = torch.empty(0, dtype=torch.uint8)
    native.copy_segments([(z, z.clone())])
    assert len(native.SegmentPlan([(z, z)])) == 0


def test_plan_reuse(backend):
    pairs, dst, expected = random_segments(random.Random(3), 1 << 16, 30, 1000)
    plan = native.SegmentPlan(pairs, num_threads=2)
    assert plan.total_bytes == sum(s.numel() for s, _ in pairs)
    plan.run()
    assert torch.equal(dst, expected)
    for s, _ in pairs:  # new source contents, same addresses
        s.add_(1)
    pairs2 = [(s, d.clone()) for s, d in pairs]
    native.copy_segments(pairs2)
    plan.run()
    for (_, d), (_, d2) in zip(pairs, pairs2):
        assert torch.equal(d, d2)


def test_plan_from_a_table_moved_onto_another_buffer(backend):
    """A plan's table, destinations shifted onto a second buffer of the same layout, copies
    exactly what a plan built from views of that buffer copies; without the extension the
    caller is told to build from views (None)."""
    pairs, dst, expected = random_segments(random.Random(5), 1 << 16, 40, 900)
    plan = native.SegmentPlan(pairs)
    other = torch.full_like(dst, 7)
    moved = native.SegmentPlan.from_table(plan.src, plan.dst - dst.data_ptr() + other.data_ptr(),
                                          plan.nbytes, other.device, (other,))
    if backend == "torch":
        assert moved is None
        return
    assert moved.mode == "cpu" and len(moved) == len(plan.nbytes)
    moved.run()
    want = torch.full_like(dst, 7)
    for s, d in pairs:
        o = d.data_ptr() - dst.data_ptr()
        want[o:o + d.numel()] = s
    assert torch.equal(other, want)
    assert not torch.equal(dst, expected)          # the plan's own destination is untouched


@pytest.mark.parametrize("bad, msg", [
    (lambda a, b: (a[:10], b[:11]), "10 bytes"),
    (lambda a, b: (a[:16].view(torch.int32), b[:4].view(torch.int32)), "uint8"),
    (lambda a, b: (a[:16].view(4, 4), b[:16].view(4, 4)), "1-D"),
    (lambda a, b: (a[::2], b[:50]), "contiguous"),
    (lambda a, b: (a[:4].numpy(), b[:4]), "not a torch.Tensor"),
    (lambda a, b: (a[:4],), "pair"),
])
def test_validation_names_segment(bad, msg):
    a, b = torch.zeros(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    good = (a[:5], b[:5])
    with pytest.raises(ValueError, match=f"segment 1: .*{msg}"):
        native.copy_segments([good, bad(a, b)])
    with pytest.raises(ValueError):
        native.SegmentPlan([good], num_threads=-1)


@needs_ext
def test_raw_binding_checks():
    C = native._C
    buf = np.zeros(16, dtype=np.uint8)
    addr = buf.ctypes.data
    ok = np.array([addr], dtype=np.int64)
    with pytest.raises(ValueError, match="length"):
        C.copy_segments_cpu(ok, ok, np.array([1, 2], dtype=np.int64), 1)
    with pytest.raises(ValueError, match="negative"):
        C.copy_segments_cpu(ok, ok, np.array([-1], dtype=np.int64), 1)
    with pytest.raises(ValueError, match="null"):
        C.copy_segments_cpu(np.array([0], dtype=np.int64), ok, np.array([4], dtype=np.int64), 1)
    with pytest.raises(ValueError, match="1-D"):
        C.copy_segments_cpu(ok.reshape(1, 1), ok.reshape(1, 1), np.ones((1, 1), np.int64), 1)
    with pytest.raises(TypeError):  # float tables would be truncated addresses: refused
        C.copy_segments_cpu(ok.astype(np.float64), ok, np.array([1], dtype=np.int64), 1)
    with pytest.raises(ValueError):
        C.copy_segments_cpu(ok, ok, np.array([1], dtype=np.int64), -1)
    with pytest.raises(ValueError):
        C.xxh64(0, 5, 0)
    src = np.arange(16, dtype=np.uint8)  # lists and int32 tables are safely widened
    C.copy_segments_cpu([src.ctypes.data], [addr], np.array([16], dtype=np.int32))
    assert (buf == src).all()
    # the plan object checks its table once, at construction, the same way
    with pytest.raises(ValueError, match="length"):
        C.CpuCopyPlan(ok, ok, np.array([1, 2], dtype=np.int64))
    with pytest.raises(ValueError, match="null"):
        C.CpuCopyPlan(np.array([0], dtype=np.int64), ok, np.array([4], dtype=np.int64))
    plan = C.CpuCopyPlan(np.array([src.ctypes.data + 8], np.int64), ok, np.array([8], np.int64))
    with pytest.raises(ValueError):
        plan.run(-1)
    plan.run()
    assert len(plan) == 1 and (buf[:8] == src[8:]).all()


def test_fallback_warns_once(monkeypatch):
    monkeypatch.setattr(_ext, "HAVE_EXT", False)
    monkeypatch.setattr(_ext, "HAVE_CUDA_EXT", False)
    _ext.warn_fallback.cache_clear()
    a = torch.arange(10, dtype=torch.uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        native.copy_segments([(a, a.clone())])
        native.xxh64(b"abc")
        native.copy_segments([(a, a.clone())])
    assert [w.category for w in caught] == [RuntimeWarning]
    assert "unavailable" in str(caught[0].message)
    _ext.warn_fallback.cache_clear()


def test_ext_status_and_version():
    status = native.ext_status()
    assert "flashrt.native._C" in status
    if native.HAVE_EXT:
        assert isinstance(native._C.version, str) and native._C.version
        assert native.HAVE_CUDA_EXT == native._C.has_cuda()
        assert hasattr(native._C, "copy_segments_cuda") == native._C.has_cuda()


def test_stale_extension_is_not_used():
    """An extension built from older sources (missing functions this module calls) is refused
    with a message saying so, and the fallbacks run instead."""
    import subprocess
    import sys
    code = ("import sys, types; m = types.ModuleType('flashrt.native._C'); m.version = '0.0.1'; "
            "m.copy_segments_cpu = m.xxh64 = m.has_cuda = lambda *a: 0; "
            "sys.modules['flashrt.native._C'] = m; "
            "import flashrt.native as n; print(n.HAVE_EXT); print(n.ext_status())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    have, status = out.splitlines()[:2]
    assert have == "False" and "older sources" in status and "hash_blocks" in status


# --------------------------------------------------------------------------- xxh64

VECTORS = [(b"", 0, 0xEF46DB3751D8E999), (b"a", 0, 0xD24EC4F1A98C6E5B),
           (b"abc", 0, 0x44BC2CF5AD770999)]


@pytest.mark.parametrize("data, seed, want", VECTORS)
def test_xxh64_published_vectors(data, seed, want):
    assert xxh64_py(data, seed) == want
    assert native.xxh64(data, seed) == want


@pytest.mark.parametrize("seed", [0, 1, 0x9E3779B185EBCA87, 2**64 - 1])
def test_xxh64_matches_reference_small(backend, seed):
    rng = random.Random(seed)
    for n in range(101):  # covers every tail path and the 32-byte stripe loop
        data = bytes(rng.getrandbits(8) for _ in range(n))
        assert native.xxh64(data, seed) == xxh64_py(data, seed), n


def test_xxh64_large_buffer():
    data = random.Random(11).randbytes((1 << 20) + 13)
    want = xxh64_py(data, 12345)  # ~0.1 s in pure Python
    assert native.xxh64(data, 12345) == want
    assert native.xxh64(bytearray(data), 12345) == want
    assert native.xxh64(data[:-1], 12345) != want


def test_xxh3_reference_vector_and_fallback_at_every_length_class():
    """The numpy fallback equals the vendored reference at every length class: 0, 1-3, 4-8,
    9-16, 17-128, 129-240, and long inputs (whole 1 KiB blocks, partial stripes, last stripe)."""
    assert xxh3_py(b"") == 0x2D06800538D394C2          # published XXH3_64bits("")
    if not native.HAVE_EXT:
        pytest.skip(native.ext_status())
    assert native.xxh3(b"") == 0x2D06800538D394C2
    rng = random.Random(7)
    for n in list(range(0, 300)) + [1023, 1024, 1025, 1087, 2049, 4097, (1 << 18) + 63]:
        data = bytes(rng.getrandbits(8) for _ in range(n)) if n < 5000 else rng.randbytes(n)
        assert xxh3_py(data) == native.xxh3(data), n


def test_zero_spans_and_xxh3_parts(backend):
    buf = torch.full((100,), 7, dtype=torch.uint8)
    native.zero_spans(buf, np.array([3, 50, 99]), np.array([4, 10, 1]))
    want = torch.full((100,), 7, dtype=torch.uint8)
    want[3:7] = 0
    want[50:60] = 0
    want[99] = 0
    assert torch.equal(buf, want)
    with pytest.raises(ValueError):
        native.zero_spans(buf, np.array([95]), np.array([6]))
    assert torch.equal(buf, want)                       # a refused call writes nothing
    data = random.Random(12).randbytes(3000)
    parts = [data[:1], memoryview(data)[1:1000], bytearray(data[1000:2999]), data[2999:]]
    assert native.xxh3_parts(parts) == native.xxh3(data) == xxh3_py(data)


def test_xxh3_input_kinds(backend):
    data = random.Random(13).randbytes(4099)
    want = xxh3_py(data)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert native.xxh3(data) == want and native.xxh3(t) == want
    assert native.xxh3(memoryview(data)) == want and native.xxh3(np.frombuffer(data, np.uint8)) == want
    with pytest.raises(ValueError, match="contiguous"):
        native.xxh3(t[::2])


def _spans_case(n_bytes, seed):
    """A buffer and spans in a scrambled order: unaligned, empty, and block-crossing ones."""
    rng = random.Random(seed)
    buf = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    cuts = sorted(rng.sample(range(1, n_bytes), 9)) if n_bytes > 10 else []
    spans = list(zip([0] + cuts, [b - a for a, b in zip([0] + cuts, cuts + [n_bytes])]))
    spans.append((n_bytes // 2, 0))                      # empty span
    rng.shuffle(spans)
    off = np.array([o for o, _ in spans], dtype=np.int64)
    nb = np.array([k for _, k in spans], dtype=np.int64)
    stream = b"".join(bytes(buf[o:o + k].numpy()) for o, k in spans)
    return buf, off, nb, stream


@pytest.mark.parametrize("n_bytes, block", [(0, 64), (100, 1), (1000, 7), (4096, 64),
                                             ((3 << 20) + 5, 1 << 18), ((1 << 20) + 17, 1 << 30)])
def test_hash_blocks_is_xxh3_per_block(backend, n_bytes, block):
    """Digest b is the one-shot XXH3 of stream block b, whatever the spans' split."""
    buf, off, nb, stream = _spans_case(n_bytes, n_bytes + block)
    got = native.hash_blocks(buf, off, nb, block)
    want = b"".join(struct.pack("<Q", native.xxh3(stream[i:i + block]))
                    for i in range(0, len(stream), block))
    assert got == want
    if backend == "ext" and n_bytes > (1 << 20):        # the digests do not depend on threads
        assert native._C.hash_blocks(buf.data_ptr(), buf.numel(), off, nb, block, 1) == want


@pytest.mark.parametrize("n_bytes", [1, 33, 4096, (1 << 20) + 17, (3 << 20) + 5, (13 << 20) + 5])
def test_read_blocks_hashed_lands_bytes_and_hashes(backend, tmp_path, n_bytes):
    """13 MiB: past the threshold where the extension reads blocks on several threads."""
    buf, off, nb, stream = _spans_case(n_bytes, n_bytes)
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 11 + stream + b"tail")
    dst = torch.zeros_like(buf)
    with open(path, "rb", buffering=0) as f:
        got = native.read_blocks_hashed(f, 11, dst, off, nb, 1 << 18)
        assert f.tell() == 0                            # positioned reads
    assert got == native.hash_blocks(buf, off, nb, 1 << 18)
    assert torch.equal(dst, buf)                        # every byte of buf lies in some span
    path.write_bytes(b"x" * 11 + stream[:-1])           # the file ends one byte early
    with open(path, "rb", buffering=0) as f:
        assert native.read_blocks_hashed(f, 11, torch.zeros_like(buf), off, nb, 1 << 18) is None


def test_block_spans_outside_the_buffer_are_refused(backend, tmp_path):
    buf = torch.zeros(100, dtype=torch.uint8)
    bad = [([90], [11]), ([-1], [5]), ([0], [-1]), ([101], [0])]
    for o, k in bad:
        with pytest.raises(ValueError):
            native.hash_blocks(buf, np.array(o), np.array(k), 16)
    with pytest.raises(ValueError):
        native.hash_blocks(buf, np.array([0]), np.array([10]), 0)
    (tmp_path / "f").write_bytes(bytes(200))
    with open(tmp_path / "f", "rb", buffering=0) as f:
        with pytest.raises(ValueError):
            native.read_blocks_hashed(f, 0, buf, np.array([95]), np.array([10]), 16)
    with pytest.raises(ValueError, match="uint8"):
        native.hash_blocks(buf.float(), np.array([0]), np.array([1]), 16)


@pytest.mark.skipif(not native.HAVE_EXT, reason="load_known_table is native only")
def test_load_known_table_refuses_spans_outside_the_buffer(tmp_path):
    """The one-call capsule load bounds payload and gap spans by the buffer before reading."""
    buf = torch.full((100,), 7, dtype=torch.uint8)
    (tmp_path / "f").write_bytes(bytes(200))
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    ok, none = np.array([0], np.int64), np.array([], np.int64)
    try:
        for (o, k), gaps in [(([95], [10]), (none, none)), ((ok, [10]), ([99], [2])),
                             (([-1], [5]), (none, none)), ((ok, [-1]), (none, none))]:
            with pytest.raises(ValueError, match="outside"):
                native.load_known_table(fd, ["a"], [], buf.data_ptr(), buf.numel(),
                                        np.array(o, np.int64), np.array(k, np.int64),
                                        np.array(gaps[0], np.int64), np.array(gaps[1], np.int64), 16)
        with pytest.raises(ValueError, match="file descriptor"):
            native.load_known_table(-1, [], [], buf.data_ptr(), buf.numel(), ok, ok, none, none, 16)
        # not a capsule: nothing written
        assert native.load_known_table(fd, [], [], buf.data_ptr(), buf.numel(), ok,
                                       np.array([10], np.int64), none, none, 16) == ("not_fast", None)
    finally:
        os.close(fd)
    assert (buf == 7).all()


def test_xxh64_input_kinds(backend):
    data = random.Random(14).randbytes(4099)
    want = xxh64_py(data, 3)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert native.xxh64(t, 3) == want
    assert native.xxh64(t[:4096].view(torch.float32).view(32, 32), 3) == xxh64_py(data[:4096], 3)
    assert native.xxh64(memoryview(data), 3) == want
    assert native.xxh64(np.frombuffer(data, dtype=np.uint8), 3) == want
    assert native.xxh64(torch.empty(0)) == xxh64_py(b"")
    assert native.xxh64(data, -1) == xxh64_py(data, 2**64 - 1)  # seed mod 2**64
    with pytest.raises(ValueError, match="contiguous"):
        native.xxh64(t[::2])


# --------------------------------------------------------------------------- CUDA

@needs_cuda
@pytest.mark.parametrize("nseg, max_len, align", [
    (7, 100_000, 1), (100, 5000, 1), (300, 3000, 1), (2500, 600, 1), (3, 3_000_000, 1),
    (40, 300_000, 16), (200, 20_000, 8)])
def test_cuda_single_launch_copy(backend, nseg, max_len, align):
    # 7 / 100 / 300 / 2500 segments exercise the 32-, 128- and 1024-entry tables
    # and the multi-launch path; align 1 mixes the 16/8/4/1-byte copy paths,
    # align 16 takes the vectorised full-tile path throughout.
    pairs, dst, expected = random_segments(random.Random(nseg), 16 << 20, nseg, max_len, "cuda",
                                           align)
    plan = native.SegmentPlan(pairs)
    assert plan.mode == ("cuda" if native.HAVE_CUDA_EXT else "torch")
    plan.run()
    torch.cuda.synchronize()
    assert torch.equal(dst, expected)


@needs_cuda
def test_cuda_side_stream_and_graph_capture(backend):
    pairs, dst, expected = random_segments(random.Random(9), 1 << 20, 50, 10_000, "cuda")
    plan = native.SegmentPlan(pairs)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        plan.run()
    s.synchronize()
    assert torch.equal(dst, expected)
    dst.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst, expected)


@needs_cuda
def test_cuda_pinned_transfers(backend):
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(15)).to("cuda")
    host = torch.zeros(1 << 20, dtype=torch.uint8).pin_memory()
    back = torch.zeros_like(src)
    native.copy_segments([(src[:1000], host[:1000]), (src[5000:], host[5000:])])
    native.copy_segments([(host, back)])
    torch.cuda.synchronize()
    assert torch.equal(back[:1000], src[:1000]) and torch.equal(back[5000:], src[5000:])
    assert not back[1000:5000].any()
    assert native.xxh64(src) == native.xxh64(src.cpu())

"""8-bit weights (load(..., weights="int8")): the quantizer, the int8 linear against a float
reference on the same dequantized weights, what a load quantizes, the weight format in the
fingerprint (a capsule does not cross formats, the error names the field), capsule exactness
and never-left continuation under int8 (same path: bitwise), and greedy agreement with float32
on the shipped trained model (random weights have logits too flat to judge quality by)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashrt
from conftest import state_bytes
from flashrt.lm import load as lm_load
from flashrt import native
from flashrt.nn.linear import (INT8_MAX_ROWS, Int8Embedding, Int8Weight, Linear, dequantize_int8,
                               int8_linear, linear, quantize_int8, small_m_rows)

# greedy agreement of int8 (float32 activations) with float32 on the trained model, teacher-forced
# over PROMPTS below: 106 of 106 positions when written (over the held-out files, bench/decode.py:
# 99.0% against bf16, as float32 itself); the bar leaves room for another CPU's summation order
AGREE_MIN = 0.9
PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n    if len(argv) < 2:\n        print(",
    "class Queue:\n    \"\"\"A FIFO queue.\"\"\"\n\n"
    "    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n        self.",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, self.",
    "def _check_arg(name, value):\n    if not isinstance(value, str):\n        raise TypeError(",
)


def _ids(n, seed=0, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_quantize_int8_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 48, generator=g) * torch.logspace(-3, 1, 7)[:, None]
    w[3] = 0                                            # a zero row: scale 1, all zeros
    q = quantize_int8(w)
    assert isinstance(q, Int8Weight) and q.dtype == torch.int8 and not q.requires_grad
    assert q.scale.dtype == torch.bfloat16 and q.scale.shape == (7,)
    assert int(q.abs().max()) <= 127 and bool((q[3] == 0).all()) and float(q.scale[3]) == 1
    deq = dequantize_int8(q)
    assert torch.equal(deq, q.double().mul(q.scale.double()[:, None]).float())   # exact in float32
    # round to nearest: half a step per weight, plus the row maximum's clamp when the bf16
    # scale rounded down (at most a bf16 ulp of the maximum)
    step = q.scale.float()[:, None]
    assert bool(((deq - w).abs() <= step * 0.5 + w.abs().amax(1, keepdim=True) * 2 ** -8).all())
    assert torch.equal(quantize_int8(w), q)             # deterministic
    with pytest.raises(ValueError, match="multiple of 16.*\\(4, 40\\)"):
        quantize_int8(torch.ones(4, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_int8_linear_matches_dequantized_float(dtype, rows):
    """Under "flashrt", the rows small_m_rows gives: the extension's small-M kernel, x in
    float32, one rounding to x's dtype. Otherwise up to INT8_MAX_ROWS rows: torch's int8
    kernel, x rounded to bf16, one bf16 rounding of the result; more: the float32 GEMM on the
    exactly dequantized weights. linear() sends an Int8Weight there whatever the kernel asked."""
    g = torch.Generator().manual_seed(rows)
    w = quantize_int8(torch.randn(96, 256, generator=g))
    x = torch.randn(rows, 256, generator=g).to(dtype)
    lo, hi = small_m_rows("flashrt", torch.int8)
    for y, kernel in ((int8_linear(x, w), "aten"), (linear(x, w, kernel="flashrt"), "flashrt"),
                      (linear(x[None], w, kernel="aten")[0], "aten")):
        torch_kernel = rows <= INT8_MAX_ROWS and not (kernel == "flashrt" and lo <= rows <= hi)
        ref = F.linear((x.bfloat16() if torch_kernel else x).double(), dequantize_int8(w).double())
        rel = 2 ** -8 if torch_kernel or dtype == torch.bfloat16 else 1e-5
        assert y.dtype == dtype and y.shape == (rows, 96)
        assert bool(((y.double() - ref).abs() <= rel * ref.abs() + 1e-4).all()), kernel
    # a strided x and a contiguous one 16 bytes off the kernel's alignment: the same bits
    strided = torch.zeros(rows, 512, dtype=dtype)[:, 8:264]
    shifted = torch.zeros(rows * 256 + 8, dtype=dtype)[8:].view(rows, 256)
    for other in (strided, shifted):
        other.copy_(x)
        assert torch.equal(int8_linear(other, w), int8_linear(x, w))


@pytest.mark.skipif(not native.SMALL_M_INT8, reason="the extension's int8 small-M kernel does not run here")
def test_int8_small_m_dispatch(monkeypatch):
    """Under "flashrt" 1..SMALL_M_MAX_INT8 rows go to the extension's int8 kernel (counted;
    bitwise its result rounded once to x's dtype; a strided x made contiguous), under "onednn"
    and "aten" none do; a torch.compile'd body runs the same kernel as one op, same bits."""
    lo, hi = small_m_rows("flashrt", torch.int8)
    assert (lo, hi) == (1, native.SMALL_M_MAX_INT8) and small_m_rows("onednn", torch.int8)[1] == 0
    calls = []
    kernel = native.small_m_linear_int8
    monkeypatch.setattr(native, "small_m_linear_int8", lambda x, w, s: calls.append(x.shape[0]) or kernel(x, w, s))
    g = torch.Generator().manual_seed(6)
    w = quantize_int8(torch.randn(40, 48, generator=g))
    for m in (1, 2, hi, hi + 1):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, 48, generator=g).to(dtype)
            calls.clear()
            y = linear(x, w, kernel="flashrt")
            assert calls == ([m] if m <= hi else []), m
            if m <= hi:
                assert torch.equal(y, kernel(x.float(), w, w.scale).to(dtype))
            for other in ("onednn", "aten"):
                linear(x, w, kernel=other)
            assert calls == ([m] if m <= hi else []), m
    xt = torch.randn(48, 3, generator=g).t()                     # (3, 48), not contiguous
    assert torch.equal(linear(xt, w, kernel="flashrt"), kernel(xt.contiguous(), w, w.scale))
    body = torch.compile(lambda x: linear(x, w, kernel="flashrt"), backend="eager", fullgraph=True)
    assert torch.equal(body(xt.contiguous()), linear(xt, w, kernel="flashrt"))


def test_int8_load_quantizes_projections_and_tied_head(ckpt):
    rt = lm_load(ckpt("qwen3_5"), dtype="float32", weights="int8", max_seq_len=64)
    net = rt.net
    lin = [m for m in net.modules() if isinstance(m, Linear)]
    assert lin and all(isinstance(m.weight, Int8Weight) for m in lin)
    assert net.config.tie_word_embeddings and isinstance(net.embed_tokens, Int8Embedding)
    assert rt.model.weights == "int8" and rt.fingerprint["weights"].endswith("+int8")
    ref = lm_load(ckpt("qwen3_5"), dtype="float32", max_seq_len=64)
    assert rt.fingerprint["weights"] == ref.fingerprint["weights"] + "+int8"
    assert {k for k in rt.fingerprint if k != "weights"} == {k for k in ref.fingerprint if k != "weights"}
    # the lookup dequantizes the same rows the head multiplies by
    ids = torch.tensor([0, 5, 77])
    w = net.embed_tokens.weight
    assert torch.equal(net.embed_tokens(ids), w[ids].float() * w.scale[ids, None])
    with pytest.raises(ValueError, match="weights 'int4'.*float.*int8"):
        lm_load(ckpt("qwen3_5"), weights="int4")


def test_capsule_refused_across_weight_formats(ckpt):
    """A capsule made under float weights is refused under int8 and back, naming "weights";
    the refused restore leaves the live state byte-identical."""
    path = ckpt("qwen3_5")
    f32 = lm_load(path, dtype="float32", max_seq_len=64)
    q8 = lm_load(path, dtype="float32", weights="int8", max_seq_len=64)
    for src, dst in ((f32, q8), (q8, f32)):
        src.reset()
        src.prefill(_ids(11, 1))
        cap = src.snapshot()
        dst.reset()
        dst.prefill(_ids(5, 2))
        before = state_bytes(dst)
        with pytest.raises(flashrt.CapsuleMismatchError, match="weights differs.*int8"):
            dst.restore(cap)
        assert dst.position == 5 and torch.equal(state_bytes(dst), before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_never_left_continuation_bitwise(ckpt, dtype):
    """Under int8: snapshot, excursion, restore, decode == the run that never left, bitwise;
    a fork from the capsule continues the same; every decode logit differs from float's."""
    path = ckpt("qwen3_5")
    ref = lm_load(path, dtype=dtype, weights="int8", max_seq_len=128, prefill_chunk=8)
    rt = lm_load(path, dtype=dtype, weights="int8", max_seq_len=128, prefill_chunk=8)
    prompt, cont = _ids(29, 3), _ids(12, 4)
    ref.prefill(prompt)
    want = torch.stack([ref.decode(t) for t in cont])
    rt.prefill(prompt)
    cap = rt.snapshot()
    rt.prefill(_ids(17, 5))
    rt.generate(max_new_tokens=5)
    rt.restore(cap)
    assert torch.equal(torch.stack([rt.decode(t) for t in cont]), want)
    child = rt.fork(cap)
    assert torch.equal(torch.stack([child.decode(t) for t in cont]), want)
    fl = lm_load(path, dtype=dtype, max_seq_len=128, prefill_chunk=8)
    fl.prefill(prompt)
    assert not torch.equal(torch.stack([fl.decode(t) for t in cont]), want)   # int8 did run


def test_int8_greedy_agrees_with_float_on_trained_model():
    """Teacher-forced greedy agreement of int8 with float32 over the prompts' positions, on the
    shipped trained model (AGREE_MIN: measured with margin)."""
    from flashrt.assets import trained_model_path
    path = trained_model_path()
    f32 = lm_load(path, dtype="float32", max_seq_len=256)
    q8 = lm_load(path, dtype="float32", weights="int8", max_seq_len=256)
    same = total = 0
    for p in PROMPTS:
        ids = f32.tokenizer.encode(p)
        f32.reset()
        q8.reset()
        a = f32.prefill(ids, all_logits=True).argmax(-1)
        b = q8.prefill(ids, all_logits=True).argmax(-1)
        same, total = same + int((a == b).sum()), total + len(ids)
    assert total > 80 and same / total >= AGREE_MIN, (same, total)

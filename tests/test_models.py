"""One runner for every model family: parity with transformers, chunking, stale rows, graph body."""
from __future__ import annotations

import pytest
import torch

import flashrt
from flashrt.lm import graph_body_step
from flashrt import native
from conftest import ARCHS, assert_greedy_matches, hf_logits, hf_reference, margin_check, teacher_forced

PROMPT = 20


def _ids(n, vocab=512, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.skipif(not native.SMALL_M_LINEAR, reason="small-M kernel does not run here")
def test_flashrt_kernel_dispatch(monkeypatch):
    """1..32 float32 rows take the small-M kernel (counted, and bitwise what it gives alone; a
    strided x is made contiguous; one row is its GEMV); more rows and a strided weight take
    oneDNN (no small-M call); all agree with F.linear."""
    from flashrt.nn.linear import linear, small_m_rows
    lo, hi = small_m_rows("flashrt", torch.float32)
    assert (lo, hi) == (1, native.SMALL_M_MAX)
    calls = []
    kernel = native.small_m_linear
    monkeypatch.setattr(native, "small_m_linear", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g)
    for m in (1, 2, 16, 32, 33, 64):
        x = torch.randn(m, 24, generator=g)
        calls.clear()
        y = linear(x, w, kernel="flashrt")
        small_m = lo <= m <= hi
        assert calls == ([m] if small_m else []), m
        torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)
        if small_m:                                            # same kernel: same bits
            assert torch.equal(y, kernel(x, w))
    xt = torch.randn(24, 8, generator=g).t()                   # (8, 24), not contiguous
    calls.clear()
    assert torch.equal(linear(xt, w, kernel="flashrt"), kernel(xt.contiguous(), w)) and calls == [8]
    wt = torch.randn(24, 40, generator=g).t()
    calls.clear()
    torch.testing.assert_close(linear(xt.contiguous(), wt, kernel="flashrt"), xt @ wt.T,
                               rtol=1e-5, atol=1e-5)
    assert calls == []                                         # a strided weight: oneDNN


def _onednn_runs_bf16() -> bool:
    x = torch.ones(2, 16, dtype=torch.bfloat16)
    try:
        return bool(torch.backends.mkldnn.is_available() and
                    torch.ops.mkldnn._linear_pointwise(x, x, None, "none", [], "").float().eq(16).all())
    except RuntimeError:
        return False


@pytest.mark.skipif(not (native.SMALL_M_LINEAR and _onednn_runs_bf16()),
                    reason="needs the small-M kernel and oneDNN's bf16 inner product")
def test_flashrt_kernel_dispatch_bf16(monkeypatch):
    """bf16 weights: 1..SMALL_M_MAX_BF16 rows (a strided x, a bias too) go to the small-M kernel
    (counted: at small K its bits often equal oneDNN's), summed in float32 and rounded once; one
    row without a bias to its bf16-in-and-out form."""
    from flashrt.nn.linear import linear
    calls = []
    kernel, one_row = native.small_m_linear, native.gemv_bf16
    monkeypatch.setattr(native, "small_m_linear", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    monkeypatch.setattr(native, "gemv_bf16", lambda x, w: calls.append("gemv_bf16") or one_row(x, w))
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(40, 24, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16()
    for m in (1, 8, 9, 32):
        x = torch.randn(m, 24, generator=g).bfloat16()
        calls.clear()
        y = linear(x, w, kernel="flashrt")
        # one row without a bias: bf16 in and out (gemv_bf16, the same bits)
        want = ["gemv_bf16"] if m == 1 and native.GEMV_BF16 else [m] if m <= native.SMALL_M_MAX_BF16 else []
        assert calls == want, m
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=2 ** -7, atol=2 ** -7)
    xt = torch.randn(24, 4, generator=g).bfloat16().t()       # (4, 24), not contiguous
    with_bias = linear(xt, w, b, kernel="flashrt")
    assert torch.equal(with_bias, (kernel(xt.float().contiguous(), w) + b).bfloat16())


@pytest.mark.skipif(not native.SMALL_M_LINEAR, reason="small-M kernel does not run here")
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_linear_pack_is_its_members_bitwise(fmt, monkeypatch):
    """A LinearPack on the small-M kernel: one call over the concatenated rows (counted) whose
    outputs are bitwise its members' own (a bias too); the members' weights become views of the
    pack and keep their names; more rows than the kernel takes, or a member weight replaced
    after packing, run the members one by one (still right)."""
    from flashrt.nn.linear import Linear, LinearPack, quantize_int8, small_m_rows
    g = torch.Generator().manual_seed(6)
    dtype = torch.bfloat16 if fmt == "bfloat16" else torch.float32
    parent = torch.nn.Module()
    for name, out in (("a", 40), ("b", 8), ("c", 24)):
        m = Linear(32, out, bias=fmt == "float32")
        with torch.no_grad():
            m.weight = torch.nn.Parameter(torch.randn(out, 32, generator=g).to(dtype), requires_grad=False)
            if m.bias is not None:
                m.bias = torch.nn.Parameter(torch.randn(out, generator=g), requires_grad=False)
        if fmt == "int8":
            m.weight = quantize_int8(m.weight)
        m.kernel = "flashrt"
        setattr(parent, name, m)
    parent.abc = LinearPack(parent.a, parent.b, parent.c)
    names = sorted(parent.state_dict())
    hi = small_m_rows("flashrt", torch.int8 if fmt == "int8" else dtype)[1]
    xs = {m: torch.randn(m, 32, generator=g).to(dtype) for m in (1, 3, hi + 1)}
    want = {m: [parent.a(x), parent.b(x), parent.c(x)] for m, x in xs.items()}
    assert parent.abc.pack() and sorted(parent.state_dict()) == names
    packed = parent.abc.packed
    assert packed.shape == (72, 32) and parent.b.weight.data_ptr() == packed[40].data_ptr()
    calls = []
    for fn in ("small_m_linear", "small_m_linear_int8", "gemv_bf16"):
        monkeypatch.setattr(native, fn, (lambda f: lambda x, *a: calls.append(x.shape[0]) or f(x, *a))(
            getattr(native, fn)))
    for m, x in xs.items():
        calls.clear()
        got = parent.abc(x)
        assert all(torch.equal(u, v) for u, v in zip(got, want[m])), m
        assert calls == ([m] if m <= hi else []), (m, calls)
    parent.b.weight = torch.nn.Parameter(parent.b.weight.detach().clone(), requires_grad=False) \
        if fmt != "int8" else quantize_int8(torch.randn(8, 32, generator=g))
    calls.clear()
    got = parent.abc(xs[1])
    assert len(calls) == 3 and torch.equal(got[1], parent.b(xs[1])) and torch.equal(got[0], want[1][0])


def test_loaded_models_pack_their_projections(runtime):
    """Loaded on the CPU under the small-M kernel, every family's q/k/v, gate/up (and Qwen3.5's
    four Gated DeltaNet inputs) are packed; the parameter names are the checkpoint's, and a run
    with the packs undone gives the same logits bit for bit."""
    from flashrt.nn.linear import LinearPack
    for arch in ARCHS:
        rt = runtime(arch)
        packs = [m for m in rt.net.modules() if isinstance(m, LinearPack)]
        if not native.SMALL_M_LINEAR:
            assert all(p.packed is None for p in packs)
            continue
        assert packs and all(p.packed is not None for p in packs), arch
        assert not any("abc" in n or ".qkv." in n or "gate_up" in n for n in rt.net.state_dict())
        ids = _ids(12, seed=7)
        rt.prefill(ids)
        cap = rt.snapshot()
        on = [rt.decode(t) for t in (5, 9, 11)]
        for p in packs:
            p.views = (0,) * len(p.views)      # no member views the pack: each runs alone
        rt.restore(cap)
        off = [rt.decode(t) for t in (5, 9, 11)]
        assert all(torch.equal(a, b) for a, b in zip(on, off)), arch


@pytest.mark.parametrize("weights", ["float", "int8"])
def test_loaded_weights_sit_in_one_block(runtime, weights):
    """load_model gathers every weight (parameters, buffers, int8 scales, the packs' tensors)
    into one block; the members still view their pack, and moving the weights again changes
    no logit bit."""
    from flashrt.models.loader import gather_weights
    from flashrt.nn.linear import Int8Weight, LinearPack
    for arch in ARCHS:
        rt = runtime(arch, weights=weights)
        net, packs = rt.net, [m for m in rt.net.modules() if isinstance(m, LinearPack)]
        tensors = [*net.parameters(), *net.buffers(), *(t for p in packs if p.packed is not None
                                                       for t in p.tensors())]
        tensors += [t.scale for t in net.parameters() if isinstance(t, Int8Weight)]
        assert weights == "float" or any(isinstance(t, Int8Weight) for t in tensors), arch
        blocks = {t.untyped_storage().data_ptr() for t in tensors}
        assert len(blocks) == 1, (arch, len(blocks))
        for p in packs:
            if p.packed is not None:
                assert p.views == tuple(m.weight.data_ptr() for m in p.members), arch
        ids = _ids(12, seed=3)
        rt.prefill(ids)
        cap = rt.snapshot()
        before = [rt.decode(t) for t in (4, 8)]
        assert gather_weights(net) > 0
        assert {t.untyped_storage().data_ptr() for t in tensors} != blocks     # moved
        assert all(p.packed is None or p.views == tuple(m.weight.data_ptr() for m in p.members)
                   for p in packs), arch
        rt.restore(cap)
        assert all(torch.equal(a, b) for a, b in zip(before, [rt.decode(t) for t in (4, 8)])), arch


def test_zeroed_block_is_aligned_and_advised():
    """zeroed_block: zeroed and writable; on a Linux CPU from HUGE_PAGE up, HUGE_PAGE-aligned
    in a mapping the kernel may back with huge pages (THPeligible, where THP is not off)."""
    import mmap
    from flashrt.core.arena import HUGE_PAGE, zeroed_block
    small = zeroed_block(4096, torch.device("cpu"))
    assert small.shape == (4096,) and not small.any()
    big = zeroed_block(HUGE_PAGE + 12345, torch.device("cpu"))
    assert big.shape == (HUGE_PAGE + 12345,) and big.dtype == torch.uint8 and not big.any()
    big[-1] = 7
    assert int(big[-1]) == 7
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    assert big.data_ptr() % HUGE_PAGE == 0
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return
    if "[never]" in thp:
        return
    with open("/proc/self/smaps") as f:
        mine, eligible = False, None
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                mine = lo <= big.data_ptr() < hi
            elif mine and head == "THPeligible:":
                eligible = line.split()[1]
    assert eligible == "1"


@pytest.mark.skipif(not native.SMALL_M_LINEAR, reason="small-M kernel does not run here")
def test_widen_kernel_dispatch(monkeypatch):
    """WIDEN (bf16 where oneDNN has none; forced here, oneDNN float32 runs everywhere): 1..32
    rows on the small-M kernel (counted), more rows bitwise oneDNN's float32 product of the
    widened weight, rounded once; a bias is added before that rounding."""
    from flashrt.nn.linear import WIDEN, linear
    calls = []
    kernel = native.small_m_linear
    monkeypatch.setattr(native, "small_m_linear", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(40, 24, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16()
    for m in (1, 8, 9, 32, 33, 64):
        x = torch.randn(m, 24, generator=g).bfloat16()
        calls.clear()
        y = linear(x, w, b, kernel=WIDEN)
        assert calls == ([m] if m <= native.SMALL_M_MAX else []), m
        if m > native.SMALL_M_MAX:
            wide = torch.ops.mkldnn._linear_pointwise(x.float(), w.float(), None, "none", [], "")
            assert torch.equal(y, (wide + b).bfloat16())
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), x.float() @ w.float().T + b.float(), rtol=2 ** -7, atol=2 ** -6)
    x32, w32 = torch.randn(3, 24, generator=g), torch.randn(40, 24, generator=g)   # float32 layers
    assert torch.equal(linear(x32, w32, kernel=WIDEN), kernel(x32, w32))


@pytest.mark.parametrize("kernel", ["auto", "onednn", "aten"])
@pytest.mark.parametrize("arch", ARCHS)
def test_parity_teacher_forced(arch, kernel, ckpt, runtime):
    """Prompt (one prefill) + 32 single-token decodes vs transformers on the same 52 tokens,
    with the projections on the load-time choice (on CPU fp32: the small-M kernel for the
    20-token prompt, oneDNN for decodes), on oneDNN alone and on F.linear."""
    rt = runtime(arch, prefill_chunk=64, linear_kernel=kernel)
    ids = _ids(PROMPT + 32)
    ours = [rt.prefill(ids[:PROMPT], all_logits=True)]
    ours += [rt.decode(t)[None] for t in ids[PROMPT:]]
    ref = hf_logits(hf_reference(ckpt(arch)), ids)
    diff = (torch.cat(ours) - ref).abs().max().item()
    assert diff <= 1e-4, f"{arch}: max |logit diff| {diff:.3g} > 1e-4"


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_64_tokens_margin_rule(arch, ckpt, runtime):
    rt = runtime(arch)
    prompt = _ids(PROMPT, seed=1)
    toks = rt.generate(prompt, max_new_tokens=64, ignore_eos=True)
    assert len(toks) == 64 and rt.tokens == prompt + toks
    ref = hf_logits(hf_reference(ckpt(arch)), prompt + toks)
    bad, smallest_gap = margin_check(ref[PROMPT - 1: PROMPT - 1 + 64], toks)
    print(f"{arch}: smallest top-2 gap met {smallest_gap:.3g}")
    assert not bad, f"{arch}: greedy tokens differ where the reference is decisive: {bad}"


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_same_continuation(arch, runtime):
    ids = _ids(45, seed=2)
    one = runtime(arch, prefill_chunk=64)
    l_one = one.prefill(ids)
    many = runtime(arch, prefill_chunk=7)
    many.prefill(ids[:13])
    l_many = many.prefill(ids[13:])
    assert (l_one - l_many).abs().max() <= 1e-4
    # another path: the chunked run's greedy continuation, teacher-forced through the one-shot run
    toks = many.generate(max_new_tokens=16, ignore_eos=True)
    assert_greedy_matches(teacher_forced(one, l_one, toks), toks, what=arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_stale_bytes_never_read(arch, runtime):
    """NaN in every per-token row and io buffer of a fresh arena changes no bit of any result."""
    clean, dirty = runtime(arch, prefill_chunk=16), runtime(arch, prefill_chunk=16)
    a = dirty.arena
    for s in a.slots:
        t = a[s.name]
        if s.spec.seq_dim == 0 and t.is_floating_point():
            t.fill_(float("nan"))
        elif s.spec.kind in ("io", "scratch"):
            a.bytes_of(s.name).fill_(0xFF)
    ids = _ids(40, seed=3)
    assert torch.equal(clean.prefill(ids), dirty.prefill(ids))
    assert clean.generate(max_new_tokens=8) == dirty.generate(max_new_tokens=8)
    assert torch.equal(clean.decode(5), dirty.decode(5))


@pytest.mark.parametrize("arch", ARCHS)
def test_static_graph_body_matches_eager(arch, runtime):
    """The body a CUDA graph captures (device-side positions, full-capacity masked attention),
    run eagerly on CPU over NaN-filled stale rows, matches the eager path."""
    eager, static = runtime(arch), runtime(arch)
    a = static.arena
    for s in a.slots:
        if s.spec.seq_dim == 0 and a[s.name].is_floating_point():
            a[s.name].fill_(float("nan"))
    ids = _ids(30, seed=4)
    with torch.no_grad():
        for chunk in (ids[:16], ids[16:24], ids[24:25], ids[25:]):
            want = eager.prefill(chunk)
            graph_body_step(static, torch.tensor(chunk))
            got = a["meta.logits"]
            assert torch.isfinite(got).all()
            assert (got - want).abs().max() <= 1e-4
    assert int(a["meta.position"]) == 30 and static.tokens == ids


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_reproducible(arch, runtime):
    rt = runtime(arch)
    p = _ids(10, seed=5)
    a = rt.generate(p, max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    rt.reset()
    b = rt.generate(p, max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    rt.reset()
    c = rt.generate(p, max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=8)
    rt.reset()
    greedy = rt.generate(p, max_new_tokens=12)
    rt.reset()
    k1 = rt.generate(p, max_new_tokens=12, temperature=0.7, top_k=1, seed=3)
    assert a == b and a != c and k1 == greedy


def test_layout_table_and_fingerprint(runtime):
    rt, rt2 = runtime("qwen3"), runtime("qwen3", max_seq_len=64)
    table = rt.layout()
    for name in ("layers.0.attn.k", "meta.tokens", "sampler.rng", "io.ids"):
        assert name in table
    assert "capsule state: fixed" in table
    # capacity is not part of the layout identity; dtype is
    assert rt.arena.fingerprint() == rt2.arena.fingerprint()
    assert rt.arena.capsule_bytes(10) == rt.arena.fixed_state_bytes + 10 * rt.arena.per_token_bytes


def test_errors_name_the_problem(runtime, ckpt):
    rt = runtime("qwen3", max_seq_len=32)
    with pytest.raises(RuntimeError, match="before any prefill"):
        rt.decode(1)
    with pytest.raises(ValueError, match="empty"):
        rt.prefill([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rt.prefill([1, 2, 99999])
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        rt.prefill(list(range(33)))
    assert rt.position == 0            # refused input leaves the session untouched
    rt.prefill(list(range(32)))
    with pytest.raises(ValueError, match="max_seq_len 32 reached"):
        rt.decode(1)
    assert rt.generate(max_new_tokens=4) == [] and rt.finish_reason == "max_seq_len"
    with pytest.raises(ValueError, match="not supported on cpu"):
        flashrt.load(ckpt("qwen3"), dtype="float16")
    with pytest.raises(flashrt.ArenaError, match="exceeds free cpu memory"):
        flashrt.load(ckpt("qwen3"), max_seq_len=10**10)


def test_bad_checkpoints(ckpt, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    src = ckpt("qwen3")

    def variant(name, edit_cfg=None, edit_w=None):
        d = tmp_path / name
        shutil.copytree(src, d)
        if edit_cfg:
            cfg = json.loads((d / "config.json").read_text())
            edit_cfg(cfg)
            (d / "config.json").write_text(json.dumps(cfg))
        if edit_w:
            w = load_file(d / "model.safetensors")
            edit_w(w)
            save_file(w, d / "model.safetensors", metadata={"format": "pt"})
        return d

    with pytest.raises(flashrt.ConfigError, match="model_type 'llama4'"):
        flashrt.load(variant("arch", lambda c: c.update(model_type="llama4")))
    with pytest.raises(flashrt.ConfigError, match="hidden_act"):
        flashrt.load(variant("act", lambda c: c.update(hidden_act="gelu")))
    with pytest.raises(flashrt.WeightError, match=r"missing weight.*layers.1.mlp.up_proj.weight"):
        flashrt.load(variant("missing", edit_w=lambda w: w.pop("model.layers.1.mlp.up_proj.weight")))
    with pytest.raises(flashrt.WeightError, match=r"model.norm.weight.*shape \(3,\)"):
        flashrt.load(variant("shape", edit_w=lambda w: w.update({"model.norm.weight": torch.ones(3)})))
    with pytest.raises(flashrt.WeightError, match="unexpected weight 'model.extra.weight'"):
        flashrt.load(variant("extra", edit_w=lambda w: w.update({"model.extra.weight": torch.ones(3)})))


def test_byte_tokenizer_round_trip(runtime):
    rt = runtime("qwen3")
    tok = rt.tokenizer
    assert tok.kind == "bytes"
    text = "héllo, flashrt"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([104, 300, 105]) == "h<300>i"


# bf16 bound, relative to max |logit|, against transformers run in bf16 on the same weights.
# Qwen3.5 is looser: its recurrent state stays fp32 here while transformers rounds parts of the
# delta rule to bf16, and both differ from fp32 by ~30% on this random tiny model.
BF16_REL = {"qwen3": 0.02, "lfm2": 0.04, "qwen3_5": 0.1}


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_parity(arch, ckpt, runtime):
    rt = runtime(arch, dtype="bfloat16")
    ids = _ids(PROMPT + 16, seed=6)
    ours = torch.cat([rt.prefill(ids[:PROMPT], all_logits=True)] + [rt.decode(t)[None] for t in ids[PROMPT:]])
    ref_model = hf_reference(ckpt(arch), torch.bfloat16)
    ref = hf_logits(ref_model, ids)
    scale = ref.abs().max().item()
    rel = (ours - ref).abs().max().item() / scale
    assert rel <= BF16_REL[arch], f"{arch} bf16: relative logit diff {rel:.3g} > {BF16_REL[arch]}"
    # greedy identity where the gap is more than twice the error bound can move a logit; 200
    # tokens, so that even Qwen3.5's loose bound leaves enough decisive positions (18 here;
    # 32 tokens gave it 2) and at least 10 must be
    rt.reset()
    n = 200
    toks = rt.generate(ids[:PROMPT], max_new_tokens=n, ignore_eos=True)
    ref = hf_logits(ref_model, ids[:PROMPT] + toks)[PROMPT - 1: PROMPT - 1 + n]
    margin = 2 * BF16_REL[arch] * scale
    bad, _ = margin_check(ref, toks, margin=margin)
    assert not bad, f"{arch} bf16: greedy differs where the reference is decisive: {bad}"
    top2 = ref.topk(2, dim=-1).values
    decisive = int((top2[:, 0] - top2[:, 1] > margin).sum())
    assert len(toks) == n and decisive >= 10, f"{arch} bf16: only {decisive}/{n} decisive positions"


def test_linear_kernel_selection(runtime):
    from flashrt.nn.linear import WIDEN, Linear
    rt = runtime("qwen3", linear_kernel="aten")
    kernels = {m.kernel for m in rt.net.modules() if isinstance(m, Linear)}
    assert kernels == {"aten"} and rt.net.linear_kernel == "aten" == rt.model.linear_kernel
    assert rt.snapshot().meta.provenance["linear"] == "aten"
    auto = runtime("qwen3")
    want = ("aten" if not torch.backends.mkldnn.is_available() else
            "flashrt" if native.SMALL_M_LINEAR else "onednn")
    assert {m.kernel for m in auto.net.modules() if isinstance(m, Linear)} == {want}
    with pytest.raises(ValueError, match="linear kernel 'fast'"):
        runtime("qwen3", linear_kernel="fast")
    if native.SMALL_M_LINEAR and want == "flashrt":   # bf16 weights: oneDNN's bf16 or widened weights
        bf = runtime("qwen3", dtype="bfloat16")
        want_bf = "flashrt" if _onednn_runs_bf16() else WIDEN
        assert {m.kernel for m in bf.net.modules() if isinstance(m, Linear)} == {want_bf}
        assert runtime("qwen3", dtype="bfloat16", linear_kernel="flashrt").net.linear_kernel == want_bf
        if want_bf == WIDEN:
            with pytest.raises(ValueError, match="linear kernel 'onednn' unavailable: oneDNN refused"):
                runtime("qwen3", dtype="bfloat16", linear_kernel="onednn")
    # a capsule records the kernel as provenance only: it restores across kernels
    ids = _ids(20, seed=5)
    rt.prefill(ids)
    auto.restore(rt.snapshot())
    assert auto.tokens == ids


def test_loaded_weights_do_not_follow_the_checkpoint_file(tmp_path):
    """The model owns its weights: the checkpoint rewritten in place after load (float32 on disk
    and in the model, where safetensors hands out views of the mapped file) changes nothing the
    model computes."""
    import struct

    from flashrt.lm import load
    from flashrt.models.checkpoint import make_checkpoint
    d = make_checkpoint("qwen3", "tiny", tmp_path, dtype="float32")
    rt = load(d, dtype="float32", max_seq_len=64)
    ids = list(range(3, 19))
    before = rt.prefill(ids, all_logits=True)
    f = d / "model.safetensors"
    header = struct.unpack("<Q", f.read_bytes()[:8])[0]
    with open(f, "r+b") as fh:                  # every tensor byte zeroed, in place
        fh.seek(8 + header)
        fh.write(bytes(f.stat().st_size - 8 - header))
    rt.reset()
    assert torch.equal(rt.prefill(ids, all_logits=True), before)

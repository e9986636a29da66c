"""Qwen3.5-specific checks: both checkpoint layouts vs transformers, GDN math, MTP, configs.

The generic parity/chunking/static-body checks for every arch live in test_models.py.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

import flashrt
from conftest import assert_greedy_matches, hf_cached_step, hf_logits, hf_reference, teacher_forced
from flashrt.core.step import StepCtx
from flashrt.nn.linear_attn import (causal_conv, chunk_gated_delta_rule, fast_kernels,
                                 recurrent_gated_delta_rule)
from flashrt.models import qwen3_5 as q35

ARCH, PROMPT, DECODE = "qwen3_5", 20, 32


def _ids(n, seed=0, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _config(ckpt, **text_edits):
    cfg = json.loads((ckpt(ARCH) / "config.json").read_text())
    cfg["text_config"].update(text_edits)
    return cfg


# ---- parity with transformers --------------------------------------------------------------
@pytest.mark.parametrize("layout", ["multimodal", "text"])
def test_parity_both_layouts(layout, ckpt, runtime):
    """20-token prefill (all logits) + 32 decodes vs transformers, teacher-forced.

    One-shot transformers runs its chunked rule over all 52 tokens while we decode with the
    recurrent rule; those two fp32 orderings differ by ~3e-5 inside transformers itself, so the
    1e-4 bound holds against the one-shot reference and a 2e-5 bound against transformers'
    own cached decode (same rule per step as ours; bmm vs sum reduction order).
    """
    kw = {"layout": "text"} if layout == "text" else {}     # multimodal is the default layout
    path = ckpt(ARCH, **kw)
    # F.linear, transformers' own matmul: the 2e-5 bound compares the recurrent rules alone
    # (other projection kernels sum in other orders; test_models checks them at 1e-4)
    rt = runtime(ARCH, ckpt_kw=kw, prefill_chunk=64, linear_kernel="aten")
    ids = _ids(PROMPT + DECODE)
    ours = torch.cat([rt.prefill(ids[:PROMPT], all_logits=True)] + [rt.decode(t)[None] for t in ids[PROMPT:]])
    model = hf_reference(path)
    expect = "Qwen3_5ForConditionalGeneration" if layout == "multimodal" else "Qwen3_5ForCausalLM"
    assert type(model).__name__ == expect
    one_shot = hf_logits(model, ids)
    diff = (ours - one_shot).abs().max().item()
    print(f"{layout}: max |logit diff| vs one-shot transformers {diff:.3g}")
    assert diff <= 1e-4
    logits, cache = hf_cached_step(model, ids[:PROMPT])      # transformers' own incremental decode
    steps = [logits]
    for t in ids[PROMPT:]:
        logits, cache = hf_cached_step(model, [t], cache)
        steps.append(logits)
    inc = (ours - torch.cat(steps).float()).abs().max().item()
    print(f"{layout}: max |logit diff| vs transformers' cached decode {inc:.3g}")
    assert inc <= 2e-5


def test_parity_multi_chunk_prefill(ckpt, runtime):
    """A 150-token prefill runs 3 inner 64-token chunks of the delta rule (and one 150-row conv)."""
    rt = runtime(ARCH, prefill_chunk=256)
    ids = _ids(150, seed=7)
    ours = rt.prefill(ids, all_logits=True)
    ref = hf_logits(hf_reference(ckpt(ARCH)), ids)
    assert (ours - ref).abs().max().item() <= 1e-4


# ---- chunking ------------------------------------------------------------------------------
def test_chunked_prefill_matches_one_shot(runtime):
    ids = _ids(40, seed=2)
    one = runtime(ARCH, prefill_chunk=64)
    l_one = one.prefill(ids, all_logits=True)
    small = runtime(ARCH, prefill_chunk=7)
    l_small = small.prefill(ids, all_logits=True)
    split = runtime(ARCH, prefill_chunk=64)
    l_split = torch.cat([split.prefill(ids[:13], all_logits=True), split.prefill(ids[13:], all_logits=True)])
    assert (l_one - l_small).abs().max() <= 1e-4 and (l_one - l_split).abs().max() <= 1e-4
    for name in one.arena.names(("recurrent", "conv")):
        if name == "mtp.hidden":       # the last hidden state: compared through the logits
            continue
        assert (one.arena[name] - small.arena[name]).abs().max() <= 5e-5, name
        assert (one.arena[name] - split.arena[name]).abs().max() <= 5e-5, name
    # each split's greedy continuation, teacher-forced through the one-shot run (restored to
    # the end of the prompt for each): the same tokens wherever one-shot is decisive
    at_prompt = one.snapshot()
    for name, rt in (("chunk 7", small), ("13 + 27", split)):
        toks = rt.generate(max_new_tokens=16, ignore_eos=True)
        one.restore(at_prompt)
        assert_greedy_matches(teacher_forced(one, l_one[-1], toks), toks, what=name)


# ---- GDN math against transformers' reference functions ---------------------------------------
def _hf_rule(rule, q, k, v, g, beta, s0):
    """transformers' rule on one sequence; q, k repeated to the value heads first, as its layer
    does (transformers >= 5.2x also repeats inside the rule; 5.17 expects it done)."""
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    o, s = rule(q[None], k[None], v[None], g[None], beta[None], initial_state=s0[None],
                output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0], s[0]


def test_delta_rules_match_transformers():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    gen = torch.Generator().manual_seed(0)
    T, Hk, Hv, Dk, Dv = 150, 2, 4, 16, 8
    q, k = torch.randn(T, Hk, Dk, generator=gen), torch.randn(T, Hk, Dk, generator=gen)
    v = torch.randn(T, Hv, Dv, generator=gen)
    g = -torch.rand(T, Hv, generator=gen)
    beta = torch.rand(T, Hv, generator=gen)
    s0 = torch.randn(Hv, Dk, Dv, generator=gen)
    ref_o, ref_s = _hf_rule(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, s0)
    s = s0.clone()
    o = chunk_gated_delta_rule(q, k, v, g, beta, s)
    assert (o - ref_o).abs().max() <= 1e-5 and (s - ref_s).abs().max() <= 1e-5
    ref_o, ref_s = _hf_rule(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, s0)
    s = s0.clone()
    o = recurrent_gated_delta_rule(q, k, v, g, beta, s)
    assert (o - ref_o).abs().max() <= 1e-5 and (s - ref_s).abs().max() <= 1e-5
    # chunked over two calls (70 + 80) == one call: the state carries everything
    s = s0.clone()
    o2 = torch.cat([chunk_gated_delta_rule(q[:70], k[:70], v[:70], g[:70], beta[:70], s),
                    chunk_gated_delta_rule(q[70:], k[70:], v[70:], g[70:], beta[70:], s)])
    assert (o2 - ref_o).abs().max() <= 1e-4 and (s - ref_s).abs().max() <= 1e-4


@pytest.mark.parametrize("T", [1, 2, 5, 16, 63])
def test_short_steps_are_one_chunk_of_their_own_length(T):
    """A step shorter than the 64-token chunk runs as one unpadded chunk: same outputs and state
    as transformers' padded chunk rule (and its recurrent rule) within fp32 rounding."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    gen = torch.Generator().manual_seed(T)
    Hk, Hv, Dk, Dv = 2, 4, 16, 8
    q, k = torch.randn(T, Hk, Dk, generator=gen), torch.randn(T, Hk, Dk, generator=gen)
    v = torch.randn(T, Hv, Dv, generator=gen)
    g, beta = -torch.rand(T, Hv, generator=gen), torch.rand(T, Hv, generator=gen)
    s0 = torch.randn(Hv, Dk, Dv, generator=gen)
    s = s0.clone()
    o = chunk_gated_delta_rule(q, k, v, g, beta, s)
    for ref in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        ref_o, ref_s = _hf_rule(ref, q, k, v, g, beta, s0)
        assert (o - ref_o).abs().max() <= 1e-5 and (s - ref_s).abs().max() <= 1e-5


def test_causal_conv_state_and_chunks():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    gen = torch.Generator().manual_seed(1)
    T, C, K = 11, 24, 4
    x, w = torch.randn(T, C, generator=gen), torch.randn(C, K, generator=gen)
    ref = hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    state = torch.zeros(C, K - 1)
    parts = [causal_conv(x[a:b], state, w) for a, b in ((0, 2), (2, 3), (3, 11))]  # 2 < K-1 too
    assert (torch.cat(parts) - ref).abs().max() <= 1e-6
    assert torch.equal(state, x[-(K - 1):].t())         # last K-1 inputs, oldest first


# ---- MTP -----------------------------------------------------------------------------------
def _zc_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _mtp_reference(net, tokens, hidden, positions):
    """Plain torch, no cache, full causal attention: the MTP head from its weights alone."""
    c, sd = net.config, {k: v.float() for k, v in net.state_dict().items() if k.startswith("mtp.")}
    eps, E = c.rms_norm_eps, net.embed_tokens.weight
    H, KV, D, R = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rot_dim
    x = torch.cat([_zc_norm(E[tokens], sd["mtp.pre_fc_norm_embedding.weight"], eps),
                   _zc_norm(hidden, sd["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ sd["mtp.fc.weight"].T
    p = "mtp.layers.0."
    h = _zc_norm(x, sd[p + "input_layernorm.weight"], eps)
    T = h.shape[0]
    qg = (h @ sd[p + "self_attn.q_proj.weight"].T).view(T, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
    q = _zc_norm(q, sd[p + "self_attn.q_norm.weight"], eps)
    k = _zc_norm((h @ sd[p + "self_attn.k_proj.weight"].T).view(T, KV, D), sd[p + "self_attn.k_norm.weight"], eps)
    v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(T, KV, D)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, R, 2).float() / R))
    ang = positions[:, None].float() * inv                          # (T, R/2)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def rope(t):
        a, b, rest = t[..., :R // 2], t[..., R // 2:R], t[..., R:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)
    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
    s = torch.einsum("thd,shd->hts", q, k) / D ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, H * D) * torch.sigmoid(gate)
    x = x + o @ sd[p + "self_attn.o_proj.weight"].T
    h = _zc_norm(x, sd[p + "post_attention_layernorm.weight"], eps)
    x = x + (F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)) \
        @ sd[p + "mlp.down_proj.weight"].T
    return _zc_norm(x, sd["mtp.norm.weight"], eps) @ E.T


def test_mtp_matches_reference_and_incremental(runtime):
    rt = runtime(ARCH)
    net, a = rt.net, rt.arena
    assert net.has_mtp
    ids = torch.tensor(_ids(12, seed=3))
    n = len(ids)
    with torch.no_grad():
        hidden = net.hidden(net.embed(ids), StepCtx(n, torch.arange(n), start=0), a, all_positions=True)
        assert torch.equal(a["mtp.hidden"], hidden[-1])       # post-final-norm last hidden state
        # pairs (hidden at p, token at p+1) at MTP positions p = 0 .. n-2
        toks, hid, pos = ids[1:], hidden[:-1], torch.arange(n - 1)
        ref = _mtp_reference(net, toks, hid, pos)
        one = net.draft(toks, hid, StepCtx(n - 1, pos, start=0), a)[0]
        assert (one - ref).abs().max() <= 1e-5
        a["mtp.attn.k"].fill_(float("nan"))                   # incremental rebuilds every row
        a["mtp.attn.v"].fill_(float("nan"))
        inc = torch.cat([net.draft(toks[p:p + 1], hid[p:p + 1], StepCtx(1, pos[p:p + 1], start=p), a)[0]
                         for p in range(n - 1)])
        assert (inc - one).abs().max() <= 1e-5
        # graph-safe body (device positions, full-capacity attention) agrees too
        static = net.draft(toks[-3:], hid[-3:], StepCtx(3, pos[-3:], static=True), a)[0]
        assert (static - one[-3:]).abs().max() <= 1e-5


def test_checkpoint_without_mtp_loads_and_warns(ckpt):
    with pytest.warns(UserWarning, match="no MTP weights; MTP disabled"):
        rt = flashrt.load(ckpt(ARCH, mtp=False), dtype="float32", max_seq_len=64)
    assert not rt.net.has_mtp and not hasattr(rt.net, "mtp")
    assert not [n for n in rt.arena.names() if n.startswith("mtp.")]
    with_mtp = flashrt.load(ckpt(ARCH), dtype="float32", max_seq_len=64)
    assert {"mtp.attn.k", "mtp.attn.v"} <= set(with_mtp.arena.names(("kv",)))   # ordinary kinds
    assert "mtp.hidden" in with_mtp.arena.names(("recurrent",))
    ids = _ids(10, seed=4)
    assert torch.equal(rt.prefill(ids), with_mtp.prefill(ids))   # same main weights (same seed)


# ---- dtype, weights, configs ------------------------------------------------------------------
def test_bf16_keeps_fp32_state_and_params(runtime):
    rt = runtime(ARCH, dtype="bfloat16")
    gdn = rt.net.layers[0].linear_attn
    assert gdn.A_log.dtype == gdn.dt_bias.dtype == torch.float32
    assert gdn.in_proj_qkv.weight.dtype == torch.bfloat16
    assert rt.arena["layers.0.gdn.recurrent"].dtype == torch.float32
    assert rt.arena["layers.0.gdn.conv"].dtype == torch.bfloat16
    ids = _ids(30, seed=5)
    ref = runtime(ARCH).prefill(ids)
    got = rt.prefill(ids)
    # bf16 against fp32 on the same weights: measured 0.032 of max |logit| (a bf16-only slip in
    # the gate, e.g. dt_bias dropped, gives 0.22)
    assert torch.isfinite(got).all() and (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_weight_names(runtime):
    net = runtime(ARCH).net
    assert net.map_weight_name("model.visual.blocks.0.attn.qkv.weight") is None
    assert net.map_weight_name("model.language_model.layers.0.linear_attn.A_log") == "layers.0.linear_attn.A_log"
    assert net.map_weight_name("model.layers.3.self_attn.q_proj.weight") == "layers.3.self_attn.q_proj.weight"
    assert net.map_weight_name("lm_head.weight") is None                # tied
    assert net.map_weight_name("mtp.fc.weight") == "mtp.fc.weight"


def test_ungated_attention_variant(ckpt):
    """attn_output_gate=False: q_proj is h*d wide and no gate; checked against the gated layer
    with zero gate rows (sigmoid 0 = 1/2) and a doubled o_proj."""
    gated = q35.Qwen3_5Config.from_hf(_config(ckpt))
    plain = q35.Qwen3_5Config.from_hf(_config(ckpt, attn_output_gate=False))
    g = torch.Generator().manual_seed(0)
    ga, pa = q35.Attention(gated, "x"), q35.Attention(plain, "x")
    for m in (ga, pa):
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.2, generator=g)
    H, D = gated.num_attention_heads, gated.head_dim
    assert pa.q_proj.weight.shape[0] == H * D and ga.q_proj.weight.shape[0] == 2 * H * D
    with torch.no_grad():
        w = ga.q_proj.weight.view(H, 2, D, -1)
        w[:, 0] = pa.q_proj.weight.view(H, D, -1)
        w[:, 1] = 0
        for n in ("k_proj", "v_proj", "q_norm", "k_norm"):
            getattr(ga, n).weight.copy_(getattr(pa, n).weight)
        ga.o_proj.weight.copy_(2 * pa.o_proj.weight)
    T = 5
    x, pos = torch.randn(T, gated.hidden_size, generator=g), torch.arange(T)
    rot = q35.Rotary(gated.rot_dim, gated.rope_theta)
    cos, sin = rot(pos, x.dtype)

    def run(m):
        st = {"x.k": torch.zeros(8, gated.num_key_value_heads, D), "x.v": torch.zeros(8, gated.num_key_value_heads, D)}
        return m(x, StepCtx(T, pos, start=0), st, cos, sin)
    with torch.no_grad():
        assert (run(ga) - run(pa)).abs().max() <= 1e-5


@pytest.mark.parametrize("edit, field", [
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     "layer_types"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"linear_num_key_heads": 3, "linear_num_value_heads": 4}, "linear_num_value_heads"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
])
def test_config_errors_name_the_field(ckpt, edit, field):
    with pytest.raises(flashrt.ConfigError, match=field):
        q35.Qwen3_5Config.from_hf(_config(ckpt, **edit))


def test_config_error_through_load(ckpt, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(ckpt(ARCH), d)
    cfg = _config(ckpt, layer_types=["linear_attention"] * 3 + ["moe_attention"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(flashrt.ConfigError, match="layer_types.*moe_attention"):
        flashrt.load(d, dtype="float32", max_seq_len=32)


def test_text_config_and_wrapper_read_alike(ckpt):
    wrapper = json.loads((ckpt(ARCH) / "config.json").read_text())
    text = json.loads((ckpt(ARCH, layout="text") / "config.json").read_text())
    assert text["model_type"] == "qwen3_5_text" and wrapper["model_type"] == "qwen3_5"
    assert q35.Qwen3_5Config.from_hf(wrapper) == q35.Qwen3_5Config.from_hf(text)


# ---- optional CUDA kernels -------------------------------------------------------------------
_fla, _conv = fast_kernels()


@pytest.mark.skipif(not torch.cuda.is_available() or _fla is None or _conv is None,
                    reason="needs CUDA with flash-linear-attention and causal-conv1d")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_torch(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, tol = "cuda", (2e-3 if dtype == torch.float32 else 3e-2)
    T, Hk, Hv, Dk, Dv, C, K = 100, 2, 4, 64, 64, 256, 4

    def r(*s):
        return torch.randn(*s, generator=gen, device=dev)
    q, k, v = r(T, Hk, Dk).to(dtype), r(T, Hk, Dk).to(dtype), r(T, Hv, Dv).to(dtype)
    g, beta = -torch.rand(T, Hv, generator=gen, device=dev), torch.rand(T, Hv, generator=gen, device=dev).to(dtype)
    s0 = r(Hv, Dk, Dv) * 0.1
    for rule, n in ((chunk_gated_delta_rule, T), (recurrent_gated_delta_rule, 1)):
        sa, sb = s0.clone(), s0.clone()
        oa = rule(q[:n], k[:n], v[:n], g[:n], beta[:n], sa, fast=False)
        ob = rule(q[:n], k[:n], v[:n], g[:n], beta[:n], sb, fast=True)
        assert (oa.float() - ob.float()).abs().max() <= tol * max(1.0, oa.abs().max().item())
        assert (sa - sb).abs().max() <= tol * max(1.0, sa.abs().max().item())
    x, w = r(T, C).to(dtype), r(C, K).to(dtype)
    sa, sb = torch.zeros(C, K - 1, device=dev, dtype=dtype), torch.zeros(C, K - 1, device=dev, dtype=dtype)
    for a, b in ((0, 37), (37, 38), (38, T)):                   # prefill, one decode, prefill
        oa, ob = causal_conv(x[a:b], sa, w, fast=False), causal_conv(x[a:b], sb, w, fast=True)
        assert (oa.float() - ob.float()).abs().max() <= tol * 10
        assert torch.equal(sa, sb)

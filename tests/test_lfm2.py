"""LFM2-specific tests: conv-state semantics, config parsing, parity on non-default variants.

Generic checks (stale rows, graph body, sampling) for every arch live in tests/test_models.py.
"""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

import flashrt
from flashrt.lm import graph_body_step
from conftest import assert_greedy_matches, hf_logits, hf_reference, margin_check, teacher_forced
from flashrt.models.lfm2 import Lfm2Config, effective_ff_dim

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "flashrt" / "models" / "configs"
PROMPT, TOL = 20, 1e-4


def _ids(n, vocab=512, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _real_cfg() -> dict:
    return json.loads((CONFIGS / "lfm2-350m.json").read_text())


# ---- parity with transformers (fp32, tiny checkpoint) -----------------------------------------
def test_parity_prefill_then_decode(ckpt, runtime):
    """20-token prefill (all logits) + 32 greedy decodes vs teacher-forced transformers."""
    rt = runtime("lfm2", prefill_chunk=64)
    ids = _ids(PROMPT)
    ours = [rt.prefill(ids, all_logits=True)]
    for _ in range(32):
        tok = int(ours[-1][-1].argmax())
        ids.append(tok)
        ours.append(rt.decode(tok)[None])
    ours = torch.cat(ours)                             # (52, V): row i = logits after ids[i]
    ref = hf_logits(hf_reference(ckpt("lfm2")), ids)
    diff = (ours - ref).abs().max(dim=-1).values       # per position
    assert ours.shape == ref.shape and diff.max() <= TOL, f"max |logit diff| {diff.max():.3g}"


def test_greedy_64_tokens(ckpt, runtime):
    rt = runtime("lfm2")
    prompt = _ids(PROMPT, seed=2)                      # a prompt whose continuation hits no EOS
    toks = rt.generate(prompt, max_new_tokens=64)
    assert len(toks) == 64 and rt.finish_reason == "length" and rt.tokens == prompt + toks
    ref = hf_logits(hf_reference(ckpt("lfm2")), prompt + toks)
    bad, gap = margin_check(ref[PROMPT - 1: PROMPT - 1 + 64], toks)
    assert not bad, f"greedy tokens differ where the reference is decisive: {bad} (min gap {gap:.3g})"


# ---- conv state: chunking, buffers ----------------------------------------------------------
def _conv_states(rt):
    return {n: rt.arena[n].clone() for n in rt.arena.names(("conv",))}


def test_chunked_prefill_matches_one_shot(runtime):
    """chunk 64 (one step) == chunk 7 == chunk 1 (T < L_cache-1) == two calls 13 + 27."""
    ids = _ids(40, seed=3)
    one = runtime("lfm2", prefill_chunk=64)
    ref = one.prefill(ids, all_logits=True)
    runs = {}
    for name, chunk, split in (("chunk7", 7, None), ("chunk1", 1, None), ("13+27", 64, 13)):
        rt = runtime("lfm2", prefill_chunk=chunk)
        parts = [ids] if split is None else [ids[:split], ids[split:]]
        got = torch.cat([rt.prefill(p, all_logits=True) for p in parts])
        assert (got - ref).abs().max() <= TOL, name
        for n, s in _conv_states(one).items():
            assert torch.allclose(rt.arena[n], s, atol=1e-6), f"{name}: {n}"
        runs[name] = rt
    # each split's greedy continuation, teacher-forced through the one-shot run (restored to
    # the end of the prompt for each): the same tokens wherever one-shot is decisive
    at_prompt = one.snapshot()
    for name, rt in runs.items():
        toks = rt.generate(max_new_tokens=32, ignore_eos=True)
        one.restore(at_prompt)
        assert_greedy_matches(teacher_forced(one, ref[-1], toks), toks, what=name)


def test_state_buffers(runtime):
    """Conv layers: one (L_cache-1, hidden) conv buffer and no KV; attention layers: K/V only."""
    rt = runtime("lfm2", max_seq_len=64)
    c, a = rt.net.config, rt.arena
    for i, kind in enumerate(c.layer_types):
        conv, k, v = f"layers.{i}.conv.state", f"layers.{i}.attn.k", f"layers.{i}.attn.v"
        if kind == "conv":
            assert conv in a and k not in a and v not in a
            s = a.slot(conv).spec
            assert (s.kind, s.shape, s.seq_dim) == ("conv", (c.conv_L_cache - 1, c.hidden_size), None)
        else:
            assert conv not in a
            for n in (k, v):
                s = a.slot(n).spec
                assert (s.kind, s.shape, s.seq_dim) == (
                    "kv", (64, c.num_key_value_heads, c.head_dim), 0)
    assert a.names(("recurrent", "mtp")) == []
    # the state is the last L-1 conv inputs: nonzero after a prefill, zero again after reset
    rt.prefill(_ids(9))
    assert all(s.abs().sum() > 0 for s in _conv_states(rt).values())
    rt.reset()
    assert all(s.abs().sum() == 0 for s in _conv_states(rt).values())


def test_bfloat16_close_to_fp32(runtime):
    ids = _ids(40, seed=4)
    ref = runtime("lfm2").prefill(ids, all_logits=True)
    got = runtime("lfm2", dtype="bfloat16").prefill(ids, all_logits=True)
    assert torch.isfinite(got).all() and (got - ref).abs().max() < 0.3
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


# ---- config ---------------------------------------------------------------------------------
def test_real_config():
    c = Lfm2Config.from_hf(_real_cfg())
    assert c.intermediate_size == 4608                 # int(2*6656/3) -> 4437 -> up to 256s
    assert c.layer_types == tuple("full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv"
                                  for i in range(16))
    assert (c.head_dim, c.rope_theta, c.tie_word_embeddings, c.conv_L_cache) == (64, 1e6, True, 3)


@pytest.mark.parametrize("ff,mult,multiple_of,auto", [
    (6656, 1.0, 256, True), (192, 1.0, 32, True), (200, 1.5, 16, True), (1000, 0.7, 64, True),
    (300, 1.0, 256, False)])
def test_ff_width_matches_transformers(ff, mult, multiple_of, auto):
    import transformers as tf
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP
    hf = tf.Lfm2Config(hidden_size=8, intermediate_size=ff, block_ffn_dim_multiplier=mult,
                       block_multiple_of=multiple_of, block_auto_adjust_ff_dim=auto)
    ours = Lfm2Config.from_hf(dict(_real_cfg(), block_ff_dim=ff, block_ffn_dim_multiplier=mult,
                                   block_multiple_of=multiple_of, block_auto_adjust_ff_dim=auto))
    assert ours.intermediate_size == Lfm2MLP(hf).w1.out_features
    assert effective_ff_dim(ff, auto, mult, multiple_of) == ours.intermediate_size


def test_layer_types_preferred_over_full_attn_idxs():
    types = ["conv", "full_attention"] * 8
    c = Lfm2Config.from_hf(dict(_real_cfg(), layer_types=types))
    assert c.layer_types == tuple(types)
    cfg = _real_cfg()
    del cfg["full_attn_idxs"]                          # neither: every layer attends (transformers)
    assert set(Lfm2Config.from_hf(cfg).layer_types) == {"full_attention"}


@pytest.mark.parametrize("edit,field", [
    (dict(layer_types=["conv"] * 15 + ["sliding_attention"]), "layer_types"),
    (dict(layer_types=["conv"] * 3), "layer_types"),
    (dict(full_attn_idxs=[2, 16]), "full_attn_idxs"),
    (dict(num_key_value_heads=5), "num_key_value_heads"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}), "rope_parameters"),
    (dict(block_use_swiglu=False), "block_use_swiglu"),
    (dict(conv_dim=512), "conv_dim"),
    (dict(conv_L_cache=0), "conv_L_cache"),
])
def test_config_errors_name_the_field(edit, field):
    with pytest.raises(flashrt.ConfigError, match=field):
        Lfm2Config.from_hf(dict(_real_cfg(), **edit))


def test_unsupported_layer_type_refused_at_load(ckpt, tmp_path):
    import shutil
    d = tmp_path / "bad"
    shutil.copytree(ckpt("lfm2"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["layer_types"][0] = "mamba"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(flashrt.ConfigError, match="layer_types.*mamba"):
        flashrt.load(d)


# ---- parity on non-default variants ---------------------------------------------------------
def _variant_checkpoint(out: pathlib.Path, L: int) -> pathlib.Path:
    """conv biases, untied head, attention first, MQA, rope theta 5000, multiplier 1.5."""
    import transformers as tf
    cfg = tf.Lfm2Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, intermediate_size=200, block_multiple_of=16,
        block_ffn_dim_multiplier=1.5, layer_types=["full_attention", "conv", "conv", "full_attention"],
        conv_L_cache=L, conv_bias=True, tie_word_embeddings=False, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(L)
        model = tf.Lfm2ForCausalLM(cfg).eval()
        for n, p in model.named_parameters():         # biases start at 0, norms at 1: perturb
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("L", [1, 2, 4])
def test_variant_parity_eager_and_static(L, tmp_path):
    d = _variant_checkpoint(tmp_path / f"L{L}", L)
    ids = _ids(40, seed=5)
    ref = hf_logits(hf_reference(d), ids)
    rt = flashrt.load(d, dtype="float32", max_seq_len=64, prefill_chunk=7)
    assert rt.net.config.intermediate_size == 208 and not rt.net.config.tie_word_embeddings
    ours = [rt.prefill(ids[:PROMPT], all_logits=True)] + [rt.decode(t)[None] for t in ids[PROMPT:]]
    ours = torch.cat(ours)
    assert (ours - ref).abs().max() <= TOL
    # the graph-captured body (device positions, fixed T), run eagerly on CPU
    st = flashrt.load(d, dtype="float32", max_seq_len=64, prefill_chunk=16)
    pos = 0
    with torch.no_grad():
        for n in (16, 3, 1, 1, 8, 11):
            graph_body_step(st, torch.tensor(ids[pos: pos + n]))
            pos += n
            assert (st.arena["meta.logits"] - ref[pos - 1]).abs().max() <= TOL, pos

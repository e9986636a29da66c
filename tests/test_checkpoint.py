"""Tests for the random-weight checkpoint maker (tiny sizes only: fast)."""
import importlib.util
import json
import pathlib

import pytest
import torch
from safetensors import safe_open

try:
    from flashrt.models import checkpoint as ck
except ImportError:  # before packaging: load the module straight from the repo
    _path = pathlib.Path(__file__).resolve().parents[1] / "flashrt" / "models" / "checkpoint.py"
    _spec = importlib.util.spec_from_file_location("flashrt_models_checkpoint", _path)
    ck = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(ck)
make_checkpoint = ck.make_checkpoint

import transformers as tf  # noqa: E402

SHARED = ck.CONFIG_DIR
CASES = [("qwen3", None), ("qwen3_5", "multimodal"), ("qwen3_5", "text"), ("lfm2", None)]
CLASSES = {("qwen3", None): tf.Qwen3ForCausalLM, ("lfm2", None): tf.Lfm2ForCausalLM,
           ("qwen3_5", "multimodal"): tf.Qwen3_5ForConditionalGeneration,
           ("qwen3_5", "text"): tf.Qwen3_5ForCausalLM}
MTP_LAYER = ["input_layernorm", "post_attention_layernorm"] + \
    [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")] + \
    [f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]


def _tensors(d: pathlib.Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One tiny checkpoint per (arch, layout), shared by the tests below."""
    root = tmp_path_factory.mktemp("ck")
    return {c: make_checkpoint(c[0], "tiny", root / f"{c[0]}-{c[1]}", layout=c[1]) for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_tiny_loads_in_transformers(built, case):
    d = built[case]
    for f in ("config.json", "model.safetensors", "generation_config.json", "flashrt_checkpoint.json"):
        assert (d / f).is_file(), f
    cfg = tf.AutoConfig.from_pretrained(d)
    text = cfg.get_text_config()
    assert (text.hidden_size, text.vocab_size, text.num_attention_heads) == (64, 512, 4)
    assert text.num_hidden_layers == {"qwen3": 2, "qwen3_5": 4, "lfm2": 4}[case[0]]
    gen = json.loads((d / "generation_config.json").read_text())
    assert {"bos_token_id", "eos_token_id"} <= gen.keys() and gen["eos_token_id"] < 512
    meta = json.loads((d / "flashrt_checkpoint.json").read_text())
    assert meta["random_weights"] is True and meta["arch"] == case[0] and meta["seed"] == 0
    assert meta["vocab_reduced_from"] == ck._real_json(case[0]).get("text_config", ck._real_json(case[0]))["vocab_size"]

    on_disk = _tensors(d)
    assert "lm_head.weight" not in on_disk  # tied embeddings are stored once
    model, info = CLASSES[case].from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    # only the MTP head (which transformers does not model) may be left over
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    assert not info.get("mismatched_keys")
    # the names on disk are the names transformers uses: every value arrives unchanged
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in on_disk.items() if not k.startswith("mtp."))
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 9, 512) and torch.isfinite(logits).all()
    assert logits.std(-1).min() > 0.05


def test_key_prefixes(built):
    prefixes = lambda d: {k.split(".")[0] + "." + k.split(".")[1] for k in _tensors(d)}  # noqa: E731
    assert prefixes(built["qwen3", None]) == {"model.embed_tokens", "model.layers", "model.norm"}
    assert prefixes(built["qwen3_5", "multimodal"]) == {"model.language_model", "model.visual", "mtp.fc",
                                                        "mtp.layers", "mtp.norm", "mtp.pre_fc_norm_embedding",
                                                        "mtp.pre_fc_norm_hidden"}
    assert {p for p in prefixes(built["qwen3_5", "text"]) if p.startswith("model.")} == \
        {"model.embed_tokens", "model.layers", "model.norm"}


def test_norm_conventions(built):
    """Qwen3.5 norms are zero-centred (mean ~0) except the gated one; others are ~1."""
    t = _tensors(built["qwen3_5", "text"])
    assert abs(t["model.norm.weight"].mean()) < 0.1 and t["model.norm.weight"].std() > 0.03
    assert abs(t["mtp.norm.weight"].mean()) < 0.1
    assert abs(t["model.layers.0.linear_attn.norm.weight"].mean() - 1) < 0.1
    t = _tensors(built["qwen3", None])
    assert abs(t["model.norm.weight"].mean() - 1) < 0.1 and t["model.norm.weight"].std() > 0.03


def test_mtp_names_and_shapes(built, tmp_path):
    t = _tensors(built["qwen3_5", "multimodal"])
    h = 64
    assert t["mtp.fc.weight"].shape == (h, 2 * h)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert t[f"mtp.{n}.weight"].shape == (h,)
    for p in MTP_LAYER:  # layer 3 is the main model's full-attention layer
        assert t[f"mtp.layers.0.{p}.weight"].shape == t[f"model.language_model.layers.3.{p}.weight"].shape
    assert t["mtp.layers.0.self_attn.q_proj.weight"].shape == (4 * 16 * 2, h)  # output gate doubles q
    assert sum(k.startswith("mtp.") for k in t) == 4 + len(MTP_LAYER)
    d = make_checkpoint("qwen3_5", "tiny", tmp_path, mtp=False)
    assert not any(k.startswith("mtp.") for k in _tensors(d))


def test_seed_determinism(built, tmp_path):
    a = _tensors(built["lfm2", None])
    b = _tensors(make_checkpoint("lfm2", "tiny", tmp_path / "same", seed=0))
    c = _tensors(make_checkpoint("lfm2", "tiny", tmp_path / "other", seed=1))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_sharding(built, tmp_path):
    d = make_checkpoint("qwen3", "tiny", tmp_path, max_shard_bytes=40_000)
    assert not (d / "model.safetensors").exists()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    shards = sorted(d.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and all(s.name.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    seen, total = {}, 0
    for s in shards:
        with safe_open(s, "pt") as f:
            for k in f.keys():
                assert k not in seen
                seen[k] = s.name
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    assert seen == index["weight_map"] and index["metadata"]["total_size"] == total
    ref = _tensors(built["qwen3", None])
    assert all(torch.equal(ref[k], v) for k, v in _tensors(d).items()) and ref.keys() == seen.keys()
    model, info = tf.Qwen3ForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_dtype_override(tmp_path):
    d = make_checkpoint("qwen3", "tiny", tmp_path, dtype="bfloat16")
    assert {t.dtype for t in _tensors(d).values()} == {torch.bfloat16}
    assert json.loads((d / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="qwen3_5"):
        make_checkpoint("llama", "tiny", tmp_path)
    with pytest.raises(ValueError, match="tiny"):
        make_checkpoint("qwen3", "huge", tmp_path)
    with pytest.raises(ValueError, match="multimodal"):
        ck.build_config("qwen3_5", "tiny", layout="vision")


@pytest.mark.parametrize("arch,name", [("qwen3", "qwen3-0.6b.json"), ("qwen3_5", "qwen3_5-0.8b.json"),
                                       ("lfm2", "lfm2-350m.json")])
def test_real_config_shapes(arch, name):
    """The "real" size is the released config (no weights built here)."""
    ref = json.loads((SHARED / name).read_text())
    ref = ref.get("text_config", ref)
    for size in ("real", {"qwen3": "0.6b", "qwen3_5": "0.8b", "lfm2": "350m"}[arch]):
        text = ck.build_config(arch, size).get_text_config()
        assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == \
            (ref["hidden_size"], ref["num_hidden_layers"], ref["vocab_size"])
        assert text.num_attention_heads == ref["num_attention_heads"]
        assert text.dtype == torch.bfloat16
    if arch == "qwen3_5":
        assert text.layer_types == ref["layer_types"]
        assert text.rope_parameters["mrope_section"] == [11, 11, 10]
    if arch == "lfm2":
        assert text.layer_types.count("full_attention") == len(ref["full_attn_idxs"])


def test_small_config_consistent():
    text = ck.build_config("qwen3_5", "small").get_text_config()
    rot = int(text.head_dim * text.rope_parameters["partial_rotary_factor"])
    assert sum(text.rope_parameters["mrope_section"]) == rot // 2
    assert text.layer_types.count("full_attention") == 2 and text.vocab_size == 32000


def test_default_checkpoint_cached(tmp_path):
    a = ck.default_checkpoint("lfm2", "tiny", cache_dir=tmp_path)
    assert a == tmp_path / "lfm2-tiny-seed0" and (a / "model.safetensors").is_file()
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ck.default_checkpoint("lfm2", "tiny", cache_dir=tmp_path) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["lfm2-tiny-seed0"]  # no temp dirs left


def test_cli(tmp_path, capsys):
    assert ck.main(["qwen3_5", "tiny", str(tmp_path), "--seed", "3", "--layout", "text", "--no-mtp"]) == 0
    assert "random weights" in capsys.readouterr().out
    meta = json.loads((tmp_path / "flashrt_checkpoint.json").read_text())
    assert meta["seed"] == 3 and meta["layout"] == "text" and meta["mtp"] is False

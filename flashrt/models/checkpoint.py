"""Random-weight checkpoints in the exact on-disk format of released models.

There is no model hub on the machines FlashRT is developed on, so tests and
benchmarks run against checkpoints made here: the real configs of the smallest
released models (configs/*.json, copied from the model cards) are fed through
transformers' own config and model classes, so key names, shapes and config
fields are whatever transformers (and hence the released files) use.  Only the
dimensions are shrunk for "tiny"/"small"; "real" keeps the real config.

The weights are random, so generated text is meaningless.  They are made
"decisive" on purpose (see _perturb_norms and TINY_INIT_RANGE) so that a loader
or kernel bug changes the logits visibly instead of hiding in near-ties.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import tempfile

import torch

CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "configs"
ARCHS = {"qwen3": "qwen3-0.6b.json", "qwen3_5": "qwen3_5-0.8b.json", "lfm2": "lfm2-350m.json"}
SIZES = ("tiny", "small", "real")
# the released model names, as aliases of "real" for their own arch
SIZE_ALIASES = {"qwen3": "0.6b", "qwen3_5": "0.8b", "lfm2": "350m"}
LAYOUTS = ("multimodal", "text")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NORM_STD = 0.1  # spread of the perturbation added to every RMSNorm weight

# With initializer_range 0.02 the logits' spread is ~0.02*sqrt(hidden): 0.16 at
# hidden 64, where argmax gaps are small enough for bf16 rounding to flip them.
# Scaling the init to match the real model's ~0.6 keeps greedy decoding stable.
TINY_INIT_RANGE = 0.1
SMALL_INIT_RANGE = 0.03

# Dimensions per (arch, size).  Keys are transformers config fields (for
# qwen3_5: text_config fields).  "block_ff_dim" for lfm2 is the pre-adjust
# width: with block_auto_adjust_ff_dim transformers uses
# ceil_to(multiple_of, int(2*ff/3) * multiplier), so 192 -> 128 and 2304 -> 1536.
_COMMON = {
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 initializer_range=TINY_INIT_RANGE),
    "small": dict(hidden_size=512, num_attention_heads=8, vocab_size=32000,
                  initializer_range=SMALL_INIT_RANGE),
}
_OVERRIDES = {
    ("qwen3", "tiny"): dict(num_hidden_layers=2, head_dim=16, intermediate_size=128),
    ("qwen3", "small"): dict(num_hidden_layers=8, num_key_value_heads=4, head_dim=64,
                             intermediate_size=1536),
    ("qwen3_5", "tiny"): dict(
        num_hidden_layers=4, head_dim=16, intermediate_size=128,
        # explicit, and consistent with the real full_attention_interval of 4
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        # value heads > key heads exercises the GQA-style repeat in the delta rule
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4),
    ("qwen3_5", "small"): dict(
        num_hidden_layers=8, num_key_value_heads=2, head_dim=128, intermediate_size=1536,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        linear_num_key_heads=8, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4),
    ("lfm2", "tiny"): dict(num_hidden_layers=4, full_attn_idxs=[1, 3], block_ff_dim=192,
                           block_multiple_of=32, conv_L_cache=3),
    ("lfm2", "small"): dict(num_hidden_layers=8, num_key_value_heads=4, full_attn_idxs=[2, 5, 7],
                            block_ff_dim=2304, block_multiple_of=256, conv_L_cache=3),
}
# The vision tower only has to exist (released layout) and load; keep it minimal.
_SMALL_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2)

# make_checkpoint(chat=True): a byte-level tokenizer (id i < 256 is byte i) plus each family's
# added tokens, in the released order from id 256, with the released chat template. Per arch:
# (template in flashrt/assets/chat_templates, released id of the first added token, the added
# tokens as (text, special), named special tokens, the end-of-turn tokens generation stops at).
CHAT_TEMPLATES = pathlib.Path(__file__).resolve().parents[1] / "assets" / "chat_templates"
_QWEN_TOKENS = tuple((t, True) for t in (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")) + tuple((t, False) for t in (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"))
CHAT_TOKENIZERS = {
    "qwen3": ("qwen3-0.6b.jinja", 151643, _QWEN_TOKENS,
              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, ("<|im_end|>", "<|endoftext|>")),
    "qwen3_5": ("qwen3_5-0.8b.jinja", 248044, _QWEN_TOKENS,
                {"eos_token": "<|im_end|>", "pad_token": "<|vision_pad|>"}, ("<|im_end|>", "<|endoftext|>")),
    "lfm2": ("lfm2-350m.jinja", 0, tuple((t, True) for t in (
        "<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|fim_pre|>", "<|fim_mid|>", "<|fim_suf|>",
        "<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
        "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>")),
        {"bos_token": "<|startoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}, ("<|im_end|>",)),
}


def _norm_arch_size(arch: str, size: str) -> tuple[str, str]:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; allowed: {sorted(ARCHS)}")
    size = str(size).lower()
    size = "real" if size == SIZE_ALIASES[arch] else size
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for {arch}; allowed: {list(SIZES)} "
                         f"(or {SIZE_ALIASES[arch]!r} for real)")
    return arch, size


def _real_json(arch: str) -> dict:
    return json.loads((CONFIG_DIR / ARCHS[arch]).read_text())


def _map_token_ids(d: dict, real_vocab: int, vocab: int) -> None:
    """Keep special-token ids inside a reduced vocab: ids past its end are moved
    to the same distance from the top, so their order and spacing survive."""
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id",
              "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        v = d.get(k)
        if isinstance(v, int) and v >= vocab:
            d[k] = max(vocab - (real_vocab - v), 0) if real_vocab - v <= vocab else v % vocab


def _mrope_section(real: list[int], half_rotary: int) -> list[int]:
    # transformers' Qwen3.5 text rope interleaves T/H/W frequencies by
    # mrope_section, whose sum must be rotary_dim/2; scale the real split.
    sec = [half_rotary * s // sum(real) for s in real]
    for i in range(half_rotary - sum(sec)):
        sec[i % len(sec)] += 1
    return sec


def build_config(arch: str, size: str, dtype: str | None = None, layout: str | None = None):
    """The transformers config of a checkpoint, without building any weights."""
    from transformers import Lfm2Config, Qwen3_5Config, Qwen3_5TextConfig, Qwen3Config

    arch, size = _norm_arch_size(arch, size)
    layout = layout or "multimodal"
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; allowed: {list(LAYOUTS)}")
    d = _real_json(arch)
    if dtype is None:
        dtype = "float32" if size == "tiny" else (d.get("torch_dtype") or "bfloat16")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {list(DTYPES)}")
    d.pop("torch_dtype", None)
    text = d["text_config"] if arch == "qwen3_5" else d
    real_vocab = text["vocab_size"]
    if size != "real":
        text.update(_COMMON[size], **_OVERRIDES[arch, size])
        _map_token_ids(text, real_vocab, text["vocab_size"])
    if arch == "qwen3_5":
        if text.get("bos_token_id") is None:
            # Qwen's bos is <|endoftext|>, which is the eos of this text config
            text["bos_token_id"] = text["eos_token_id"]
        rope = text["rope_parameters"]
        half = int(text["head_dim"] * rope["partial_rotary_factor"]) // 2
        rope["mrope_section"] = _mrope_section(rope["mrope_section"], half)
        if size != "real":
            _map_token_ids(d, real_vocab, text["vocab_size"])
            d["vision_config"] = dict(_SMALL_VISION)
        # the merger projects vision features into the text embedding space
        d["vision_config"]["out_hidden_size"] = text["hidden_size"]
        if layout == "text":
            text["architectures"] = ["Qwen3_5ForCausalLM"]
            cfg = Qwen3_5TextConfig(**text)
        else:
            cfg = Qwen3_5Config(**d)
    elif arch == "qwen3":
        cfg = Qwen3Config(**d)
    else:
        cfg = Lfm2Config(**d)
    cfg.dtype = DTYPES[dtype]
    for sub in ("text_config", "vision_config"):
        if getattr(cfg, sub, None) is not None:
            getattr(cfg, sub).dtype = DTYPES[dtype]
    return cfg


def _model_class(arch: str, layout: str):
    import transformers as tf
    if arch == "qwen3_5":
        return tf.Qwen3_5ForCausalLM if layout == "text" else tf.Qwen3_5ForConditionalGeneration
    return {"qwen3": tf.Qwen3ForCausalLM, "lfm2": tf.Lfm2ForCausalLM}[arch]


@torch.no_grad()
def _build_model(cls, cfg):
    # Construct on the meta device in the target dtype, then allocate once and
    # run transformers' own init: no default kaiming init, no dtype copy.
    prev = torch.get_default_dtype()
    torch.set_default_dtype(cfg.dtype)
    try:
        with torch.device("meta"):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.to_empty(device="cpu")
    model.init_weights()  # initialize_weights + tie_weights; also fills rope buffers
    return model.eval()


@torch.no_grad()
def _perturb_norms(model) -> None:
    """RMSNorm weights come out of init as exact ones (x * w) or zeros (Qwen3.5's
    zero-centred x * (1 + w)).  Either way a loader that applies the wrong
    convention would still compute the same thing, so add N(0, 0.1) noise."""
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if "RMSNorm" not in type(mod).__name__ or not isinstance(w, torch.Tensor):
            continue
        w.add_(torch.randn(w.shape, dtype=torch.float32).mul_(NORM_STD).to(w.dtype))


def _mtp_tensors(state: dict, cfg, std: float) -> dict:
    """Qwen3.5's multi-token-prediction head in the released naming.  transformers
    ignores (drops) it, so generate it here: one full-attention decoder layer with
    the main model's full-attention layer shapes, plus the fc/norm glue."""
    text = cfg.get_text_config()
    idx = text.layer_types.index("full_attention")
    prefix = next(k.split(f"layers.{idx}.")[0] for k in state if f"layers.{idx}.self_attn" in k)
    layer = {k[len(prefix):]: v for k, v in state.items() if k.startswith(f"{prefix}layers.{idx}.")}
    dt, h = cfg.dtype, text.hidden_size

    def rand(shape, norm):
        # zero-centred norms (N(0,0.1)), projections like transformers' init
        return torch.randn(shape, dtype=torch.float32).mul_(NORM_STD if norm else std).to(dt)

    out = {"mtp.fc.weight": rand((h, 2 * h), False)}
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = rand((h,), True)
    for k, v in layer.items():
        out["mtp.layers.0." + k.split(".", 2)[2]] = rand(v.shape, "norm" in k)
    return out


def _write_safetensors(tensors: dict, out: pathlib.Path, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards, cur, cur_bytes = [], {}, 0
    for k, t in tensors.items():
        nb = t.numel() * t.element_size()
        if cur and cur_bytes + nb > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[k], cur_bytes = t.contiguous(), cur_bytes + nb
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        for k, t in shard.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_checkpoint(arch: str, size: str, out_dir, seed: int = 0, dtype: str | None = None,
                    layout: str | None = None, max_shard_bytes: int = 2 * 2**30,
                    mtp: bool = True, chat: bool = False) -> pathlib.Path:
    """Write a random-weight checkpoint (config.json, model.safetensors or shards
    + index, generation_config.json, flashrt_checkpoint.json) to out_dir.
    chat: also tokenizer.json + tokenizer_config.json (write_chat_tokenizer: the released chat
    template, its tags single tokens), with the config's token ids pointing at those tokens;
    the weights are the same as without it.
    arch "smolvla": a LeRobot policy directory instead (models/smolvla_checkpoint.py);
    "pocket_tts": models/pocket_tts_checkpoint.py (sizes tiny, real); "nemotron_asr_streaming":
    models/nemotron_checkpoint.py (sizes tiny, real)."""
    if chat and arch not in CHAT_TOKENIZERS:
        raise ValueError(f"chat=True: no chat tokenizer for {arch!r}; one of {sorted(CHAT_TOKENIZERS)}")
    if arch == "smolvla":
        from .smolvla_checkpoint import make_smolvla
        return make_smolvla(str(size).lower(), out_dir, seed, dtype or "float32")
    if arch == "pocket_tts":      # the model at the root, its codec in audio_tokenizer/
        from .pocket_tts_checkpoint import make_pocket_tts
        return make_pocket_tts(size, out_dir, seed, dtype or "float32")
    if arch == "nemotron_asr_streaming":     # streaming ASR: sizes tiny, real
        from .nemotron_checkpoint import make_nemotron
        return make_nemotron(str(size).lower(), out_dir, seed, dtype or "float32")
    arch, size = _norm_arch_size(arch, size)
    layout = layout or "multimodal"
    cfg = build_config(arch, size, dtype, layout)
    text = cfg.get_text_config()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
        torch.manual_seed(seed)
        model = _build_model(_model_class(arch, layout), cfg)
        _perturb_norms(model)
        state = model.state_dict()
        if text.tie_word_embeddings:  # released checkpoints store the embedding once
            state.pop("lm_head.weight", None)
        if arch == "qwen3_5" and mtp:
            state.update(_mtp_tensors(state, cfg, text.initializer_range))
    bad = [k for k, t in state.items() if not torch.isfinite(t).all()]
    if bad:
        raise RuntimeError(f"non-finite random weights: {bad[:5]}")

    _write_safetensors(state, out, max_shard_bytes)
    cfg.save_pretrained(out)
    # Released configs say torch_dtype; transformers 5 writes dtype.  Keep both so
    # loaders reading either field see the weights' dtype.
    cj = json.loads((out / "config.json").read_text())
    cj["torch_dtype"] = str(cfg.dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cj, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": text.bos_token_id, "eos_token_id": text.eos_token_id,
           "pad_token_id": getattr(text, "pad_token_id", None)}
    if chat:
        gen = _chat_token_ids(arch, out, write_chat_tokenizer(arch, out))
    (out / "generation_config.json").write_text(
        json.dumps({k: v for k, v in gen.items() if v is not None}, indent=2) + "\n")
    real_vocab = _real_json(arch).get("text_config", _real_json(arch))["vocab_size"]
    note = "random weights: output is meaningless"
    if size != "real":
        note += (f"; initializer_range {text.initializer_range} (real: 0.02) so the small hidden "
                 "size still gives a decisive logit spread; RMSNorm weights perturbed by N(0, 0.1)")
    meta = {"arch": arch, "size": size, "seed": seed, "layout": layout if arch == "qwen3_5" else None,
            "dtype": str(cfg.dtype).removeprefix("torch."), "mtp": bool(arch == "qwen3_5" and mtp),
            "random_weights": True,
            "vocab_reduced_from": real_vocab if text.vocab_size != real_vocab else None,
            "note": note, **({"chat_tokenizer": True} if chat else {})}
    (out / "flashrt_checkpoint.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def write_chat_tokenizer(arch: str, out_dir) -> dict[str, int]:
    """tokenizer.json (byte-level: id i < 256 is byte i, then the family's added tokens, each one
    token) and tokenizer_config.json with the released chat template, in out_dir. Returns
    {added token: id}. Fits any vocab_size >= 256 + the added tokens (tiny: 512)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    name, _, added, named, _ = CHAT_TOKENIZERS[arch]
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in _bytes_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in added])
    out = pathlib.Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: 256 + k for k, (t, _) in enumerate(added)}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
           "model_max_length": 1 << 20, "bos_token": None, "unk_token": None, **named,
           "added_tokens_decoder": {str(ids[t]): {"content": t, "lstrip": False, "normalized": False,
                                                  "rstrip": False, "single_word": False, "special": special}
                                    for t, special in added},
           "chat_template": (CHAT_TEMPLATES / name).read_text(encoding="utf-8")}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return ids


def _chat_token_ids(arch: str, out: pathlib.Path, ids: dict[str, int]) -> dict:
    """Point config.json's token ids (released ids of added tokens) at the chat tokenizer's ids;
    returns the generation config (eos: the family's end-of-turn tokens)."""
    _, first, added, _, stops = CHAT_TOKENIZERS[arch]
    real, cj = _real_json(arch), json.loads((out / "config.json").read_text())
    real_text = real.get("text_config", real)
    pairs = ([(cj["text_config"], real_text), (cj, real)] if "text_config" in cj
             else [(cj, {**real, **real_text})])
    for have, was in pairs:
        for k in [k for k in have if k.endswith("_token_id")]:
            # Qwen3.5's text config has no bos; build_config makes it the eos, as Qwen's is
            r = was.get(k, was.get("eos_token_id") if k == "bos_token_id" else None)
            if isinstance(r, int) and 0 <= r - first < len(added):
                have[k] = ids[added[r - first][0]]
    (out / "config.json").write_text(json.dumps(cj, indent=2, sort_keys=True) + "\n")
    text = cj.get("text_config", cj)
    return {"bos_token_id": text.get("bos_token_id"), "eos_token_id": [ids[t] for t in stops],
            "pad_token_id": text.get("pad_token_id")}


def default_checkpoint(arch: str = "qwen3_5", size: str = "tiny", cache_dir=None) -> pathlib.Path:
    """A seed-0 checkpoint built once per cache dir and reused.  Built in a temp
    dir next to the target and renamed into place, so concurrent processes never
    see a half-written checkpoint (the loser of a rename race just discards its copy)."""
    arch, size = _norm_arch_size(arch, size)
    root = pathlib.Path(cache_dir or pathlib.Path.home() / ".cache" / "flashrt" / "checkpoints")
    target = root / f"{arch}-{size}-seed0"
    if (target / "flashrt_checkpoint.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        make_checkpoint(arch, size, tmp, seed=0)
        with contextlib.suppress(OSError):  # another process won the race
            os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not (target / "flashrt_checkpoint.json").exists():
        raise RuntimeError(f"could not create {target}")
    return target


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="flashrt make-checkpoint",
                                description="Write a random-weight checkpoint (output is meaningless).")
    p.add_argument("arch", choices=sorted(ARCHS) + ["smolvla", "pocket_tts",
                                                      "nemotron_asr_streaming"])
    p.add_argument("size", help=f"one of {list(SIZES)}, or the real model's name {SIZE_ALIASES}")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--layout", choices=LAYOUTS, help="qwen3_5 only (default multimodal)")
    p.add_argument("--no-mtp", action="store_true", help="qwen3_5: omit the mtp.* weights")
    p.add_argument("--max-shard-bytes", type=int, default=2 * 2**30)
    p.add_argument("--chat", action="store_true",
                   help="also a byte-level tokenizer with the released chat template and its tags")
    a = p.parse_args(argv)
    out = make_checkpoint(a.arch, a.size, a.out_dir, seed=a.seed, dtype=a.dtype, layout=a.layout,
                          max_shard_bytes=a.max_shard_bytes, mtp=not a.no_mtp, chat=a.chat)
    print(f"wrote {a.arch}/{a.size} checkpoint to {out} (random weights: output is meaningless)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Random-weight Pocket TTS checkpoints in the released on-disk layout: transformers'
PocketTTSForConditionalGeneration.save_pretrained at the root, the codec's own
PocketTTSAudioTokenizerModel.save_pretrained in `audio_tokenizer/` beside it.

"real" is transformers' default configs (the released shape: 6 x 1024 backbone, 6 x 512 flow
head, a 2-layer 512-wide codec transformer, 1920 samples per frame); "tiny" shrinks every width
and keeps each mechanism (a sliding window shorter than a test utterance, dilated convs).
Init leaves LayerNorm affines at 1/0, layer scales at 0.01 and the BOS latent and latent
statistics at 0/1: a loader that dropped or swapped them would still match, so they are perturbed.
"""
from __future__ import annotations

import json
import pathlib

import torch

SIZES = ("tiny", "real")
CODEC_DIR = "audio_tokenizer"

_TINY = dict(vocab_size=304, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, latent_dim=8, initializer_range=0.1,
             audio_prompt_token_id=300, audio_latent_token_id=301, audio_prompt_bos_token_id=302,
             audio_bos_token_id=303, pad_token_id=3)
_TINY_FLOW = dict(hidden_size=32, num_hidden_layers=2, latent_dim=8, condition_dim=64,
                  frequency_embedding_size=16)
_TINY_CODEC = dict(hidden_size=32, num_filters=4, upsampling_ratios=[4, 3, 2], latent_stride=4,
                   num_residual_layers=2, intermediate_size=64, num_attention_heads=4,
                   num_key_value_heads=4, sliding_window=12, upsample_groups=32, latent_dim=8,
                   layer_scale_initial_scale=0.3, initializer_range=0.1)


def build_configs(size: str):
    """(PocketTTSConfig, PocketTTSAudioTokenizerConfig) of a size."""
    from transformers import PocketTTSAudioTokenizerConfig, PocketTTSConfig, PocketTTSFlowHeadConfig
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} for pocket_tts; allowed: {list(SIZES)}")
    if size == "real":
        return PocketTTSConfig(), PocketTTSAudioTokenizerConfig()
    flow = PocketTTSFlowHeadConfig(**_TINY_FLOW)
    return PocketTTSConfig(flow_head_config=flow, **_TINY), PocketTTSAudioTokenizerConfig(**_TINY_CODEC)


@torch.no_grad()
def _build(cls, cfg):
    with torch.device("meta"):
        model = cls(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.eval()


@torch.no_grad()
def _perturb(model, std: float) -> None:
    """Affines and scales that init leaves at constants get N(c, std) instead (see module doc)."""
    for name, t in model.state_dict().items():
        if name.startswith("loss_weighting") or not t.is_floating_point():
            continue
        leaf = name.rsplit(".", 1)[-1]
        const = name.endswith(("norm.weight", "layernorm.weight", "norm.bias", "layernorm.bias"))
        if const or leaf in ("scale", "bos_latent", "latent_mean"):
            t.add_(torch.randn(t.shape) * std)
        elif leaf == "latent_std":
            t.mul_(torch.exp(torch.randn(t.shape) * std))


def make_pocket_tts(size: str, out_dir, seed: int = 0, dtype: str = "float32") -> pathlib.Path:
    """Write a random-weight Pocket TTS checkpoint (model at the root, codec in audio_tokenizer/)."""
    from transformers import PocketTTSAudioTokenizerModel, PocketTTSForConditionalGeneration
    size = str(size).lower()
    tts_cfg, codec_cfg = build_configs(size)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):       # leave the caller's RNG untouched
        torch.manual_seed(seed)
        tts = _build(PocketTTSForConditionalGeneration, tts_cfg)
        codec = _build(PocketTTSAudioTokenizerModel, codec_cfg)
        for m in (tts, codec):
            _perturb(m, 0.1)
    dt = getattr(torch, dtype)
    tts.to(dt).save_pretrained(out)
    codec.to(dt).save_pretrained(out / CODEC_DIR)
    note = {"arch": "pocket_tts", "size": size, "seed": seed, "dtype": dtype, "random_weights": True,
            "note": "random weights: output is meaningless; norms, layer scales, the BOS latent "
                    "and latent statistics perturbed by 0.1"}
    (out / "flashrt_checkpoint.json").write_text(json.dumps(note, indent=2) + "\n")
    return out

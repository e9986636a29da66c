"""Random-weight Nemotron Speech Streaming checkpoints in the released Hugging Face format.

transformers' own NemotronAsrStreamingForRNNT is built from a locally made config and saved
with save_pretrained (config.json, model.safetensors, generation_config.json), plus its
feature extractor's preprocessor_config.json. "real" is the released 0.6B shape (transformers'
config defaults: 24 conformer layers of 1024, a 2 x 640 LSTM, vocabulary 1025 with blank 1024);
"tiny" shrinks every width but keeps 80 mel bins, the 8x subsampling and a left context (14
frames) that every released lookahead (13, 6, 1, 0) divides into whole chunks, as 70 does.
"""
from __future__ import annotations

import json
import math
import pathlib

import torch

SIZES = ("tiny", "real")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ENCODER = {
    "real": {},
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 subsampling_conv_channels=16, sliding_window=15, initializer_range=0.2),
}
# vocab >= 256: the loader's byte-level fallback tokenizer needs it when no tokenizer ships
_TOP = {"real": {}, "tiny": dict(vocab_size=257, blank_token_id=256, decoder_hidden_size=32)}
LN_STD = 0.1     # LayerNorm weights/biases come out of init as exact 1/0: perturb so a wrong
                 # convention (or a swapped weight/bias) changes the output visibly
# prediction network: LSTM weights N(0, 3/sqrt(H)), biases N(0, 0.5), projector N(0, 2/sqrt(H)).
# At transformers' init its output is ~300x smaller than the encoder's, so the tokens emitted
# would not depend on the decoder state at all (a broken LSTM would go unseen)
PRED_SCALE = (3.0, 0.5, 2.0)


def _decisive_prediction(model) -> None:
    dec, (w, b, proj) = model.decoder, PRED_SCALE
    scale = 1.0 / math.sqrt(model.config.decoder_hidden_size)
    for name, p in dec.lstm.named_parameters():
        p.copy_(torch.randn(p.shape) * (w * scale if "weight" in name else b))
    dec.decoder_projector.weight.copy_(torch.randn(dec.decoder_projector.weight.shape) * proj * scale)


def _balance_blank(model, fe) -> float:
    """Raise the joint's blank bias so blank wins at about half the frames of 1 s of noise from
    the start state: at random init blank is one class of 1025 and would almost never win, and a
    transducer that never advances on its own only ever shows the max-symbols path."""
    audio = torch.randn(fe.sampling_rate) * 0.1
    feats = fe(audio.numpy(), sampling_rate=fe.sampling_rate, return_tensors="pt")
    blank = model.config.blank_token_id
    enc = model.get_audio_features(input_features=feats["input_features"],
                                   num_lookahead_tokens=0).pooler_output[0]          # (T, J)
    z = model.joint(model.decoder(torch.tensor([[blank]]))[0][None], enc[:, None])[:, 0]   # (T, V)
    others = torch.cat([z[:, :blank], z[:, blank + 1:]], dim=-1)
    shift = (others.max(-1).values - z[:, blank]).median()
    model.joint.head.bias[blank] += shift
    return float(shift)


def build_config(size: str):
    """The transformers config of a checkpoint at `size` (no weights)."""
    from transformers import NemotronAsrStreamingConfig
    if size not in SIZES:
        raise ValueError(f"nemotron_asr_streaming size {size!r}: expected one of {SIZES}")
    dropout = dict(dropout=0.0, layerdrop=0.0, activation_dropout=0.0, attention_dropout=0.0)
    cfg = NemotronAsrStreamingConfig(encoder_config={**_ENCODER[size], **dropout}, **_TOP[size])
    cfg.architectures = ["NemotronAsrStreamingForRNNT"]
    return cfg


@torch.no_grad()
def make_nemotron(size: str, out_dir, seed: int = 0, dtype: str = "float32") -> pathlib.Path:
    """Write a random-weight checkpoint to out_dir; the caller's torch RNG is left untouched."""
    from transformers import NemotronAsrStreamingFeatureExtractor, NemotronAsrStreamingForRNNT
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {list(_DTYPES)}")
    cfg = build_config(size)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = NemotronAsrStreamingForRNNT(cfg).eval()
        for mod in model.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.add_(torch.randn(mod.weight.shape).mul_(LN_STD))
                mod.bias.add_(torch.randn(mod.bias.shape).mul_(LN_STD))
        _decisive_prediction(model)
        fe = NemotronAsrStreamingFeatureExtractor(feature_size=cfg.encoder_config.num_mel_bins)
        shift = _balance_blank(model, fe)
    model.to(_DTYPES[dtype])
    # generate() needs a start token; the released generation config starts from blank
    model.generation_config.decoder_start_token_id = cfg.blank_token_id
    model.save_pretrained(out)
    fe.save_pretrained(out)
    note = "random weights: output is meaningless"
    if size != "real":
        note += (f"; initializer_range {cfg.encoder_config.initializer_range} (real: 0.02) so the "
                 f"small widths still give a decisive logit spread")
    meta = {"arch": "nemotron_asr_streaming", "size": size, "seed": seed, "dtype": dtype,
            "random_weights": True, "note": note + f"; LayerNorm weights and biases perturbed by N(0, {LN_STD}); prediction "
            f"network scaled {PRED_SCALE} (LSTM weights, biases, projector) to matter; joint blank "
            f"bias raised by {shift:.4f} so blank wins at about half the frames"}
    (out / "flashrt_checkpoint.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out

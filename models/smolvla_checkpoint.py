"""Random-weight SmolVLA policies in LeRobot's on-disk format, and the local SmolVLM directory.

LeRobot builds SmolVLA's backbone from `vlm_model_name` with AutoConfig/AutoProcessor even when
it loads no VLM weights; with no hub here, the policy directory carries that directory itself
(`vlm/`: a SmolVLM config at the chosen size, a byte-level BPE tokenizer built with the
`tokenizers` package, the image/processor configs AutoProcessor asks for).  config.json names it
relatively ("vlm"); LeRobot resolves that against the working directory, flashrt against the
policy directory.

This module imports nothing from flashrt at module level: bench/lerobot_reference.py loads it
by path inside the LeRobot venv to write the same VLM directory.
"""
from __future__ import annotations

import json
import pathlib

SIZES = ("tiny", "small", "real")
VLM_DIR = "vlm"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>",
                  "<image>", "<global-img>", "<end_of_utterance>")
# Sentences the toy tokenizer learns its merges from (only the ids' layout matters: the weights
# are random, but task text must tokenize into several multi-byte tokens).
_CORPUS = [
    "pick up the red cube and place it in the box",
    "push the green block to the left of the table",
    "open the drawer, take the sponge and close the drawer",
    "grasp the cup by its handle and pour the water into the bowl",
    "stack the blue cube on top of the yellow cube",
    "move the arm to the home position and release the gripper",
    "insert the peg into the hole",
    "fold the towel in half",
]

# SmolVLM2-500M-Video-Instruct (the released backbone of smolvla_base) and shrunken variants.
# Keys are transformers' SmolVLMConfig fields.
_TEXT = {
    "real": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                 num_key_value_heads=5, head_dim=64, vocab_size=49280, max_position_embeddings=8192),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=2048),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=1024),
}
_VISION = {
    "real": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 image_size=512, patch_size=16),
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  image_size=256, patch_size=16),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 image_size=32, patch_size=8),
}
_SCALE = {"real": 4, "small": 4, "tiny": 2}
# smolvla_base: 16 of the 32 text layers, 3 cameras, a 6-dof arm
_POLICY = {
    "real": dict(num_vlm_layers=16, cameras={"camera1": (3, 256, 256), "camera2": (3, 256, 256),
                                             "camera3": (3, 256, 256)}, state_dim=6, action_dim=6),
    "small": dict(num_vlm_layers=4, cameras={"top": (3, 240, 320), "wrist": (3, 128, 128)},
                  state_dim=6, action_dim=6),
    "tiny": dict(num_vlm_layers=4, cameras={"top": (3, 24, 40), "wrist": (3, 30, 30)},
                 state_dim=6, action_dim=5),
}


def _check_size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"smolvla size {size!r}: expected one of {SIZES}")
    return size


def vlm_config(size: str) -> dict:
    """SmolVLM config.json at `size`; image_token_id is looked up in our tokenizer."""
    t = dict(_TEXT[_check_size(size)], model_type="llama", rms_norm_eps=1e-5, rope_theta=100000.0,
             hidden_act="silu", attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
             initializer_range=0.02)
    v = dict(_VISION[size], model_type="smolvlm_vision", num_channels=3, layer_norm_eps=1e-6,
             hidden_act="gelu_pytorch_tanh", attention_dropout=0.0, initializer_range=0.02)
    return {"architectures": ["SmolVLMForConditionalGeneration"], "model_type": "smolvlm",
            "scale_factor": _SCALE[size], "image_token_id": SPECIAL_TOKENS.index("<image>"),
            "vocab_size": t["vocab_size"], "tie_word_embeddings": False,
            "text_config": t, "vision_config": v}


def policy_layout(size: str) -> dict:
    return dict(_POLICY[_check_size(size)])


def build_tokenizer(vocab_size: int):
    """A byte-level BPE (GPT-2 style, like SmolVLM's) trained on _CORPUS; specials take ids 0..6."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 400), special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def write_vlm_dir(out, size: str) -> pathlib.Path:
    """The local stand-in for the hub's SmolVLM2 directory (config, tokenizer, processor configs)."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = vlm_config(size)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    build_tokenizer(cfg["text_config"]["vocab_size"]).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
        "bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
        "padding_side": "right", "processor_class": "SmolVLMProcessor",
        "extra_special_tokens": {"fake_image_token": "<fake_token_around_image>",
                                 "image_token": "<image>", "global_image_token": "<global-img>",
                                 "end_of_utterance_token": "<end_of_utterance>"}}, indent=2))
    edge = cfg["vision_config"]["image_size"]
    img = {"image_processor_type": "SmolVLMImageProcessor", "processor_class": "SmolVLMProcessor",
           "do_convert_rgb": True, "do_resize": True, "size": {"longest_edge": edge},
           "max_image_size": {"longest_edge": edge}, "do_image_splitting": False, "resample": 1,
           "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True}
    (out / "preprocessor_config.json").write_text(json.dumps(img, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(
        dict(img, video_processor_type="SmolVLMVideoProcessor"), indent=2))
    seq = (edge // cfg["vision_config"]["patch_size"] // cfg["scale_factor"]) ** 2
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "SmolVLMProcessor", "image_seq_len": seq}, indent=2))
    return out

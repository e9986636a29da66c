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


# ---- the policy directory -------------------------------------------------------------------
# LeRobot 0.4.4's SmolVLAConfig as it saves it (config.json), defaults; features filled per size.
_LEROBOT_DEFAULTS = {
    "type": "smolvla", "n_obs_steps": 1, "input_features": None, "output_features": None,
    "device": "cpu", "use_amp": False, "use_peft": False, "push_to_hub": True, "repo_id": None,
    "private": None, "tags": None, "license": None, "pretrained_path": None, "chunk_size": 50,
    "n_action_steps": 50,
    "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
    "max_state_dim": 32, "max_action_dim": 32, "resize_imgs_with_padding": None, "empty_cameras": 0,
    "adapt_to_pi_aloha": False, "use_delta_joint_actions_aloha": False, "tokenizer_max_length": 48,
    "num_steps": 10, "use_cache": True, "freeze_vision_encoder": True, "train_expert_only": True,
    "train_state_proj": True, "optimizer_lr": 0.0001, "optimizer_betas": [0.9, 0.95],
    "optimizer_eps": 1e-08, "optimizer_weight_decay": 1e-10, "optimizer_grad_clip_norm": 10,
    "scheduler_warmup_steps": 1000, "scheduler_decay_steps": 30000, "scheduler_decay_lr": 2.5e-06,
    "vlm_model_name": VLM_DIR, "load_vlm_weights": False, "add_image_special_tokens": False,
    "attention_mode": "cross_attn", "prefix_length": -1, "pad_language_to": "longest",
    "num_expert_layers": -1, "num_vlm_layers": 16, "self_attn_every_n_layers": 2,
    "expert_width_multiplier": 0.75, "min_period": 0.004, "max_period": 4.0, "rtc_config": None,
    "compile_model": False, "compile_mode": "max-autotune"}


def policy_config(size: str) -> dict:
    lay, image = policy_layout(size), _VISION[_check_size(size)]["image_size"]
    feats = {f"observation.images.{cam}": {"type": "VISUAL", "shape": list(s)}
             for cam, s in lay["cameras"].items()}
    feats["observation.state"] = {"type": "STATE", "shape": [lay["state_dim"]]}
    return dict(_LEROBOT_DEFAULTS, input_features=feats, num_vlm_layers=lay["num_vlm_layers"],
                output_features={"action": {"type": "ACTION", "shape": [lay["action_dim"]]}},
                resize_imgs_with_padding=[image, image])


def decisive_init(named_params, seed: int) -> None:
    """In place, in sorted-name order (the reference script and make_checkpoint draw the same
    numbers): N(0, 1/fan_in) matrices, 1-D norm parameters 1 + N(0, 0.1), biases N(0, 0.02).
    LeRobot's own init (std 0.02) gives near-zero actions, where a wrong op would hide."""
    import math

    import torch
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(named_params, key=lambda kv: kv[0]):
            if "norm" in name and p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(math.prod(p.shape[1:])))


def random_stats(size: str, seed: int) -> dict:
    """Dataset statistics for the state and action features: {key: {mean, std, min, max}}."""
    import torch
    lay, g = policy_layout(size), torch.Generator().manual_seed(seed + 2)

    def one(dim):
        mean, std = torch.randn(dim, generator=g), 0.5 + torch.rand(dim, generator=g)
        return {"mean": mean, "std": std, "min": mean - 3 * std, "max": mean + 3 * std}
    return {"observation.state": one(lay["state_dim"]), "action": one(lay["action_dim"])}


def _write_processors(out: pathlib.Path, cfg: dict, stats: dict) -> None:
    # policy_preprocessor.json / policy_postprocessor.json as LeRobot 0.4.4 saves SmolVLA's
    from safetensors.torch import save_file
    flat = {f"{k}.{s}": t.contiguous() for k, d in stats.items() for s, t in d.items()}
    pre_file, post_file = ("policy_preprocessor_step_5_normalizer_processor.safetensors",
                           "policy_postprocessor_step_0_unnormalizer_processor.safetensors")
    save_file(flat, str(out / pre_file))
    save_file(flat, str(out / post_file))
    nmap, dev = cfg["normalization_mapping"], {"registry_name": "device_processor",
                                               "config": {"device": "cpu", "float_dtype": None}}
    pre = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "smolvla_new_line_processor", "config": {}},
        {"registry_name": "tokenizer_processor", "config": {
            "max_length": cfg["tokenizer_max_length"], "task_key": "task", "padding_side": "right",
            "padding": cfg["pad_language_to"], "truncation": True, "tokenizer_name": cfg["vlm_model_name"]}},
        dev,
        {"registry_name": "normalizer_processor", "config": {
            "eps": 1e-08, "features": {**cfg["input_features"], **cfg["output_features"]},
            "norm_map": nmap}, "state_file": pre_file}]}
    post = {"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor", "config": {
            "eps": 1e-08, "features": cfg["output_features"], "norm_map": nmap},
         "state_file": post_file}, dev]}
    (out / "policy_preprocessor.json").write_text(json.dumps(pre, indent=2))
    (out / "policy_postprocessor.json").write_text(json.dumps(post, indent=2))


def make_smolvla(size: str, out_dir, seed: int = 0, dtype: str = "float32") -> pathlib.Path:
    """A random-weight SmolVLA policy directory in LeRobot's format at `size` ("real": the
    smolvla_base shape, ~450M parameters). Same numbers as bench/lerobot_reference.py for a seed."""
    import torch
    from safetensors.torch import save_file

    from flashrt.models.smolvla import Model, SmolVLAConfig
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_vlm_dir(out / VLM_DIR, size)
    cfg, vlm = policy_config(size), vlm_config(size)
    with torch.device("meta"):
        net = Model(SmolVLAConfig.from_lerobot(cfg, vlm))
    hidden, vocab = vlm["text_config"]["hidden_size"], vlm["text_config"]["vocab_size"]
    shapes = {net.lerobot_name(n): p.shape for n, p in net.named_parameters()}
    shapes[Model.IGNORED[0]], shapes[Model.IGNORED[1]] = (vocab, hidden), (hidden,)
    params = {n: torch.empty(s) for n, s in shapes.items()}
    decisive_init(params.items(), seed)
    want = getattr(torch, dtype)
    save_file({n: t.to(want) for n, t in params.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=4))
    _write_processors(out, cfg, random_stats(size, seed))
    (out / "flashrt_checkpoint.json").write_text(json.dumps(
        {"arch": "smolvla", "size": size, "seed": seed, "dtype": dtype, "random_weights": True,
         "note": "random weights: actions are meaningless"}, indent=2))
    return out

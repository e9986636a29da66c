"""SmolVLA's processor steps and the loading of a LeRobot policy directory.

LeRobot keeps these outside model.safetensors: policy_preprocessor.json (task text + "\\n",
tokenization to <= tokenizer_max_length tokens, MEAN_STD normalisation of the state from the
normalizer safetensors) and policy_postprocessor.json (unnormalisation of the action); the
image steps (resize with padding, [0, 1] -> [-1, 1]) sit in the policy's prepare_images.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from flashrt.errors import ConfigError, WeightError
from flashrt.nn.linear import select_linear_kernel

from .loader import assign_weights, fingerprint
from .smolvla import Model, SmolVLAConfig


def resize_with_pad(img: torch.Tensor, width: int, height: int, pad_value: float = 0.0):
    """LeRobot's resize_with_pad: keep aspect ratio, bilinear, pad on the left and top.
    img: (N, C, H, W)."""
    h, w = img.shape[2:]
    ratio = max(w / width, h / height)
    rh, rw = int(h / ratio), int(w / ratio)
    out = F.interpolate(img, size=(rh, rw), mode="bilinear", align_corners=False)
    return F.pad(out, (max(0, int(width - rw)), 0, max(0, int(height - rh)), 0), value=pad_value)


def _step(pipeline: dict, name: str, path: Path) -> dict:
    for s in pipeline.get("steps", []):
        if s.get("registry_name") == name:
            return s
    raise ConfigError(f"{path}: no {name!r} step (expected LeRobot's SmolVLA processor pipeline)")


def _stats(path: Path, step: dict, key: str, mode: str):
    """(mean, std) for MEAN_STD, or None for IDENTITY; other modes are refused."""
    if mode == "IDENTITY":
        return None
    if mode != "MEAN_STD":
        raise ConfigError(f"{path}: normalisation {mode!r} for {key!r} (only MEAN_STD, IDENTITY)")
    with safe_open(str(path.parent / step["state_file"]), framework="pt") as f:
        names = set(f.keys())
        if f"{key}.mean" not in names or f"{key}.std" not in names:
            raise WeightError(f"{step['state_file']}: no {key}.mean / {key}.std statistics")
        return f.get_tensor(f"{key}.mean").float(), f.get_tensor(f"{key}.std").float()


def _finite(key: str, t: torch.Tensor) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{key}: has non-finite values (NaN or inf)")


class Processor:
    """Raw LeRobot observation dict -> model inputs; normalised action -> robot action."""

    def __init__(self, path: Path, c: SmolVLAConfig, vlm_dir: Path, device):
        from tokenizers import Tokenizer
        pre = json.loads((path / "policy_preprocessor.json").read_text())
        post = json.loads((path / "policy_postprocessor.json").read_text())
        tok = _step(pre, "tokenizer_processor", path / "policy_preprocessor.json")["config"]
        if tok.get("padding_side", "right") != "right" or not tok.get("truncation", True):
            raise ConfigError(f"{path}: tokenizer step {tok} (expected right padding, truncation)")
        self.max_length, self.padding = tok.get("max_length", 512), tok.get("padding", "longest")
        if self.padding not in ("longest", "max_length"):
            raise ConfigError(f"{path}: tokenizer padding {self.padding!r} (longest or max_length)")
        self.tokenizer = Tokenizer.from_file(str(vlm_dir / "tokenizer.json"))
        pad = json.loads((vlm_dir / "tokenizer_config.json").read_text()).get("pad_token")
        self.pad_id = self.tokenizer.token_to_id(pad) if pad else None
        norm = _step(pre, "normalizer_processor", path / "policy_preprocessor.json")
        unnorm = _step(post, "unnormalizer_processor", path / "policy_postprocessor.json")
        self.eps = norm["config"].get("eps", 1e-8)
        nmap = norm["config"]["norm_map"]
        self.state_stats = _stats(path / "policy_preprocessor.json", norm, "observation.state", nmap["STATE"])
        self.action_stats = _stats(path / "policy_postprocessor.json", unnorm, "action",
                                   unnorm["config"]["norm_map"]["ACTION"])
        self.config, self.device = c, torch.device(device)

    def tokenize(self, task: str) -> tuple[torch.Tensor, torch.Tensor]:
        text = task if task.endswith("\n") else task + "\n"      # SmolVLANewLineProcessor
        ids = self.tokenizer.encode(text).ids[: self.max_length]
        n = len(ids)
        if self.padding == "max_length" and n < self.max_length:
            if self.pad_id is None:
                raise ConfigError("padding to max_length needs a pad_token in tokenizer_config.json")
            ids = ids + [self.pad_id] * (self.max_length - n)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[:n] = True
        return torch.tensor(ids, dtype=torch.long, device=self.device), mask.to(self.device)

    def preprocess(self, obs: dict) -> dict:
        """Pure: a bad observation raises (naming the key and what was expected), nothing else."""
        c = self.config
        if not isinstance(obs, dict):
            raise TypeError(f"observation: {type(obs).__name__}, expected a dict")
        missing = [k for k, _ in c.cameras if k not in obs] + \
            [k for k in ("observation.state", "task") if k not in obs]
        if missing:
            raise KeyError(f"observation lacks {missing}; expected {[k for k, _ in c.cameras]}, "
                           "'observation.state' and 'task'")
        pixels = []
        for key, shape in c.cameras:
            img = torch.as_tensor(obs[key], device=self.device).float()
            img = img[None] if img.dim() == 3 else img
            if img.dim() != 4 or img.shape[0] != 1 or img.shape[1] != 3:
                raise ValueError(f"{key}: shape {tuple(img.shape)}, expected (3, H, W) or (1, 3, H, W)")
            _finite(key, img)
            pixels.append(resize_with_pad(img, c.image_size, c.image_size) * 2.0 - 1.0)
        state = torch.as_tensor(obs["observation.state"], device=self.device).float().reshape(-1)
        if state.numel() != c.state_dim:
            raise ValueError(f"observation.state: {state.numel()} values, expected {c.state_dim}")
        _finite("observation.state", state)
        if self.state_stats is not None:
            mean, std = (t.to(self.device) for t in self.state_stats)
            state = (state - mean) / (std + self.eps)
        padded = torch.zeros(c.max_state_dim, device=self.device)
        padded[: c.state_dim] = state
        if not isinstance(obs["task"], str):
            raise TypeError(f"task: {type(obs['task']).__name__}, expected str")
        tokens, mask = self.tokenize(obs["task"])
        return {"pixels": torch.cat(pixels), "tokens": tokens, "token_mask": mask, "state": padded}

    def postprocess(self, action: torch.Tensor) -> torch.Tensor:
        if self.action_stats is None:
            return action
        mean, std = (t.to(action.device) for t in self.action_stats)
        return action * std + mean


def vlm_dir_of(path: Path, pol: dict) -> Path:
    """config.json's vlm_model_name, resolved against the policy directory."""
    name = pol.get("vlm_model_name", "")
    d = (path / name) if not Path(name).is_absolute() else Path(name)
    if not (d / "config.json").exists() or not (d / "tokenizer.json").exists():
        raise FileNotFoundError(f"{path}: vlm_model_name {name!r} is not a local SmolVLM directory "
                                f"with config.json and tokenizer.json (looked in {d}; no hub here)")
    return d


def load_with_fingerprint(path, device="cpu", dtype=torch.float32,
                          linear_kernel: str = "auto") -> tuple[Model, Processor, dict]:
    """A LeRobot SmolVLA directory -> (model with weights, processor, fingerprint): the weights go
    through the shared loader (loader.assign_weights), so the fingerprint is what load_model's
    would be. linear_kernel: the projections' matmul path (flashrt.nn.linear.select_linear_kernel;
    "aten" is plain F.linear)."""
    path, device = Path(path), torch.device(device)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a LeRobot policy directory)")
    pol = json.loads((path / "config.json").read_text())
    vlm_dir = vlm_dir_of(path, pol)
    c = SmolVLAConfig.from_lerobot(pol, json.loads((vlm_dir / "config.json").read_text()))
    with torch.device("meta"):
        net = Model(c)
    digest = assign_weights(net, path, device, dtype)
    select_linear_kernel(net, device, dtype, linear_kernel)
    return net.eval(), Processor(path, c, vlm_dir, device), fingerprint(net, dtype, digest)


def load(path, device="cpu", dtype=torch.float32, linear_kernel: str = "auto") -> tuple[Model, Processor]:
    """load_with_fingerprint without the fingerprint: (model with weights, processor)."""
    net, proc, _ = load_with_fingerprint(path, device, dtype, linear_kernel)
    return net, proc

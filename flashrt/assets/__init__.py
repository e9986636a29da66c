"""Files shipped inside the package: the default model, trained here by `python -m flashrt.dev.train`
(a ~5M-parameter Qwen3.5-shaped hybrid on CPython's standard library; see README).

Rule: data and the path to it; imports nothing of flashrt."""
from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "pystdlib-qwen35"


def trained_model_path(name: str = DEFAULT_MODEL) -> Path:
    """Directory of a shipped Hugging Face-format checkpoint (config.json, model.safetensors, ...)."""
    path = Path(__file__).resolve().parent / name
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no shipped checkpoint {name!r} (retrain it with "
                                f"`python -m flashrt.dev.train --out {path}`)")
    return path

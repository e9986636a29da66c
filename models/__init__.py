"""Model files, one per Hugging Face model_type, and random-weight checkpoints for them."""
from __future__ import annotations

import importlib

from flashrt.loader import check_supported

# model_type in config.json -> module in this package
MODEL_TYPES = {
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5",
    "lfm2": "lfm2",
    "tiny_vla": "tiny_vla",
}


def model_module(hf_config: dict):
    mt = check_supported(hf_config, MODEL_TYPES)
    return importlib.import_module(f"{__name__}.{MODEL_TYPES[mt]}")


def make_checkpoint(*args, **kwargs):
    from .checkpoint import make_checkpoint as _make
    return _make(*args, **kwargs)


def default_checkpoint(*args, **kwargs):
    from .checkpoint import default_checkpoint as _default
    return _default(*args, **kwargs)

"""model_type in config.json -> the model file that implements it. Adding a model is one file
in this package and one line here."""
from __future__ import annotations

import importlib

from flashrt.errors import ConfigError

MODEL_TYPES = {
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5",
    "lfm2": "lfm2",
    "tiny_vla": "tiny_vla",
    "nemotron_asr_streaming": "nemotron_asr_streaming",
    "pocket_tts": "pocket_tts", "pocket_tts_audio_tokenizer": "pocket_tts_codec",
}


def check_supported(hf: dict, supported) -> str:
    mt = hf.get("model_type")
    if mt not in supported:
        arch = hf.get("architectures")
        raise ConfigError(f"unsupported architecture: model_type {mt!r} (architectures {arch}); "
                          f"supported model_types: {sorted(supported)}")
    return mt


def model_module(hf_config: dict):
    """The model file for a parsed config.json (its CONFIG and Model)."""
    mt = check_supported(hf_config, MODEL_TYPES)
    return importlib.import_module(f"flashrt.models.{MODEL_TYPES[mt]}")

"""The small protocol every model file implements, and helpers they share.

A model owns weights and declares its state; it never allocates state itself. The runtime
gives it an arena (name -> view) and a StepCtx; the model reads and writes its named buffers
in place, so the same forward runs eagerly on CPU and inside a captured CUDA graph.
"""
from __future__ import annotations

import torch
from torch import nn

from .arena import BufferSpec
from .errors import ConfigError
from .layers import StepCtx, linear


class CausalLM(nn.Module):
    """Base class. Subclasses set `model_type`, `config`, and implement the three hooks."""
    model_type: str = ""
    linear_kernel: str = "aten"     # heads; set with the projections by select_linear_kernel

    def state_specs(self, max_seq_len: int, dtype: torch.dtype) -> list[BufferSpec]:
        """Named buffers this model reads and writes (KV, recurrent, conv, mtp)."""
        raise NotImplementedError

    def forward(self, ids: torch.Tensor, ctx: StepCtx, state, all_logits: bool = False) -> torch.Tensor:
        """ids: (T,) int64. Advances the model's state by T tokens. Returns logits (T or 1, V)."""
        raise NotImplementedError

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> parameter name; None means 'known, ignored here'.
        Default: the plain Hugging Face causal-LM layout (`model.*`, optional `lm_head`)."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None                     # a tied head saved anyway duplicates embed_tokens
        return name[len("model."):] if name.startswith("model.") else name

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from final hidden states (T, hidden) -> (T, vocab), tied or untied."""
        w = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return linear(x, w, kernel=self.linear_kernel)

    # -- shared --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def materialize_buffers(self, device) -> None:
        """Recompute non-persistent buffers after weights were assigned from a meta-device build."""
        for m in self.modules():
            if hasattr(m, "rebuild") and m is not self:
                m.rebuild(device)

    def extra_weight_names(self, present: set[str]) -> set[str]:
        """Parameters that may legitimately be absent (e.g. optional MTP weights)."""
        return set()


def require(cfg: dict, key: str, model_type: str):
    if key not in cfg:
        raise ConfigError(f"{model_type} config: missing field {key!r}")
    return cfg[key]


def check(cond: bool, model_type: str, field: str, why: str) -> None:
    if not cond:
        raise ConfigError(f"{model_type} config: unsupported {field}: {why}")

"""Causal language models on the protocol: token ids or embeddings in, logits and hidden out.

A model file subclasses CausalLM and implements `state_specs` and `hidden` (layers + final
norm); embedding, the head and the input forms are shared here.
"""
from __future__ import annotations

import torch

from flashrt.core.step import StepCtx
from flashrt.nn.linear import linear
from .protocol import InputSpec, StatefulModel


class CausalLM(StatefulModel):
    linear_kernel: str = "aten"     # heads; set with the projections by select_linear_kernel

    def input_specs(self, dtype):
        h = self.config.hidden_size
        return [InputSpec("ids", (), torch.int64, "token ids"),
                InputSpec("embeds", (h,), None, "input embeddings (e.g. image or audio features)")]

    def hidden(self, x: torch.Tensor, ctx: StepCtx, state, all_positions: bool) -> torch.Tensor:
        """(T, hidden) input embeddings -> (T or 1, hidden) after the final norm."""
        raise NotImplementedError

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)                              # (T,) -> (T, hidden)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from final hidden states (T, hidden) -> (T, vocab), tied or untied."""
        w = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return linear(x, w, kernel=self.linear_kernel)

    def forward(self, inputs: dict, ctx: StepCtx, state, all_positions: bool | str = False) -> dict:
        x = inputs["embeds"] if "embeds" in inputs else self.embed(inputs["ids"])
        h = self.hidden(x, ctx, state, bool(all_positions))
        # "hidden": every position's hidden (a draft head's input), the vocab head on the last only
        return {"logits": self.head(h[-1:] if all_positions == "hidden" else h), "hidden": h}

    def map_weight_name(self, name: str) -> str | None:
        """The plain Hugging Face causal-LM layout (`model.*`, optional `lm_head`)."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None                     # a tied head saved anyway duplicates embed_tokens
        return name[len("model."):] if name.startswith("model.") else name

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

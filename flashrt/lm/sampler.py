"""Token sampling over the arena's counter RNG (flashrt.core.rng): the host entry `sample` and
the graph-safe rule `draw` are one function, so the two paths cannot drift."""
from __future__ import annotations

import torch

from flashrt.core.rng import at_counter


def validate(temperature: float, top_k: int, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample(logits: torch.Tensor, rng: torch.Tensor, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits: (V,) float32. Returns the token as an int64 tensor of shape (1,).

    The host's entry to draw(): the same function a captured step runs on device tensors, so
    the two cannot drift. Greedy skips draw's sort (same argmax, no randomness consumed), and
    a filter the settings turn off is skipped (its mask would keep every token)."""
    if temperature == 0.0:
        return torch.argmax(logits).reshape(1)
    dev = logits.device
    return draw(logits, rng, torch.full((1,), temperature, dtype=torch.float32, device=dev),
                torch.full((1,), top_k, dtype=torch.int64, device=dev) if top_k > 0 else None,
                torch.full((1,), top_p, dtype=torch.float32, device=dev) if top_p < 1.0 else None)


def draw(logits: torch.Tensor, rng: torch.Tensor, temperature: torch.Tensor,
         top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """The sampling rule on device tensors, without host syncs or branches (graph-safe).

    logits (V,) float32; temperature (1,) float32; top_k (1,) int64 (0: off), top_p (1,)
    float32 (1.0: off), or None where the caller knows that filter is off. Returns the token,
    int64 (1,). Greedy (temperature 0) is argmax and consumes no randomness. Otherwise: scale,
    keep the top-k, keep the smallest set of tokens whose probability reaches top_p, then
    invert the CDF of what is left (sorted by probability, stable, so ties resolve the same
    way everywhere); the counter advances by one.
    """
    hot = temperature > 0                                            # (1,) bool
    zero = torch.zeros((), device=logits.device)
    # a temperature below 1e-6 divides like 1e-6 (one-hot anyway): 1e-44 made the logits inf
    # and the softmax NaN
    scaled = logits.float() / torch.where(hot, temperature.clamp(min=1e-6), torch.ones_like(temperature))
    probs, order = torch.sort(torch.softmax(scaled, dim=-1), descending=True, stable=True)
    if top_k is not None:
        rank = torch.arange(probs.shape[0], device=probs.device)
        probs = torch.where((top_k <= 0) | (rank < top_k), probs, zero)
    if top_p is not None:
        # keep token j if the mass before it is < top_p (the first token is always kept)
        before = torch.cumsum(probs, 0) - probs
        probs = torch.where((top_p >= 1.0) | (before < top_p * probs.sum()), probs, zero)
    cdf = torch.cumsum(probs.double(), 0)
    u = at_counter(rng) * cdf[-1]
    rng[1:2].add_(hot.long())
    j = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[0] - 1)
    return torch.where(hot, order[j], torch.argmax(logits).reshape(1))

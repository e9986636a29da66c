"""Sampling with a counter-based RNG whose whole state is two int64s in the arena.

`rng` = [seed, counter] (kind rng). Each draw hashes (seed, counter) with splitmix64 using
tensor ops only, then bumps the counter in place: a CUDA graph can advance it, a capsule
carries it, and the same (seed, counter, logits) always gives the same token on any device.
"""
from __future__ import annotations

import math

import torch

_M64 = 1 << 64


def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - _M64 if c >= 1 << 63 else c


_GOLDEN, _C1, _C2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift on int64 (>> is arithmetic in torch)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    # int64 multiply wraps modulo 2**64 on every torch backend, as splitmix64 needs.
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _C1
    z = (z ^ _shr(z, 27)) * _C2
    return z ^ _shr(z, 31)


def _at_counter(rng: torch.Tensor) -> torch.Tensor:
    """The draw in [0, 1) as float64 (shape (1,)) at rng = [seed, counter]; rng is not changed."""
    z = _splitmix64(_splitmix64(rng[0:1]) ^ rng[1:2])
    return _shr(z, 11).double() * (1.0 / (1 << 53))


def uniform(rng: torch.Tensor) -> torch.Tensor:
    """One draw in [0, 1) as float64 (shape (1,)) from rng = [seed, counter]; advances counter."""
    u = _at_counter(rng)
    rng[1:2].add_(1)
    return u


def uniforms(rng: torch.Tensor, n: int) -> torch.Tensor:
    """n draws in [0, 1) as float64 (shape (n,)): the same values as n calls of uniform()."""
    counters = rng[1:2] + torch.arange(n, device=rng.device)
    z = _splitmix64(_splitmix64(rng[0:1]) ^ counters)
    rng[1:2].add_(n)
    return _shr(z, 11).double() * (1.0 / (1 << 53))


def normal(rng: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Standard normal float32 of `shape` (Box-Muller over 2 * numel draws, float64 math);
    e.g. a policy's flow-matching noise, carried by capsules with the rng buffer."""
    n = math.prod(shape)
    u = uniforms(rng, 2 * n)
    r = torch.sqrt(-2.0 * torch.log1p(-u[:n]))       # 1 - u in (0, 1]: the log is finite
    return (r * torch.cos((2 * math.pi) * u[n:])).float().view(shape)


def seed_rng(rng: torch.Tensor, seed: int) -> None:
    rng.copy_(torch.tensor([_s64(seed % _M64), 0], dtype=torch.int64))


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
    u = _at_counter(rng) * cdf[-1]
    rng[1:2].add_(hot.long())
    j = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[0] - 1)
    return torch.where(hot, order[j], torch.argmax(logits).reshape(1))

"""A counter-based RNG whose whole state is two int64s in the arena.

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


def at_counter(rng: torch.Tensor) -> torch.Tensor:
    """The draw in [0, 1) as float64 (shape (1,)) at rng = [seed, counter]; rng is not changed."""
    z = _splitmix64(_splitmix64(rng[0:1]) ^ rng[1:2])
    return _shr(z, 11).double() * (1.0 / (1 << 53))


def uniform(rng: torch.Tensor) -> torch.Tensor:
    """One draw in [0, 1) as float64 (shape (1,)) from rng = [seed, counter]; advances counter."""
    u = at_counter(rng)
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

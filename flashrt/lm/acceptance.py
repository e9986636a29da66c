"""The speculative acceptance rule as pure functions, vectorised over leading dimensions.

Sampling: accept draft d ~ q with probability min(1, p(d)/q(d)); on the first rejection sample
from normalize(max(0, p - q)); all accepted: a bonus token from p. Greedy: p is a point mass.
"""
from __future__ import annotations

import torch


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The distribution `flashrt.lm.sampler.sample` draws from, as float64 probabilities (..., V).

    Same steps: scale, softmax, stable descending sort, keep top-k, keep the smallest prefix
    whose mass reaches top_p, renormalise. Greedy (temperature 0) is a point mass on argmax.
    """
    V = logits.shape[-1]
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), V).double()
    probs, order = torch.sort(torch.softmax(logits.float() / temperature, dim=-1), dim=-1,
                              descending=True, stable=True)
    zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
    if top_k > 0:
        probs = torch.where(torch.arange(V, device=probs.device) < top_k, probs, zero)
    if top_p < 1.0:
        before = torch.cumsum(probs, -1) - probs
        probs = torch.where(before < top_p * probs.sum(-1, keepdim=True), probs, zero)
    probs = probs.double()
    out = torch.zeros_like(probs).scatter_(-1, order, probs)
    return out / out.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in index order: probs (..., V) (need not sum to 1), u (...) in [0, 1).

    Never returns a zero-probability token (a rounding overshoot lands on the last nonzero)."""
    cdf = torch.cumsum(probs.double(), -1)
    x = (u.double() * cdf[..., -1]).unsqueeze(-1)
    j = torch.searchsorted(cdf, x, right=True)[..., 0]
    V = probs.shape[-1]
    last = V - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(j, last)


def accept_test(p: torch.Tensor, q: torch.Tensor, d: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept draft d ~ q with probability min(1, p(d)/q(d)): u * q(d) < p(d), u in [0, 1)."""
    pd = p.gather(-1, d.unsqueeze(-1))[..., 0].double()
    qd = q.gather(-1, d.unsqueeze(-1))[..., 0].double()
    return u.double() * qd < pd


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)); p itself where that is empty (p == q: rejection impossible)."""
    r = (p.double() - q.double()).clamp_min_(0.0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / torch.where(s > 0, s, torch.ones_like(s)), p.double())


def accept_draft(p, q, d, u_accept, u_resample):
    """One position of the rule: (accepted, token). token = d if accepted, else a sample of the
    residual. Shapes: p, q (..., V); d, u_accept, u_resample (...). Vectorised for tests."""
    ok = accept_test(p, q, d, u_accept)
    return ok, torch.where(ok, d, sample_from(residual(p, q), u_resample))

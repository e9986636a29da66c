"""Checking what users pass as model inputs, and content ids for embedding positions.

Embedding positions (image or audio features) enter the token history as negative content
ids: -(1 + base + i) for row i of a segment whose content digest is `base`. So the history
names them, a capsule carries them, and a store's prefix trie matches a repeated image +
instruction prefix by content.
"""
from __future__ import annotations

import hashlib
import numbers

import torch

_BASE_BITS = 61       # digest bits; leaves room for row offsets below 2**62


def token_ids(ids, vocab: int, device) -> torch.Tensor:
    """A 1-D int64 tensor of token ids in [0, vocab), or a TypeError/ValueError naming why not."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"token ids expected, got {type(ids).__name__}: tokenize text first, "
                        "e.g. rt.prefill(rt.tokenizer.encode(text))")
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got dtype {ids.dtype}")
        vals = ids.reshape(-1).tolist()
    else:
        try:
            vals = list(ids)
        except TypeError:
            raise TypeError(f"token ids must be a list or 1-D tensor of ints, got "
                            f"{type(ids).__name__}") from None
        for j, v in enumerate(vals):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"token id at index {j} is {v!r} ({type(v).__name__}); token ids "
                                "must be ints")
        vals = [int(v) for v in vals]
    if not vals:
        raise ValueError("empty ids: need at least one token")
    for j, i in enumerate(vals):
        if not 0 <= i < vocab:
            raise ValueError(f"token id {i} at index {j} is outside the vocabulary [0, {vocab})")
    return torch.tensor(vals, dtype=torch.int64, device=device)


def embeds_ids(embeds, hidden: int, position_ids=None, specs=()):
    """(content ids (T,) int64 on CPU, (base, host embeds, host position ids or None)) for an
    embedding segment; the digest covers the embeddings and their rope positions."""
    if not isinstance(embeds, torch.Tensor) or not embeds.is_floating_point():
        raise TypeError(f"embeds must be a floating-point tensor (T, {hidden}), got "
                        f"{type(embeds).__name__}")
    if embeds.dim() != 2 or embeds.shape[1] != hidden or embeds.shape[0] == 0:
        raise ValueError(f"embeds must have shape (T >= 1, {hidden}), got {tuple(embeds.shape)}")
    host = embeds.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.sha256(host.numpy().tobytes())
    pid = None
    if position_ids is not None:
        if not any(s.name == "position_ids" for s in specs):
            raise ValueError("position_ids=: this model takes no position ids (its inputs: "
                             f"{[s.name for s in specs]})")
        want = next(s.shape for s in specs if s.name == "position_ids")
        if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point() or \
                tuple(position_ids.shape) != (host.shape[0], *want):
            raise ValueError(f"position_ids must be an integer tensor of shape "
                             f"{(host.shape[0], *want)}, got {getattr(position_ids, 'shape', position_ids)}")
        pid = position_ids.detach().to("cpu", torch.int64).contiguous()
        digest.update(pid.numpy().tobytes())
    base = int.from_bytes(digest.digest()[:8], "little") >> (64 - _BASE_BITS)
    ids = -(1 + base + torch.arange(host.shape[0], dtype=torch.int64))
    return ids, (base, host, pid)


def context_ids(context, vocab: int, max_len: int, who: str = "set_context", specs=()):
    """(history ids, [(base, embeds)]) for a context of token ids and embedding tensors."""
    if type(context) is list and 0 < len(context) <= max_len and all(type(v) is int for v in context) \
            and 0 <= min(context) and max(context) < vocab:
        return list(context), []         # plain token ids, all valid: no per-item checks
    if isinstance(context, torch.Tensor) and not context.is_floating_point():
        context = context.reshape(-1).tolist()
    if isinstance(context, (str, bytes)) or not isinstance(context, (list, tuple)):
        raise TypeError(f"{who}: context must be a list of token ids (and (T, hidden) embedding "
                        f"tensors), got {type(context).__name__}; tokenize text first")
    out, segs, run = [], [], []
    for item in list(context) + [None]:
        seg = item if isinstance(item, tuple) else (item, None)     # (embeds, position_ids)
        if isinstance(seg[0], torch.Tensor) and seg[0].is_floating_point() or item is None:
            if run:
                try:
                    out += token_ids(run, vocab, "cpu").tolist()
                except (TypeError, ValueError) as e:
                    raise type(e)(f"{who}: {e}") from None
                run = []
            if item is not None:
                e = seg[0]
                ids, s = embeds_ids(e, e.shape[-1] if e.dim() == 2 else -1, seg[1], specs)
                out += ids.tolist()
                segs.append(s)
        else:
            run.append(item)
    if not out or len(out) > max_len:
        raise ValueError(f"{who}: context needs 1..{max_len} positions, got {len(out)}")
    return out, segs


class EmbeddingSegments:
    """Embedding segments a session prefilled, by content digest: rollback and set_context
    re-run embedding positions from here. Immutable once added, so forks share them."""

    def __init__(self):
        self._segs: dict = {}

    def add(self, base: int, embeds: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        self._segs.setdefault(base, (embeds, position_ids))

    def rows(self, ids: list[int]):
        """(embeddings (n, hidden), position ids (n, 3) or None) behind n consecutive content ids."""
        first = -ids[0] - 1
        for base, (e, pid) in self._segs.items():
            i = first - base
            if 0 <= i and i + len(ids) <= e.shape[0]:
                return e[i: i + len(ids)], (None if pid is None else pid[i: i + len(ids)])
        raise ValueError(f"positions with content ids {ids[0]}..{ids[-1]} came from embeddings "
                         "this session does not hold (a capsule restored from elsewhere): "
                         "restore a capsule at or after them, or prefill the embeddings again")


def common_prefix(a, b) -> int:
    """How many leading ids two histories share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

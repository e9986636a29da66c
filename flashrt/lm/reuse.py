"""Reuse policy for a language-model session: reach a wanted context by the cheapest path.

Candidates: the session's own history (extend it, or roll back to the common prefix, which
re-runs from the nearest rollback source) and the longest prefix stored in a CapsuleStore
(restore it, prefill the rest). The new boundary is remembered in the store as a
shared-prefix capsule over the deepest stored capsule it extends.
"""
from __future__ import annotations

import warnings

import torch

from flashrt.errors import CapsuleError
from flashrt.lm.inputs import context_ids


def set_context(lm, context, store=None, remember: bool = True, advance=None) -> int:
    """Make lm's whole context exactly `context`; returns the positions not re-run.
    advance(ids): appends the positions not reused (default lm.advance)."""
    toks, segs = context_ids(context, lm.net.vocab_size, lm.max_seq_len,
                             specs=lm.net.input_specs(lm.model.dtype))
    for seg in segs:
        lm.embeds.add(*seg)
    n = min(lm.position, len(toks))
    diff = (lm.arena["meta.tokens"][:n].cpu() != torch.tensor(toks[:n])).nonzero()
    common = int(diff[0]) if len(diff) else n
    own = common if common == lm.position else lm.session.rollback_source(common)
    cap, m = store.match(toks, lm.fingerprint) if store is not None else (None, 0)
    if cap is not None and m > own:              # fewer positions to re-run from the store
        lm.restore(cap)
        reused = m
    else:
        if common < lm.position:
            lm.rollback(common)
        reused = own
    if lm.position < len(toks):
        (advance or lm.advance)(torch.tensor(toks[lm.position:], device=lm.arena.device))
    if remember and store is not None and m < len(toks):
        remember_boundary(lm, store)
    return reused


def remember_boundary(lm, store) -> None:
    """Store a capsule of lm's boundary: only the rows past the deepest stored capsule it
    extends. Failing to store it never fails the caller (the context is set)."""
    stored = [a for a in lm.session.ancestors() if store.key_of(a[0]) is not None]
    parent = max(stored, key=lambda a: a[1], default=None)     # (id, position)
    try:
        store.put(lm.session.snapshot(parent=parent))
    except (ValueError, CapsuleError) as e:
        warnings.warn(f"set_context: boundary not remembered: {e}")

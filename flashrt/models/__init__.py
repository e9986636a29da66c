"""Models: the protocol a model file implements, the registry, the loader, and one file per
Hugging Face model_type (plus random-weight checkpoint writers for each).

Rule: a model file imports from `flashrt.models.base` only (and torch); it never imports a
session, capsule, language-model, policy or serve module. The loader and registry import model
files; nothing below this package imports lm, policy, speech or serve. Adding a model is one
file here and one line in registry.py.
"""
from __future__ import annotations

from .registry import MODEL_TYPES, model_module  # noqa: F401


def make_checkpoint(*args, **kwargs):
    """Write a random-weight checkpoint in a family's real on-disk format (see checkpoint.py)."""
    from .checkpoint import make_checkpoint as _make
    return _make(*args, **kwargs)


def default_checkpoint(*args, **kwargs):
    from .checkpoint import default_checkpoint as _default
    return _default(*args, **kwargs)

"""Execution-state capsules: types, copy (arena <-> capsule), format (files), index (prefix
trie) and store (tiers, budgets, LRU)."""
from flashrt.errors import (CapsuleConsumedError, CapsuleCorruptError, CapsuleError,  # noqa: F401
                            CapsuleMismatchError)

from .format import load as load_capsule, read_header, save as save_capsule  # noqa: F401
from .store import CapsuleStore  # noqa: F401
from .types import Capsule, CapsuleMeta, Entry  # noqa: F401

__all__ = ["Capsule", "CapsuleMeta", "Entry", "CapsuleStore", "save_capsule", "load_capsule",
           "read_header", "CapsuleError", "CapsuleMismatchError", "CapsuleCorruptError",
           "CapsuleConsumedError"]

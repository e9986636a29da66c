"""Execution-state capsules at rest: the capsule type, the file format, the prefix index, the
store with its memory and disk tiers, and the Redis fleet tier.

Rule: bytes at rest. capsules/ imports only native/ and errors; never core, nn, models, lm,
policy or serve, and it names no buffer (the session says which entry is a capsule's history
key, in its metadata). Copying an arena into a capsule is core's (core/copy.py).
"""
from flashrt.errors import (CapsuleConsumedError, CapsuleCorruptError, CapsuleError,  # noqa: F401
                            CapsuleMismatchError)

from .format import load as load_capsule, read_header, save as save_capsule  # noqa: F401
from .named import NamedCapsules, NamedLimitError  # noqa: F401
from .store import CapsuleStore  # noqa: F401
from .types import Capsule, CapsuleMeta, Entry  # noqa: F401

__all__ = ["Capsule", "CapsuleMeta", "Entry", "CapsuleStore", "NamedCapsules", "NamedLimitError",
           "save_capsule", "load_capsule",
           "read_header", "CapsuleError", "CapsuleMismatchError", "CapsuleCorruptError",
           "CapsuleConsumedError"]

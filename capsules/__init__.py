"""Execution-state capsules (capsule.py, format.py) and the tiered capsule store (store.py)."""
from flashrt.errors import (CapsuleConsumedError, CapsuleCorruptError, CapsuleError,  # noqa: F401
                            CapsuleMismatchError)

from .capsule import Capsule  # noqa: F401
from .store import CapsuleStore  # noqa: F401

__all__ = ["Capsule", "CapsuleStore", "CapsuleError", "CapsuleMismatchError",
           "CapsuleCorruptError", "CapsuleConsumedError"]

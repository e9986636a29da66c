"""Exception types. Every error names what is wrong; none is raised after live state changed."""


class FlashRTError(Exception):
    """Base of all FlashRT errors."""


class ArenaError(FlashRTError, RuntimeError):
    """A bad buffer layout, or an arena the device cannot hold."""


class ConfigError(FlashRTError, ValueError):
    """A checkpoint config the implementation does not support; the message names the field."""


class WeightError(FlashRTError, ValueError):
    """A missing, unexpected or mis-shaped weight; the message names the tensor."""


class CapsuleError(FlashRTError):
    """Base of capsule errors."""


class CapsuleMismatchError(CapsuleError):
    """The capsule does not fit this runtime (weights, config, dtype, layout, length)."""


class CapsuleCorruptError(CapsuleError):
    """The capsule file is damaged: checksum, truncation, magic or format version."""


class CapsuleConsumedError(CapsuleError):
    """A single-use capsule was already restored once."""

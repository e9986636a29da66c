"""FlashRT: a latency-first execution-state runtime.

    rt = flashrt.load(path)            # weights + one session (arena) on a device
    logits = rt.prefill(ids); tok = rt.generate(max_new_tokens=8)
    cap = rt.snapshot(); ...; rt.restore(cap)   # byte-exact state capsules

The package's folders, each with its rule in its own docstring (tests/test_structure.py checks
the imports against them): native/ and kernels/ (compiled and Triton code), capsules/ (bytes at
rest), core/ (arena, session, copies, graphs), nn/ (building blocks), models/ (protocol,
registry, loader, one file per model), lm/ and policy/ (layers on a Session), serve/ (HTTP),
dev/ (demo and training entry points). Nothing inside the package imports this face.
"""
from __future__ import annotations

from .errors import (ArenaError, CapsuleConsumedError, CapsuleCorruptError, CapsuleError,  # noqa: F401
                     CapsuleMismatchError, ConfigError, FlashRTError, WeightError)
from .version import __version__  # noqa: F401


def load(path, device="cpu", dtype=None, max_seq_len: int = 4096, cuda_graphs: bool = True,
         sessions: int = 1, prefill_chunk: int = 2048, checkpoint_every: int = 1024,
         max_checkpoints: int = 16, seed: int = 0, linear_kernel: str = "auto",
         compile: bool = False, weights: str = "float"):
    """Load a Hugging Face-format checkpoint directory and open a session on it
    (flashrt.lm.load with these settings: the fields of flashrt.lm.Options).

    sessions > 1 pre-allocates (and on CUDA pre-captures) that many sessions in total, so
    `fork()` never allocates or captures on the hot path; it raises when none is free.
    linear_kernel: "auto" (on CPU: "flashrt" where the extension's small-M kernel runs, else
    "onednn" where oneDNN runs the dtype; else "aten"), "flashrt" (oneDNN, with 2-32-row float32
    steps and 1-8-row bf16 steps on the small-M kernel; bf16 where oneDNN has no bf16, as on
    AVX2-only CPUs: 1-32 rows on the small-M kernel, longer steps on oneDNN in float32 from
    weights widened per call, reported as "flashrt-widen"), "onednn" or "aten" (F.linear,
    transformers' kernel: bitwise-comparable with it; for debugging).
    compile: steps of up to 64 positions run as torch.compile'd (inductor) bodies, captured
    after compiling on CUDA; the chosen linear kernels stay whole inside them (one custom op).
    Off by default: each body compiles on first use (seconds to minutes); bench/compile.py
    measures where it pays.
    weights: "float" (as stored, in dtype) or "int8" (per-row symmetric int8 projections and
    vocabulary head, float activations; CPU; a capsule is refused across weight formats).
    """
    from .lm import Options, load as _load
    return _load(path, Options(max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
                               checkpoint_every=checkpoint_every, max_checkpoints=max_checkpoints,
                               device=device, dtype=dtype, linear_kernel=linear_kernel,
                               sessions=sessions, cuda_graphs=cuda_graphs, seed=seed,
                               compile=compile, weights=weights))


def load_policy(path, device="cpu", dtype=None, seed: int = 0):
    """Load a LeRobot policy directory (SmolVLA) as a flashrt.policy.Policy: select_action(obs)
    on raw observations, predict_action_chunk, reset, snapshot / restore / fork."""
    from .policy import load_policy as _load_policy
    return _load_policy(path, device=device, dtype=dtype, seed=seed)


def __getattr__(name):
    # Lazy: importing flashrt stays cheap and free of torch work until used.
    if name == "LanguageModel":
        from .lm import LanguageModel
        return LanguageModel
    if name == "Session":
        from .core.session import Session
        return Session
    if name in ("Capsule", "save_capsule", "load_capsule"):
        from . import capsules
        return getattr(capsules, name)
    raise AttributeError(f"module 'flashrt' has no attribute {name!r}")


__all__ = ["load", "load_policy", "LanguageModel", "Session", "Capsule", "save_capsule",
           "load_capsule", "FlashRTError", "ArenaError", "ConfigError", "WeightError",
           "CapsuleError", "CapsuleMismatchError", "CapsuleCorruptError", "CapsuleConsumedError",
           "__version__"]

"""The policy layer: observations in, actions out, over a Session (what flashrt.lm is for LMs).

Rule: policy/ sits on a Session: it imports core, models, capsules and errors; never lm,
serve or dev.

It follows LeRobot's PreTrainedPolicy: `select_action(obs)` hands out the next queued action
and runs a new chunk when the queue is empty; `predict_action_chunk(obs, noise=None)` runs
one; `reset()` empties the queue. Every piece of state is an arena buffer, so a capsule
taken anywhere (mid-chunk included) continues bitwise, and forks are what-if branches.
The model runs under the contract of flashrt.models.protocol.PolicyModel (its docstring:
attributes, buffers, forward, processors); contract.py checks it, policy.py holds Policy.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from flashrt.errors import ConfigError
from flashrt.models.loader import resolve_dtype

from .contract import check_policy_model  # noqa: F401
from .policy import Policy


def load_policy(path, device="cpu", dtype=None, seed: int = 0, linear_kernel: str = "auto") -> Policy:
    """A LeRobot policy directory (config.json, model.safetensors, processor files) -> a
    Policy over raw LeRobot observations that returns unnormalised actions. dtype None: float32
    on CPU. linear_kernel: auto | aten | onednn | flashrt (see flashrt.load)."""
    path, device = Path(path), torch.device(device)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a LeRobot policy directory)")
    kind = json.loads((path / "config.json").read_text()).get("type")
    if kind != "smolvla":
        raise ConfigError(f"{path}: policy type {kind!r} is not supported (supported: 'smolvla')")
    from flashrt.models.smolvla_processor import load_with_fingerprint
    net, proc, fp = load_with_fingerprint(path, device=device, dtype=resolve_dtype(dtype, device, None),
                                          linear_kernel=linear_kernel)
    return Policy(net, fp, seed=seed, provenance={"path": str(path)}, processor=proc)

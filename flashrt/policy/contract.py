"""The check that a model is a flashrt.models.protocol.PolicyModel this layer can run: the class,
its attributes and the buffers it declares (the contract itself is documented on the class)."""
from __future__ import annotations

import torch

from flashrt.core.arena import CAPSULE_KINDS
from flashrt.models.protocol import PolicyModel

# (name, kind, shape, dtype) of the fixed-shape policy buffers; actions.queue is checked below
_BUFFERS = (("actions.head", "meta", (1,), torch.int64), ("actions.count", "meta", (1,), torch.int64),
            ("step", "meta", (1,), torch.int64), ("noise.rng", "rng", (2,), torch.int64))


def check_policy_model(net, dtype: torch.dtype) -> None:
    """Refuse a model this layer cannot run, naming each gap and what was expected."""
    name = type(net).__name__
    if not isinstance(net, PolicyModel):
        raise TypeError(f"{name} is not a policy model: expected a subclass of "
                        "flashrt.models.protocol.PolicyModel (models/tiny_vla.py is the smallest)")
    attrs = PolicyModel.__annotations__
    missing = [f"{a!r} ({attrs[a]})" for a in attrs if not hasattr(net, a)]
    if missing:
        raise ValueError(f"{name} does not set PolicyModel attribute(s) {', '.join(missing)} "
                         "(see flashrt.models.protocol.PolicyModel)")
    noise = tuple(net.noise_shape)
    if len(noise) != 2 or not 0 < net.action_dim <= noise[1]:
        raise ValueError(f"{name}: noise_shape {noise}, action_dim {net.action_dim}; expected "
                         "(chunk_size, noise_dim) and 1 <= action_dim <= noise_dim")
    chunk = noise[0]
    specs = {s.name: s for s in net.state_specs(net.prefix_len, dtype)}
    gaps = []
    for n, kind, shape, dt in _BUFFERS:
        s = specs.get(n)
        if s is None or (s.kind, tuple(s.shape), s.dtype) != (kind, shape, dt):
            gaps.append(f"{n} ({kind}, {shape}, {dt})")
    q = specs.get("actions.queue")
    if q is None or q.kind not in CAPSULE_KINDS or q.seq_dim is not None or q.dtype != torch.float32 \
            or len(q.shape) != 2 or q.shape[1] != net.action_dim or q.shape[0] > chunk:
        gaps.append(f"actions.queue (fixed capsule kind, (n <= {chunk}, {net.action_dim}), float32)")
    if gaps:
        raise ValueError(f"{name} does not declare the policy buffers: {'; '.join(gaps)}")

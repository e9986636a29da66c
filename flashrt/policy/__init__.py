"""The policy layer: observations in, actions out, over a Session (what flashrt.lm is for LMs).

Rule: policy/ sits on a Session: it imports core, models, capsules and errors; never lm,
serve or dev.

It follows LeRobot's PreTrainedPolicy: `select_action(obs)` hands out the next queued action
and runs a new chunk when the queue is empty; `predict_action_chunk(obs, noise=None)` runs
one; `reset()` empties the queue. Every piece of state is an arena buffer, so a capsule
taken anywhere (mid-chunk included) continues bitwise, and forks are what-if branches.

Contract for a policy model (a flashrt.models.protocol.StatefulModel; models/tiny_vla.py is the
smallest, a SmolVLA or pi0 file follows the same):
  attributes
    prefix_len     rows of prefix K/V one chunk writes (the session's max_seq_len)
    obs_shapes     {name: shape} of one observation, batch 1 without a batch dim
    noise_shape    (chunk_size, noise_dim) of the flow-matching noise
    action_dim     (optional; default noise_dim) action width: SmolVLA and pi0 pad noise to 32
    model_type, config (a dataclass)   what the default fingerprint digests, with the weights
  state_specs(max_seq_len, dtype) declares, besides its own buffers (prefix K/V: per-token rows
  [0, prefix_len), kind kv, rewritten at every chunk):
    actions.queue  (n_action_steps, action_dim) float32, fixed-size capsule kind: the chunk
                   being handed out (n_action_steps <= chunk_size)
    actions.head   (1,) int64 meta: next queue row to hand out
    actions.count  (1,) int64 meta: rows filled; head == count: empty
    noise.rng      (2,) int64 rng: [seed, counter] of flashrt.core.rng, the noise source
    step           (1,) int64 meta: actions handed out since reset
  forward({**obs, "noise"?}, ctx, arena) with ctx over positions [0, prefix_len): writes the
  prefix rows, denoises (drawing noise from noise.rng unless "noise" is given) and returns
  {"actions": (chunk_size, action_dim)}. It never touches the queue buffers: this layer does.
The session's position is the count of valid prefix rows: 0 after reset, prefix_len after a chunk.

A processor (optional; LeRobot's pre/postprocessor, e.g. models/smolvla_processor.py) takes raw
observations instead: preprocess(obs) -> forward's inputs, refusing bad input before any state
is written; postprocess(actions) -> robot units, applied to what select_action and
predict_action_chunk return (the queue holds the model's actions, as LeRobot's does).
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import asdict
from pathlib import Path

import torch

from flashrt.core.arena import CAPSULE_KINDS
from flashrt.capsules.types import Capsule
from flashrt.errors import ConfigError
from flashrt.models.loader import resolve_dtype, weights_digest
from flashrt.core.rng import seed_rng
from flashrt.core.session import Session, SessionOptions

_I64 = ("meta", (1,), torch.int64)
_CONTRACT = {"actions.head": _I64, "actions.count": _I64, "step": _I64,
             "noise.rng": ("rng", (2,), torch.int64)}


def fingerprint_of(net, dtype: torch.dtype) -> dict:
    """What decides a capsule's meaning, for a model built in memory (random weights): its
    type, a digest of its config and of its parameters (names as the model has them)."""
    cfg = json.dumps(asdict(net.config), sort_keys=True, default=str).encode()
    params = [(n, t.detach().cpu()) for n, t in net.state_dict().items()]
    return {"model_type": net.model_type, "config": hashlib.sha256(cfg).hexdigest()[:16],
            "weights": weights_digest(params), "dtype": str(dtype).replace("torch.", "")}


def action_dim(net) -> int:
    return getattr(net, "action_dim", net.noise_shape[1])


def check_contract(net, dtype: torch.dtype) -> None:
    """Refuse a model that does not declare what this layer needs, naming each gap."""
    gaps = [f"attribute {a!r}" for a in ("prefix_len", "obs_shapes", "noise_shape")
            if not hasattr(net, a)]
    if gaps:
        raise ValueError(f"{type(net).__name__} is not a policy model: missing {', '.join(gaps)}")
    specs = {s.name: s for s in net.state_specs(net.prefix_len, dtype)}
    for name, (kind, shape, dt) in _CONTRACT.items():
        s = specs.get(name)
        if s is None or (s.kind, tuple(s.shape), s.dtype) != (kind, shape, dt):
            gaps.append(f"{name} ({kind}, {shape}, {dt})")
    q, width = specs.get("actions.queue"), action_dim(net)
    if q is None or q.kind not in CAPSULE_KINDS or q.seq_dim is not None or q.dtype != torch.float32 \
            or len(q.shape) != 2 or q.shape[1] != width or q.shape[0] > net.noise_shape[0]:
        gaps.append(f"actions.queue (fixed capsule kind, (n <= {net.noise_shape[0]}, "
                    f"{width}), float32)")
    if gaps:
        raise ValueError(f"{type(net).__name__} does not declare the policy buffers: {'; '.join(gaps)}")


def _check_tensor(what: str, t, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != shape:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what}: expected a float tensor of shape {shape}, got {got}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what}: has non-finite values (NaN or inf)")


class Policy:
    """A policy session (batch 1) over a policy model's weights; forks share the weights.
    fingerprint: a flashrt.models.loader.LoadedModel's when loaded from disk; default: computed."""

    def __init__(self, net, fingerprint: dict | None = None, seed: int = 0,
                 provenance: dict | None = None, processor=None):
        p = next(net.parameters())
        self.net, self.device, self.dtype, self._prov = net, p.device, p.dtype, provenance
        self.processor = processor
        check_contract(net, self.dtype)
        self._fp = fingerprint if fingerprint is not None else fingerprint_of(net, self.dtype)
        n = net.prefix_len           # no rollback checkpoints: a chunk rewrites every prefix row
        opts = SessionOptions(max_seq_len=n, prefill_chunk=n, checkpoint_every=n + 1, max_checkpoints=1)
        self.session = Session(net, [], self.device, self.dtype, self._fp, opts, provenance)
        self.arena = self.session.arena
        self._lock = threading.RLock()
        self.seed(seed)

    position = property(lambda self: self.session.position)
    fingerprint = property(lambda self: self.session.fingerprint)

    def layout(self) -> str:
        return self.arena.table()

    @property
    def queue_length(self) -> int:
        """Actions left in the queue."""
        return int(self.arena["actions.count"]) - int(self.arena["actions.head"])

    @property
    def steps(self) -> int:
        """Actions handed out since the last reset (the arena's step counter)."""
        return int(self.arena["step"])

    # ---- inputs -------------------------------------------------------------------------
    def _prepare(self, obs: dict, noise) -> dict:
        """forward's inputs; every refusal happens here, before any state is written."""
        if self.processor is not None:
            inputs = dict(self.processor.preprocess(obs))     # raw obs: the processor checks
        else:
            want = self.net.obs_shapes
            if not isinstance(obs, dict) or set(obs) != set(want):
                got = sorted(obs, key=str) if isinstance(obs, dict) else type(obs).__name__
                raise ValueError(f"observation: expected a dict with keys {sorted(want)}, got {got}")
            for k, shape in want.items():
                _check_tensor(f"observation {k!r}", obs[k], tuple(shape))
            inputs = {k: obs[k].to(self.device, self.dtype) for k in want}
        if noise is not None:
            _check_tensor("noise", noise, tuple(self.net.noise_shape))
            inputs["noise"] = noise.to(self.device, torch.float32)
        return inputs

    def _post(self, actions: torch.Tensor) -> torch.Tensor:
        return actions if self.processor is None else self.processor.postprocess(actions)

    def _chunk(self, inputs: dict) -> torch.Tensor:
        """Rewrite the prefix rows from inputs, denoise; the chunk as the model returns it."""
        self.session.adopt(0)       # this chunk's prefix overwrites rows [0, prefix_len)
        out = self.session.step(self.net.prefix_len, lambda ctx: self.net(inputs, ctx, self.arena))
        return out["actions"]

    # ---- public stepping ------------------------------------------------------------------
    @torch.no_grad()
    def predict_action_chunk(self, obs: dict, noise: torch.Tensor | None = None) -> torch.Tensor:
        """A fresh chunk (chunk_size, action_dim) float32 for obs; the queue is left as it is.
        noise=None draws it from the arena's RNG (advancing it); given noise draws nothing."""
        with self._lock:
            inputs = self._prepare(obs, noise)
            return self._post(self._chunk(inputs).float().clone())

    @torch.no_grad()
    def select_action(self, obs: dict, noise: torch.Tensor | None = None) -> torch.Tensor:
        """The next queued action (action_dim,) float32; an empty queue first runs a chunk
        and queues its first n_action_steps rows. obs is checked even when not needed."""
        with self._lock:
            inputs = self._prepare(obs, noise)
            a = self.arena
            head = int(a["actions.head"])
            if head >= int(a["actions.count"]):
                q = a["actions.queue"]
                q.copy_(self._chunk(inputs)[: q.shape[0]])
                a["actions.count"].fill_(q.shape[0])
                a["actions.head"].zero_()
                head = 0
            action = a["actions.queue"][head].clone()
            a["actions.head"].add_(1)
            a["step"].add_(1)
            return self._post(action)

    def seed(self, seed: int) -> None:
        """Restart the noise stream at `seed` (counter 0)."""
        with self._lock, torch.no_grad():
            seed_rng(self.arena["noise.rng"], seed)

    def reset(self) -> None:
        """A new episode: queue, step counter and prefix emptied; the noise stream continues.
        For an episode that replays exactly, restore a capsule of the initial state instead."""
        with self._lock:
            self.session.reset()

    # ---- capsules -------------------------------------------------------------------------
    def snapshot(self, into: Capsule | None = None, single_use: bool = False) -> Capsule:
        """Copy the whole state: prefix rows, queue and index, step counter, noise RNG."""
        with self._lock:
            return self.session.snapshot(into, single_use)

    def restore(self, cap: Capsule, on_validated=None) -> None:
        """Make the state the capsule's; refused, state untouched, unless it fits (model,
        config, weights, dtype, layout). on_validated: see Session.restore (the store's claim)."""
        with self._lock:
            self.session.restore(cap, on_validated=on_validated)

    def empty_capsule(self) -> Capsule:
        """A preallocated capsule buffer for snapshot(into=)."""
        return self.session.empty_capsule()

    def fork(self, cap: Capsule | None = None, seed: int | None = None) -> "Policy":
        """An independent policy over the same weights, from `cap` or the live state; seed
        restarts its noise stream (the queued actions it inherited stay as they are)."""
        with self._lock:
            src = cap if cap is not None else self.snapshot()
            child = Policy(self.net, self._fp, provenance=self._prov, processor=self.processor)
            child.restore(src)
            if seed is not None:
                child.seed(seed)
            return child


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
    from flashrt.models.smolvla_processor import load
    net, proc = load(path, device=device, dtype=resolve_dtype(dtype, device, None), linear_kernel=linear_kernel)
    return Policy(net, seed=seed, provenance={"path": str(path)}, processor=proc)

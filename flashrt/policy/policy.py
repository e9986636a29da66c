"""Policy: a PolicyModel on a Session, with LeRobot's action queue; all its state is arena buffers."""
from __future__ import annotations

import threading

import torch

from flashrt.capsules.types import Capsule
from flashrt.core.layer import SessionLayer
from flashrt.core.rng import seed_rng
from flashrt.core.session import Session, SessionOptions
from flashrt.models.loader import fingerprint as model_fingerprint

from .contract import check_policy_model


def _check_tensor(what: str, t, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != shape:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{what}: expected a float tensor of shape {shape}, got {got}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what}: has non-finite values (NaN or inf)")


class Policy(SessionLayer):
    """A policy session (batch 1) over a PolicyModel's weights; forks share the weights.
    State (what a capsule holds): prefix rows, queue and index, step counter, noise RNG; reset()
    empties all but the noise stream (restore a capsule of the initial state to replay exactly).
    fingerprint: the loader's when loaded from disk (so capsules fit any load of those files);
    default: flashrt.models.loader.fingerprint of the parameters as they are."""

    def __init__(self, net, fingerprint: dict | None = None, seed: int = 0,
                 provenance: dict | None = None, processor=None):
        p = next(net.parameters())
        self.net, self.device, self.dtype, self._prov = net, p.device, p.dtype, provenance
        self.processor = processor
        check_policy_model(net, self.dtype)
        self._fp = fingerprint if fingerprint is not None else model_fingerprint(net, self.dtype)
        n = net.prefix_len           # no rollback checkpoints: a chunk rewrites every prefix row
        opts = SessionOptions(max_seq_len=n, prefill_chunk=n, checkpoint_every=n + 1, max_checkpoints=1)
        self.session = Session(net, [], self.device, self.dtype, self._fp, opts, provenance)
        self.arena = self.session.arena
        self._lock = threading.RLock()
        self.seed(seed)

    position = property(lambda self: self.session.position)

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

    # ---- capsules -------------------------------------------------------------------------
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

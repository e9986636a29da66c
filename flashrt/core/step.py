"""The step context: what a Session tells a model about one step (the contract between them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepCtx:
    """Host-planned description of one step over T new tokens."""
    T: int
    positions: torch.Tensor          # (T,) int64 absolute positions of the new tokens
    start: int | None = None         # committed position before the step (eager path)
    static: bool = False             # graph-safe path: no host ints, no data-dependent shapes
    rope: torch.Tensor | None = None  # (T,) or (3, T) rotary positions where they differ (mrope)
    # fixed buffer name -> (T, *shape): each mixer also writes its state after every position t
    # into planes[name][t] (speculative verify: Session.state_planes, StatePlanes.keep)
    planes: dict | None = None

    @property
    def end(self) -> int:
        return self.start + self.T

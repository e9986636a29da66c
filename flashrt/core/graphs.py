"""CUDA graph capture in one place: bodies captured once per session over its arena.

A body reads inputs from fixed-address arena buffers and writes its results there too, so a
graph replays it at any position (the position is a device tensor, never a baked-in int).
Warm-up runs the bodies for real; the caller supplies `preserving`, which puts the session's
state back afterwards. Capture is largest body first into one shared memory pool.
"""
from __future__ import annotations

from typing import Callable

import torch


class CapturedBodies:
    def __init__(self):
        self.graphs: dict = {}
        self.outs: dict = {}
        self._pool = None

    def capture(self, bodies: dict, preserving: Callable) -> None:
        """bodies: key -> zero-argument callable, in increasing size; captured once each."""
        def go():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.no_grad(), torch.cuda.stream(stream):
                for body in bodies.values():       # warm-up: kernels chosen, workspaces sized
                    body()
            torch.cuda.current_stream().wait_stream(stream)
            with torch.no_grad():
                for key, body in reversed(list(bodies.items())):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self._pool):
                        self.outs[key] = body()
                    self._pool = g.pool() if self._pool is None else self._pool
                    self.graphs[key] = g
            torch.cuda.synchronize()
        preserving(go)

    def __contains__(self, key) -> bool:
        return key in self.graphs

    def replay(self, key):
        """Replay; returns the body's output tensors (static buffers: copy before the next)."""
        self.graphs[key].replay()
        return self.outs[key]


def power_of_two_sizes(max_size: int) -> list[int]:
    """Captured step sizes; any length replays as a sum of them (no padding: padding would
    advance recurrent state by positions that do not exist)."""
    return [1 << i for i in range(max_size.bit_length()) if (1 << i) <= max_size]


class HostReadback:
    """Small device results read on the host without stalling the stream: a two-slot ring
    (pinned on CUDA); slot k is read after its event while the device runs the next step."""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int64):
        cuda = device.type == "cuda"
        self.host = torch.zeros(2, dtype=dtype, pin_memory=cuda)
        self.events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self.pushed = self.popped = 0

    def push(self, src: torch.Tensor) -> None:
        """Queue a copy of src (1,) behind the work already on the stream."""
        if self.pushed - self.popped >= 2:
            raise RuntimeError("HostReadback: both slots are in flight; pop() one first")
        i = self.pushed % 2
        self.host[i: i + 1].copy_(src, non_blocking=True)
        if self.events is not None:
            self.events[i].record()
        self.pushed += 1

    def pop(self):
        """The oldest pushed value, as a Python number (waits for its copy only)."""
        i = self.popped % 2
        if self.events is not None:
            self.events[i].synchronize()
        self.popped += 1
        return self.host[i].item()

    def clear(self) -> None:
        """Forget values pushed and not popped (their copies stay ordered on the stream)."""
        self.popped = self.pushed

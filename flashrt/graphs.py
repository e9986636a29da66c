"""CUDA graphs: one graph per step size, captured once per session over its arena.

Captured sizes are powers of two up to `max_size` (decode and short prefill chunks such as a
user turn, where launch overhead dominates; longer chunks run eagerly, since the graph body
attends over the whole capacity).
A length is replayed as a sum of captured sizes, so no step is padded: padding would advance
recurrent state by tokens that do not exist. Inputs go through io.ids; the position lives in
meta.position; logits land in meta.logits.
"""
from __future__ import annotations

import torch


class StepGraphs:
    def __init__(self, rt, max_size: int = 1):
        self.rt, self.max_size = rt, max_size
        self.sizes = [1 << i for i in range(max_size.bit_length()) if (1 << i) <= max_size]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def capture(self) -> None:
        """Warm up, then capture largest first so smaller graphs reuse the shared pool."""
        rt, pool = self.rt, None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for T in self.sizes:                     # warm-up: kernels chosen, workspaces sized
                rt._static_step(T)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.no_grad():
            for T in reversed(self.sizes):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    rt._static_step(T)
                pool = g.pool() if pool is None else pool
                self.graphs[T] = g
        torch.cuda.synchronize()

    def run(self, ids: torch.Tensor) -> None:
        """Replay for len(ids) tokens, as a sum of captured sizes, largest first."""
        io, i, n = self.rt.arena["io.ids"], 0, ids.shape[0]
        for T in reversed(self.sizes):
            while n - i >= T:
                io[:T].copy_(ids[i: i + T])
                self.graphs[T].replay()
                i += T

"""The main and draft-head steps of speculative decoding (flashrt/lm/speculative.py): eager over a
session's arena, or graph-safe bodies (positions on device, full-capacity masked attention)
that CUDA captures once per size and kind. Both can keep the fixed state after every verified
position (flashrt.core.session.StatePlanes), which a partial acceptance copies back.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from flashrt.core.graphs import CapturedBodies
from flashrt.core.step import StepCtx


# ---- steps: eager, static (graph body run eagerly), or captured ---------------------------------
class EagerSteps:
    """Main all-position step (not committed) and draft-head step, eager (host positions), over
    a session's arena: its caller holds the arena (forks sharing it take turns: core/shared.py)."""

    def __init__(self, net, session):
        self.net, self.session = net, session
        self.planes = None        # the StatePlanes the last main step filled (None: none)
        self._planes = None

    def planes_for(self, T: int):
        """StatePlanes of at least T positions (grown once to the largest T), None if the model
        writes none."""
        if self._planes is None or self._planes.size < T:
            self._planes = self.session.state_planes(T)
        return self._planes

    def main(self, ids: torch.Tensor, all_logits: bool = True, planes: bool = False):
        """Run len(ids) positions at the session's position WITHOUT committing them. Returns
        (hidden (T, H), float32 logits (T, V), or (1, V) if not all_logits). planes=True: also
        keep the fixed state after every position in self.planes (StatePlanes.keep)."""
        net, a, T = self.net, self.session.arena, ids.shape[0]
        self.planes = self.planes_for(T) if planes else None
        p = None if self.planes is None else self.planes.views(T)

        def body(ctx):
            out = net({"ids": ids}, replace(ctx, planes=p), a, all_positions=all_logits or "hidden")
            return out["hidden"], out["logits"].float()
        return self.session.step(ids.shape[0], body, commit=False)

    def draft(self, tokens: torch.Tensor, hidden: torch.Tensor, row0: int, last_only: bool = False):
        """Draft head over pairs at rows row0.. (writes its rows there). Returns (logits
        (T, V), or (1, V) of the last pair if last_only (a prefill writing rows), hidden (T, H))."""
        T = tokens.shape[0]
        ctx = StepCtx(T, torch.arange(row0, row0 + T, device=tokens.device), start=row0)
        return self.net.draft(tokens, hidden, ctx, self.session.arena, last_only)


class SpecSteps(EagerSteps):
    """Graph-safe bodies (positions on device, full-capacity masked attention) for T <= max_T;
    capture=True (CUDA) records one graph per size and kind, capture=False runs the same
    bodies eagerly (how the CPU tests check them). Larger sizes fall back to eager. main and
    draft take and return what EagerSteps' do. The bodies read only the arena and these
    buffers: forks sharing the arena share one set (Speculator.steps_for)."""

    def __init__(self, net, session, max_T: int, capture: bool):
        super().__init__(net, session)
        dev = session.device
        self.max_T = min(max_T, session.options.prefill_chunk)
        self.m_tok = torch.zeros(self.max_T, dtype=torch.int64, device=dev)
        self.m_hid = torch.zeros(self.max_T, net.config.hidden_size, dtype=session.dtype, device=dev)
        self.m_pos = torch.zeros(1, dtype=torch.int64, device=dev)
        self.ids = session.arena["io.ids"]
        # every main body writes state planes (when the model can): the graphs hold their addresses
        self.graph_planes = session.state_planes(self.max_T)
        self.graphs = CapturedBodies()
        if capture:
            bodies = {key: (lambda key=key: self.run_body(*key)) for key in self.bodies()}
            self.graphs.capture(bodies, self.preserving_state)

    def preserving_state(self, fn):
        """Warm-up/capture runs the bodies for real: at the session's scratch window (the draft
        bodies too), with the state put back afterwards."""
        a = self.session.arena

        def at_scratch():
            self.m_pos.copy_(a["meta.position"])
            return fn()
        return self.session.preserving_state(at_scratch, self.max_T)

    def _main_body(self, T):
        gp = self.graph_planes
        ctx = replace(self.session.static_ctx(T), planes=None if gp is None else gp.views(T))
        out = self.net({"ids": self.ids[:T]}, ctx, self.session.arena, all_positions=True)
        return out["hidden"], out["logits"].float()

    def _draft_body(self, T):
        pos = self.m_pos + torch.arange(T, device=self.m_pos.device)
        return self.net.draft(self.m_tok[:T], self.m_hid[:T], self.session.static_ctx(T, pos),
                              self.session.arena)

    def main(self, ids, all_logits=True, planes=False):
        T = ids.shape[0]
        if T > self.max_T:
            return super().main(ids, all_logits, planes)
        self.planes = self.graph_planes if planes else None
        self.ids[:T].copy_(ids)
        replayed = ("main", T) in self.graphs
        h, logits = self.graphs.replay(("main", T)) if replayed else self._main_body(T)
        # one body per size runs the vocab head on every position: the last is what was asked
        logits = logits if all_logits else logits[-1:]
        return (h.clone(), logits.clone()) if replayed else (h, logits)

    def draft(self, tokens, hidden, row0, last_only=False):
        T = tokens.shape[0]
        if T > self.max_T:
            return super().draft(tokens, hidden, row0, last_only)
        self.m_tok[:T].copy_(tokens)
        self.m_hid[:T].copy_(hidden)
        self.m_pos.fill_(row0)
        replayed = ("draft", T) in self.graphs
        logits, h = self.graphs.replay(("draft", T)) if replayed else self._draft_body(T)
        logits = logits[-1:] if last_only else logits      # as in main: the head ran on every row
        return (logits.clone(), h.clone()) if replayed else (logits, h)

    def planes_for(self, T):
        return self.graph_planes if T <= self.max_T else super().planes_for(T)

    def serves(self, k: int) -> bool:
        """Whether these bodies cover a round of k drafts (k + 1 verify positions, capped as
        in __init__: longer rounds run eagerly past the cap)."""
        return self.max_T >= min(k + 1, self.session.options.prefill_chunk)

    def bodies(self) -> list:
        """(kind, T) of every body this object captures, smallest first per kind."""
        out = [("main", T) for T in range(1, self.max_T + 1)]
        if self.net.has_draft_head:
            out += [("draft", T) for T in range(1, self.max_T + 1)]
        return out

    def run_body(self, kind: str, T: int):
        return self._main_body(T) if kind == "main" else self._draft_body(T)

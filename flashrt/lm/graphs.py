"""The language model's step bodies over one arena: the step per power-of-two size, and
"sample" and "decode" for generation on the device. On CUDA each is captured once
(flashrt.core.graphs) and replayed; with capture=False they run eagerly (CPU tests check them).
"""
from __future__ import annotations

import types

import torch

from flashrt.core.graphs import CapturedBodies, HostReadback, power_of_two_sizes
from flashrt.core.session import Session

from .sampler import draw


def record(arena, ids, positions, last_logits) -> None:
    """A step's history and last logits, in the arena (the captured and the eager step)."""
    arena["meta.logits"].copy_(last_logits)
    arena["meta.tokens"].index_copy_(0, positions, ids)


def static_step(net, session: Session, T: int) -> None:
    """The captured step body: T ids from io.ids, positions from meta.position."""
    a, ctx = session.arena, session.static_ctx(T)
    ids = a["io.ids"][:T]
    out = net({"ids": ids}, ctx, a)
    record(a, ids, ctx.positions, out["logits"][-1])


def sample_body(arena) -> None:
    """Draw the next token from meta.logits into io.next, with the io.* settings and the
    arena RNG: the host sampler's function on device tensors (no sync)."""
    arena["io.next"].copy_(draw(arena["meta.logits"], arena["sampler.rng"], arena["io.temperature"],
                                arena["io.top_k"], arena["io.top_p"]))


def decode_body(net, session: Session) -> None:
    """One generation step: the token in io.next runs through the model (the caller commits
    its position), then the token after it is drawn into io.next."""
    session.arena["io.ids"][:1].copy_(session.arena["io.next"])
    static_step(net, session, 1)
    sample_body(session.arena)


def _own_code(fn, key):
    """fn with a code object of its own: dynamo caches compiled frames per code object (at most
    recompile_limit each), and the size bodies would otherwise share one."""
    code = fn.__code__.replace(co_name=f"body_{key}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class StepGraphs:
    """The bodies over `session`'s arena, for the net `net` (any member of a shared arena runs
    them on its turn). A length replays as a sum of sizes, largest first; no padding: it would
    advance recurrent state. capture=False runs the bodies eagerly: the graph path on CPU."""

    def __init__(self, net, session: Session, options, device, capture: bool = True,
                 compile: bool = False):
        o = options         # warm-up steps max_size positions for real: within the capacity
        max_size = min(o.graph_max_tokens, o.prefill_chunk, o.max_seq_len)
        self.session = session
        self.sizes, self.captured = power_of_two_sizes(max_size), capture
        self.max_size = self.sizes[-1]
        s = session
        self.fns = {"sample": lambda: sample_body(s.arena), "decode": lambda: decode_body(net, s)}
        self.fns.update({T: (lambda T=T: static_step(net, s, T)) for T in self.sizes})
        if compile:     # fixed shapes per body; inductor fuses the elementwise ops between matmuls
            self.fns = {k: torch.compile(_own_code(f, k), dynamic=False) for k, f in self.fns.items()}
        self.readback = HostReadback(device)
        self.bodies = CapturedBodies()
        if capture:
            self.bodies.capture(self.fns, lambda fn: self.session.preserving_state(fn, self.max_size))
        self._extensions: dict = {}

    def extension(self, key: str, make, usable=lambda ext: True):
        """A body set another layer builds over this arena (speculative decoding's verify and
        draft steps): make(session) runs once (again when not usable), every member shares it."""
        ext = self._extensions.get(key)
        if ext is None or not usable(ext):
            ext = self._extensions[key] = make(self.session)
        return ext

    def call(self, key) -> None:
        if self.captured:
            self.bodies.replay(key)
        else:
            self.fns[key]()

    def run(self, ids: torch.Tensor) -> None:
        io, i, n = self.session.arena["io.ids"], 0, ids.shape[0]
        for size in reversed(self.sizes):
            while n - i >= size:
                io[:size].copy_(ids[i: i + size])
                self.call(size)
                self.session.commit(size)
                i += size

    def generate(self, n: int, stops, temperature: float, top_k: int, top_p: float) -> list[int]:
        """Up to n tokens drawn on the device, each committed. Replay k steps token k and draws
        k+1; it is queued before the host reads token k, so the device does not wait on it."""
        if n <= 0:
            return []
        session, rb = self.session, self.readback
        a = session.arena
        a["io.temperature"].fill_(temperature)
        a["io.top_k"].fill_(top_k)
        a["io.top_p"].fill_(top_p)
        self.call("sample")
        rb.push(a["io.next"])
        out = []
        while len(out) < n:
            self.call("decode")
            session.commit(1)
            rb.push(a["io.next"])
            out.append(rb.pop())
            if out[-1] in stops:
                break
        # the last replay drew one token past the end: give back its draw (draw's rule: one
        # per token when temperature > 0), so the stream is the host loop's
        a["sampler.rng"][1:2].sub_((a["io.temperature"] > 0).long())
        rb.clear()
        return out


def use_graph_bodies(lm, capture: bool = False, compile: bool = False) -> StepGraphs:
    """Step lm through its graph bodies (capture=False: run eagerly, how CPU tests check what
    CUDA graphs record; compile: through torch.compile, as Options.compile does)."""
    return lm.use_graph_bodies(capture, compile)


@torch.no_grad()
def graph_body_step(lm, ids: torch.Tensor) -> None:
    """Run the captured step's body eagerly for len(ids) tokens and commit them: what a CUDA
    graph records (device positions, full-capacity masked attention), testable on CPU."""
    session = lm.activate()
    session.arena["io.ids"][: ids.shape[0]].copy_(ids)
    static_step(lm.net, session, ids.shape[0])
    session.commit(ids.shape[0])

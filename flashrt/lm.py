"""The language-model layer: token ids (or embeddings) in, sampled tokens out, over a Session.

It owns what a session does not know: the token history, the last logits, the sampler's RNG
stream, the io buffers of the captured step, and multimodal embedding segments.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashrt.arena import BufferSpec
from flashrt.capsules.types import Capsule
from flashrt.graphs import CapturedBodies, HostReadback, power_of_two_sizes
from flashrt.inputs import EmbeddingSegments, embeds_ids, token_ids
from flashrt.loader import LoadedModel
from flashrt.sampler import draw, sample, seed_rng, validate
from flashrt.session import Session, SessionOptions
from flashrt.slots import Slot


@dataclass
class Options:
    max_seq_len: int = 4096
    prefill_chunk: int = 2048         # tokens per eager prefill step (fewer weight passes)
    checkpoint_every: int = 1024      # rollback checkpoints at multiples of this position
    max_checkpoints: int = 16         # memory bound: oldest dropped first
    cuda_graphs: bool = True
    graph_max_tokens: int = 64        # steps up to this many tokens replay graphs; longer run eagerly
    compile: bool = False             # torch.compile the graph bodies (before capture on CUDA)
    seed: int = 0


def lm_specs(o: Options, vocab: int) -> list[BufferSpec]:
    return [
        BufferSpec("meta.logits", "meta", (vocab,), torch.float32),     # after the last position
        BufferSpec("meta.tokens", "meta", (o.max_seq_len,), torch.int64, seq_dim=0),
        BufferSpec("sampler.rng", "rng", (2,), torch.int64),            # [seed, counter]
        BufferSpec("io.ids", "io", (o.prefill_chunk,), torch.int64),
        # the device-side sampler (StepGraphs.generate): its settings, and the token it drew
        BufferSpec("io.temperature", "io", (1,), torch.float32),
        BufferSpec("io.top_k", "io", (1,), torch.int64),
        BufferSpec("io.top_p", "io", (1,), torch.float32),
        BufferSpec("io.next", "io", (1,), torch.int64),
    ]


class LanguageModel:
    """A causal LM session (batch 1). Parallel branches are forks over the same weights."""

    def __init__(self, model: LoadedModel, options: Options, pool=None, slot: Slot | None = None):
        """slot: another session's arena and graphs, to take turns in (see fork(share=))."""
        self.model, self.options, self._pool = model, options, pool
        self.net = model.net
        self.embeds = EmbeddingSegments()   # re-run on rollback; shared with forks
        self.finish_reason = None
        self.context_reused = 0              # positions set_context took over instead of re-running
        self.speculator = None            # flashrt.speculative state, made on first use
        if slot is None:
            sopts = SessionOptions(options.max_seq_len, options.prefill_chunk,
                                   options.checkpoint_every, options.max_checkpoints)
            session = Session(self.net, lm_specs(options, self.net.vocab_size), model.device,
                              model.dtype, model.fingerprint, sopts, {"linear": model.linear_kernel})
            seed_rng(session.arena["sampler.rng"], options.seed)
            slot = Slot(session, first=self)
        self._slot, self._lock = slot, slot.lock      # forks sharing the arena share its lock
        capture = options.cuda_graphs and model.device.type == "cuda"
        if slot.graphs is None and (capture or options.compile):   # compiled bodies run on CPU too
            slot.graphs = StepGraphs(self, capture, options.compile)

    # ---- properties (a fork sharing the arena takes its turn first: flashrt/slots.py) ----
    session = property(lambda self: self._slot.take(self))
    arena = property(lambda self: self._slot.take(self).arena)
    graphs = property(lambda self: self._slot.graphs_for(self),
                      lambda self, g: setattr(self._slot, "graphs", g))
    position = property(lambda self: self._slot.position(self))
    max_seq_len = property(lambda self: self.options.max_seq_len)
    fingerprint = property(lambda self: self.session.fingerprint)
    tokenizer = property(lambda self: self.model.tokenizer)

    @property
    def tokens(self) -> list[int]:
        """The history: token ids, and negative ids for embedding positions (see inputs.py)."""
        with self._lock:
            return self.arena["meta.tokens"][: self.position].tolist()

    def layout(self) -> str:
        return self.arena.table()

    # ---- steps ------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor | None = None, embeds: torch.Tensor | None = None,
                hist: torch.Tensor | None = None, all_positions: bool = False, commit: bool = True,
                position_ids: torch.Tensor | None = None):
        """One eager step at the session's position; returns the model's outputs dict.
        hist: history ids to record (embeds: their content ids). commit=False: a verify step
        whose positions the caller commits (commit_tokens) or rewinds."""
        inputs = {"ids": ids} if embeds is None else {"embeds": embeds.to(self.model.dtype)}
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        rec = ids if hist is None else hist

        a = self.arena

        def body(ctx):
            out = self.net(inputs, ctx, a, all_positions=all_positions)
            if commit:
                record(a, rec, ctx.positions, out["logits"][-1])
            return out
        return self.session.step(rec.shape[0], body, commit=commit)

    def commit_tokens(self, ids: torch.Tensor, last_logits: torch.Tensor) -> None:
        """Commit positions a forward(commit=False) step ran: history, last logits, position."""
        P = self.position
        record(self.arena, ids, torch.arange(P, P + ids.shape[0], device=ids.device), last_logits)
        self.session.commit(ids.shape[0])

    def _step_ids(self, ids: torch.Tensor, all_logits: bool):
        if self.graphs is not None and not all_logits and ids.shape[0] <= self.graphs.max_size:
            return self.graphs.run(ids)
        return self.forward(ids, all_positions=all_logits)["logits"]

    def advance(self, hist: torch.Tensor, all_logits: bool = False):
        """Append positions in session-planned chunks; hist holds token ids and content ids of
        embedding segments this session holds. Returns all logits (float32) if asked."""
        outs, i = [], 0
        for n in self.session.chunks(hist.shape[0]):
            part = hist[i: i + n]
            if bool((part < 0).any()):
                out = _step_mixed(self, part, all_logits)
            else:
                out = self._step_ids(part, all_logits)
            if all_logits:
                outs.append(out)
            i += n
        return torch.cat(outs).float() if all_logits else None

    # ---- public stepping ----------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids=None, all_logits: bool = False, embeds: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        """Append token ids, or embeddings (T, hidden) such as image or audio features, with
        their (T, 3) multimodal rope positions where the model has them (Qwen3.5); returns
        float32 logits of the last position (or of all, shape (T, V))."""
        with self._lock:
            if (ids is None) == (embeds is None):
                raise TypeError("prefill takes token ids or embeds=, exactly one of them")
            if position_ids is not None and embeds is None:
                raise TypeError("position_ids= goes with embeds= (a multimodal segment)")
            if embeds is not None:
                hist, seg = embeds_ids(embeds, self.net.config.hidden_size, position_ids,
                                       self.net.input_specs(self.model.dtype))
                self.embeds.add(*seg)
                t = hist.to(self.model.device)
            else:
                t = token_ids(ids, self.net.vocab_size, self.model.device)
            self.session.check_room(t.shape[0])
            out = self.advance(t, all_logits)
            return out if all_logits else self.arena["meta.logits"].clone()

    @torch.no_grad()
    def decode(self, token: int) -> torch.Tensor:
        """Append one token; returns its float32 logits (a fresh tensor, not an arena view)."""
        with self._lock:
            if self.position == 0:
                raise RuntimeError("decode() before any prefill: the session is empty (position 0)")
            if self.position >= self.max_seq_len:
                raise ValueError(f"max_seq_len {self.max_seq_len} reached: cannot decode at "
                                 f"position {self.position}")
            t = token_ids([token], self.net.vocab_size, self.model.device)
            self.advance(t)
            return self.arena["meta.logits"].clone()

    @torch.no_grad()
    def generate(self, ids=None, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop=(), ignore_eos: bool = False,
                 speculative: str | None = None, draft_tokens: int = 2, drafter=None) -> list[int]:
        """Sample up to max_new_tokens; every returned token is committed to the session.

        seed=None continues the session's RNG stream; an int reseeds it. Stops after EOS or
        any `stop` id; finish_reason says why. speculative="mtp" drafts with the checkpoint's
        draft head, "draft" with drafter(rt, k); see flashrt/speculative.py."""
        if speculative is not None or drafter is not None:
            with self._lock:
                return self.speculation().generate(ids, max_new_tokens, temperature, top_k, top_p,
                                                   seed, stop, ignore_eos, speculative, draft_tokens,
                                                   drafter)
        validate(temperature, top_k, top_p)
        with self._lock:
            stops = self.start_generation(ids, seed, stop, ignore_eos)
            if self.graphs is not None:
                n = min(max_new_tokens, self.max_seq_len - self.position)
                out = self.graphs.generate(n, stops, temperature, top_k, top_p)
                self.finish_reason = ("stop" if out and out[-1] in stops else
                                      "length" if len(out) == max_new_tokens else "max_seq_len")
                return out
            out, self.finish_reason = _host_generate(self, max_new_tokens, stops, temperature,
                                                     top_k, top_p)
            return out

    def speculation(self):
        """This session's speculative-decoding state (flashrt.speculative.Speculator):
        `.stats` holds the last speculative call's rounds, drafts and acceptance by position."""
        if self.speculator is None:
            from flashrt.speculative import Speculator
            self.speculator = Speculator(self)
        return self.speculator

    def sample(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> int:
        """A token from the last logits and the session's RNG stream (not committed)."""
        return int(sample(self.arena["meta.logits"], self.arena["sampler.rng"], temperature, top_k, top_p))

    def start_generation(self, ids, seed, stop, ignore_eos, prefill=None) -> set:
        """Prefill ids (or require context), reseed, and return the stop ids."""
        if ids is not None:
            (prefill or self.prefill)(ids)
        elif self.position == 0:
            raise RuntimeError("generate() without ids on an empty session: prefill first")
        if seed is not None:
            self.seed(seed)
        return set(stop) | (set() if ignore_eos else set(self.model.eos_ids))

    def seed(self, seed: int) -> None:
        with self._lock, torch.no_grad():
            seed_rng(self.arena["sampler.rng"], seed)

    def reset(self) -> None:
        """Empty the session: zero fixed state, position 0. The RNG stream continues."""
        with self._lock:
            self.session.reset()

    # ---- capsules -----------------------------------------------------------------------
    def snapshot(self, into: Capsule | None = None, single_use: bool = False,
                 parent: Capsule | None = None) -> Capsule:
        """Copy the committed state (see Session.snapshot)."""
        with self._lock:
            return self._slot.take(self).snapshot(into, single_use, parent)

    def restore(self, cap: Capsule, kinds=None, on_validated=None) -> None:
        """Make the session's state the capsule's; refused, state untouched, unless it fits."""
        with self._lock:
            self._slot.take(self).restore(cap, kinds, on_validated)

    def empty_capsule(self, max_tokens: int | None = None, host: bool = False) -> Capsule:
        """A preallocated capsule buffer for snapshot(into=) (host=True: for load_capsule(into=)),
        sized for max_tokens (default: all)."""
        return self.session.empty_capsule(max_tokens, host)

    @torch.no_grad()
    def rollback(self, position: int) -> None:
        """Return to an earlier token boundary of the history (see Session.rollback). The
        RNG stream is not rewound, so a retry samples afresh."""
        with self._lock:
            hist = self.arena["meta.tokens"][: max(0, min(position, self.position))].clone()
            self.session.rollback(position, lambda a, b: self.advance(hist[a:b]))

    def fork(self, cap: Capsule | None = None, seed: int | None = None,
             share: bool | None = None) -> "LanguageModel":
        """An independent session over the same weights, from `cap` or the live state; it
        does not inherit rollback checkpoints (its capsule serves as its base).

        share: the fork takes turns in this session's arena and captured graphs instead of
        owning its own: the fork costs one state copy, each switch between the two two more
        (flashrt/slots.py). Default: when graphs are captured and no pool was loaded."""
        with self._lock:
            src = cap if cap is not None else self.snapshot()
            if share is None:
                share = self._pool is None and self.graphs is not None and self.graphs.captured
            if share:
                child = LanguageModel(self.model, self.options, slot=self._slot)
                self._slot.join(child, src)
            else:
                child = self._pool.acquire() if self._pool is not None else \
                    LanguageModel(self.model, self.options)
                child.restore(src)
            child.embeds = self.embeds           # immutable segments, by content digest
            if seed is not None:
                child.seed(seed)
            return child

    def close(self) -> None:
        """Give a pooled session back to its pool, or a shared-arena fork's turn back."""
        if self._pool is not None:
            self._pool.release(self)
        else:
            self._slot.leave(self)

    @torch.no_grad()
    def set_context(self, context, store=None, remember: bool = True, advance=None) -> torch.Tensor:
        """Make the whole context exactly `context` (token ids, and (T, hidden) embedding
        tensors for multimodal segments); returns the float32 last logits. Reuses this
        session's history or the longest prefix in `store` (flashrt/reuse.py); context_reused
        says how many positions were taken over instead of re-run. advance(ids) appends the
        rest (default self.advance; speculation().prefill also writes the draft head's rows)."""
        from flashrt.reuse import set_context
        with self._lock:
            self.context_reused = set_context(self, context, store, remember, advance)
            return self.arena["meta.logits"].clone()


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


def _host_generate(lm: LanguageModel, n: int, stops, temperature, top_k, top_p):
    """Eager generation: sample on the host, step, commit; (tokens, finish reason)."""
    out = []
    for _ in range(n):
        if lm.position >= lm.max_seq_len:
            return out, "max_seq_len"
        tok = lm.sample(temperature, top_k, top_p)
        lm.advance(torch.tensor([tok], device=lm.model.device))
        out.append(tok)
        if tok in stops:
            return out, "stop"
    return out, "length"


class StepGraphs:
    """The language model's graph bodies: the step per power-of-two size (a length replays as
    a sum of them, largest first; no padding: it would advance recurrent state), and "sample"
    and "decode" for generation on the device. capture=False runs the bodies eagerly: the
    graph path on CPU, as tests check it."""

    def __init__(self, lm: LanguageModel, capture: bool = True, compile: bool = False):
        o = lm.options      # warm-up steps max_size positions for real: within the capacity
        max_size = min(o.graph_max_tokens, o.prefill_chunk, o.max_seq_len)
        s = self.session = lm.session    # the bodies read this arena: any member of lm's slot runs them
        self.sizes, self.captured = power_of_two_sizes(max_size), capture
        self.max_size = self.sizes[-1]
        self.fns = {"sample": lambda: sample_body(s.arena), "decode": lambda: decode_body(lm.net, s)}
        self.fns.update({T: (lambda T=T: static_step(lm.net, s, T)) for T in self.sizes})
        if compile:     # fixed shapes per body; inductor fuses the elementwise ops between matmuls
            self.fns = {k: torch.compile(f, dynamic=False) for k, f in self.fns.items()}
            # the size bodies share one code object (the lambda), and dynamo keeps at most
            # recompile_limit entries per code object (8): past it a body would run uncompiled
            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, len(self.fns))
        self.readback = HostReadback(lm.model.device)
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


def use_graph_bodies(lm: LanguageModel, capture: bool = False, compile: bool = False) -> StepGraphs:
    """Step lm through its graph bodies (capture=False: run eagerly, how CPU tests check what
    CUDA graphs record: prefill chunks, decode and device-side sampling; compile: through
    torch.compile, as Options.compile does before capture)."""
    lm.graphs = StepGraphs(lm, capture, compile)
    return lm.graphs


@torch.no_grad()
def graph_body_step(lm: LanguageModel, ids: torch.Tensor) -> None:
    """Run the captured step's body eagerly for len(ids) tokens and commit them: what a CUDA
    graph records (device positions, full-capacity masked attention), testable on CPU."""
    lm.arena["io.ids"][: ids.shape[0]].copy_(ids)
    static_step(lm.net, lm.session, ids.shape[0])
    lm.session.commit(ids.shape[0])


def _step_mixed(lm: LanguageModel, part: torch.Tensor, all_logits: bool):
    """A chunk holding embedding positions: runs of ids and of embeddings, in order."""
    outs, i, vals = [], 0, part.tolist()
    while i < len(vals):
        j = i
        while j < len(vals) and (vals[j] < 0) == (vals[i] < 0):
            j += 1
        run = part[i:j]
        if vals[i] >= 0:
            outs.append(lm.forward(run, all_positions=all_logits)["logits"])
        else:
            e, pid = lm.embeds.rows(vals[i:j])
            outs.append(lm.forward(embeds=e.to(lm.model.device), hist=run, position_ids=pid,
                                     all_positions=all_logits)["logits"])
        i = j
    return torch.cat(outs) if all_logits else None

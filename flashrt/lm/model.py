"""The language model: token ids (or embeddings) in, sampled tokens out, over a Session.

It owns what a session does not know: the token history, the last logits, the sampler's RNG
stream, the io buffers of the step bodies, and multimodal embedding segments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flashrt.capsules.types import Capsule
from flashrt.core.arena import BufferSpec
from flashrt.core.rng import seed_rng
from flashrt.core.session import Session, SessionOptions
from flashrt.core.shared import SharedArena
from flashrt.errors import ArenaError
from flashrt.models.loader import LoadedModel

from .grammar import Constraint, Grammar, GrammarOptions, Grammars
from .graphs import StepGraphs, record
from .inputs import EmbeddingSegments, embeds_ids, token_ids
from .sampler import sample, validate

if TYPE_CHECKING:
    from .speculative import Speculator

HISTORY = "meta.tokens"     # the per-token buffer whose rows are a capsule's history key


@dataclass
class Options(SessionOptions):
    """Every setting of a language model, from load() to the server: one object end to end.
    The session's fields (max_seq_len, prefill_chunk, checkpoint_every, max_checkpoints) are
    inherited; a Session reads only those."""
    device: str = "cpu"
    dtype: object = None              # None: float32 on CPU, the config's dtype on CUDA
    linear_kernel: str = "auto"       # see flashrt.nn.linear.select_linear_kernel
    weights: str = "float"            # "int8": projections and head in int8 (models.loader.load_model)
    sessions: int = 1                 # sessions made at load (fork() takes from them)
    cuda_graphs: bool = True
    graph_max_tokens: int = 64        # steps up to this many tokens replay graphs; longer run eagerly
    compile: bool = False             # torch.compile the graph bodies (before capture on CUDA)
    seed: int = 0
    grammar: GrammarOptions = field(default_factory=GrammarOptions)   # constrained decoding's bounds

    def __post_init__(self):
        for name in ("max_seq_len", "prefill_chunk", "checkpoint_every", "max_checkpoints",
                     "sessions", "graph_max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.grammar, GrammarOptions):
            raise TypeError(f"grammar must be a GrammarOptions, got {type(self.grammar).__name__}")


def lm_specs(o: Options, vocab: int) -> list[BufferSpec]:
    return [
        BufferSpec("meta.logits", "meta", (vocab,), torch.float32),     # after the last position
        BufferSpec(HISTORY, "meta", (o.max_seq_len,), torch.int64, seq_dim=0),
        BufferSpec("sampler.rng", "rng", (2,), torch.int64),            # [seed, counter]
        BufferSpec("io.ids", "io", (o.prefill_chunk,), torch.int64),
        # the device-side sampler (StepGraphs.generate): its settings, and the token it drew
        BufferSpec("io.temperature", "io", (1,), torch.float32),
        BufferSpec("io.top_k", "io", (1,), torch.int64),
        BufferSpec("io.top_p", "io", (1,), torch.float32),
        BufferSpec("io.next", "io", (1,), torch.int64),
    ]


class LanguageModel:
    """A causal LM session (batch 1). Parallel branches are forks over the same weights.

    A fork may share its parent's arena and graphs (fork(share=True)): members take turns, and
    a member's turn is taken only by an explicit call (activate(), or any stepping or capsule
    method); reading `session` or `arena` of a member that is not resident raises."""

    def __init__(self, model: LoadedModel, options: Options, pool=None,
                 shared: SharedArena | None = None):
        """shared: another session's arena and graphs, to take turns in (see fork(share=))."""
        self.model, self.options, self._pool = model, options, pool
        self.net = model.net
        self.embeds = EmbeddingSegments()   # re-run on rollback; shared with forks
        self.finish_reason = None
        self.context_reused = 0              # positions set_context took over instead of re-running
        self.speculator: Speculator | None = None    # speculative state, made on first use
        self.grammars = Grammars(model, options.grammar)   # compiled grammars; shared with forks
        self.constraint: Constraint | None = None    # the active grammar's state (grammar.py)
        if shared is None:
            session = Session(self.net, lm_specs(options, self.net.vocab_size), model.device,
                              model.dtype, model.fingerprint, options, {"linear": model.linear_kernel},
                              history=HISTORY)
            seed_rng(session.arena["sampler.rng"], options.seed)
            shared = SharedArena(session, first=self)
        self._shared, self._lock = shared, shared.lock   # forks sharing the arena share its lock
        capture = options.cuda_graphs and model.device.type == "cuda"
        if shared.graphs is None and (capture or options.compile):   # compiled bodies run on CPU too
            self.use_graph_bodies(capture, options.compile)

    # ---- the arena: explicit turns --------------------------------------------------------
    def activate(self) -> Session:
        """The session, holding this member's state: on a shared arena another member's turn
        ends here (its state is parked: one copy, and this one's comes back: another)."""
        return self._shared.take(self)

    def _resident(self) -> Session:
        if not self._shared.resident(self):
            raise ArenaError("this fork shares its arena and another member holds it: call "
                             "activate() first (it copies the state in)")
        return self._shared.session

    session = property(_resident, doc="The Session holding this model's state (no copy).")
    arena = property(lambda self: self._resident().arena, doc="The arena (no copy).")
    graphs = property(lambda self: self._shared.graphs, doc="Step bodies over the arena, or None.")
    position = property(lambda self: self._shared.position(self))
    max_seq_len = property(lambda self: self.options.max_seq_len)
    fingerprint = property(lambda self: self._shared.session.fingerprint)  # one per shared arena
    tokenizer = property(lambda self: self.model.tokenizer)

    def use_graph_bodies(self, capture: bool = False, compile: bool = False) -> StepGraphs:
        """Step through graph bodies over this arena (capture=False: eagerly, as CPU tests check
        what CUDA graphs record; compile: torch.compile'd first, as Options.compile does)."""
        session = self.activate()
        self._shared.graphs = StepGraphs(self.net, session, self.options, self.model.device,
                                         capture, compile)
        return self._shared.graphs

    @property
    def tokens(self) -> list[int]:
        """The history: token ids, and negative ids for embedding positions (see inputs.py)."""
        with self._lock:
            return self.session.arena[HISTORY][: self.position].tolist()

    def layout(self) -> str:
        return self._shared.session.arena.table()

    # ---- steps ------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor | None = None, embeds: torch.Tensor | None = None,
                hist: torch.Tensor | None = None, all_positions: bool | str = False,
                commit: bool = True, position_ids: torch.Tensor | None = None):
        """One eager step at the session's position; returns the model's outputs dict.
        hist: history ids to record (embeds: their content ids). commit=False: a verify step
        whose positions the caller commits (commit_tokens) or rewinds."""
        inputs = {"ids": ids} if embeds is None else {"embeds": embeds.to(self.model.dtype)}
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        rec = ids if hist is None else hist
        session = self.activate()
        a = session.arena

        def body(ctx):
            out = self.net(inputs, ctx, a, all_positions=all_positions)
            if commit:
                record(a, rec, ctx.positions, out["logits"][-1])
            return out
        return session.step(rec.shape[0], body, commit=commit)

    def commit_tokens(self, ids: torch.Tensor, last_logits: torch.Tensor) -> None:
        """Commit positions a forward(commit=False) step ran: history, last logits, position."""
        session = self.activate()
        P = session.position
        record(session.arena, ids, torch.arange(P, P + ids.shape[0], device=ids.device), last_logits)
        session.commit(ids.shape[0])

    def advance(self, hist: torch.Tensor, all_logits: bool = False):
        """Append positions in session-planned chunks; hist holds token ids and content ids of
        embedding segments this session holds. Returns all logits (float32) if asked."""
        session, graphs = self.activate(), self.graphs

        def run(i, n):
            part = hist[i: i + n]
            if bool((part < 0).any()):
                return self._step_mixed(part, all_logits)
            if graphs is not None and not all_logits and n <= graphs.max_size:
                return graphs.run(part)
            return self.forward(part, all_positions=all_logits)["logits"]
        outs = session.advance(hist.shape[0], run)
        return torch.cat(outs).float() if all_logits else None

    def _step_mixed(self, part: torch.Tensor, all_logits: bool):
        """A chunk holding embedding positions: runs of ids and of embeddings, in order."""
        outs, i, vals = [], 0, part.tolist()
        while i < len(vals):
            j = i
            while j < len(vals) and (vals[j] < 0) == (vals[i] < 0):
                j += 1
            run = part[i:j]
            if vals[i] >= 0:
                outs.append(self.forward(run, all_positions=all_logits)["logits"])
            else:
                e, pid = self.embeds.rows(vals[i:j])
                outs.append(self.forward(embeds=e.to(self.model.device), hist=run, position_ids=pid,
                                         all_positions=all_logits)["logits"])
            i = j
        return torch.cat(outs) if all_logits else None

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
            self.activate().check_room(t.shape[0])
            self.constraint = None      # the context is the caller's: decode() forces under a grammar
            out = self.advance(t, all_logits)
            return out if all_logits else self.arena["meta.logits"].clone()

    @torch.no_grad()
    def decode(self, token: int) -> torch.Tensor:
        """Append one token; returns its float32 logits (a fresh tensor, not an arena view).
        Under a grammar (self.constraint) the token must be one it allows (ValueError, state
        untouched, if not) and the logits come back masked to what it allows next."""
        with self._lock:
            if self.position == 0:
                raise RuntimeError("decode() before any prefill: the session is empty (position 0)")
            if self.position >= self.max_seq_len:
                raise ValueError(f"max_seq_len {self.max_seq_len} reached: cannot decode at "
                                 f"position {self.position}")
            t = token_ids([token], self.net.vocab_size, self.model.device)
            c = self.constraint
            if c is not None and not c.accept(int(token)):
                raise ValueError(f"token {token} is not allowed by the active grammar "
                                 f"({c.grammar.kind} {c.grammar.key[:12]}) at position {self.position}")
            try:
                self.advance(t)
            except BaseException:
                if c is not None:
                    c.rollback(1)
                raise
            out = self.arena["meta.logits"].clone()
            return out if c is None or c.terminated else c.mask(out)

    @torch.no_grad()
    def generate(self, ids=None, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop=(), ignore_eos: bool = False,
                 speculative: str | None = None, draft_tokens: int = 2, drafter=None,
                 grammar: Grammar | None = None) -> list[int]:
        """Sample up to max_new_tokens; every returned token is committed to the session.

        seed=None continues the session's RNG stream; an int reseeds it. Stops after EOS or
        any `stop` id; finish_reason says why. speculative="mtp" drafts with the checkpoint's
        draft head, "draft" with drafter(rt, k); see flashrt/lm/speculative.py. grammar: every
        token is one it allows (flashrt/lm/grammar.py); without ids, the same grammar continues
        the active constraint (after a rollback, say), and grammar=None continues any."""
        if speculative is not None or drafter is not None:
            with self._lock:
                out, self.finish_reason = self.speculation().generate(
                    ids, max_new_tokens, temperature, top_k, top_p, seed, stop, ignore_eos,
                    speculative, draft_tokens, drafter, grammar)
                return out
        validate(temperature, top_k, top_p)
        with self._lock:
            stops, c = self.start_generation(ids, seed, stop, ignore_eos, grammar=grammar)
            self.activate()
            if self.graphs is not None and c is None:   # a grammar masks outside the decode graph
                n = min(max_new_tokens, self.max_seq_len - self.position)
                out = self.graphs.generate(n, stops, temperature, top_k, top_p)
                self.finish_reason = ("stop" if out and out[-1] in stops else
                                      "length" if len(out) == max_new_tokens else "max_seq_len")
                return out
            out, self.finish_reason = self._host_generate(max_new_tokens, stops, temperature,
                                                          top_k, top_p, c)
            return out

    def _host_generate(self, n: int, stops, temperature, top_k, top_p, c: Constraint | None = None):
        """Eager generation: sample on the host, step, commit; (tokens, finish reason). Under
        constraint c each token is drawn from the masked logits and accepted."""
        out = []
        for _ in range(n):
            if self.position >= self.max_seq_len:
                return out, "max_seq_len"
            if c is not None and c.terminated:
                return out, "stop"
            tok = self.sample(temperature, top_k, top_p)
            if c is not None:
                c.require(tok)
            self.advance(torch.tensor([tok], device=self.model.device))
            out.append(tok)
            if tok in stops:
                return out, "stop"
        return out, "length"

    def speculation(self) -> Speculator:
        """This session's speculative-decoding state (flashrt.lm.speculative.Speculator):
        `.stats` holds the last speculative call's rounds, drafts and acceptance by position,
        `.decoder()` decodes a round at a time. It uses this class only through its
        SpeculationTarget members (flashrt/lm/speculative.py lists them)."""
        if self.speculator is None:
            from flashrt.lm.speculative import Speculator
            self.speculator = Speculator(self)
        return self.speculator

    def sample(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               logits: torch.Tensor | None = None) -> int:
        """A token from the last logits (masked by the active grammar) and the session's RNG
        stream (not committed). logits: (V,) float32 to draw from instead, used as given (a
        caller's final logits: biased, masked by it; flashrt serve's logit_bias and logprobs)."""
        a = self.activate().arena
        if logits is None:
            logits, c = a["meta.logits"], self.constraint
            logits = logits if c is None else c.mask(logits.clone())
        return int(sample(logits, a["sampler.rng"], temperature, top_k, top_p))

    def start_generation(self, ids, seed, stop, ignore_eos, prefill=None,
                         grammar: Grammar | None = None) -> tuple[set, Constraint | None]:
        """Prefill ids (or require context), reseed, start the grammar at the position (or
        continue the active constraint: see generate); returns (the stop ids, the constraint).
        Under a grammar the EOS ids stop even with ignore_eos: it allows them only once complete."""
        keep = grammar is None or (ids is None and self.constraint is not None
                                   and self.constraint.grammar.key == grammar.key)
        if not keep:
            self.grammars.compile(grammar)          # refused before any state changes
        if ids is not None:
            self.constraint = None
            (prefill or self.prefill)(ids)
        elif self.position == 0:
            raise RuntimeError("generate() without ids on an empty session: prefill first")
        if seed is not None:
            self.seed(seed)
        if not keep:
            self.constraint = Constraint(grammar, self.grammars, self.position)
        c = self.constraint
        return set(stop) | (set() if ignore_eos and c is None else set(self.model.eos_ids)), c

    def constrain(self, grammar: Grammar | None, accepted=()) -> Constraint | None:
        """Start `grammar` at the current position (None: end the active one); the tokens
        committed from here on are accepted by it. Returns the constraint (self.constraint).
        accepted: ids it already accepted, the history's last tokens (a grammar state its
        caller kept, e.g. a server session's): continued, replayed when first used; a
        ValueError, state untouched, unless they end the history."""
        with self._lock:
            accepted = [int(t) for t in accepted]
            if grammar is None:
                if accepted:
                    raise ValueError("constrain(None, accepted=...): accepted ids need a grammar")
                self.constraint = None
            else:
                self.grammars.compile(grammar)
                start = self.position - len(accepted)
                if start < 0 or accepted and self.tokens[start:] != accepted:
                    raise ValueError(f"constrain: the {len(accepted)} accepted ids are not the last "
                                     f"tokens of the history (position {self.position})")
                self.constraint = Constraint(grammar, self.grammars, start, accepted)
            return self.constraint

    def seed(self, seed: int) -> None:
        with self._lock, torch.no_grad():
            seed_rng(self.activate().arena["sampler.rng"], seed)

    def reset(self) -> None:
        """Empty the session: zero fixed state, position 0. The RNG stream continues."""
        with self._lock:
            self.activate().reset()
            self.constraint = None

    # ---- capsules -----------------------------------------------------------------------
    def snapshot(self, into: Capsule | None = None, single_use: bool = False,
                 parent: Capsule | None = None) -> Capsule:
        """Copy the committed state (see Session.snapshot); an active grammar's record
        (grammar.py: key, spec, start, ids) goes in meta.extra["grammar"]."""
        with self._lock:
            cap = self.activate().snapshot(into, single_use, parent)
            if self.constraint is not None:
                cap.meta.extra["grammar"] = self.constraint.record()
            return cap

    def restore(self, cap: Capsule, kinds=None, on_validated=None) -> None:
        """Make the session's state the capsule's, its grammar state included (rebuilt by
        replay when first used); refused, state untouched, unless it fits."""
        with self._lock:
            c = self._constraint_of(cap)
            self.activate().restore(cap, kinds, on_validated)
            self.constraint = c

    def _constraint_of(self, cap: Capsule) -> Constraint | None:
        if not isinstance(cap, Capsule):       # the session's restore names the error
            return None
        rec = cap.meta.extra.get("grammar")
        return None if rec is None else Constraint.from_record(rec, self.grammars, cap.position)

    def empty_capsule(self, max_tokens: int | None = None, host: bool = False) -> Capsule:
        """A preallocated capsule buffer for snapshot(into=) (host=True: for load_capsule(into=)),
        sized for max_tokens (default: all)."""
        return self._shared.session.empty_capsule(max_tokens, host)

    @torch.no_grad()
    def rollback(self, position: int) -> None:
        """Return to an earlier token boundary of the history (see Session.rollback); the
        active grammar rolls back by the tokens undone. The RNG stream is not rewound, so a
        retry samples afresh."""
        with self._lock:
            session = self.activate()
            hist = session.arena[HISTORY][: max(0, min(position, self.position))].clone()
            session.rollback(position, lambda a, b: self.advance(hist[a:b]))
            c = self.constraint         # the grammar undoes the same tokens; before it, it ends
            if c is not None:
                if self.position < c.start:
                    self.constraint = None
                else:
                    c.rollback(len(c.ids) - (self.position - c.start))

    def fork(self, cap: Capsule | None = None, seed: int | None = None,
             share: bool | None = None) -> "LanguageModel":
        """An independent session over the same weights, from `cap` or the live state; it
        does not inherit rollback checkpoints (its capsule serves as its base).

        share: the fork takes turns in this session's arena and captured graphs instead of
        owning its own: the fork costs one state copy, each switch between the two two more
        (flashrt/core/shared.py). Default: when graphs are captured and no pool was loaded."""
        with self._lock:
            src = cap if cap is not None else self.snapshot()
            if share is None:
                share = self._pool is None and self.graphs is not None and self.graphs.captured
            if share:
                child = LanguageModel(self.model, self.options, shared=self._shared)
                self._shared.join(child, src)
            else:
                child = self._pool.acquire() if self._pool is not None else \
                    LanguageModel(self.model, self.options)
                child.restore(src)
            child.embeds = self.embeds           # immutable segments, by content digest
            child.grammars = self.grammars       # compiled grammars, by key
            # the grammar state: the live matcher forked, or the capsule's replayed on first use
            live = cap is None and self.constraint is not None
            child.constraint = self.constraint.fork() if live else child._constraint_of(src)
            if seed is not None:
                child.seed(seed)
            return child

    def close(self) -> None:
        """Give a pooled session back to its pool, or a shared-arena fork's turn back."""
        if self._pool is not None:
            self._pool.release(self)
        else:
            self._shared.leave(self)

    @torch.no_grad()
    def set_context(self, context, store=None, remember: bool = True, advance=None) -> torch.Tensor:
        """Make the whole context exactly `context` (token ids, and (T, hidden) embedding
        tensors for multimodal segments); returns the float32 last logits. Reuses this
        session's history or the longest prefix in `store` (flashrt/lm/reuse.py); context_reused
        says how many positions were taken over instead of re-run. advance(ids) appends the
        rest (default self.advance; speculation().prefill also writes the draft head's rows)."""
        from flashrt.lm.reuse import set_context
        with self._lock:
            self.activate()
            self.context_reused = set_context(self, context, store, remember, advance)
            self.constraint = None      # the context is the caller's (a restored capsule's grammar too)
            return self.arena["meta.logits"].clone()

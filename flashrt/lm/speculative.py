"""Speculative decoding: the model's draft head (Qwen3.5's MTP layer) or an injected drafter
drafts, the main model verifies k+1 tokens in one step, the accepted prefix is committed.

    rt.generate(prompt, max_new_tokens=64, speculative="mtp", draft_tokens=2)

One round, from a session at rest at position P (tokens [0, P) committed, the last logits the
prediction for P) with a pending token x0 (chosen, not yet run through the model):
1. draft d1..dk (greedy: argmax; sampling: d ~ q under the target's temperature/top-k/top-p);
2. verify [x0, d1..dk] at positions P..P+k in one step (all-position hidden and logits); the
   step also keeps every fixed buffer's value after each position (flashrt.core.session.StatePlanes);
3. accept (acceptance.py; uniforms from the arena RNG, so capsules carry the stream);
4. commit x0, d1..da; on partial acceptance the fixed state becomes its plane after d_a (one
   copy; KV is rewound by position); 5. the correction/bonus token becomes the next pending one.
A model that writes no planes gets mechanism "rerun": mark the fixed state before the verify,
rewind to it and re-run x0, d1..da (use_mechanism; costs compared in bench/README.md).

Draft-head rows: row p of the head's KV holds the pair (main hidden at p, token at p+1), so the
rows of accepted tokens are written once their main hidden states exist, in the next round's
first draft call (the "backlog"); a generate call flushes it at the end, so a session at rest
has rows [0, P-1) valid and a capsule taken between calls continues identically. Writing rows
below the committed position invalidates capsules above them as delta parents (Session).
Injected drafters: `drafter(rt, k) -> <= k token ids` (or `(ids, q)`, q (len, V) probabilities);
they continue `pending_token(rt)`. Greedy output equals plain greedy up to near-ties: a (k+1)-
token verify changes logit bits vs single-token decode (~1e-6 fp32).
CUDA: the verify and draft bodies are captured per size (graphs.py extension) on first use.
Under a grammar (grammar.py) tokens, drafts and verify rows are masked by their prefix's state
(DraftMasks), a refused draft ends the drafts: greedy output is plain greedy's (as above).

The speculator's contract with the language model (SpeculationTarget; LanguageModel has it):
the only members of `rt` this module uses, all public.
  activate() -> Session       take this member's turn in its arena (a fork sharing it may have
                              run since): every state read and write goes through that Session,
                              never through rt.session / rt.arena
  net, model                  the model (has_draft_head, draft_hidden, draft), its device and
                              checkpoint identity
  graphs                      the arena's step bodies (None: eager), which the speculative
                              bodies extend
  start_generation(ids, seed, stop, ignore_eos, prefill, grammar)   prompt, reseed, grammar:
                              (the stop ids, the constraint or None)
  advance(ids)                a plain step (replayed graphs where there are), committed
  commit_tokens(ids, last_logits)   commit positions a verify step ran
  speculation()               this per-session state (the module-level helpers below)
Nothing here writes to rt: Speculator.generate returns (tokens, finish_reason), a
SpeculativeDecoder exposes its finish_reason, and LanguageModel.generate sets its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from flashrt.core.rng import uniform
from flashrt.lm.acceptance import accept_test, residual, sample_from, target_probs
from flashrt.lm.grammar import Constraint, DraftMasks
from flashrt.lm.inputs import token_ids
from flashrt.lm.sampler import sample, validate
from flashrt.lm.speculative_steps import EagerSteps, SpecSteps

if TYPE_CHECKING:
    from flashrt.core.session import Session
    from flashrt.lm.graphs import StepGraphs
    from flashrt.models.loader import LoadedModel
    from flashrt.models.protocol import StatefulModel

__all__ = ["EagerSteps", "SpecSteps", "SpeculationTarget", "SpeculativeDecoder", "Speculator",
           "generate", "use_static_steps", "use_mechanism", "last_stats", "pending_token",
           "check_request"]

MODES = ("mtp", "draft")
MECHANISMS = ("planes", "rerun")


class SpeculationTarget(Protocol):
    """What the speculator uses of a LanguageModel (the module docstring says what for); a
    Protocol rather than the class itself: lm/model.py imports this module."""
    net: StatefulModel
    model: LoadedModel

    @property
    def graphs(self) -> StepGraphs | None: ...

    def activate(self) -> Session: ...

    def start_generation(self, ids, seed: int | None, stop, ignore_eos: bool, prefill=None,
                         grammar=None) -> tuple[set, Constraint | None]: ...

    def advance(self, hist: torch.Tensor, all_logits: bool = False): ...

    def commit_tokens(self, ids: torch.Tensor, last_logits: torch.Tensor) -> None: ...

    def speculation(self) -> Speculator: ...


class Speculator:
    """Per-session speculative state kept across generate calls: the mark buffer, the steps,
    the pending token (for injected drafters) and the last call's statistics."""

    def __init__(self, rt: SpeculationTarget):
        self.rt = rt
        self.steps: EagerSteps | None = None
        self.mark = None
        self.pending: int | None = None
        self.stats: dict = {}
        self.mechanism = "planes"

    def use_mechanism(self, name: str) -> None:
        """How a partial acceptance rewinds the fixed state: "planes" (the verify also keeps the
        state after each position; the accepted one is copied back) or "rerun" (mark, rewind,
        re-run the accepted tokens). "planes" falls back to "rerun" where the model writes none."""
        if name not in MECHANISMS:
            raise ValueError(f"mechanism {name!r}: use one of {MECHANISMS}")
        self.mechanism = name

    def use_static_steps(self, max_T: int, capture: bool = False) -> SpecSteps:
        """Run the graph-safe bodies (capture=False: eagerly, as CPU tests check them)."""
        self.steps = SpecSteps(self.rt.net, self.rt.activate(), max_T, capture)
        return self.steps

    def steps_for(self, k: int | None) -> EagerSteps:
        """Steps for rounds of k drafts (None: a prefill, which any steps serve). With graph
        bodies: the set over this arena, made (on CUDA: captured) once and shared with the forks
        that take turns in it."""
        rt, s = self.rt, self.steps
        graphs = rt.graphs
        if graphs is not None and k is not None and not (isinstance(s, SpecSteps) and s.serves(k)):
            s = self.steps = graphs.extension(
                "speculative", lambda session: SpecSteps(rt.net, session, k + 1, graphs.captured),
                usable=lambda steps: steps.serves(k))
        elif s is None:
            s = self.steps = EagerSteps(rt.net, rt.activate())
        return s

    @torch.no_grad()
    def generate(self, ids, max_new_tokens, temperature, top_k, top_p, seed, stop, ignore_eos,
                 speculative, draft_tokens, drafter, grammar=None) -> tuple[list[int], str]:
        """LanguageModel.generate(..., speculative=...) under the session's lock: same contract
        as plain generate (every returned token is committed). Returns (tokens, finish_reason)."""
        check_request(self.rt, speculative, draft_tokens, drafter)
        validate(temperature, top_k, top_p)
        d = SpeculativeDecoder(self, draft_tokens, drafter, temperature, top_k, top_p)
        stops, d.constraint = self.rt.start_generation(ids, seed, stop, ignore_eos, d.prefill, grammar)
        return d.run(max_new_tokens, stops), d.finish_reason

    def decoder(self, draft_tokens: int = 2, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, drafter=None,
                constraint: Constraint | None = None) -> SpeculativeDecoder:
        """Speculative decoding a round at a time (SpeculativeDecoder), for a caller that
        interleaves sessions and holds this one's lock while it uses it (flashrt serve), under
        the grammar state `constraint` (LanguageModel.constraint) if given."""
        check_request(self.rt, "draft" if drafter is not None else "mtp", draft_tokens, drafter)
        validate(temperature, top_k, top_p)
        return SpeculativeDecoder(self, draft_tokens, drafter, temperature, top_k, top_p, constraint)

    def prefill(self, ids) -> None:
        """Append ids and write the draft head's rows for their pairs (and the pair that joins
        them to the history), so drafting after them sees the whole context."""
        SpeculativeDecoder(self, None, None, 0.0, 0, 1.0).prefill(ids)


def use_static_steps(rt: SpeculationTarget, max_T: int, capture: bool = False) -> SpecSteps:
    return rt.speculation().use_static_steps(max_T, capture)


def use_mechanism(rt: SpeculationTarget, name: str) -> None:
    rt.speculation().use_mechanism(name)


def last_stats(rt: SpeculationTarget) -> dict | None:
    """Counters of the session's last speculative generate call (None before any): rounds,
    drafted, accepted, partial rounds rewound by a plane copy (plane_rewinds) or by a re-run
    (reprefills), and per draft position j reached_at[j] (draft j verified with drafts < j all
    accepted) and accepted_at[j]: position j's conditional acceptance."""
    s = rt.speculation().stats
    return {k: list(v) if isinstance(v, list) else v for k, v in s.items()} if s else None


def pending_token(rt: SpeculationTarget) -> int | None:
    """The token the drafts continue (chosen, not yet committed), while a drafter runs."""
    return rt.speculation().pending


def check_request(rt: SpeculationTarget, speculative, draft_tokens, drafter) -> None:
    """Refuse a speculative request before any state changes."""
    if speculative is None and drafter is not None:
        raise ValueError("drafter= needs speculative='draft' (or 'mtp' on a checkpoint with MTP)")
    if speculative not in MODES:
        raise ValueError(f"speculative={speculative!r}: use 'mtp' (the checkpoint's MTP layer "
                         "drafts) or 'draft' (an injected drafter= drafts), or None")
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ValueError(f"draft_tokens must be an int >= 1, got {draft_tokens!r}")
    if drafter is not None and not callable(drafter):
        raise TypeError(f"drafter must be callable(rt, k) -> token ids, got {type(drafter).__name__}")
    if speculative == "mtp" and not rt.net.has_draft_head:
        if rt.net.draft_hidden is not None:      # the model type has a head, the weights none
            why = f"the checkpoint {rt.model.path} has no MTP weights (mtp.*)"
        else:
            why = f"model type {rt.model.model_type!r} has no MTP layer (no MTP weights)"
        raise ValueError(f"speculative='mtp': {why}; use speculative=None, or "
                         "speculative='draft' with a drafter=")
    if speculative == "draft" and drafter is None:
        raise ValueError("speculative='draft' needs drafter=callable(rt, k) -> token ids")


def generate(rt, ids=None, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, stop=(), ignore_eos: bool = False,
             speculative: str = "mtp", draft_tokens: int = 2, drafter=None, grammar=None) -> list[int]:
    return rt.generate(ids, max_new_tokens, temperature, top_k, top_p, seed, stop, ignore_eos,
                       speculative, draft_tokens, drafter, grammar)


class SpeculativeDecoder:
    """Speculative decoding over one session, a round at a time; Speculator.decoder() makes
    one (generate drives one through run()). Its caller holds the session's lock while it
    uses it; every call takes the member's turn first, so forks sharing an arena may run
    between calls (a server interleaving sessions).

      first()            the first token, chosen from the last logits (pending); None when the
                         session is full
      next(room, stops)  one round, emitting at most `room` tokens: those committed after the
                         pending token, then the next pending one unless the decoder finished
      close()            commit the pending token and write the draft head's rows: at rest
    Every token they return is chosen; all but the pending last one are committed.
      pending            the chosen, uncommitted token the next round starts from (None: none)
      finish_reason      None while it goes on; "stop" (a stop id was committed), "length" (the
                         room or budget used up) or "max_seq_len" (the session is full)
      stats              this decoder's counters (Speculator.stats once closed; last_stats)
      constraint, masks  the grammar state it decodes under (None: none); a round's DraftMasks
    """

    def __init__(self, spec: Speculator, k: int | None, drafter, temperature: float, top_k: int,
                 top_p: float, constraint: Constraint | None = None):
        """k: drafts per round (None: a decoder that only prefills)."""
        rt = spec.rt
        self.spec, self.rt, self.net, self.constraint, self.masks = spec, rt, rt.net, constraint, None
        self.session = rt.activate()
        self.a = self.session.arena
        self.k, self.drafter = k or 0, drafter
        self.temp, self.top_k, self.top_p = temperature, top_k, top_p
        self.greedy = temperature == 0.0
        self.hidden_name = rt.net.draft_hidden if rt.net.has_draft_head else None
        self.steps = spec.steps_for(k)
        self.planes = spec.mechanism == "planes" and self.steps.planes_for(self.k + 1) is not None
        self.dev = rt.model.device
        self.pending: int | None = None
        self.finish_reason: str | None = None
        # draft-head backlog: main hidden states at rows r0.. and the tokens after them
        self.bl_h: list[torch.Tensor] = []
        self.bl_t: list[int] = []
        self.bl_r0 = 0
        # per draft position j: rounds that verified draft j after accepting 0..j-1, and accepted it
        self.stats = {"rounds": 0, "drafted": 0, "accepted": 0, "plane_rewinds": 0, "reprefills": 0,
                      "reached_at": [0] * self.k, "accepted_at": [0] * self.k}

    # -- helpers ---------------------------------------------------------------------------
    def _turn(self) -> Session:
        """This member's state in the arena (another fork may have run since the last call)."""
        return self.rt.activate()

    def _t(self, ids) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.dev)

    def _u(self) -> torch.Tensor:
        return uniform(self.a["sampler.rng"])[0]

    def _last_hidden(self) -> torch.Tensor:
        return self.a[self.hidden_name][None].clone()

    def _draft(self, tokens: torch.Tensor, hidden: torch.Tensor, row0: int, last_only: bool = False):
        if row0 < self.session.position:      # rows below the committed position change
            self.session.invalidate_from(row0)
        return self.steps.draft(tokens, hidden, row0, last_only)

    # -- prompt -----------------------------------------------------------------------------
    def prefill(self, ids) -> None:
        """Append ids (committed) and write the draft head's rows for their pairs."""
        rt, session = self.rt, self._turn()
        t = token_ids(ids, self.net.vocab_size, self.dev)
        session.check_room(t.shape[0])
        if self.hidden_name is None:
            rt.advance(t)
            return
        start = session.position
        hs = [self._last_hidden()] if start > 0 else []
        i = 0
        for n in session.chunks(t.shape[0]):
            h, logits = self.steps.main(t[i: i + n], all_logits=False)
            rt.commit_tokens(t[i: i + n], logits[-1])
            hs.append(h)
            i += n
        # draft-head rows for the prompt's pairs (hidden at p, token at p+1)
        hid, toks = torch.cat(hs)[:-1], (t if start > 0 else t[1:])
        row0, chunk = (start - 1 if start > 0 else 0), session.options.prefill_chunk
        for j in range(0, toks.shape[0], chunk):
            self._draft(toks[j: j + chunk], hid[j: j + chunk], row0 + j, last_only=True)

    # -- drafting ---------------------------------------------------------------------------
    def _masked(self, logits: torch.Tensor, row: int) -> torch.Tensor:
        """Draft logits (V,) under the grammar's mask after the drafts so far (row): a copy."""
        return logits if self.masks is None else self.masks.apply(logits[None].float().clone(), row)[0]

    def _pick(self, logits: torch.Tensor):
        logits = torch.nan_to_num(logits.float(), nan=-1e30, posinf=1e30, neginf=-1e30)
        if self.greedy:
            return int(logits.argmax()), None
        q = target_probs(logits, self.temp, self.top_k, self.top_p)
        return int(sample_from(q, self._u())), q

    def _draft_head(self, x0: int, k: int):
        P, dm = self.session.position, self.masks
        hid, toks = torch.cat(self.bl_h), self.bl_t
        assert self.bl_r0 + len(toks) == P and hid.shape[0] == len(toks)
        logits, g = self._draft(self._t(toks), hid, self.bl_r0)
        self.bl_h, self.bl_t = [], []
        d, q = self._pick(self._masked(logits[-1], 0))
        drafts, qs = [d], [q]
        for j in range(1, k):
            if dm is not None and not (dm.push(d) and dm.open):   # the grammar ends here
                break
            logits, g = self.steps.draft(self._t([d]), g[-1:], P - 1 + j)
            d, q = self._pick(self._masked(logits[-1], j))
            drafts.append(d)
            qs.append(q)
        return drafts, (None if self.greedy else torch.stack(qs))

    def _draft_injected(self, x0: int, k: int):
        self.spec.pending = x0
        try:
            out = self.drafter(self.rt, k)
        finally:
            self.spec.pending = None
            self._turn()          # the drafter may have run another member of the arena
        q = None
        if isinstance(out, tuple):
            out, q = out
        if isinstance(out, torch.Tensor):
            out = out.reshape(-1).tolist()
        drafts = [int(d) for d in out][:k]
        V = self.net.vocab_size
        bad = [d for d in drafts if not 0 <= d < V]
        if bad:
            raise ValueError(f"drafter returned token ids {bad} outside the vocabulary [0, {V})")
        if self.greedy or not drafts:
            return drafts, None
        if q is None:      # a deterministic drafter: point mass on its token
            return drafts, torch.nn.functional.one_hot(self._t(drafts), V).double()
        q = torch.as_tensor(q, device=self.dev).double()[: len(drafts)]
        return drafts, q / q.sum(-1, keepdim=True)

    # -- acceptance -------------------------------------------------------------------------
    def _accept(self, L: torch.Tensor, drafts: list[int], q):
        """(number of drafts accepted, the next token y) from verify logits L (k+1, V)."""
        k = len(drafts)
        if self.greedy:
            tgt = L.argmax(-1).tolist()
            for i, d in enumerate(drafts):
                if d != tgt[i]:
                    return i, tgt[i]
            return k, tgt[k]
        for i, d in enumerate(drafts):
            p = target_probs(L[i], self.temp, self.top_k, self.top_p)
            if not bool(accept_test(p, q[i], self._t(d), self._u())):
                return i, int(sample_from(residual(p, q[i]), self._u()))
        return k, int(sample(L[k], self.a["sampler.rng"], self.temp, self.top_k, self.top_p))

    # -- one round --------------------------------------------------------------------------
    def _budget(self, room: int) -> int:
        s, P = self.session, self.session.position
        every = s.options.checkpoint_every    # verify never crosses a checkpoint boundary
        return max(0, min(self.k, room, s.max_seq_len - P - 1, every - P % every - 1))

    def _round(self, x0: int, k: int, stops):
        """Verify x0 + up to k drafts; commit. Returns (committed tokens, next token y, stopped)."""
        rt, session = self.rt, self.session
        P = session.position
        use_head = self.drafter is None
        c = self.constraint
        self.masks = dm = None if c is None else DraftMasks(c, x0, k)   # x0 accepted for good
        drafting = k > 0 and (dm is None or dm.open)        # x0 may complete the grammar
        drafts, q = [], None
        if drafting:
            drafts, q = self._draft_head(x0, k) if use_head else self._draft_injected(x0, k)
            if dm is not None:
                drafts, q = dm.trial(drafts, q)
        toks = [x0] + drafts
        consumed = use_head and drafting
        if not drafts:                       # a plain step (captured graphs when there are)
            rt.advance(self._t([x0]))
            H = self._last_hidden() if self.hidden_name else None
            L = self._masked(self.a["meta.logits"], 0)[None]
            y = int(L[0].argmax()) if self.greedy else int(
                sample(L[0], self.a["sampler.rng"], self.temp, self.top_k, self.top_p))
            n = 1
        else:
            if not self.planes:
                self.spec.mark = mark = session.mark(into=self.spec.mark)
            H, L = self.steps.main(self._t(toks), planes=self.planes)
            # the arena keeps the raw logits; the rule sees each row masked by its prefix's state
            n_acc, y = self._accept(L if dm is None else dm.apply(L.clone()), drafts, q)
            n = n_acc + 1
            stop_at = next((i for i, t in enumerate(toks[:n]) if t in stops), None)
            if stop_at is not None:
                n = stop_at + 1
            if n < len(toks) and self.planes:    # partial: the fixed state after position n-1
                self.steps.planes.keep(n - 1)
                L = L[:n]
                self.stats["plane_rewinds"] += 1
            elif n < len(toks):                  # partial: rewind the fixed state, re-run
                session.rewind(mark)
                H, L = self.steps.main(self._t(toks[:n]), all_logits=False)
                self.stats["reprefills"] += 1
            rt.commit_tokens(self._t(toks[:n]), L[-1])   # L's last row: the prediction for P+n
            self.stats["drafted"] += len(drafts)
            self.stats["accepted"] += n_acc
            for j in range(min(n_acc + 1, len(drafts))):
                self.stats["reached_at"][j] += 1
                self.stats["accepted_at"][j] += j < n_acc
        self.stats["rounds"] += 1
        if dm is not None:                   # the trial drafts out, the committed ones in
            dm.close()
            for t in toks[1:n]:
                c.require(t)
        stopped = any(t in stops for t in toks[:n]) or (c is not None and c.terminated)
        if self.hidden_name:
            if consumed:
                self.bl_h, self.bl_t, self.bl_r0 = [], [], P
            self.bl_h.append(H[:n])
            self.bl_t += toks[1:n]
        return toks[:n], (None if stopped else y), stopped

    def _flush(self):
        """Write draft-head rows for every pair whose token is committed: [r0, position - 1)."""
        if not self.hidden_name or not self.bl_h:
            return
        m = min(sum(h.shape[0] for h in self.bl_h), len(self.bl_t),
                self.session.position - 1 - self.bl_r0)
        if m > 0:
            self._draft(self._t(self.bl_t[:m]), torch.cat(self.bl_h)[:m], self.bl_r0)
        self.bl_h, self.bl_t = [], []

    # -- one token, one round, the end: a generate call, or a server interleaving sessions ---
    def first(self) -> int | None:
        """The first token, chosen from the last logits (pending: not yet committed); None
        when the session is full (finish_reason "max_seq_len") or the grammar complete ("stop")."""
        s, c = self._turn(), self.constraint
        if s.position >= s.max_seq_len or (c is not None and c.terminated):
            self.finish_reason = "max_seq_len" if s.position >= s.max_seq_len else "stop"
            return None
        L = self.a["meta.logits"] if c is None else c.mask(self.a["meta.logits"].clone())
        x0 = int(sample(L, self.a["sampler.rng"], self.temp, self.top_k, self.top_p))
        if self.hidden_name:
            self.bl_h, self.bl_t, self.bl_r0 = [self._last_hidden()], [x0], s.position - 1
        self.pending = x0
        return x0

    def next(self, room: int, stops) -> list[int]:
        """One round after the pending token, emitting at most `room` tokens: those committed
        after it, then the next pending token unless a stop id was committed, the room is
        used up or the session is full (then pending is None and finish_reason says which)."""
        if self.pending is None:
            raise RuntimeError("next() without a pending token: first() was not called, or the "
                               f"decoder finished ({self.finish_reason})")
        s = self._turn()
        committed, y, stopped = self._round(self.pending, self._budget(room), stops)
        new, self.pending = committed[1:], None
        if stopped:
            self.finish_reason = "stop"
        elif len(new) < room and s.position < s.max_seq_len:
            if self.hidden_name:
                self.bl_t.append(y)
            new.append(y)
            self.pending = y
        else:
            self.finish_reason = "length" if len(new) >= room else "max_seq_len"
        return new

    def close(self) -> None:
        """Commit the pending token and write the draft head's rows: the session is at rest."""
        self._turn()
        if self.pending is not None:
            if self.constraint is not None:
                self.constraint.require(self.pending)
            self.rt.advance(self._t([self.pending]))
            self.pending = None
        self._flush()
        self.spec.stats = dict(self.stats)

    def run(self, max_new: int, stops) -> list[int]:
        """A whole generate call: up to max_new tokens, every one committed; then closed."""
        out = [] if max_new <= 0 else [t for t in [self.first()] if t is not None]
        while self.pending is not None:
            if self.pending in stops:
                self.finish_reason = "stop"
                break
            if len(out) >= max_new:
                self.finish_reason = "length"
                break
            out += self.next(max_new - len(out), stops)
        self.finish_reason = self.finish_reason or "length"      # max_new <= 0
        self.close()
        return out

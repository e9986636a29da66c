"""Speculative decoding: the Qwen3.5 MTP layer (or an injected drafter) drafts, the main model
verifies k+1 tokens in one step, the accepted prefix is committed, the rest is rolled back.

    rt.generate(prompt, max_new_tokens=64, speculative="mtp", draft_tokens=2)

One round, from a session at rest at position P (tokens [0, P) committed, `meta.logits` the
prediction for P) with a pending token x0 (already chosen, not yet run through the model):

1. draft: the MTP layer proposes d1..dk (greedy: argmax; sampling: d ~ q, q the MTP's
   distribution under the same temperature/top-k/top-p as the target);
2. snapshot the fixed-size state (recurrent, conv, MTP hidden, ...) into a preallocated
   capsule (`snapshot_arena(..., fixed_only=True, into=...)`, one contiguous copy);
3. verify: one main-model step over [x0, d1..dk] at positions P..P+k returning all-position
   hidden states and logits;
4. accept: greedy: the longest prefix of drafts equal to the target's argmax; sampling: the
   standard rule (accept d with prob min(1, p(d)/q(d)); on the first rejection sample from
   normalize(max(0, p - q)); all accepted: a bonus token from p), uniforms from the arena RNG
   (`flashrt.sampler.uniform`), so capsules carry the stream;
5. commit x0, d1..da. All k accepted: the verify state already is the committed state.
   Otherwise restore the fixed state from the capsule (KV is rewound by position for free:
   rows past the committed position are never read) and re-prefill x0, d1..da (a+1 tokens);
6. the correction/bonus token y becomes the next round's pending token.

Mechanism: (b) fixed-state capsule + restore + re-prefill, chosen over (a) per-step state
planes kept during verify. Measured on CPU (fp32, 1 thread, a shared 2-core machine; medians,
ms; context 128; `python bench/speculative.py`, bench/results/speculative.json; noisy):

    size   decode  verify k=1..4  snapshot  restore  re-prefill 1 | 2..4 tok  MTP step  planes est.
    tiny    5.1    7.9 - 8.4      0.41      0.08     5.0 | 7.9 - 8.4          1.9       0.04
    small  52      100 - 114      0.87      0.35     53  | 87 - 95            19        0.4 - 0.8

(tiny: 4 layers, hidden 64, vocab 512, 19 KiB fixed state; small: 8 layers, hidden 512, vocab
32k, 1 MiB fixed state.) The capsule copies cost ~1% (small) to ~6% (tiny) of a verify step;
the cost of (b) is the re-prefill on partial acceptance: one more main step over the a+1
accepted tokens. (a) would avoid that re-prefill; its extra work (the per-token GDN rule in
place of the chunked one over k+1 tokens, plus k+1 state-plane copies: "planes est.") is
0.4-0.8 ms on small, so by these figures (a) is the cheaper mechanism whenever acceptance is
partial (modeled small, k=3, acceptance 0.7: 11.3 tok/s with (b) vs ~14.5 with (a); equal at
acceptance 1). (a) however needs every recurrent mixer to emit a state per token: a change to
the GDN layer in models/qwen3_5.py / flashrt/linear_attn.py (and on GPU a GDN kernel that
writes intermediate states; fla's chunked kernel does not), outside this module. (b) needs
nothing from the models and works for every one of them (attention-only, GDN, short-conv,
MTP), so (b) is what is implemented, correctness first; (a) for GDN is the recommended next
step, worth the re-prefill cost above.

On this CPU speculative decoding does not pay: a step over 2..5 tokens costs ~2x a 1-token
step whatever k (fp32 GEMM at M >= 2 vs the M = 1 GEMV), and the MTP step is ~37% of a decode
(its 32k-vocab head), so the modeled break-even per-token acceptance on small is 0.95 (k = 3,
4) and k = 1, 2 never break even; at acceptance 1, k = 4 models 1.20x (an oracle drafter, which
drafts for free, measures 1.4-1.7x end to end at k = 3, 4). On a GPU, where a (k+1)-token step
costs about a 1-token step, the balance differs; not measured here (no GPU). Random weights
accept almost no MTP draft, so real acceptance rates cannot be measured with these checkpoints.

Everything the next round needs lives in the arena between rounds except the MTP "backlog":
MTP KV row p holds the pair (main hidden at p, token at p+1) (see models/qwen3_5.py), so the
rows of accepted tokens can only be written once their main hidden states exist (verify or
re-prefill returns them per position). They are written in the next round's first MTP call
together with the new (hidden, pending token) pair, one batched MTP step; at the end of a
generate call the backlog is flushed, so a session at rest has MTP rows [0, P-1) valid and a
capsule taken between generate calls continues identically. Row P-1 pairs with the next
pending token and is written by the next draft. The prompt given to generate(ids=...,
speculative=...) is prefilled with per-position hidden states and its MTP rows filled; a
context built by plain prefill()/decode() leaves its MTP rows unwritten: drafts still verify
exactly (output is unaffected), acceptance is lower. Writing MTP rows below the committed
position (row P-1, the prompt's rows) drops the session's anchors above the lowest row written:
a capsule taken at rest holds the old row P-1, so it can no longer parent a delta snapshot.

MTP drafting beyond the first token feeds the MTP layer's own (post-norm) output hidden state
as the next step's hidden (as vLLM's MTP proposer does); the draft KV rows it writes past the
committed position are rewritten from true main hidden states before they are read again.

Injected drafters: `drafter(rt, k) -> list of <= k token ids` (or `(ids, q)`, q a (len, V)
tensor of the drafter's probabilities, for sampling; plain ids count as a point mass q=1).
`rt.tokens` is the committed context; the drafts continue it after the pending token
`pending_token(rt)`. k may be below draft_tokens near max_new_tokens, max_seq_len and rollback
checkpoint boundaries (verify never crosses one, so checkpoints stay where rollback expects).
speculative="draft" uses a drafter on any model (qwen3, lfm2 too); speculative="mtp" needs a
checkpoint with MTP weights (a drafter may still replace its drafts; MTP rows are kept).

Greedy output equals plain greedy decoding up to near-ties: verifying k+1 tokens in one step
(chunked GDN rule, batched matmuls) changes logit bits vs single-token decode (~1e-6 fp32).

CUDA graphs (unverified on GPU: no GPU on the development machine). The verify step needs
all-position hidden states and logits, which the runtime's per-power-of-two step graphs do not
return, so it gets its own captured bodies: `SpecSteps` captures, per size T = 1..k+1, the
all-position main step (serves verify with T = k+1 and re-prefill with T = a+1) and the MTP
step (the batched first draft step and the T=1 chained steps). They are captured lazily on the
first speculative generate with a given k on a CUDA session with cuda_graphs (a one-off cost
of a few captures); the graph bodies are exactly the static (device-position) bodies that the
CPU tests run eagerly. Single-token steps (k'=0 rounds, the final pending commit) use the
runtime's own graphs. Everything else (prompt prefill, backlog flush) runs eagerly.
"""
from __future__ import annotations

import torch

from flashrt.arena import CAPSULE_KINDS
from flashrt.capsules.capsule import CapsuleMeta, restore_arena, snapshot_arena
from flashrt.layers import StepCtx
from flashrt.sampler import sample, uniform, validate

MODES = ("mtp", "draft")


# ---- the acceptance rule (pure functions, vectorised over leading dims) ------------------------
def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The distribution `flashrt.sampler.sample` draws from, as float64 probabilities (..., V).

    Same steps: scale, softmax, stable descending sort, keep top-k, keep the smallest prefix
    whose mass reaches top_p, renormalise. Greedy (temperature 0) is a point mass on argmax.
    """
    V = logits.shape[-1]
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), V).double()
    probs, order = torch.sort(torch.softmax(logits.float() / temperature, dim=-1), dim=-1,
                              descending=True, stable=True)
    zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
    if top_k > 0:
        probs = torch.where(torch.arange(V, device=probs.device) < top_k, probs, zero)
    if top_p < 1.0:
        before = torch.cumsum(probs, -1) - probs
        probs = torch.where(before < top_p * probs.sum(-1, keepdim=True), probs, zero)
    probs = probs.double()
    out = torch.zeros_like(probs).scatter_(-1, order, probs)
    return out / out.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in index order: probs (..., V) (need not sum to 1), u (...) in [0, 1).

    Never returns a zero-probability token (a rounding overshoot lands on the last nonzero)."""
    cdf = torch.cumsum(probs.double(), -1)
    x = (u.double() * cdf[..., -1]).unsqueeze(-1)
    j = torch.searchsorted(cdf, x, right=True)[..., 0]
    V = probs.shape[-1]
    last = V - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(j, last)


def accept_test(p: torch.Tensor, q: torch.Tensor, d: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept draft d ~ q with probability min(1, p(d)/q(d)): u * q(d) < p(d), u in [0, 1)."""
    pd = p.gather(-1, d.unsqueeze(-1))[..., 0].double()
    qd = q.gather(-1, d.unsqueeze(-1))[..., 0].double()
    return u.double() * qd < pd


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)); p itself where that is empty (p == q: rejection impossible)."""
    r = (p.double() - q.double()).clamp_min_(0.0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / torch.where(s > 0, s, torch.ones_like(s)), p.double())


def accept_draft(p, q, d, u_accept, u_resample):
    """One position of the rule: (accepted, token). token = d if accepted, else a sample of the
    residual. Shapes: p, q (..., V); d, u_accept, u_resample (...). Vectorised for tests."""
    ok = accept_test(p, q, d, u_accept)
    return ok, torch.where(ok, d, sample_from(residual(p, q), u_resample))


# ---- the MTP step, returning its hidden state too -----------------------------------------------
def mtp_step(net, tokens, hidden, ctx: StepCtx, state):
    """`Model.mtp_forward` plus the MTP's post-norm output hidden state (T, hidden), which the
    next chained draft step consumes. Same ops as mtp_forward (tests hold them equal)."""
    m = net.mtp
    e = m.pre_fc_norm_embedding(net.embed_tokens(tokens))
    x = m.fc(torch.cat([e, m.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
    cos, sin = net.rotary(ctx.positions, x.dtype)
    h = m.norm(m.layers[0](x, ctx, state, cos, sin))
    return net.logits(h), h


# ---- steps: eager, static (graph body run eagerly), or captured ---------------------------------
class EagerSteps:
    """Main all-position step and MTP step, eager (host positions)."""

    def __init__(self, rt):
        self.rt, self.net = rt, rt.net
        self.has_hidden = hasattr(rt.net, "hidden_states")

    def main(self, ids: torch.Tensor, all_logits: bool = True):
        """Advance the model by len(ids) at rt.position WITHOUT committing (rt._pos unchanged).
        Returns (hidden (T, H) or None, float32 logits (T, V), or (1, V) if not all_logits)."""
        rt, T = self.rt, ids.shape[0]
        start = rt._pos
        ctx = StepCtx(T, torch.arange(start, start + T, device=ids.device), start=start)
        if not self.has_hidden:
            return None, self.net(ids, ctx, rt.arena, all_logits=True).float()
        h = self.net.hidden_states(ids, ctx, rt.arena, all_positions=True)
        return h, self.net.logits(h if all_logits else h[-1:]).float()

    def mtp(self, tokens: torch.Tensor, hidden: torch.Tensor, row0: int):
        """MTP over pairs at rows row0.. (writes MTP KV there). Returns (logits, hidden)."""
        T = tokens.shape[0]
        ctx = StepCtx(T, torch.arange(row0, row0 + T, device=tokens.device), start=row0)
        return mtp_step(self.net, tokens, hidden, ctx, self.rt.arena)


class SpecSteps(EagerSteps):
    """Graph-safe bodies (positions on device, full-capacity masked attention) for T <= max_T.

    capture=True (CUDA) records one graph per size for the main all-position step and the MTP
    step; capture=False runs the same bodies eagerly (how the CPU tests check them). Sizes
    above max_T (or prefill_chunk) fall back to the eager path. Unverified on GPU.
    """

    def __init__(self, rt, max_T: int, capture: bool):
        super().__init__(rt)
        a, dev = rt.arena, rt.model.device
        self.max_T = min(max_T, rt.options.prefill_chunk)
        hid = rt.net.config.hidden_size
        self.m_tok = torch.zeros(self.max_T, dtype=torch.int64, device=dev)
        self.m_hid = torch.zeros(self.max_T, hid, dtype=rt.model.dtype, device=dev)
        self.m_pos = torch.zeros(1, dtype=torch.int64, device=dev)
        self.ids = a["io.ids"]
        self.graphs: dict = {}
        self.outs: dict = {}
        if capture:
            self._capture()

    def _main_body(self, T):
        a = self.rt.arena
        positions = a["meta.position"] + a["io.arange"][:T]
        h = self.net.hidden_states(self.ids[:T], StepCtx(T, positions, static=True), a,
                                   all_positions=True)
        return h, self.net.logits(h).float()

    def _mtp_body(self, T):
        a = self.rt.arena
        positions = self.m_pos + a["io.arange"][:T]
        return mtp_step(self.net, self.m_tok[:T], self.m_hid[:T], StepCtx(T, positions, static=True), a)

    def main(self, ids, all_logits=True):
        T = ids.shape[0]
        if T > self.max_T:
            return super().main(ids, all_logits)
        self.ids[:T].copy_(ids)
        if ("main", T) in self.graphs:
            self.graphs["main", T].replay()
            h, logits = self.outs["main", T]
            return h.clone(), logits.clone()
        return self._main_body(T)

    def mtp(self, tokens, hidden, row0):
        T = tokens.shape[0]
        if T > self.max_T:
            return super().mtp(tokens, hidden, row0)
        self.m_tok[:T].copy_(tokens)
        self.m_hid[:T].copy_(hidden)
        self.m_pos.fill_(row0)
        if ("mtp", T) in self.graphs:
            self.graphs["mtp", T].replay()
            logits, h = self.outs["mtp", T]
            return logits.clone(), h.clone()
        return self._mtp_body(T)

    def bodies(self) -> list:
        """(kind, T) of every body this object captures."""
        out = [("main", T) for T in range(1, self.max_T + 1)]
        if getattr(self.net, "has_mtp", False):
            out += [("mtp", T) for T in range(1, self.max_T + 1)]
        return out

    def run_body(self, kind: str, T: int):
        return self._main_body(T) if kind == "main" else self._mtp_body(T)

    def preserving_state(self, fn):
        """Run fn (warm-up / capture of the bodies) and put the session's state back.

        The bodies run for real during warm-up: they advance the fixed state (put back from a
        fixed-only capsule) and write KV/MTP rows at a scratch position w.. (w = the committed
        position, or lower near max_seq_len, when rows [w, P) are saved and put back)."""
        rt, a = self.rt, self.rt.arena
        P = rt._pos
        w = max(0, min(P, rt.max_seq_len - self.max_T))
        fixed = snapshot_arena(a, P, CapsuleMeta(P, rt.fingerprint, {}), fixed_only=True)
        rows = {n: a[n][w: P].clone() for n in a.names() if a.slot(n).spec.seq_dim == 0
                and a.slot(n).spec.kind in ("kv", "mtp")} if w < P else {}
        a["meta.position"].fill_(w)
        self.m_pos.fill_(w)
        try:
            return fn()
        finally:
            restore_arena(a, fixed, CAPSULE_KINDS)
            for n, r in rows.items():
                a[n][w: P].copy_(r)
            a["meta.position"].fill_(P)

    def _capture(self):
        """Warm up on a side stream, then capture every body (largest first, one shared pool)."""
        def go():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.no_grad(), torch.cuda.stream(stream):
                for kind, T in self.bodies():
                    self.run_body(kind, T)
            torch.cuda.current_stream().wait_stream(stream)
            pool = None
            with torch.no_grad():
                for kind, T in reversed(self.bodies()):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool):
                        out = self.run_body(kind, T)
                    pool = g.pool() if pool is None else pool
                    self.graphs[kind, T], self.outs[kind, T] = g, out
            torch.cuda.synchronize()
        self.preserving_state(go)


def _cache(rt) -> dict:
    """Per-session objects reused across generate calls (capsule buffer, captured steps)."""
    c = getattr(rt, "_spec_cache", None)
    if c is None:
        c = rt._spec_cache = {}
    return c


def use_static_steps(rt, max_T: int, capture: bool = False) -> SpecSteps:
    """Make this session's speculative steps the graph-safe bodies (capture=False: run eagerly,
    for CPU tests of what a graph would record)."""
    s = _cache(rt)["steps"] = SpecSteps(rt, max_T, capture)
    return s


def _steps(rt, k: int):
    c = _cache(rt)
    s = c.get("steps")
    if rt.graphs is not None and (not isinstance(s, SpecSteps) or s.max_T < k + 1):
        s = c["steps"] = SpecSteps(rt, k + 1, capture=True)
    elif s is None:
        s = c["steps"] = EagerSteps(rt)
    return s


def last_stats(rt) -> dict | None:
    """Counters of the session's last speculative generate call (None before any): rounds,
    drafted, accepted, reprefills, and per draft position j (lists of length draft_tokens)
    reached_at[j] (draft j verified with drafts < j all accepted) and accepted_at[j], so
    accepted_at[j] / reached_at[j] is position j's conditional acceptance rate."""
    s = getattr(rt, "_spec_stats", None)
    return None if s is None else {k: list(v) if isinstance(v, list) else v for k, v in s.items()}


def pending_token(rt) -> int | None:
    """The token the drafts continue (chosen, not yet committed), while a drafter runs."""
    return getattr(rt, "_spec_pending", None)


# ---- checks -------------------------------------------------------------------------------------
def check_request(rt, speculative, draft_tokens, drafter) -> None:
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
    if speculative == "mtp" and not getattr(rt.net, "has_mtp", False):
        mt = rt.model.model_type
        if hasattr(rt.net, "has_mtp"):
            why = f"the checkpoint {rt.model.path} has no MTP weights (mtp.*)"
        else:
            why = f"model type {mt!r} has no MTP layer (no MTP weights)"
        raise ValueError(f"speculative='mtp': {why}; use speculative=None, or "
                         "speculative='draft' with a drafter=")
    if speculative == "draft" and drafter is None:
        raise ValueError("speculative='draft' needs drafter=callable(rt, k) -> token ids")


# ---- generate -----------------------------------------------------------------------------------
@torch.no_grad()
def generate(rt, ids=None, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, stop=(), ignore_eos: bool = False,
             speculative: str = "mtp", draft_tokens: int = 2, drafter=None) -> list[int]:
    """Runtime.generate(..., speculative=...) lands here; same contract as plain generate
    (every returned token is committed; finish_reason says why it ended)."""
    check_request(rt, speculative, draft_tokens, drafter)
    validate(temperature, top_k, top_p)
    with rt._lock:
        g = _Generation(rt, draft_tokens, drafter, temperature, top_k, top_p)
        stops = rt._start_generation(ids, seed, stop, ignore_eos, g.prefill)
        return g.run(max_new_tokens, stops)


class _Generation:
    """One speculative generate call over a session (holds its lock)."""

    def __init__(self, rt, k, drafter, temperature, top_k, top_p):
        self.rt, self.net, self.a = rt, rt.net, rt.arena
        self.k, self.drafter = k, drafter
        self.temp, self.top_k, self.top_p = temperature, top_k, top_p
        self.greedy = temperature == 0.0
        self.has_mtp = getattr(rt.net, "has_mtp", False)
        self.steps = _steps(rt, k)
        self.dev = rt.model.device
        # MTP backlog: main hidden states at rows r0.. and the tokens after them
        self.bl_h: list[torch.Tensor] = []
        self.bl_t: list[int] = []
        self.bl_r0 = 0
        # per draft position j: rounds that verified draft j after accepting 1..j-1, and accepted it
        self.stats = {"rounds": 0, "drafted": 0, "accepted": 0, "reprefills": 0,
                      "reached_at": [0] * k, "accepted_at": [0] * k}

    # -- helpers ---------------------------------------------------------------------------
    def _t(self, ids) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.dev)

    def _u(self) -> torch.Tensor:
        return uniform(self.a["sampler.rng"])[0]

    def _commit(self, toks: list[int], logits_last: torch.Tensor):
        rt, P, n = self.rt, self.rt._pos, len(toks)
        rt._note_threads()
        rt._commit(self._t(toks), torch.arange(P, P + n, device=self.dev), logits_last, P + n)
        rt._pos = P + n
        rt._maybe_checkpoint()

    def _write_mtp(self, tokens: torch.Tensor, hidden: torch.Tensor, row0: int):
        # rows below the committed position change: capsules that hold the old rows are no
        # longer anchors (parents for delta snapshots / rollback sources)
        self.rt._drop_anchors_above(row0)
        return self.steps.mtp(tokens, hidden, row0)

    # -- prompt -----------------------------------------------------------------------------
    def prefill(self, ids):
        rt = self.rt
        t = rt._check_ids(ids)
        if not self.has_mtp:
            rt._advance(t, False)
            return
        start = rt._pos
        hs = [self.a["mtp.hidden"][None].clone()] if start > 0 else []
        i = 0
        for n in rt._chunks(t.shape[0]):
            h, logits = EagerSteps.main(self.steps, t[i: i + n], all_logits=False)
            self._commit(t[i: i + n].tolist(), logits[-1])
            hs.append(h)
            i += n
        # MTP rows for the prompt's pairs (hidden at p, token at p+1)
        hid, toks = torch.cat(hs)[:-1], (t if start > 0 else t[1:])
        row0, chunk = (start - 1 if start > 0 else 0), rt.options.prefill_chunk
        for j in range(0, toks.shape[0], chunk):
            self.rt._drop_anchors_above(row0 + j)
            EagerSteps.mtp(self.steps, toks[j: j + chunk], hid[j: j + chunk], row0 + j)

    # -- drafting ---------------------------------------------------------------------------
    def _pick(self, logits: torch.Tensor):
        logits = torch.nan_to_num(logits.float(), nan=-1e30, posinf=1e30, neginf=-1e30)
        if self.greedy:
            return int(logits.argmax()), None
        q = target_probs(logits, self.temp, self.top_k, self.top_p)
        return int(sample_from(q, self._u())), q

    def _draft_mtp(self, x0: int, k: int):
        P = self.rt._pos
        hid = torch.cat(self.bl_h)
        toks = self.bl_t
        assert self.bl_r0 + len(toks) == P and hid.shape[0] == len(toks)
        logits, g = self._write_mtp(self._t(toks), hid, self.bl_r0)
        self.bl_h, self.bl_t = [], []
        d, q = self._pick(logits[-1])
        drafts, qs = [d], [q]
        for j in range(1, k):
            logits, g = self.steps.mtp(self._t([d]), g[-1:], P - 1 + j)
            d, q = self._pick(logits[-1])
            drafts.append(d)
            qs.append(q)
        return drafts, (None if self.greedy else torch.stack(qs))

    def _draft_injected(self, x0: int, k: int):
        rt = self.rt
        rt._spec_pending = x0
        try:
            out = self.drafter(rt, k)
        finally:
            rt._spec_pending = None
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
            dt = self._t(d)
            if not bool(accept_test(p, q[i], dt, self._u())):
                return i, int(sample_from(residual(p, q[i]), self._u()))
        return k, int(sample(L[k], self.a["sampler.rng"], self.temp, self.top_k, self.top_p))

    # -- one round --------------------------------------------------------------------------
    def _budget(self, emitted: int, max_new: int) -> int:
        rt, P = self.rt, self.rt._pos
        every = rt.options.checkpoint_every
        return max(0, min(self.k, max_new - emitted, rt.max_seq_len - P - 1, every - P % every - 1))

    def _round(self, x0: int, k: int, stops):
        """Verify x0 + up to k drafts; commit. Returns (committed tokens, next token y, stopped)."""
        rt, P = self.rt, self.rt._pos
        use_mtp = self.drafter is None
        drafts, q = [], None
        if k > 0:
            drafts, q = self._draft_mtp(x0, k) if use_mtp else self._draft_injected(x0, k)
        toks = [x0] + drafts
        consumed = use_mtp and k > 0
        if not drafts:                       # a plain step (runtime graphs when captured)
            rt._advance(self._t([x0]), False)
            H = self.a["mtp.hidden"][None].clone() if self.has_mtp else None
            L = self.a["meta.logits"][None]
            n_acc = 0
            y = int(L[0].argmax()) if self.greedy else int(
                sample(L[0], self.a["sampler.rng"], self.temp, self.top_k, self.top_p))
            n = 1
        else:
            cap = _cache(rt).get("capsule")
            meta = CapsuleMeta(P, rt.fingerprint, {})
            _cache(rt)["capsule"] = cap = snapshot_arena(self.a, P, meta, into=cap, fixed_only=True)
            H, L = self.steps.main(self._t(toks))
            n_acc, y = self._accept(L, drafts, q)
            n = n_acc + 1
            stop_at = next((i for i, t in enumerate(toks[:n]) if t in stops), None)
            if stop_at is not None:
                n = stop_at + 1
            if n < len(toks):                # partial: rewind fixed state, re-prefill
                rng = self.a["sampler.rng"].clone()
                restore_arena(self.a, cap, CAPSULE_KINDS)
                self.a["sampler.rng"].copy_(rng)
                H, L = self.steps.main(self._t(toks[:n]), all_logits=False)
                self.stats["reprefills"] += 1
            self._commit(toks[:n], L[-1])      # verify: L has n rows; re-prefill: the last
            self.stats["drafted"] += len(drafts)
            self.stats["accepted"] += n_acc
            for j in range(min(n_acc + 1, len(drafts))):
                self.stats["reached_at"][j] += 1
                self.stats["accepted_at"][j] += j < n_acc
        self.stats["rounds"] += 1
        stopped = any(t in stops for t in toks[:n])
        if self.has_mtp:
            if consumed:
                self.bl_h, self.bl_t, self.bl_r0 = [], [], P
            self.bl_h.append(H[:n])
            self.bl_t += toks[1:n]
        return toks[:n], (None if stopped else y), stopped

    def _flush(self):
        """Write MTP rows for every pair whose token is committed: rows [r0, position - 1)."""
        if not self.has_mtp or not self.bl_h:
            return
        m = min(sum(h.shape[0] for h in self.bl_h), len(self.bl_t), self.rt._pos - 1 - self.bl_r0)
        if m > 0:
            hid = torch.cat(self.bl_h)[:m]
            self._write_mtp(self._t(self.bl_t[:m]), hid, self.bl_r0)
        self.bl_h, self.bl_t = [], []

    def run(self, max_new: int, stops) -> list[int]:
        rt, a = self.rt, self.a
        out = []
        rt.finish_reason = "length"
        if max_new <= 0:
            return out
        if rt._pos >= rt.max_seq_len:
            rt.finish_reason = "max_seq_len"
            return out
        x0 = int(sample(a["meta.logits"], a["sampler.rng"], self.temp, self.top_k, self.top_p))
        out.append(x0)
        if self.has_mtp:
            self.bl_h, self.bl_t, self.bl_r0 = [a["mtp.hidden"][None].clone()], [x0], rt._pos - 1
        pending = x0
        while pending is not None:
            if pending in stops:
                rt.finish_reason = "stop"
                break
            if len(out) >= max_new:
                break
            k = self._budget(len(out), max_new)
            committed, y, stopped = self._round(pending, k, stops)
            out += committed[1:]
            pending = None
            if stopped:
                rt.finish_reason = "stop"
                break
            if len(out) >= max_new:          # y is a bonus from p: dropping it is unbiased
                break
            if rt._pos >= rt.max_seq_len:
                rt.finish_reason = "max_seq_len"
                break
            if self.has_mtp:
                self.bl_t.append(y)
            out.append(y)
            pending = y
        if pending is not None:              # emitted, not yet committed
            rt._advance(self._t([pending]), False)
        self._flush()
        rt._spec_stats = dict(self.stats)
        return out

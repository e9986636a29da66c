"""Speculative decoding (flashrt/lm/speculative.py): the acceptance rule, greedy identity with plain
decoding for every accepted length, the state after rollback/re-prefill (main and MTP), capsules
taken between speculative calls, the graph-safe bodies, and refusal without MTP weights."""
from __future__ import annotations

import pytest
import torch

import flashrt
from flashrt.lm import acceptance as acc
from flashrt.lm import speculative as spec
from flashrt.core.step import StepCtx
from flashrt.lm.sampler import sample

ARCH, PROMPT, N = "qwen3_5", 12, 24
LAYOUTS = ["multimodal", "text"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n, seed=0, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kw(layout):
    return {"ckpt_kw": {"layout": "text"}} if layout == "text" else {}


MECHANISMS = ["planes", "rerun"]


def _spec_rt(runtime, arch, mechanism, **kw):
    rt = runtime(arch, **kw)
    spec.use_mechanism(rt, mechanism)
    return rt


def _rewinds(rt, mechanism):
    """Partial rounds of the last call, and those rewound the other way (must be 0)."""
    st = rt.speculation().stats
    mine, other = ("plane_rewinds", "reprefills") if mechanism == "planes" else ("reprefills", "plane_rewinds")
    return st[mine], st[other]


def _plain(rt, prompt, n):
    """Plain greedy decode: (tokens, the logits each token was chosen from (n, V))."""
    logits, toks, steps = rt.prefill(prompt), [], []
    for _ in range(n):
        steps.append(logits)
        toks.append(int(logits.argmax()))
        logits = rt.decode(toks[-1])
    return toks, torch.stack(steps)


def _first_divergence(got, ref_toks, ref_logits, margin=1e-3):
    """Index where `got` first leaves the plain greedy run (None if never); asserts that the
    plain run's top-2 gap there is <= margin (a near-tie, where the batched verify step may
    legitimately pick the other token)."""
    for i, t in enumerate(got):
        if i >= len(ref_toks):
            return None
        if t != ref_toks[i]:
            top2 = ref_logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap <= margin, f"token {i}: speculative {t} vs plain {ref_toks[i]}, top-2 gap {gap:.3g}"
            return i
    return None


@pytest.fixture(scope="module")
def plain_ref(runtime):
    """Plain greedy runs per layout, computed once: (prompt, tokens, logits)."""
    out = {}

    def get(layout, prompt_seed=1, n=N + 8):
        key = (layout, prompt_seed, n)
        if key not in out:
            prompt = _ids(PROMPT, seed=prompt_seed)
            toks, logits = _plain(runtime(ARCH, **_kw(layout)), prompt, n)
            out[key] = prompt, toks, logits
        return out[key]
    return get


def _check_state(rt, fresh):
    """The session's committed state equals a fresh prefill of its own history (within fp32
    tolerance): last logits, main state (next-token logits after teacher-forced decodes), and
    the MTP rows [0, P-1) and hidden a one-shot MTP pass over the history writes."""
    toks = rt.tokens
    P = len(toks)
    ref_logits = fresh.prefill(toks)
    assert (rt.arena["meta.logits"] - ref_logits).abs().max() <= 1e-4
    net = fresh.net
    if getattr(net, "has_mtp", False):
        with torch.no_grad():
            ids = torch.tensor(toks)
            scratch = fresh.fork()
            scratch.reset()
            hid = net.hidden(net.embed(ids), StepCtx(P, torch.arange(P), start=0), scratch.arena,
                                    all_positions=True)
            net.draft(ids[1:], hid[:-1], StepCtx(P - 1, torch.arange(P - 1), start=0), scratch.arena)[0]
        for name in ("mtp.attn.k", "mtp.attn.v"):
            d = (rt.arena[name][: P - 1] - scratch.arena[name][: P - 1]).abs().max()
            assert d <= 1e-4, f"{name} rows [0, {P - 1}) differ by {d:.3g}"
        assert (rt.arena["mtp.hidden"] - hid[-1]).abs().max() <= 1e-4
    for t in _ids(3, seed=99):                      # the state continues like a fresh one
        assert (rt.decode(t) - fresh.decode(t)).abs().max() <= 1e-4


# ---- the acceptance rule -------------------------------------------------------------------
def _chi2(tokens, p):
    n = tokens.shape[0]
    counts = torch.bincount(tokens, minlength=p.shape[0]).double()
    exp = n * p.double()
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token outside p's support was emitted"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


# 7 degrees of freedom: P(chi2 > 40) ~ 1.4e-6 for a correct rule; the wrong rules below
# score in the thousands at n = 40000.
CHI2_LIMIT = 40.0


def _synthetic(n=40000, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.07, 0.00], dtype=torch.float64)
    q = torch.tensor([0.05, 0.30, 0.05, 0.25, 0.05, 0.05, 0.05, 0.20], dtype=torch.float64)
    d = acc.sample_from(q.expand(n, -1), torch.rand(n, generator=g, dtype=torch.float64))
    u1 = torch.rand(n, generator=g, dtype=torch.float64)
    u2 = torch.rand(n, generator=g, dtype=torch.float64)
    return p, q, d, u1, u2


def test_acceptance_rule_emits_p_and_wrong_rules_fail():
    p, q, d, u1, u2 = _synthetic()
    P, Q = p.expand(d.shape[0], -1), q.expand(d.shape[0], -1)
    assert _chi2(d, q) < CHI2_LIMIT                          # the drafts really follow q
    ok, tok = acc.accept_draft(P, Q, d, u1, u2)
    assert _chi2(tok, p) < CHI2_LIMIT
    expect_rate = float(torch.minimum(p, q).sum())           # P(accept) = sum min(p, q)
    assert abs(ok.double().mean().item() - expect_rate) < 0.01
    # wrong rule 1: always accept the draft (emits q)
    assert _chi2_or_inf(d, p) > 10 * CHI2_LIMIT
    # wrong rule 2: on rejection resample from p instead of the residual
    wrong = torch.where(ok, d, acc.sample_from(P, u2))
    assert _chi2_or_inf(wrong, p) > 10 * CHI2_LIMIT
    # wrong rule 3: accept with probability p(d) (no division by q)
    acc3 = u1 < P.gather(-1, d[:, None])[:, 0]
    wrong3 = torch.where(acc3, d, acc.sample_from(acc.residual(P, Q), u2))
    assert _chi2_or_inf(wrong3, p) > 10 * CHI2_LIMIT


def _chi2_or_inf(tokens, p):
    try:
        return _chi2(tokens, p)
    except AssertionError:        # emitted a token p never emits: as wrong as it gets
        return float("inf")


def test_two_position_chain_matches_joint():
    """k=2 drafts with a context-dependent target p(t2 | t1): the first two emitted tokens follow
    p(t1) p(t2 | t1) when a rejection at position 1 is followed by a plain sample (next round)."""
    n, V = 40000, 6
    g = torch.Generator().manual_seed(1)
    p1 = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, -1)
    p2 = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5, -1)   # p2[t1]
    q1 = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    q2 = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64), -1)
    u = torch.rand(6, n, generator=g, dtype=torch.float64)
    d1 = acc.sample_from(q1.expand(n, -1), u[0])
    d2 = acc.sample_from(q2[d1], u[1])
    ok1, t1 = acc.accept_draft(p1.expand(n, -1), q1.expand(n, -1), d1, u[2], u[3])
    ok2, t2_spec = acc.accept_draft(p2[d1], q2[d1], d2, u[4], u[5])
    t2_next_round = acc.sample_from(p2[t1], u[5])      # rejected at 1: t2 comes from a new round
    t2 = torch.where(ok1, t2_spec, t2_next_round)
    joint = (p1[:, None] * p2).reshape(-1)
    assert _chi2(t1 * V + t2, joint) < 80.0             # 35 dof: P(chi2 > 80) ~ 1e-5


def test_target_probs_is_the_samplers_distribution():
    logits = torch.tensor([2.0, 1.5, 1.5, 0.3, -1.0, 0.9, 1.1, -0.2])
    for temp, k, top_p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (0.9, 0, 0.8), (1.3, 4, 0.7)]:
        p = acc.target_probs(logits, temp, k, top_p)
        assert abs(float(p.sum()) - 1) < 1e-12
        rng = torch.tensor([123, 0])
        toks = torch.tensor([int(sample(logits, rng, temp, k, top_p)) for _ in range(1000)])
        assert _chi2(toks, p) < 40.0
    greedy = acc.target_probs(logits, 0.0)
    assert torch.equal(greedy, torch.nn.functional.one_hot(torch.tensor(0), 8).double())


# ---- greedy identity ------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_mtp_greedy_equals_plain(layout, k, runtime, plain_ref):
    prompt, ref_toks, ref_logits = plain_ref(layout)
    rt = runtime(ARCH, **_kw(layout))
    out = rt.generate(prompt, max_new_tokens=N, ignore_eos=True, speculative="mtp", draft_tokens=k)
    assert len(out) == N and rt.finish_reason == "length"
    assert rt.tokens == prompt + out
    _first_divergence(out, ref_toks, ref_logits)
    st = rt.speculation().stats
    assert st["drafted"] > 0 and st["rounds"] <= N
    # a second call continues the same session (MTP backlog flushed in between)
    more = rt.generate(max_new_tokens=6, ignore_eos=True, speculative="mtp", draft_tokens=k)
    assert rt.tokens == prompt + out + more
    if _first_divergence(out + more, ref_toks, ref_logits) is None:
        assert out + more == ref_toks[: N + 6]
    _check_state(rt, runtime(ARCH, **_kw(layout)))


def _oracle(prompt, ref, err_at=None, calls=None):
    """Drafts the plain greedy continuation after the pending token; err_at: that draft index
    (0-based) is replaced by a wrong token, so every round accepts exactly err_at drafts."""
    def drafter(rt, k):
        i = len(rt.tokens) - len(prompt)                 # index of the pending token in ref
        if rt.tokens[len(prompt):] == ref[:i]:           # still on the plain history
            assert spec.pending_token(rt) == ref[i]
        d = [ref[i + 1 + j] if i + 1 + j < len(ref) else 0 for j in range(k)]
        if err_at is not None and err_at < k:
            d[err_at] = (d[err_at] + 1) % 512
        if calls is not None:
            calls.append(k)
        return d
    return drafter


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_accepted_length(layout, mechanism, runtime, plain_ref):
    """k=4, drafts wrong first at position j = 0..3, or never (oracle): every round accepts
    exactly min(j, k) drafts, output stays plain greedy, and the committed state is right,
    whether partial rounds keep the verify's state plane or re-run the accepted tokens."""
    prompt, ref_toks, ref_logits = plain_ref(layout)
    k = 4
    for err_at in [0, 1, 2, 3, None]:
        rt, calls = _spec_rt(runtime, ARCH, mechanism, **_kw(layout)), []
        out = rt.generate(prompt, max_new_tokens=N, ignore_eos=True, speculative="mtp",
                          draft_tokens=k, drafter=_oracle(prompt, ref_toks, err_at, calls))
        assert rt.tokens == prompt + out and len(out) == N
        if _first_divergence(out, ref_toks, ref_logits) is not None:
            continue                        # a near-tie: the oracle is off-history from here
        assert out == ref_toks[:N]
        st = rt.speculation().stats
        want = sum(c if err_at is None else min(err_at, c) for c in calls)
        assert st["accepted"] == want, (err_at, st, calls)
        mine, other = _rewinds(rt, mechanism)
        assert other == 0
        if err_at is None:
            assert mine == 0 and st["rounds"] <= -(-N // (k + 1)) + 1
        else:
            assert mine > 0
        _check_state(rt, runtime(ARCH, **_kw(layout)))


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mtp_rows_after_accepted_mtp_drafts(layout, mechanism, runtime, plain_ref):
    """Random MTP weights almost never agree with the main model, so the MTP drafter's own
    tokens are replaced by the plain greedy ones (first wrong at j): the MTP still runs every
    draft step (chained hidden states, KV rows past the committed position, the batched backlog
    write of accepted rows), and accepted lengths 0..k all occur (every round accepts exactly
    min(j, drafts)). The MTP rows [0, P-1) must end up what a one-shot MTP pass over the history
    writes."""
    prompt, ref_toks, ref_logits = plain_ref(layout)
    k, orig = 3, spec.SpeculativeDecoder._draft_head
    lengths = set()                          # accepted lengths seen in full rounds (k drafts)

    for err_at in [0, 1, 2, None]:
        calls = []

        def draft(self, x0, kk):
            calls.append(kk)
            i = len(self.rt.tokens) - len(prompt)
            want = [ref_toks[i + 1 + j] for j in range(kk)]
            if err_at is not None and err_at < kk:
                want[err_at] = (want[err_at] + 1) % 512
            self._pick = lambda logits: (want.pop(0), None)
            return orig(self, x0, kk)
        spec.SpeculativeDecoder._draft_head = draft
        try:
            rt = _spec_rt(runtime, ARCH, mechanism, **_kw(layout))
            out = rt.generate(prompt, max_new_tokens=N, ignore_eos=True, speculative="mtp",
                              draft_tokens=k)
        finally:
            spec.SpeculativeDecoder._draft_head = orig
        assert rt.tokens == prompt + out
        if _first_divergence(out, ref_toks, ref_logits) is None:
            assert out == ref_toks[:N]
            # a wrong draft at j caps a round at min(j, kk) accepted: the total says each
            # round accepted exactly that many
            expect = sum(kk if err_at is None else min(err_at, kk) for kk in calls)
            assert rt.speculation().stats["accepted"] == expect, (err_at, rt.speculation().stats, calls)
            if k in calls:
                lengths.add(k if err_at is None else min(err_at, k))
        _check_state(rt, runtime(ARCH, **_kw(layout)))
    assert lengths == set(range(k + 1)), lengths


def test_mtp_drafts_are_the_chained_mtp_steps(runtime):
    """One round's MTP draft logits equal a by-hand chain on a fork: (main hidden at P-1, x0) at
    MTP row P-1, then (the MTP's own output hidden, previous draft) at rows P, P+1."""
    rt = runtime(ARCH)
    rt.generate(_ids(PROMPT, seed=6), max_new_tokens=1, speculative="mtp")
    fork, P = rt.fork(), rt.position
    seen, orig = [], spec.SpeculativeDecoder._pick

    def pick(self, logits):
        seen.append(logits.clone())
        return orig(self, logits)
    spec.SpeculativeDecoder._pick = pick
    try:
        rt.generate(max_new_tokens=5, ignore_eos=True, speculative="mtp", draft_tokens=3)
    finally:
        spec.SpeculativeDecoder._pick = orig
    net, a = fork.net, fork.arena
    tok, h = int(a["meta.logits"].argmax()), a["mtp.hidden"][None].clone()
    with torch.no_grad():
        for j in range(3):
            row = P - 1 + j
            ctx = StepCtx(1, torch.tensor([row]), start=row)
            logits, h = net.draft(torch.tensor([tok]), h, ctx, a)
            assert (logits[-1] - seen[j]).abs().max() <= 1e-5
            tok = int(logits[-1].argmax())


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_rng_stream_advances_by_the_draws_made(mechanism, runtime, monkeypatch):
    """Sampled rounds that reject: the arena RNG counter counts every draw (draft sampling,
    acceptance tests, residual/bonus samples) - the fixed-state restore must not rewind it."""
    draws = [0]
    real_u, real_sample = spec.uniform, spec.sample

    def u(rng):
        draws[0] += 1
        return real_u(rng)

    def smp(*a, **kw):
        draws[0] += 1
        return real_sample(*a, **kw)
    monkeypatch.setattr(spec, "uniform", u)
    monkeypatch.setattr(spec, "sample", smp)
    rt = _spec_rt(runtime, ARCH, mechanism)
    rt.generate(_ids(PROMPT, seed=9), max_new_tokens=12, temperature=1.0, seed=4, ignore_eos=True,
                speculative="mtp", draft_tokens=3)
    assert _rewinds(rt, mechanism)[0] > 0
    assert int(rt.arena["sampler.rng"][1]) == draws[0]


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("arch", ["qwen3", "lfm2"])
def test_injected_drafter_on_models_without_mtp(arch, mechanism, runtime):
    """speculative='draft' works for attention-only (qwen3) and short-conv (lfm2) models."""
    ref_rt = runtime(arch)
    prompt = _ids(PROMPT, seed=5)
    ref_toks, ref_logits = _plain(ref_rt, prompt, N)
    for err_at in (1, None):
        rt = _spec_rt(runtime, arch, mechanism)
        out = rt.generate(prompt, max_new_tokens=N, ignore_eos=True, speculative="draft",
                          draft_tokens=3, drafter=_oracle(prompt, ref_toks, err_at))
        assert rt.tokens == prompt + out
        if _first_divergence(out, ref_toks, ref_logits) is None:
            assert out == ref_toks
        _check_state(rt, runtime(arch))


# ---- state planes ----------------------------------------------------------------------------
def test_rule_and_conv_planes_are_the_states_after_each_position():
    """planes[t] is bitwise the state the same path leaves after positions [0, t]: the per-token
    gated delta rule, and both conv layouts (GDN (C, K-1), LFM2's (K-1, C))."""
    from flashrt.nn.layers import depthwise_causal_conv
    from flashrt.nn.linear_attn import causal_conv, recurrent_gated_delta_rule
    g = torch.Generator().manual_seed(3)
    T, Hk, Hv, D, C, K = 5, 2, 4, 8, 6, 4
    q, k = torch.randn(T, Hk, D, generator=g), torch.randn(T, Hk, D, generator=g)
    v = torch.randn(T, Hv, D, generator=g)
    beta, gl = torch.rand(T, Hv, generator=g), -torch.rand(T, Hv, generator=g)
    s0 = torch.randn(Hv, D, D, generator=g)
    st, planes = s0.clone(), torch.full((T, Hv, D, D), float("nan"))
    recurrent_gated_delta_rule(q, k, v, gl, beta, st, planes=planes)
    assert torch.equal(planes[-1], st)
    x, w, c0 = torch.randn(T, C, generator=g), torch.randn(C, K, generator=g), torch.randn(C, K - 1, generator=g)
    c, cpl = c0.clone(), torch.full((T, C, K - 1), float("nan"))
    causal_conv(x, c, w, planes=cpl)
    l0 = c0.t().contiguous()
    ls, lpl = l0.clone(), torch.full((T, K - 1, C), float("nan"))
    depthwise_causal_conv(x, ls, w, planes=lpl)
    for t in range(T):
        ref = s0.clone()
        recurrent_gated_delta_rule(q[: t + 1], k[: t + 1], v[: t + 1], gl[: t + 1], beta[: t + 1], ref)
        assert torch.equal(planes[t], ref), t
        ref = c0.clone()
        causal_conv(x[: t + 1], ref, w)
        assert torch.equal(cpl[t], ref), t
        ref = l0.clone()
        depthwise_causal_conv(x[: t + 1], ref, w)
        assert torch.equal(lpl[t], ref), t


@pytest.mark.parametrize("arch,layout", [("qwen3_5", "multimodal"), ("qwen3_5", "text"),
                                         ("lfm2", "text"), ("qwen3", "text")])
def test_verify_planes_cover_the_fixed_state(arch, layout, runtime):
    """A 5-position verify with planes writes every fixed buffer's plane (NaN-filled before),
    its last plane is the state the step left, and keeping plane t leaves the state a 5-position
    verify of t+1 tokens leaves (1e-5: the projections see 5 rows vs t+1). Attention-only
    models have no plane to keep."""
    kw = _kw(layout) if arch == ARCH else {}
    rt = runtime(arch, **kw)
    rt.prefill(_ids(PROMPT, seed=13))
    sess, steps = rt.session, spec.EagerSteps(rt.net, rt.session)
    fixed = [s.name for s in rt.arena.slots if s.spec.kind in ("recurrent", "conv")]
    toks = torch.tensor(_ids(5, seed=14))
    mark = sess.mark()
    planes = steps.planes_for(5)
    assert sorted(planes.buffers) == sorted(fixed) and (arch != "qwen3" or fixed == [])
    for t in range(5):
        sess.rewind(mark)
        for b in planes.buffers.values():
            b.fill_(float("nan"))
        steps.main(toks, planes=True)
        assert steps.planes is planes
        end = {n: rt.arena[n].clone() for n in fixed}
        for n in fixed:
            assert not planes.buffers[n].isnan().any(), f"{n}: a plane was not written"
            assert torch.equal(planes.buffers[n][-1], end[n]), n
        planes.keep(t)
        kept = {n: rt.arena[n].clone() for n in fixed}
        sess.rewind(mark)
        steps.main(toks[: t + 1], planes=True)
        for n in fixed:
            d = (kept[n].float() - rt.arena[n].float()).abs().max()
            assert d <= 1e-5, f"{n}: plane {t} differs from a {t + 1}-token step by {d:.3g}"
    assert rt.position == PROMPT


def test_model_without_planes_falls_back_to_rerun(runtime, monkeypatch):
    """A model that does not declare state_planes gets the mark/rewind/re-run mechanism."""
    rt = runtime(ARCH)
    monkeypatch.setattr(type(rt.net), "state_planes", False)
    assert rt.session.state_planes(3) is None
    rt.generate(_ids(PROMPT, seed=15), max_new_tokens=8, ignore_eos=True, speculative="mtp",
                draft_tokens=2)
    st = rt.speculation().stats
    assert st["plane_rewinds"] == 0 and st["reprefills"] > 0
    with pytest.raises(ValueError, match="mechanism 'both'"):
        spec.use_mechanism(rt, "both")


# ---- a round at a time (flashrt serve) --------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_decoder_rounds_are_generate(temperature, runtime):
    """Speculator.prefill + decoder() driven round by round (a server's loop) give
    generate()'s tokens and leave its state byte for byte (same path, same RNG draws)."""
    prompt = _ids(PROMPT, seed=16)
    ref = runtime(ARCH)
    want = ref.generate(prompt, max_new_tokens=10, temperature=temperature, seed=2,
                        ignore_eos=True, speculative="mtp", draft_tokens=3)
    rt = runtime(ARCH)
    sp = rt.speculation()
    sp.prefill(prompt)
    rt.seed(2)
    dec = sp.decoder(3, temperature)
    got = [dec.first()]
    while len(got) < 10 and dec.pending is not None:
        got += dec.next(10 - len(got), set())
    dec.close()
    assert got == want and rt.tokens == ref.tokens
    diff = [s.name for s in rt.arena.slots if s.spec.kind in ("kv", "recurrent", "conv", "rng", "meta")
            and not torch.equal(rt.arena[s.name], ref.arena[s.name])]
    assert not diff, diff
    with pytest.raises(ValueError, match="draft_tokens"):
        sp.decoder(0)


def test_decoder_says_why_it_finished(runtime, plain_ref):
    """The decoder's finish_reason: None while it goes on, then "stop", "length" or
    "max_seq_len" with pending None; it never writes the session's (generate sets that)."""
    prompt, ref_toks, ref_logits = plain_ref("multimodal")
    top2 = ref_logits[:N].topk(2, dim=-1).values     # exact equalities below: no near-tie
    assert (top2[:, 0] - top2[:, 1] > 1e-3).all()
    stop_tok = ref_toks[6]
    first_stop = ref_toks.index(stop_tok)

    def decode(room, stops=(), **kw):
        rt = runtime(ARCH, **kw)
        sp = rt.speculation()
        sp.prefill(prompt)
        dec = sp.decoder(3, drafter=_oracle(prompt, ref_toks))
        got = [t for t in [dec.first()] if t is not None]
        while dec.pending is not None:
            assert dec.finish_reason is None
            got += dec.next(room - len(got), set(stops))
        with pytest.raises(RuntimeError, match="pending"):
            dec.next(1, set())
        dec.close()
        assert rt.tokens == prompt + got and rt.finish_reason is None
        return got, dec.finish_reason
    assert decode(N, stops=(stop_tok,)) == (ref_toks[: first_stop + 1], "stop")
    assert decode(7) == (ref_toks[:7], "length")
    assert decode(100, max_seq_len=PROMPT + 10) == (ref_toks[:10], "max_seq_len")
    assert decode(5, max_seq_len=PROMPT) == ([], "max_seq_len")      # full before first()


def test_prefill_makes_no_step_bodies(runtime, monkeypatch):
    """Speculator.prefill (a server's prompt, before any decoder) runs on the steps there are:
    it makes no body set for one draft (on CUDA: a capture of every size) that the decoder's
    draft_tokens then replace."""
    from flashrt.lm import use_graph_bodies
    made, real = [], spec.SpecSteps.__init__
    monkeypatch.setattr(spec.SpecSteps, "__init__",
                        lambda self, *a, **kw: made.append(a[2]) or real(self, *a, **kw))
    rt = runtime(ARCH)
    use_graph_bodies(rt)
    sp = rt.speculation()
    for seed in (20, 21):
        sp.prefill(_ids(PROMPT, seed=seed))
        dec = sp.decoder(3)
        dec.first()
        dec.next(4, set())
        dec.close()
    assert made == [4]


@pytest.mark.parametrize("drafter", ["mtp", "injected"])
def test_decoders_of_forks_sharing_an_arena_interleave(drafter, runtime):
    """A server interleaves the rounds of forks that take turns in one arena: every decoder
    call takes its member's turn first (around a drafter that never touches rt too), so each
    member's tokens and state are bitwise those of a session that ran alone."""
    from conftest import state_bytes
    from flashrt.lm import use_graph_bodies
    kw = {"temperature": 0.9}
    if drafter == "injected":
        kw["drafter"] = lambda rt, k: [7, 8, 9][:k]

    def fresh():
        rt = runtime(ARCH)
        use_graph_bodies(rt)
        rt.prefill(_ids(PROMPT, seed=23))
        return rt

    def start(rt, seed):
        rt.speculation().prefill(_ids(4, seed=seed))
        rt.seed(seed)

    def rounds(decs, n=8):
        out = [[d.first()] for d in decs]
        while any(d.pending is not None and len(o) < n for d, o in zip(decs, out)):
            for d, o in zip(decs, out):
                if d.pending is not None and len(o) < n:
                    o += d.next(n - len(o), set())
        for d in decs:
            d.close()
        return out

    parent = fresh()
    members = [(parent, 7), (parent.fork(share=True), 8)]
    for rt, seed in members:
        start(rt, seed)
    got = rounds([rt.speculation().decoder(2, **kw) for rt, _ in members])
    for (rt, seed), toks in zip(members, got):
        alone = fresh()
        start(alone, seed)
        assert toks == rounds([alone.speculation().decoder(2, **kw)])[0]
        assert torch.equal(state_bytes(rt), state_bytes(alone))


# ---- stops, budgets, limits -----------------------------------------------------------------
def test_stop_inside_accepted_drafts_and_exact_budgets(runtime, plain_ref):
    prompt, ref_toks, ref_logits = plain_ref("multimodal")
    # the exact token equalities below need a plain run with no near-tie
    top2 = ref_logits[:N].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1] > 1e-3).all(), (top2[:, 0] - top2[:, 1]).min()
    j = 6
    stop_tok = ref_toks[j]
    first = ref_toks.index(stop_tok)
    rt = runtime(ARCH)
    out = rt.generate(prompt, max_new_tokens=N, stop=(stop_tok,), speculative="mtp", draft_tokens=4,
                      drafter=_oracle(prompt, ref_toks))
    assert out == ref_toks[: first + 1] and rt.finish_reason == "stop"
    assert rt.tokens == prompt + out
    _check_state(rt, runtime(ARCH))
    for n in (1, 2, 5, 7):               # budgets that cut rounds short
        rt = runtime(ARCH)
        out = rt.generate(prompt, max_new_tokens=n, ignore_eos=True, speculative="mtp", draft_tokens=4,
                          drafter=_oracle(prompt, ref_toks))
        assert out == ref_toks[:n] and rt.tokens == prompt + out and rt.finish_reason == "length"
    assert runtime(ARCH).generate(prompt, max_new_tokens=0, speculative="mtp") == []


def test_max_seq_len_and_checkpoint_boundaries(runtime, plain_ref):
    """Verify never crosses a rollback checkpoint boundary (checkpoint_every=8 here), rollback
    after speculative decoding restores the checkpoint below and ends within 1e-4 of a fresh
    prefill, and max_seq_len ends generation like plain decoding."""
    prompt, ref_toks, ref_logits = plain_ref("multimodal")
    rt = runtime(ARCH, checkpoint_every=8, max_seq_len=PROMPT + 20)
    out = rt.generate(prompt, max_new_tokens=100, ignore_eos=True, speculative="mtp", draft_tokens=3,
                      drafter=_oracle(prompt, ref_toks))
    assert len(out) == 20 and rt.finish_reason == "max_seq_len" and rt.tokens == prompt + out
    assert rt.session.checkpoint_positions() == [8, 16, 24, 32]
    back = rt.tokens[:PROMPT + 5]
    assert rt.session.rollback_source(PROMPT + 5) == 16       # the checkpoint, then one re-run
    rt.rollback(PROMPT + 5)
    fresh = runtime(ARCH, max_seq_len=PROMPT + 20)
    assert (rt.arena["meta.logits"] - fresh.prefill(back)).abs().max() <= 1e-4
    plain = runtime(ARCH, max_seq_len=PROMPT + 20)
    assert len(plain.generate(prompt, max_new_tokens=100, ignore_eos=True)) == 20


# ---- sampling and capsules --------------------------------------------------------------------
def test_sampled_top_k_1_is_greedy(runtime, plain_ref):
    prompt, ref_toks, ref_logits = plain_ref("text")
    rt = runtime(ARCH, ckpt_kw={"layout": "text"})
    out = rt.generate(prompt, max_new_tokens=16, temperature=0.9, top_k=1, ignore_eos=True,
                      speculative="mtp", draft_tokens=2, seed=3)
    _first_divergence(out, ref_toks, ref_logits)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_capsule_between_speculative_calls_continues_identically(temperature, runtime, tmp_path):
    rt = runtime(ARCH)
    prompt = _ids(PROMPT, seed=7)
    kw = dict(temperature=temperature, ignore_eos=True, speculative="mtp", draft_tokens=3)
    rt.generate(prompt, max_new_tokens=9, seed=11, **kw)
    cap = rt.snapshot()
    flashrt.save_capsule(cap, tmp_path / "mid.cap")
    a = rt.generate(max_new_tokens=15, **kw)
    fork = rt.fork(cap)
    b = fork.generate(max_new_tokens=15, **kw)
    other = runtime(ARCH)
    other.restore(flashrt.load_capsule(tmp_path / "mid.cap"))
    c = other.generate(max_new_tokens=15, **kw)
    assert a == b == c and len(a) == 15
    assert torch.equal(rt.arena["sampler.rng"], fork.arena["sampler.rng"])


def test_sampled_injected_drafter_with_probabilities(runtime):
    """A drafter returning (ids, q) drives the sampled rule; output is committed and reproducible."""
    V = 512

    def drafter(rt, k):
        q = torch.full((k, V), 1.0 / V)
        return [int(rt.tokens[-1] + j) % V for j in range(k)], q
    outs = []
    for _ in range(2):
        rt = runtime(ARCH)
        out = rt.generate(_ids(PROMPT, seed=8), max_new_tokens=12, temperature=1.0, seed=5,
                          ignore_eos=True, speculative="mtp", draft_tokens=2, drafter=drafter)
        assert rt.tokens[PROMPT:] == out and len(out) == 12
        outs.append(out)
    assert outs[0] == outs[1]


# ---- the speculator's contract with the language model -----------------------------------------
def _contract() -> frozenset:
    """The members SpeculationTarget declares."""
    t = spec.SpeculationTarget
    return frozenset({n for n in vars(t) if not n.startswith("_")} | set(t.__annotations__))


class _OnlyContract:
    """A LanguageModel as the speculator may see it: its SpeculationTarget members, read only."""

    def __init__(self, rt):
        object.__setattr__(self, "_rt", rt)
        object.__setattr__(self, "_names", _contract())

    def __getattr__(self, name):
        assert name in self._names, f"the speculator read rt.{name}, outside SpeculationTarget"
        return getattr(self._rt, name)

    def __setattr__(self, name, value):
        raise AssertionError(f"the speculator set rt.{name}")


def test_language_model_has_the_speculators_contract(runtime):
    """SpeculationTarget is the surface the module docstring lists, and LanguageModel has it
    (methods with the same leading parameters)."""
    import inspect
    from flashrt.lm import LanguageModel
    contract = _contract()
    assert contract == {"net", "model", "graphs", "activate", "start_generation", "advance",
                        "commit_tokens", "speculation"}
    rt = runtime(ARCH)
    for name in contract:
        assert hasattr(rt, name), name
        want = vars(spec.SpeculationTarget).get(name)
        if inspect.isfunction(want):
            params = list(inspect.signature(want).parameters)
            assert list(inspect.signature(getattr(LanguageModel, name)).parameters)[: len(params)] == params


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_the_speculator_uses_only_its_contract(mechanism, runtime):
    """generate (MTP greedy and sampled, an injected drafter, a run ended by max_seq_len)
    through a LanguageModel showing only SpeculationTarget: the speculator reads nothing else,
    writes nothing on it, and generate's finish_reason is what the speculator returned."""
    prompt = _ids(PROMPT, seed=19)

    def drafter(rt, k):
        return [(spec.pending_token(rt) + 1 + j) % 512 for j in range(k)]
    runs = [({}, dict(draft_tokens=3)), ({}, dict(draft_tokens=2, temperature=0.9, seed=4)),
            ({}, dict(speculative="draft", drafter=drafter)),
            ({"max_seq_len": PROMPT + 5}, dict(draft_tokens=2))]
    for load_kw, kw in runs:
        kw = {"speculative": "mtp", "max_new_tokens": 8, "ignore_eos": True, **kw}
        ref = _spec_rt(runtime, ARCH, mechanism, **load_kw)
        want = ref.generate(prompt, **kw)
        rt = _spec_rt(runtime, ARCH, mechanism, **load_kw)
        rt.speculation().rt = _OnlyContract(rt)
        assert rt.generate(prompt, **kw) == want
        assert rt.finish_reason == ref.finish_reason == ("max_seq_len" if load_kw else "length")
        assert torch.equal(rt.arena["meta.logits"], ref.arena["meta.logits"])


# ---- graph-safe bodies, refusals ----------------------------------------------------------------
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_static_bodies_match_eager(mechanism, runtime, plain_ref):
    """The bodies SpecSteps captures on CUDA (device positions, full-capacity masked attention),
    run eagerly over NaN-filled stale rows, give plain greedy output and the right state."""
    prompt, ref_toks, ref_logits = plain_ref("multimodal")
    rt = _spec_rt(runtime, ARCH, mechanism)
    for s in rt.arena.slots:
        if s.spec.seq_dim == 0 and rt.arena[s.name].is_floating_point():
            rt.arena[s.name].fill_(float("nan"))
    steps = spec.use_static_steps(rt, max_T=4)
    out = rt.generate(prompt, max_new_tokens=16, ignore_eos=True, speculative="mtp", draft_tokens=3)
    assert rt.speculation().steps is steps
    assert _rewinds(rt, mechanism)[0] > 0          # random MTP weights: partial rounds
    _first_divergence(out, ref_toks, ref_logits)
    _check_state(rt, runtime(ARCH))


def test_graph_bodies_made_once_when_drafts_exceed_the_step_cap(runtime):
    """k + 1 verify positions beyond prefill_chunk: the bodies are capped there, and the capped
    set serves every later call (on CUDA a new set is a capture of every size)."""
    from flashrt.lm import use_graph_bodies
    rt = runtime(ARCH, prefill_chunk=2)
    use_graph_bodies(rt)
    rt.generate(_ids(PROMPT, seed=12), max_new_tokens=4, ignore_eos=True, speculative="mtp",
                draft_tokens=3)
    steps = rt.speculation().steps
    rt.generate(max_new_tokens=4, ignore_eos=True, speculative="mtp", draft_tokens=3)
    assert steps.max_T == 2 and rt.speculation().steps is steps


def test_graph_warm_up_leaves_the_state_as_it_was(runtime):
    """Capturing mid-session runs every body once for real (warm-up); near max_seq_len the
    scratch rows overlap committed rows. Whatever ran, the state is put back byte for byte."""
    rt = runtime(ARCH, max_seq_len=PROMPT + 6)
    rt.generate(_ids(PROMPT, seed=10), max_new_tokens=4, ignore_eos=True, speculative="mtp")
    before = rt.snapshot()
    steps = spec.SpecSteps(rt.net, rt.session, max_T=5, capture=False)
    assert len(steps.bodies()) == 10
    with torch.no_grad():
        steps.preserving_state(lambda: [steps.run_body(k, T) for k, T in steps.bodies()])
    after = rt.snapshot()
    assert after.position == before.position and torch.equal(after.data, before.data)


def test_spec_steps_take_the_base_steps_arguments(runtime):
    """SpecSteps.main/draft take EagerSteps' arguments and return its shapes: all_logits=False
    and last_only=True (a prefill writing rows) give the last row, from a graph body or, past
    max_T, the eager step; within 1e-4 of the eager steps' values."""
    import inspect
    for name in ("main", "draft"):
        assert (list(inspect.signature(getattr(spec.SpecSteps, name)).parameters)
                == list(inspect.signature(getattr(spec.EagerSteps, name)).parameters)), name
    rt = runtime(ARCH)
    rt.prefill(_ids(PROMPT, seed=17))
    sess, V, P = rt.activate(), rt.net.vocab_size, rt.position
    static, eager = spec.SpecSteps(rt.net, sess, max_T=3, capture=False), spec.EagerSteps(rt.net, sess)
    toks = torch.tensor(_ids(5, seed=18))
    hid = torch.randn(5, rt.net.config.hidden_size, generator=torch.Generator().manual_seed(1))
    mark = sess.mark()

    def main(steps, T, all_logits):
        sess.rewind(mark)              # a verify advances the fixed state without committing
        return steps.main(toks[:T], all_logits=all_logits)
    with torch.no_grad():
        for T in (1, 3, 5):            # 5 > max_T: the eager step
            for run in (lambda steps, flag: main(steps, T, flag),     # (hidden, logits) both
                        lambda steps, flag: steps.draft(toks[:T], hid[:T], P - 1, not flag)[::-1]):
                (h, full), (h1, last), (he, ref) = run(static, True), run(static, False), run(eager, False)
                assert full.shape == (T, V) and last.shape == ref.shape == (1, V) and h1.shape == h.shape
                assert (last[0] - full[-1]).abs().max() <= 1e-5 and torch.equal(h1, h)
                assert (last - ref).abs().max() <= 1e-4 and (h1 - he).abs().max() <= 1e-4


def test_without_mtp_weights_refused_before_any_change(ckpt, runtime):
    import flashrt
    with pytest.warns(UserWarning):
        rt = flashrt.load(ckpt(ARCH, mtp=False), dtype="float32", max_seq_len=64)
    with pytest.raises(ValueError, match="no MTP weights"):
        rt.generate(_ids(5), speculative="mtp")
    assert rt.position == 0
    for arch in ("qwen3", "lfm2"):
        with pytest.raises(ValueError, match="no MTP"):
            runtime(arch).generate(_ids(5), speculative="mtp")
    r = runtime(ARCH)
    for bad, err in [(dict(speculative="eagle"), ValueError), (dict(speculative="draft"), ValueError),
                     (dict(speculative="mtp", draft_tokens=0), ValueError),
                     (dict(drafter=lambda rt, k: []), ValueError),
                     (dict(speculative="mtp", drafter=3), TypeError)]:
        with pytest.raises(err):
            r.generate(_ids(5), **bad)
    assert r.position == 0

"""Sampling inside the captured decode step (StepGraphs.generate), checked on CPU through the
graph bodies run eagerly: the same tokens, RNG stream and arena bytes as the host loop over
the same bodies, early stops that commit nothing extra, and capsules taken mid-generation."""
from __future__ import annotations

import pytest
import torch

import flashrt.lm
from conftest import ARCHS, state_bytes
from flashrt.core.graphs import HostReadback
from flashrt.lm import graph_body_step, use_graph_bodies
from flashrt.lm.sampler import sample

SETTINGS = {"greedy": dict(temperature=0.0),
            "sampled": dict(temperature=0.8, top_k=40, top_p=0.9),
            "top_p": dict(temperature=1.3, top_p=0.5),
            "plain": dict(temperature=1.0)}           # host sample() skips both filters


pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n, seed=0):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _graph_rt(runtime, arch, **kw):
    rt = runtime(arch, max_seq_len=kw.pop("max_seq_len", 96), **kw)
    use_graph_bodies(rt)
    return rt


def _host_loop(rt, prompt, n, seed, stops=(), temperature=0.0, top_k=0, top_p=1.0):
    """What generate did on the graph path before: host sampler, then one replayed step."""
    if prompt is not None:
        rt.prefill(prompt)
    if seed is not None:
        rt.seed(seed)
    out = []
    for _ in range(n):
        if rt.position >= rt.max_seq_len:
            break
        out.append(rt.sample(temperature, top_k, top_p))
        graph_body_step(rt, torch.tensor([out[-1]]))
        if out[-1] in stops:
            break
    return out


def _state(rt) -> torch.Tensor:
    """Every arena byte but the io buffers (io.next and the settings exist for the device path)."""
    a = rt.arena
    keep = torch.ones(a.nbytes, dtype=torch.bool)
    for s in a.slots:
        if s.spec.kind == "io":
            keep[s.offset: s.offset + s.spec.nbytes] = False
    return a.data[keep].clone()


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_device_tokens_rng_and_bytes_equal_host_loop(arch, setting, runtime):
    kw, prompt = SETTINGS[setting], _ids(17, 1)
    dev, host = _graph_rt(runtime, arch), _graph_rt(runtime, arch)
    got = dev.generate(prompt, max_new_tokens=12, seed=5, ignore_eos=True, **kw)
    want = _host_loop(host, prompt, 12, 5, **kw)
    assert got == want and dev.finish_reason == "length"
    assert dev.position == host.position == 29 and dev.tokens == host.tokens
    draws = 0 if setting == "greedy" else 12
    assert dev.arena["sampler.rng"].tolist() == host.arena["sampler.rng"].tolist() == [5, draws]
    assert torch.equal(_state(dev), _state(host))


@pytest.mark.parametrize("arch", ARCHS)
def test_stop_and_max_seq_len_commit_nothing_extra(arch, runtime):
    """The replay after a stop token is never launched; the one extra draw is given back."""
    kw, prompt = SETTINGS["sampled"], _ids(9, 2)
    ref = _host_loop(_graph_rt(runtime, arch), prompt, 12, 7, **kw)
    stop = ref[5]
    dev, host = _graph_rt(runtime, arch), _graph_rt(runtime, arch)
    got = dev.generate(prompt, max_new_tokens=12, seed=7, stop=(stop,), ignore_eos=True, **kw)
    want = _host_loop(host, prompt, 12, 7, stops={stop}, **kw)
    assert got == want and got[-1] == stop and len(got) <= 6 and dev.finish_reason == "stop"
    assert torch.equal(_state(dev), _state(host))
    # room for 4 more positions: max_seq_len ends it, as in the host loop
    dev, host = _graph_rt(runtime, arch, max_seq_len=13), _graph_rt(runtime, arch, max_seq_len=13)
    got = dev.generate(prompt, max_new_tokens=12, seed=7, ignore_eos=True, **kw)
    want = _host_loop(host, prompt, 12, 7, **kw)
    assert got == want and len(got) == 4 and dev.finish_reason == "max_seq_len"
    assert torch.equal(_state(dev), _state(host))
    assert dev.generate(max_new_tokens=3) == [] and dev.finish_reason == "max_seq_len"
    assert dev.generate(max_new_tokens=0) == [] and dev.finish_reason == "length"
    assert torch.equal(_state(dev), _state(host))


@pytest.mark.parametrize("arch", ARCHS)
def test_snapshot_restore_mid_generation_continues_bitwise(arch, runtime):
    kw, prompt = SETTINGS["sampled"], _ids(15, 3)
    ref = _graph_rt(runtime, arch)
    want = ref.generate(prompt, max_new_tokens=12, seed=11, ignore_eos=True, **kw)
    rt = _graph_rt(runtime, arch)
    first = rt.generate(prompt, max_new_tokens=5, seed=11, ignore_eos=True, **kw)
    cap = rt.snapshot()
    rt.generate(max_new_tokens=6, temperature=1.0, seed=99, ignore_eos=True)   # wander off
    rt.prefill(_ids(7, 4))
    rt.restore(cap)
    rest = rt.generate(max_new_tokens=7, ignore_eos=True, **kw)     # seed=None: the stream goes on
    assert first + rest == want
    assert torch.equal(state_bytes(rt), state_bytes(ref))     # rows above: the detour's, stale


def test_generate_draws_on_device_not_on_host(runtime, monkeypatch):
    """The decode body writes the drawn token to io.next; generate never calls the host sampler."""
    rt = _graph_rt(runtime, "qwen3_5")
    rt.prefill(_ids(10, 5))
    a = rt.arena
    a["io.temperature"].fill_(0.9)
    a["io.top_k"].fill_(0)
    a["io.top_p"].fill_(0.95)
    a["io.next"].fill_(7)
    rng = a["sampler.rng"].clone()
    with torch.no_grad():
        rt.graphs.call("decode")
    rt.session.commit(1)
    assert rt.tokens[-1] == 7
    want = sample(a["meta.logits"], rng, 0.9, 0, 0.95)
    assert torch.equal(a["io.next"], want) and torch.equal(a["sampler.rng"], rng)

    def host_sampler(*args):
        raise AssertionError("the host sampler ran during a graph-path generate")
    monkeypatch.setattr(flashrt.lm.model, "sample", host_sampler)
    assert len(rt.generate(max_new_tokens=6, temperature=0.7, ignore_eos=True)) == 6


def test_graph_warm_up_leaves_the_state_as_it_was(runtime):
    """Capture runs every body once for real (sample and decode draw and step) at the scratch
    window; the state, RNG included, is put back byte for byte."""
    rt = _graph_rt(runtime, "qwen3_5", max_seq_len=24)
    rt.generate(_ids(12, 6), max_new_tokens=6, temperature=1.0, seed=2, ignore_eos=True)
    before, g = state_bytes(rt), rt.graphs
    rt.arena["io.temperature"].fill_(1.0)
    assert g.max_size == 16                  # capped by max_seq_len, not graph_max_tokens (64)
    rt.session.preserving_state(lambda: [fn() for fn in g.fns.values()], g.max_size)
    assert rt.position == 18 and torch.equal(state_bytes(rt), before)


# the graph and eager paths' logits differ by ~5e-7 (full-capacity masked attention vs the
# live rows): a draw whose uniform lies within this of flipping may legitimately differ
DRAW_TOL = 1e-5


def _log_draw_margins(monkeypatch, log):
    """Wrap the speculator's random decisions so each logs (position, margin): how far its
    uniform fell from the nearest value that flips its outcome, the analogue for draws of
    the top-2 margin rule (conftest.margin_check). Logged while log["rt"] is a session."""
    import flashrt.lm.speculative as S
    from flashrt.core.rng import at_counter
    from flashrt.lm.acceptance import target_probs
    real = {n: getattr(S, n) for n in ("sample", "sample_from", "accept_test")}

    def note(margin):
        if log["rt"] is not None:
            log["margins"].append((log["rt"].position, float(margin)))

    def cdf_margin(probs, u):          # inverse CDF: the distance to the nearest boundary
        cdf = torch.cumsum(probs.double().reshape(-1), 0)
        return ((cdf / cdf[-1])[:-1] - u.double()).abs().min()

    def sample(logits, rng, temperature=0.0, top_k=0, top_p=1.0):
        if temperature > 0:            # draw(): the CDF over probabilities sorted descending
            p = target_probs(logits, temperature, top_k, top_p)
            note(cdf_margin(p.sort(descending=True, stable=True).values, at_counter(rng)[0]))
        return real["sample"](logits, rng, temperature, top_k, top_p)

    def sample_from(probs, u):
        note(cdf_margin(probs, u))
        return real["sample_from"](probs, u)

    def accept_test(p, q, d, u):       # accepted iff u < p(d) / q(d)
        note((u.double() - p[..., d].double() / q[..., d].double()).abs())
        return real["accept_test"](p, q, d, u)
    for name, fn in (("sample", sample), ("sample_from", sample_from), ("accept_test", accept_test)):
        monkeypatch.setattr(S, name, fn)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("setting", ["greedy", "sampled", "plain"])
def test_speculative_on_graph_bodies(setting, k, runtime, monkeypatch):
    """Speculation on an lm stepping through uncaptured graph bodies runs its own bodies
    uncaptured too, and gives the eager path's tokens for the same seeds: greedy token for
    token, sampled up to the first draw within DRAW_TOL of flipping (the paths are not
    bitwise the same), which must leave at least half the tokens compared."""
    from flashrt.lm.speculative_steps import EagerSteps, SpecSteps
    kw, prompt, n = SETTINGS[setting], _ids(12, 7), 16
    log = {"rt": None, "margins": []}
    _log_draw_margins(monkeypatch, log)
    graph = _graph_rt(runtime, "qwen3_5")
    got = graph.generate(prompt, max_new_tokens=n, seed=3, ignore_eos=True, speculative="mtp",
                         draft_tokens=k, **kw)
    steps = graph.speculation().steps
    assert isinstance(steps, SpecSteps) and not steps.graphs.graphs
    eager = runtime("qwen3_5", max_seq_len=96)
    log["rt"] = eager
    want = eager.generate(prompt, max_new_tokens=n, seed=3, ignore_eos=True, speculative="mtp",
                          draft_tokens=k, **kw)
    assert eager.graphs is None and type(eager.speculation().steps) is EagerSteps
    assert len(got) == len(want) == n and graph.finish_reason == eager.finish_reason == "length"
    near = [p for p, m in log["margins"] if m <= DRAW_TOL]
    assert len(log["margins"]) == int(eager.arena["sampler.rng"][1])     # every draw has a margin
    same = (min(near) if near else eager.position) - len(prompt)   # tokens chosen before it
    assert 2 * same >= n, f"a draw within {DRAW_TOL} of flipping at token {same}: other seeds"
    assert got[:same] == want[:same], (same, got, want)
    if not near:
        assert graph.arena["sampler.rng"].tolist() == eager.arena["sampler.rng"].tolist()
        assert (graph.arena["meta.logits"] - eager.arena["meta.logits"]).abs().max() <= 1e-4


def test_host_readback_ring():
    rb = HostReadback(torch.device("cpu"))
    rb.push(torch.tensor([3]))
    rb.push(torch.tensor([4]))
    with pytest.raises(RuntimeError, match="in flight"):
        rb.push(torch.tensor([5]))
    assert rb.pop() == 3
    rb.push(torch.tensor([5]))
    assert (rb.pop(), rb.pop()) == (4, 5)
    rb.push(torch.tensor([6]))
    rb.clear()
    rb.push(torch.tensor([7]))
    assert rb.pop() == 7


def test_tiny_temperature_samples_the_argmax():
    """logits / 1e-44 overflowed to inf and the softmax to NaN (a server saw token 511 every
    step); a temperature that small is one-hot: the argmax."""
    from flashrt.lm.sampler import sample
    logits = torch.randn(512, generator=torch.Generator().manual_seed(0)) * 5
    for t in (1e-44, 1e-30, 1e-7):
        rng = torch.tensor([3, 0], dtype=torch.int64)
        assert int(sample(logits, rng, temperature=t)) == int(logits.argmax()), t

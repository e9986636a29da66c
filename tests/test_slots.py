"""Forks that take turns in one arena and its graph bodies (flashrt/core/shared.py): a fork costs a
state copy, not a capture, and every member continues bitwise as if it had run alone."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conftest import ARCHS, state_bytes
from flashrt.errors import ArenaError, CapsuleMismatchError
from flashrt.lm import use_graph_bodies

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n, seed, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _graph_rt(runtime, arch, **kw):
    rt = runtime(arch, checkpoint_every=16, **kw)
    use_graph_bodies(rt)           # the bodies CUDA captures, run eagerly
    return rt


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_fork_takes_no_arena_or_capture(arch, runtime):
    parent = _graph_rt(runtime, arch)
    parent.prefill(_ids(20, 1))
    child = parent.fork(share=True)
    assert child.graphs is parent.graphs                  # no new bodies (no capture on CUDA)
    assert child.position == parent.position == 20        # read without taking a turn
    with pytest.raises(ArenaError, match="activate"):
        child.arena                                       # reading state never copies it
    assert child.activate() is parent._shared.session     # one arena: the child is now in it
    with pytest.raises(ArenaError, match="activate"):
        parent.session                                    # parked: its turn is explicit
    own = parent.fork(share=False)
    assert own.activate() is not parent.activate()


@pytest.mark.parametrize("arch", ARCHS)
def test_interleaved_members_continue_as_if_alone(arch, runtime):
    """Parent and two forks take turns token by token; each one's tokens and final state are
    bitwise those of a session that ran the same calls alone (same step path)."""
    base = _graph_rt(runtime, arch)
    base.prefill(_ids(24, 2))
    cap = base.snapshot()

    def alone(seed):
        rt = _graph_rt(runtime, arch)
        rt.restore(cap)
        rt.seed(seed)
        toks = [t for _ in range(3) for t in rt.generate(max_new_tokens=2, temperature=1.0)]
        return toks, state_bytes(rt)

    want = {s: alone(s) for s in (5, 6, 7)}
    members = {5: base, 6: base.fork(seed=6, share=True), 7: base.fork(cap, seed=7, share=True)}
    base.seed(5)
    got = {s: [] for s in members}
    for _ in range(3):
        for s, rt in members.items():
            got[s] += rt.generate(max_new_tokens=2, temperature=1.0)
    for s, rt in members.items():
        assert got[s] == want[s][0]
        assert torch.equal(state_bytes(rt), want[s][1])


@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2"])
def test_parked_session_keeps_its_checkpoints(arch, runtime):
    """Parking takes the rollback sources along: after a fork's turn, the parent rolls back
    from the same checkpoint, to bitwise the state of a parent that never shared."""
    def run(share):
        rt = _graph_rt(runtime, arch)
        rt.prefill(_ids(40, 3))
        before = rt.activate().checkpoint_positions()
        child = rt.fork(share=share)
        child.prefill(_ids(30, 4))                       # the child's turn
        assert rt.activate().checkpoint_positions() == before
        src = rt.session.rollback_source(37)
        rt.rollback(37)
        return before, src, state_bytes(rt), rt.decode(9)
    shared, alone = run(True), run(False)
    assert shared[0] and shared[1] == alone[1] > 0
    assert torch.equal(shared[2], alone[2]) and torch.equal(shared[3], alone[3])


def test_closed_or_dropped_fork_lets_go_of_its_state(runtime):
    parent = _graph_rt(runtime, "qwen3")
    parent.prefill(_ids(20, 8))
    want = state_bytes(parent)
    child = parent.fork(share=True)
    child.prefill(_ids(5, 9))
    parked = weakref.ref(child.fork(share=True))          # never used: holds only a capsule
    gc.collect()
    assert parked() is None
    child.close()
    assert torch.equal(state_bytes(parent), want) and parent.position == 20
    dropped = parent.fork(share=True)
    dropped.prefill(_ids(3, 10))
    del dropped
    gc.collect()
    assert torch.equal(state_bytes(parent), want)


def test_share_defaults_to_captured_graphs_only(runtime):
    """On CPU (no capture) a fork owns its arena unless asked; a bad capsule is refused at fork."""
    rt = _graph_rt(runtime, "qwen3")
    rt.prefill(_ids(10, 11))
    assert rt.fork().session is not rt.session
    other = runtime("lfm2")
    other.prefill(_ids(5, 12))
    with pytest.raises(CapsuleMismatchError):
        rt.fork(other.snapshot(), share=True)
    assert rt.position == 10


def test_shared_fork_reuses_the_speculative_bodies(runtime):
    """Speculative decoding's verify and draft bodies (captured per size on CUDA) are made once
    per arena: a fork that shares it drafts with the same set, and both members' tokens and
    states are bitwise those of sessions that ran alone."""
    def alone(prompt_seed, seed):
        rt = _graph_rt(runtime, "qwen3_5")
        rt.prefill(_ids(14, 20))
        rt.seed(seed)
        out = rt.generate(_ids(3, prompt_seed), max_new_tokens=6, temperature=1.0,
                          speculative="mtp", draft_tokens=2)
        return out, state_bytes(rt)

    parent = _graph_rt(runtime, "qwen3_5")
    parent.prefill(_ids(14, 20))
    child = parent.fork(seed=8, share=True)
    parent.seed(7)
    got = {7: parent.generate(_ids(3, 21), max_new_tokens=6, temperature=1.0,
                              speculative="mtp", draft_tokens=2)}
    got[8] = child.generate(_ids(3, 22), max_new_tokens=6, temperature=1.0,
                            speculative="mtp", draft_tokens=2)
    assert child.speculation().steps is parent.speculation().steps
    for seed, prompt_seed, rt in ((7, 21, parent), (8, 22, child)):
        want = alone(prompt_seed, seed)
        assert got[seed] == want[0] and torch.equal(state_bytes(rt), want[1])


def test_turn_switches_copy_into_reused_buffers(runtime, monkeypatch):
    """A switch parks the resident into a buffer an earlier unpark freed: once two members
    have each been parked, turns allocate nothing while positions stay within the buffers'
    rows (a fresh buffer costs page faults on CPU), and both continue as if alone."""
    from flashrt.core.copy import Copier
    made = []
    for name in ("empty", "_fresh"):       # the two ways a capsule buffer is allocated
        real = getattr(Copier, name)
        monkeypatch.setattr(Copier, name, lambda self, *a, real=real, **k: made.append(1) or real(self, *a, **k))
    parent = _graph_rt(runtime, "qwen3_5")
    parent.prefill(_ids(20, 30))
    cap = parent.snapshot()
    child = parent.fork(share=True)
    made.clear()
    toks = [3, 4, 5, 6, 7, 8, 9]
    for i, t in enumerate(toks):
        child.decode(t)
        parent.decode(t + 10)
        if i == 1:                     # warm: each member has been parked once
            warm = len(made)
    assert warm == 2 and len(made) == warm     # one park buffer per member, then none
    alone = _graph_rt(runtime, "qwen3_5")
    alone.restore(cap)
    for t in toks:
        alone.decode(t)
    assert child.position == alone.position == 27
    assert torch.equal(state_bytes(child), state_bytes(alone))

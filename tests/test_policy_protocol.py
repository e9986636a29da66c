"""The model protocol beyond language models: TinyVLA (random weights) on a Session through the
policy layer. Capsules taken mid-chunk continue bitwise, forks are seeded and independent,
files and the store round-trip, an episode reset is a restore, bad inputs change nothing."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import flashrt
from conftest import state_bytes
from flashrt.capsules import CapsuleStore
from flashrt.errors import CapsuleMismatchError
from flashrt.models import model_module
from flashrt.models.base import PolicyModel
from flashrt.models.loader import fingerprint
from flashrt.models.tiny_vla import Model, TinyVLAConfig, random_model
from flashrt.policy import Policy
from flashrt.core.rng import normal, seed_rng, uniform, uniforms

CFG = TinyVLAConfig()       # chunk 8, 5 queued actions per chunk, prefix 7 rows


@pytest.fixture(scope="module")
def net():
    return random_model(CFG, seed=0)


def obs(t: int) -> dict:
    """Observation at control step t: a fixed, seeded function of t."""
    g = torch.Generator().manual_seed(1000 + t)
    return {"image": torch.randn(CFG.n_image_tokens, CFG.obs_dim, generator=g),
            "state": torch.randn(CFG.state_dim, generator=g)}


def run(policy: Policy, t0: int, n: int) -> torch.Tensor:
    """n actions from control step t0 on, stacked (n, action_dim)."""
    acts = [policy.select_action(obs(t)) for t in range(t0, t0 + n)]
    return torch.stack(acts) if acts else torch.empty(0, CFG.action_dim)


def test_model_declares_state_by_name_and_kind(net):
    p = Policy(net)
    kinds = {s.name: s.spec.kind for s in p.arena.slots}
    assert kinds["prefix.0.k"] == kinds["prefix.1.v"] == "kv"
    assert (kinds["actions.queue"], kinds["actions.head"], kinds["noise.rng"], kinds["step"]) == \
        ("recurrent", "meta", "rng", "meta")
    assert p.session.max_seq_len == net.prefix_len == CFG.n_image_tokens + 1
    assert model_module({"model_type": "tiny_vla"}).CONFIG.from_hf({"chunk_size": 8}) == CFG
    with pytest.raises(flashrt.ConfigError, match="n_action_steps"):
        TinyVLAConfig.from_hf({"n_action_steps": 9})


def test_queue_runs_a_chunk_every_n_action_steps(net):
    """Actions 0..4 are the first chunk's rows (noise drawn from the arena RNG), 5.. a new one."""
    p, ref = Policy(net, seed=3), Policy(net, seed=3)
    acts = run(p, 0, 7)
    assert p.steps == 7 and p.queue_length == 3 and p.position == net.prefix_len
    chunk0 = ref.predict_action_chunk(obs(0))
    assert chunk0.shape == (CFG.chunk_size, CFG.action_dim)
    assert torch.equal(acts[:5], chunk0[:5])
    assert torch.equal(acts[5:], ref.predict_action_chunk(obs(5))[:2])
    assert torch.equal(p.arena["noise.rng"], ref.arena["noise.rng"])   # same draws, same counter
    # given noise draws nothing and decides the chunk
    noise = torch.randn(CFG.chunk_size, CFG.action_dim, generator=torch.Generator().manual_seed(9))
    rng = ref.arena["noise.rng"].clone()
    a, b = ref.predict_action_chunk(obs(1), noise), ref.predict_action_chunk(obs(1), noise)
    assert torch.equal(a, b) and torch.equal(ref.arena["noise.rng"], rng)
    assert not torch.equal(a, ref.predict_action_chunk(obs(1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mid_chunk_snapshot_continues_bitwise(net, dtype):
    """Snapshot 2 actions into the second chunk; after an excursion, a restore (and a fork)
    hand out exactly the actions of the run that never left, across later chunks."""
    if dtype != torch.float32:
        net = random_model(CFG, seed=0, dtype=dtype)
    ref, p = Policy(net, seed=1), Policy(net, seed=1)
    want = run(ref, 0, 20)
    got = run(p, 0, 7)
    assert torch.equal(got, want[:7])
    cap = p.snapshot()
    assert p.queue_length == 3 and cap.position == net.prefix_len
    run(p, 100, 9)                                   # excursion: other observations, 2 chunks
    p.seed(77)
    p.restore(cap)
    assert p.steps == 7 and p.queue_length == 3
    assert torch.equal(run(p, 7, 13), want[7:])
    assert torch.equal(run(p.fork(cap), 7, 13), want[7:])


def test_forks_seeded_and_independent(net):
    p = Policy(net, seed=0)
    run(p, 0, 3)
    cap = p.snapshot()
    parent_bytes = state_bytes(p)
    a, b, c = p.fork(cap, seed=5), p.fork(cap, seed=5), p.fork(cap, seed=6)
    before_b = state_bytes(b)
    acts_a = run(a, 3, 9)
    assert torch.equal(state_bytes(b), before_b) and torch.equal(state_bytes(p), parent_bytes)
    acts_b, acts_c = run(b, 3, 9), run(c, 3, 9)
    assert torch.equal(acts_a, acts_b)                     # same capsule, same seed
    assert torch.equal(acts_a[:2], acts_c[:2])             # the inherited queue travels
    assert not torch.equal(acts_a[2:], acts_c[2:])         # new chunks: other noise
    assert torch.equal(state_bytes(a), state_bytes(b)) and not torch.equal(state_bytes(a), state_bytes(c))
    assert torch.equal(state_bytes(p), parent_bytes)


def test_save_load_continues_bitwise(net, tmp_path):
    p = Policy(net, seed=2)
    run(p, 0, 8)
    want_state = state_bytes(p)
    cap = p.snapshot()
    want = run(p, 8, 10)
    flashrt.save_capsule(cap, tmp_path / "mid.capsule")
    loaded = flashrt.load_capsule(tmp_path / "mid.capsule")
    q = Policy(net, seed=99)
    q.restore(loaded)
    assert torch.equal(state_bytes(q), want_state)
    assert torch.equal(run(q, 8, 10), want)


def test_store_tiers_round_trip(net, tmp_path):
    """Three capsules through a store whose device and host tiers hold one each: they land
    on disk/host/device, and each one got back continues like its source."""
    p = Policy(net, seed=4)
    caps, wants = {}, {}
    for i, k in enumerate("abc"):
        run(p, 10 * i, 3)
        caps[k] = p.snapshot()
        wants[k] = run(p.fork(caps[k]), 10 * i + 3, 8)
    m = caps["a"].data.numel()
    st = CapsuleStore(device_bytes=m, host_bytes=m, disk_dir=tmp_path / "store")
    for k in "abc":
        st.put(caps[k], k)
    assert {k: st.tier(k) for k in "abc"} == {"a": "disk", "b": "host", "c": "device"}
    q = Policy(net, seed=0)
    for k in "abc":
        q.restore(st.get(k))
        assert torch.equal(run(q, 10 * "abc".index(k) + 3, 8), wants[k]), k
    st.restore_into(q, "b")                      # the store's own restore path
    assert torch.equal(run(q, 13, 8), wants["b"])


def test_episode_reset_is_a_restore(net):
    p = Policy(net, seed=8)
    start = p.snapshot()
    initial = state_bytes(p)
    ep1 = run(p, 0, 12)
    p.restore(start)
    assert torch.equal(state_bytes(p), initial)
    assert torch.equal(run(p, 0, 12), ep1)
    # reset(): queue, counter and prefix emptied; only the noise stream differs from the start
    p.reset()
    assert p.position == 0 and p.steps == 0 and p.queue_length == 0
    rng = p.arena.bytes_of("noise.rng").clone()
    after = state_bytes(p)
    p.restore(start)
    assert not torch.equal(rng, p.arena.bytes_of("noise.rng"))
    p.arena["noise.rng"].copy_(rng.view(torch.int64))
    assert torch.equal(state_bytes(p), after)


@pytest.mark.parametrize("at", [0, 3, 5])         # empty queue, mid-chunk, chunk boundary
def test_bad_input_refused_state_untouched(net, at):
    p = Policy(net, seed=0)
    run(p, 0, at)
    before = state_bytes(p)
    bad_img = {"image": torch.zeros(CFG.n_image_tokens + 1, CFG.obs_dim), "state": obs(0)["state"]}
    with pytest.raises(ValueError, match=r"'image'.*shape \(6, 32\).*got torch.float32 \(7, 32\)"):
        p.select_action(bad_img)
    with pytest.raises(ValueError, match=r"'state'.*shape \(6,\)"):
        p.predict_action_chunk({**obs(0), "state": torch.zeros(1, CFG.state_dim)})
    with pytest.raises(ValueError, match=r"keys \['image', 'state'\]"):
        p.select_action({"image": obs(0)["image"]})
    with pytest.raises(ValueError, match=r"noise.*shape \(8, 4\)"):
        p.select_action(obs(0), noise=torch.zeros(CFG.chunk_size, CFG.action_dim + 1))
    with pytest.raises(ValueError, match="non-finite"):
        p.select_action({**obs(0), "state": torch.full((CFG.state_dim,), float("nan"))})
    foreign = Policy(random_model(CFG, seed=1)).snapshot()        # other weights
    with pytest.raises(CapsuleMismatchError):
        p.restore(foreign)
    assert torch.equal(state_bytes(p), before)


def test_not_a_policy_model_refused():
    """A model missing a contract buffer is refused at construction, the buffer named."""
    class NoQueue(Model):
        def state_specs(self, capacity, dtype):
            return [s for s in super().state_specs(capacity, dtype) if s.name != "actions.queue"]

    class WrongHead(Model):
        def state_specs(self, capacity, dtype):
            return [s if s.name != "actions.head" else dataclasses.replace(s, dtype=torch.int32)
                    for s in super().state_specs(capacity, dtype)]
    with pytest.raises(ValueError, match="actions.queue"):
        Policy(NoQueue(CFG))
    with pytest.raises(ValueError, match=r"actions.head \(meta, \(1,\), torch.int64\)"):
        Policy(WrongHead(CFG))


def test_policy_model_is_a_declared_class():
    """The contract is flashrt.models.protocol.PolicyModel: a model of another class, one that
    leaves a declared attribute unset, or one whose action width exceeds the noise is refused."""
    class NoActionDim(Model):
        def __init__(self, c):
            super().__init__(c)
            del self.action_dim

    class TooWide(Model):
        def __init__(self, c):
            super().__init__(c)
            self.action_dim = c.action_dim + 1
    assert isinstance(Model(CFG), PolicyModel) and set(PolicyModel.__annotations__) == \
        {"prefix_len", "obs_shapes", "noise_shape", "action_dim"}
    with pytest.raises(TypeError, match="Linear is not a policy model.*PolicyModel"):
        Policy(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"NoActionDim does not set .*'action_dim' \(int\)"):
        Policy(NoActionDim(CFG))
    with pytest.raises(ValueError, match=r"action_dim 5; expected .*action_dim <= noise_dim"):
        Policy(TooWide(CFG))


def test_default_fingerprint_is_the_loaders(net):
    """A policy over weights built in memory is fingerprinted by the loader's one function:
    other weights change only "weights", another dtype "weights" and "dtype"."""
    fp = {k: v for k, v in Policy(net).fingerprint.items() if k != "layout"}
    assert fp == fingerprint(net, torch.float32) and fp["model_type"] == "tiny_vla"
    other = fingerprint(random_model(CFG, seed=1), torch.float32)
    assert {k for k in fp if fp[k] != other[k]} == {"weights"}
    half = fingerprint(random_model(CFG, seed=0, dtype=torch.bfloat16), torch.bfloat16)
    assert {k for k in fp if fp[k] != half[k]} == {"weights", "dtype"}
    assert Policy(net, fingerprint=dict(fp, weights="given")).fingerprint["weights"] == "given"


def test_noise_stream_is_counter_based():
    """uniforms(n) equals n uniform() calls; normal() is standard normal and reproducible."""
    r1, r2 = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    seed_rng(r1, 42), seed_rng(r2, 42)
    assert torch.equal(uniforms(r1, 5), torch.cat([uniform(r2) for _ in range(5)]))
    assert torch.equal(r1, r2) and int(r1[1]) == 5
    x = normal(r1, (64, 64))
    seed_rng(r2, 42)
    uniforms(r2, 5)
    assert torch.equal(normal(r2, (64, 64)), x) and x.dtype == torch.float32
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05

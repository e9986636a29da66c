"""SmolVLA (tiny, random weights) through flashrt.load_policy: capsules taken mid-chunk continue
bitwise, seeded forks agree or differ, an episode reset is a restore of the initial capsule,
files and the store round-trip, foreign capsules are refused with the state untouched."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import flashrt
from conftest import state_bytes
from flashrt.capsules import CapsuleStore
from flashrt.errors import CapsuleMismatchError, WeightError
from flashrt.models import make_checkpoint
from flashrt.models.loader import weights_digest
from flashrt.models.smolvla import Model as SmolVLA
from flashrt.models.smolvla_processor import load_with_fingerprint
from flashrt.policy import Policy

# Shorter chunks than the released 50 x 10 steps keep the tests fast; no weight depends on them.
N_ACTION_STEPS = 6       # a chunk every 6 actions (LeRobot allows n_action_steps <= chunk_size)
SHORT = {"chunk_size": 10, "n_action_steps": N_ACTION_STEPS, "num_steps": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = make_checkpoint("smolvla", "tiny", tmp_path_factory.mktemp("smolvla") / "p", seed=0)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, **SHORT)))
    return out


@pytest.fixture(scope="module")
def make(ckpt):
    def get(seed=0, dtype="float32"):
        return flashrt.load_policy(ckpt, device="cpu", dtype=dtype, seed=seed)
    return get


@pytest.fixture(scope="module")
def policy(make):
    return make()


def obs(p, t: int) -> dict:
    """LeRobot-style raw observation at control step t: a fixed, seeded function of t."""
    g, c = torch.Generator().manual_seed(1000 + t), p.net.config
    o = {k: torch.rand(s, generator=g) for k, s in c.cameras}
    return dict(o, **{"observation.state": torch.randn(c.state_dim, generator=g),
                      "task": "pick up the red cube" if t % 2 else "open the drawer"})


def run(p, t0: int, n: int) -> torch.Tensor:
    """n actions from control step t0 on, stacked (n, action_dim)."""
    return torch.stack([p.select_action(obs(p, t)) for t in range(t0, t0 + n)])


def fresh(p, seed: int):
    """p back at its initial state with noise stream `seed` (a capsule-free reset)."""
    p.reset()
    p.seed(seed)
    return p


def test_mid_chunk_snapshot_restores_bitwise(policy, make):
    """Snapshot 2 actions into the second chunk; after an excursion (other observations, another
    seed, two more chunks), restore and fork hand out exactly the actions of the run that never
    left, through later chunks."""
    n = N_ACTION_STEPS
    want = run(fresh(make(), 1), 0, 3 * n)
    p = fresh(policy, 1)
    assert torch.equal(run(p, 0, n + 2), want[:n + 2])
    cap = p.snapshot()
    assert p.queue_length == n - 2 and p.steps == n + 2
    p.seed(77)
    run(p, 500, 2 * n)
    p.restore(cap)
    assert p.steps == n + 2 and p.queue_length == n - 2
    assert torch.equal(run(p, n + 2, 2 * n - 2), want[n + 2:])
    assert torch.equal(run(p.fork(cap), n + 2, 2 * n - 2), want[n + 2:])
    assert not torch.allclose(want[:n], want[n:2 * n])      # not vacuous: chunks differ


def test_forks_same_seed_agree_different_seeds_differ(policy):
    p = fresh(policy, 0)
    run(p, 0, 2)
    cap = p.snapshot()
    parent = state_bytes(p)
    a, b, c = p.fork(cap, seed=5), p.fork(cap, seed=5), p.fork(cap, seed=6)
    b_before = state_bytes(b)
    acts_a = run(a, 2, 10)
    assert torch.equal(state_bytes(b), b_before) and torch.equal(state_bytes(p), parent)
    acts_b, acts_c = run(b, 2, 10), run(c, 2, 10)
    assert torch.equal(acts_a, acts_b)                        # same capsule, same seed
    k = N_ACTION_STEPS - 2                                    # the inherited queue travels
    assert torch.equal(acts_a[:k], acts_c[:k])
    assert not torch.allclose(acts_a[k:], acts_c[k:])         # new chunks: other noise
    assert torch.equal(state_bytes(p), parent)


def test_episode_reset_is_a_restore_of_the_initial_capsule(policy):
    p = fresh(policy, 8)
    start, initial = p.snapshot(), state_bytes(p)
    ep1 = run(p, 0, 9)
    p.restore(start)
    assert torch.equal(state_bytes(p), initial) and p.steps == 0 and p.queue_length == 0
    assert torch.equal(run(p, 0, 9), ep1)
    p.reset()                          # reset() empties the episode but the noise continues
    assert p.steps == 0 and p.queue_length == 0
    assert not torch.equal(run(p, 0, 9), ep1)


def test_save_load_into_a_freshly_loaded_policy(policy, make, tmp_path):
    p = fresh(policy, 2)
    run(p, 0, 8)
    cap, want_state = p.snapshot(), state_bytes(p)
    want = run(p, 8, 8)
    flashrt.save_capsule(cap, tmp_path / "mid.capsule")
    q = make(seed=99)                  # another load of the same directory
    q.restore(flashrt.load_capsule(tmp_path / "mid.capsule"))
    assert torch.equal(state_bytes(q), want_state)
    assert torch.equal(run(q, 8, 8), want)


def test_store_tiers_round_trip(policy, make, tmp_path):
    """Three capsules through a store whose device and host tiers hold one each."""
    p = fresh(policy, 4)
    caps, wants = {}, {}
    for i, k in enumerate("abc"):
        run(p, 20 * i, 3)
        caps[k] = p.snapshot()
        wants[k] = run(p.fork(caps[k]), 20 * i + 3, 6)
    m = caps["a"].data.numel()
    st = CapsuleStore(device_bytes=m, host_bytes=m, disk_dir=tmp_path / "store")
    for k in "abc":
        st.put(caps[k], k)
    assert {k: st.tier(k) for k in "abc"} == {"a": "disk", "b": "host", "c": "device"}
    q = make()
    for k in "abc":
        q.restore(st.get(k))
        assert torch.equal(run(q, 20 * "abc".index(k) + 3, 6), wants[k]), k
    st.restore_into(q, "b")
    assert torch.equal(run(q, 23, 6), wants["b"])


def test_foreign_capsule_refused_state_untouched(policy, make):
    p = fresh(policy, 0)
    run(p, 0, 3)
    before = state_bytes(p)
    other = make(dtype="bfloat16")                 # same weights, another dtype
    run(other, 0, 1)
    with pytest.raises(CapsuleMismatchError):
        p.restore(other.snapshot())
    assert torch.equal(state_bytes(p), before)


def test_fingerprint_is_the_shared_loaders(policy, make, ckpt):
    """load_policy's fingerprint is the loader's: the digest of the tensors on disk, so another
    load in another dtype differs in "dtype" only, and a Policy built over the same files with
    that fingerprint takes the capsules of load_policy."""
    fp = {k: v for k, v in policy.fingerprint.items() if k != "layout"}
    used = [(k, t) for k, t in load_file(str(ckpt / "model.safetensors")).items()
            if k not in SmolVLA.IGNORED]                     # the VLM's LM head and final norm
    assert fp["weights"] == weights_digest(used) and fp["model_type"] == "smolvla"
    half = make(dtype="bfloat16").fingerprint
    assert {k for k in fp if fp[k] != half[k]} == {"dtype"}
    net, proc, fp2 = load_with_fingerprint(ckpt)
    assert fp2 == fp
    p, q = fresh(policy, 3), Policy(net, fp2, processor=proc)
    run(p, 0, 2)
    cap, want = p.snapshot(), run(p, 2, 4)
    q.restore(cap)
    assert torch.equal(run(q, 2, 4), want)


def test_weights_checked_by_the_shared_loader(ckpt, tmp_path):
    """SmolVLA's weights go through loader.assign_weights: names its map_weight_name drops (the
    VLM's LM head, layers past num_vlm_layers) load and stay out of the digest; a wrong shape or
    a missing tensor is refused, named."""
    def variant(name, edit):
        d = tmp_path / name
        shutil.copytree(ckpt, d)
        t = load_file(str(d / "model.safetensors"))
        edit(t)
        save_file(t, str(d / "model.safetensors"))
        return d
    vlm = "model.vlm_with_expert.vlm.model.text_model.layers."
    n_vlm = json.loads((ckpt / "config.json").read_text())["num_vlm_layers"]
    deep = f"{vlm}{n_vlm}.mlp.up_proj.weight"
    extra = variant("extra", lambda t: t.update({deep: t[f"{vlm}0.mlp.up_proj.weight"].clone()}))
    assert load_with_fingerprint(extra)[2] == load_with_fingerprint(ckpt)[2]
    name = f"{vlm}0.mlp.up_proj.weight"
    wrong = variant("wrong", lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(WeightError, match=rf"{name}.*model expects"):
        flashrt.load_policy(wrong)
    gone = variant("gone", lambda t: t.pop(name))
    with pytest.raises(WeightError, match=r"missing weight.*layers\.0\.mlp\.up_proj\.weight"):
        flashrt.load_policy(gone)

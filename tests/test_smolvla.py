"""SmolVLA against LeRobot's own implementation, through the golden files that
bench/lerobot_reference.py writes (LeRobot 0.4.4, random weights, seed 0).

The goldens are checked in; these tests never import lerobot, and they FAIL when the goldens
are missing (regenerate them with the reference script inside the LeRobot venv).
"""
from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import flashrt
from conftest import state_bytes
from flashrt.core.arena import Arena
from flashrt.core.step import StepCtx
from flashrt.models import make_checkpoint
from flashrt.models.smolvla import Model, SmolVLAConfig
from flashrt.models.smolvla_checkpoint import policy_config, vlm_config
from flashrt.models.smolvla_processor import load
from flashrt.core.rng import normal, seed_rng

GOLDEN = Path(__file__).resolve().parent / "golden" / "smolvla_tiny"
TOL = 1e-4   # fp32, across implementations


@pytest.fixture(scope="module")
def golden():
    need = ["config.json", "model.safetensors", "policy_preprocessor.json", "golden.safetensors",
            "golden.json", "vlm/tokenizer.json"]
    missing = [n for n in need if not (GOLDEN / n).exists()]
    assert not missing, (f"SmolVLA goldens missing in {GOLDEN}: {missing}; regenerate with "
                         "bench/lerobot_reference.py inside the LeRobot venv")
    meta = json.loads((GOLDEN / "golden.json").read_text())
    return load_file(str(GOLDEN / "golden.safetensors")), meta["cases"]


@pytest.fixture(scope="module")
def policy():
    with torch.random.fork_rng(devices=[]):     # seeded here, the global stream left as it was
        torch.manual_seed(0)
        return load(GOLDEN, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def pol():
    """The public API: flashrt.load_policy over the directory LeRobot saved."""
    return flashrt.load_policy(GOLDEN, device="cpu", dtype="float32")


def _obs(g, case):
    t = case["tag"]
    obs = {k[len(t) + 5:]: v.clone() for k, v in g.items() if k.startswith(t + ".obs.")}
    obs["task"] = case["task"]
    return obs


def _state(net):
    return Arena(net.state_specs(net.prefix_len, torch.float32))


def _forward(net, inputs, state):
    """One chunk through the model protocol on a bare arena (no session)."""
    n = net.prefix_len
    return net(inputs, StepCtx(n, torch.arange(n), start=0), state)["actions"]


def _maxdiff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("i", [0, 1])
def test_end_to_end_parity_with_lerobot(golden, policy, pol, i):
    """raw observation -> preprocessor -> vision tower + connector -> prefix -> flow matching ->
    postprocessor, against LeRobot on the same weights, observation and noise: stage by stage
    through the model protocol, then whole through flashrt.load_policy's predict_action_chunk."""
    g, cases = golden
    net, proc = policy
    case, t = cases[i], cases[i]["tag"]
    state = _state(net)
    with torch.no_grad():
        inp = proc.preprocess(_obs(g, case))
        assert torch.equal(inp["tokens"], g[f"{t}.pre.observation.language.tokens"][0])
        assert torch.equal(inp["token_mask"], g[f"{t}.pre.observation.language.attention_mask"][0])
        assert _maxdiff(inp["state"][: net.config.state_dim], g[f"{t}.pre.observation.state"][0]) < 1e-6
        emb = net.embed_images(inp["pixels"])
        for c, (key, _) in enumerate(net.config.cameras):
            assert _maxdiff(inp["pixels"][c], g[f"{t}.pixels.{key}"][0]) < 1e-6
            assert _maxdiff(emb[c], g[f"{t}.vision.{key}"][0]) < TOL       # SigLIP + pixel shuffle
        x, valid = net.embed_prefix(emb, inp["tokens"], inp["token_mask"], inp["state"])
        assert _maxdiff(x, g[f"{t}.prefix_embs"][0]) < TOL
        assert torch.equal(valid, g[f"{t}.prefix_pad"][0])
        L = net.fill_prefix(emb, inp["tokens"], inp["token_mask"], inp["state"], state)
        last = net.config.vlm_layers - 1
        for layer in (0, last):
            for n in ("k", "v"):
                assert _maxdiff(state[f"prefix.{layer}.{n}"][:L], g[f"{t}.prefix_{n}.{layer}"][0]) < TOL
        chunk = _forward(net, dict(inp, noise=g[f"{t}.noise"][0]), state)
        assert _maxdiff(chunk, g[f"{t}.chunk"][0]) < TOL
        assert _maxdiff(proc.postprocess(chunk), g[f"{t}.chunk_post"][0]) < TOL
    actions = pol.predict_action_chunk(_obs(g, case), noise=g[f"{t}.noise"][0])
    d = _maxdiff(actions, g[f"{t}.chunk_post"][0])
    assert d < TOL, f"{t}: max |flashrt - lerobot| = {d:.3g}"
    assert int(pol.arena["prefix.len"]) == L and torch.equal(pol.arena["prefix.0.k"][:L], state["prefix.0.k"][:L])
    # not vacuous: the actions are O(1) and differ between cases (by far more than TOL)
    assert g[f"{t}.chunk_post"].abs().max() > 0.5
    other = cases[1 - i]["tag"]
    assert not torch.allclose(g[f"{t}.chunk_post"], g[f"{other}.chunk_post"])
    assert _maxdiff(actions, g[f"{other}.chunk_post"][0]) > 100 * TOL


def test_select_action_queue_matches_lerobot(golden, pol):
    """LeRobot's select_action + postprocessor, three steps per case after a reset."""
    g, cases = golden
    n = pol.net.config.n_action_steps
    for case in cases:
        t = case["tag"]
        pol.reset()
        for i in range(3):
            a = pol.select_action(_obs(g, case), noise=g[f"{t}.noise"][0])
            assert _maxdiff(a, g[f"{t}.select.{i}"][0]) < TOL
        assert pol.steps == 3 and pol.queue_length == n - 3


def test_make_checkpoint_writes_what_lerobot_saves(golden, tmp_path):
    """make_checkpoint("smolvla", "tiny", seed=0) reproduces the directory LeRobot itself saved:
    same parameter names, bitwise the same weights, same configs, stats and VLM directory."""
    out = make_checkpoint("smolvla", "tiny", tmp_path / "p", seed=0)
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(str(GOLDEN / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    for f in ("config.json", "policy_preprocessor.json", "policy_postprocessor.json"):
        assert json.loads((out / f).read_text()) == json.loads((GOLDEN / f).read_text()), f
    for f in ("policy_preprocessor_step_5_normalizer_processor.safetensors",
              "policy_postprocessor_step_0_unnormalizer_processor.safetensors"):
        a, b = load_file(str(out / f)), load_file(str(GOLDEN / f))
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), f
    for f in (GOLDEN / "vlm").iterdir():
        if f.name == "tokenizer.json":   # the trained vocabulary, whatever the serializer's version
            a, b = (json.loads(p.read_text()) for p in (f, out / "vlm" / f.name))
            assert a["model"]["vocab"] == b["model"]["vocab"] and a["model"]["merges"] == b["model"]["merges"]
            assert [(t["id"], t["content"]) for t in a["added_tokens"]] == \
                [(t["id"], t["content"]) for t in b["added_tokens"]]
        else:
            assert filecmp.cmp(f, out / "vlm" / f.name, shallow=False), f.name


def test_state_is_named_buffers_written_in_place(pol):
    net = pol.net
    c = net.config
    specs = {s.name: s for s in net.state_specs(net.prefix_len, torch.float32)}
    cross = [i for i in range(c.vlm_layers) if not net.is_self(i)]
    assert {s.kind for s in specs.values()} == {"kv", "meta", "recurrent", "rng", "scratch"}
    assert all(f"prefix.{i}.k" in specs and f"prefix.{i}.v" in specs for i in range(c.vlm_layers))
    assert sorted({int(n.split(".")[1]) for n in specs if n.startswith("expert.")}) == cross
    assert specs["prefix.0.k"].shape == (c.prefix_capacity, c.kv_heads, c.head_dim)
    pol.reset()
    pol.seed(0)
    state = pol.arena
    ptrs = {n: state[n].data_ptr() for n in specs}
    gen = torch.Generator().manual_seed(2)
    obs = {k: torch.rand(s, generator=gen) for k, s in c.cameras}
    obs.update({"observation.state": torch.randn(c.state_dim, generator=gen), "task": "stack the cubes"})
    first = [pol.select_action(obs) for _ in range(c.n_action_steps + 1)]
    # the queue ran dry once: two chunks of noise, 2 uniforms per normal (flashrt.core.rng)
    assert int(state["noise.rng"][1]) == 2 * 2 * c.chunk_size * c.max_action_dim
    assert int(state["step"]) == c.n_action_steps + 1 and int(state["actions.head"]) == 1
    assert all(state[n].data_ptr() == p for n, p in ptrs.items())
    assert not torch.equal(first[0], first[c.n_action_steps])   # new noise, new chunk


def test_noise_rng_is_state(pol):
    """The same (seed, counter) gives the same chunk; another seed another chunk; the noise is
    flashrt.core.rng.normal's stream from [seed, counter]."""
    c = pol.net.config
    obs = {k: torch.rand(s, generator=torch.Generator().manual_seed(1)) for k, s in c.cameras}
    obs.update({"observation.state": torch.zeros(c.state_dim), "task": "open the drawer"})
    chunks = []
    for seed in (7, 7, 8):
        pol.seed(seed)
        chunks.append(pol.predict_action_chunk(obs))
    assert torch.equal(chunks[0], chunks[1])
    assert not torch.allclose(chunks[0], chunks[2])
    rng = torch.zeros(2, dtype=torch.int64)
    seed_rng(rng, 7)
    assert torch.equal(pol.predict_action_chunk(obs, noise=normal(rng, pol.net.noise_shape)), chunks[0])


@pytest.mark.parametrize("at", [0, 2])          # empty queue, mid-chunk
def test_bad_observation_is_refused_before_any_state_changes(pol, at):
    c = pol.net.config
    gen = torch.Generator().manual_seed(3)
    good = {k: torch.rand(s, generator=gen) for k, s in c.cameras}
    good.update({"observation.state": torch.randn(c.state_dim, generator=gen), "task": "push"})
    pol.reset()
    for _ in range(at):
        pol.select_action(good)
    before = state_bytes(pol)
    cam = c.cameras[0][0]
    with pytest.raises(KeyError, match=cam):
        pol.select_action({k: v for k, v in good.items() if k != cam})
    with pytest.raises(ValueError, match=f"expected {c.state_dim}"):
        pol.select_action(dict(good, **{"observation.state": torch.randn(c.state_dim + 1, generator=gen)}))
    with pytest.raises(ValueError, match=r"\(3, H, W\)"):
        pol.predict_action_chunk(dict(good, **{cam: torch.rand(4, 8, 8, generator=gen)}))
    with pytest.raises(ValueError, match="observation.state: has non-finite"):
        pol.select_action(dict(good, **{"observation.state": torch.full((c.state_dim,), float("nan"))}))
    with pytest.raises(TypeError, match="task: int, expected str"):
        pol.select_action(dict(good, task=3))
    with pytest.raises(ValueError, match=rf"noise.*shape \({c.chunk_size}, {c.max_action_dim}\)"):
        pol.select_action(good, noise=torch.zeros(1, c.chunk_size, c.max_action_dim))
    assert torch.equal(state_bytes(pol), before)


def test_small_checkpoint_loads_and_runs(tmp_path):
    with pytest.raises(ValueError, match="'huge'"):
        make_checkpoint("smolvla", "huge", tmp_path / "h")
    pol = flashrt.load_policy(make_checkpoint("smolvla", "small", tmp_path / "s", seed=3))
    c = pol.net.config
    gen = torch.Generator().manual_seed(4)
    obs = {k: torch.rand(s, generator=gen) for k, s in c.cameras}
    obs.update({"observation.state": torch.randn(c.state_dim, generator=gen), "task": "fold the towel"})
    a = pol.select_action(obs)
    assert a.shape == (c.action_dim,) and torch.isfinite(a).all()


def test_real_shape_is_smolvla_base():
    """"real": SmolVLM2-500M truncated to 16 layers, expert 0.75 wide (checked without weights)."""
    c = SmolVLAConfig.from_lerobot(policy_config("real"), vlm_config("real"))
    assert (c.hidden, c.heads, c.kv_heads, c.head_dim, c.vlm_layers) == (960, 15, 5, 64, 16)
    assert (c.e_hidden, c.e_inter, c.sa_every) == (720, 2048, 2)
    assert (c.v_hidden, c.v_layers, c.image_size, c.patch, c.scale_factor) == (768, 12, 512, 16, 4)
    assert c.image_tokens == 64 and c.prefix_capacity == 3 * 64 + 48 + 1
    assert (c.chunk_size, c.n_action_steps, c.num_steps, c.max_action_dim) == (50, 50, 10, 32)
    with torch.device("meta"):
        n = sum(p.numel() for p in Model(c).parameters())
    assert 350e6 < n < 450e6, n

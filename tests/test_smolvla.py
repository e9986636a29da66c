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

from flashrt.arena import Arena
from flashrt.models import make_checkpoint
from flashrt.models.smolvla import Model, SmolVLAConfig
from flashrt.models.smolvla_checkpoint import policy_config, vlm_config
from flashrt.models.smolvla_processor import load

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
    torch.manual_seed(0)
    return load(GOLDEN, device="cpu", dtype=torch.float32)


def _obs(g, case):
    t = case["tag"]
    obs = {k[len(t) + 5:]: v.clone() for k, v in g.items() if k.startswith(t + ".obs.")}
    obs["task"] = case["task"]
    return obs


def _state(net):
    return Arena(net.state_specs(torch.float32))


def _maxdiff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("i", [0, 1])
def test_end_to_end_parity_with_lerobot(golden, policy, i):
    """raw observation -> preprocessor -> vision tower + connector -> prefix -> flow matching ->
    postprocessor, against LeRobot on the same weights, observation and noise."""
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
        chunk = net.predict_chunk(inp, state, noise=g[f"{t}.noise"])
        assert _maxdiff(chunk, g[f"{t}.chunk"][0]) < TOL
        actions = proc.postprocess(chunk)
    d = _maxdiff(actions, g[f"{t}.chunk_post"][0])
    assert d < TOL, f"{t}: max |flashrt - lerobot| = {d:.3g}"
    # not vacuous: the actions are O(1) and differ between cases
    assert g[f"{t}.chunk_post"].abs().max() > 0.5


def test_select_action_queue_matches_lerobot(golden, policy):
    g, cases = golden
    net, proc = policy
    state = _state(net)
    for case in cases:
        t = case["tag"]
        state["actions.head"].zero_(), state["actions.count"].zero_()      # reset: empty queue
        for i in range(3):
            with torch.no_grad():
                a = net.select_action(proc.preprocess(_obs(g, case)), state, noise=g[f"{t}.noise"])
            assert _maxdiff(proc.postprocess(a), g[f"{t}.select.{i}"][0]) < TOL
        assert int(state["actions.head"]) == 3 and int(state["actions.count"]) == net.config.n_action_steps
    assert int(state["step"]) == 6


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


def test_state_is_named_buffers_written_in_place(policy):
    net, proc = policy
    c = net.config
    specs = {s.name: s for s in net.state_specs(torch.float32)}
    cross = [i for i in range(c.vlm_layers) if not net.is_self(i)]
    assert {s.kind for s in specs.values()} == {"kv", "meta", "recurrent", "rng", "scratch"}
    assert all(f"prefix.{i}.k" in specs and f"prefix.{i}.v" in specs for i in range(c.vlm_layers))
    assert sorted({int(n.split(".")[1]) for n in specs if n.startswith("expert.")}) == cross
    assert specs["prefix.0.k"].shape == (c.prefix_capacity, c.kv_heads, c.head_dim)
    state = _state(net)
    ptrs = {n: state[n].data_ptr() for n in specs}
    obs = {k: torch.rand(s) for k, s in c.cameras}
    obs.update({"observation.state": torch.randn(c.state_dim), "task": "stack the cubes"})
    with torch.no_grad():
        first = [net.select_action(proc.preprocess(obs), state) for _ in range(c.n_action_steps + 1)]
    assert int(state["noise.rng"][1]) == 2               # the queue ran dry once: a second chunk
    assert int(state["step"]) == c.n_action_steps + 1 and int(state["actions.head"]) == 1
    assert all(state[n].data_ptr() == p for n, p in ptrs.items())
    assert not torch.equal(first[0], first[c.n_action_steps])   # new noise, new chunk


def test_noise_rng_is_state(policy):
    """The same (seed, counter) gives the same chunk; another seed another chunk."""
    net, proc = policy
    c = net.config
    obs = {k: torch.rand(s, generator=torch.Generator().manual_seed(1)) for k, s in c.cameras}
    obs.update({"observation.state": torch.zeros(c.state_dim), "task": "open the drawer"})
    chunks = []
    for seed in (7, 7, 8):
        state = _state(net)
        state["noise.rng"][0] = seed
        with torch.no_grad():
            chunks.append(net.predict_chunk(proc.preprocess(obs), state).clone())
    assert torch.equal(chunks[0], chunks[1])
    assert not torch.allclose(chunks[0], chunks[2])


def test_bad_observation_is_refused_before_any_state_changes(policy):
    net, proc = policy
    c = net.config
    state = _state(net)
    before = state.data.clone()
    good = {k: torch.rand(s) for k, s in c.cameras}
    good.update({"observation.state": torch.randn(c.state_dim), "task": "push"})
    cam = c.cameras[0][0]
    with pytest.raises(KeyError, match=cam):
        proc.preprocess({k: v for k, v in good.items() if k != cam})
    with pytest.raises(ValueError, match=f"expected {c.state_dim}"):
        proc.preprocess(dict(good, **{"observation.state": torch.randn(c.state_dim + 1)}))
    with pytest.raises(ValueError, match=r"\(3, H, W\)"):
        proc.preprocess(dict(good, **{cam: torch.rand(4, 8, 8)}))
    assert torch.equal(state.data, before)


def test_small_checkpoint_loads_and_runs(tmp_path):
    with pytest.raises(ValueError, match="'huge'"):
        make_checkpoint("smolvla", "huge", tmp_path / "h")
    net, proc = load(make_checkpoint("smolvla", "small", tmp_path / "s", seed=3))
    c = net.config
    obs = {k: torch.rand(s) for k, s in c.cameras}
    obs.update({"observation.state": torch.randn(c.state_dim), "task": "fold the towel"})
    with torch.no_grad():
        a = proc.postprocess(net.select_action(proc.preprocess(obs), _state(net)))
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

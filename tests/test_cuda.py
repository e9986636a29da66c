"""CUDA checks: graph replay vs eager on the same device, capsules on the graph backend,
device <-> host capsules. Skipped without CUDA; bench/gpu_check.sh runs them on a GPU."""
from __future__ import annotations

import pytest
import torch

import flashrt
from conftest import ARCHS, state_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _ids(n, seed=0):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _load(ckpt, arch, graphs, dtype="float32"):
    # prefill_chunk 16: 7 graphs per session (steps 1-16, sample, decode), not 9: gpu_check's
    # 45 s for this file pays for every capture (each one syncs and empties the cache)
    return flashrt.load(ckpt(arch), device="cuda", dtype=dtype, max_seq_len=256,
                        prefill_chunk=16, cuda_graphs=graphs)


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_replay_matches_eager(arch, ckpt):
    eager, graph = _load(ckpt, arch, False), _load(ckpt, arch, True)
    assert graph.graphs is not None and eager.graphs is None
    ids = _ids(45, 1)
    for chunk in (ids[:37], ids[37:]):        # 37 = 32 + 4 + 1: several graphs per prefill
        le, lg = eager.prefill(chunk), graph.prefill(chunk)
        assert (le - lg).abs().max() <= 1e-3
    for _ in range(3):                          # replay several times, inputs changing
        t = int(torch.argmax(le))
        le, lg = eager.decode(t), graph.decode(t)
        assert (le - lg).abs().max() <= 1e-3
    assert graph.tokens == eager.tokens and int(graph.arena["meta.position"]) == graph.position


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_never_left_continuation_bitwise(arch, ckpt):
    ref, rt = _load(ckpt, arch, True), _load(ckpt, arch, True)
    prompt, cont = _ids(29, 2), _ids(8, 3)
    ref.prefill(prompt)
    want = torch.stack([ref.decode(t) for t in cont])
    rt.prefill(prompt)
    cap = rt.snapshot()
    rt.prefill(_ids(20, 4))
    rt.restore(cap)
    assert torch.equal(torch.stack([rt.decode(t) for t in cont]), want)


@pytest.mark.parametrize("arch", ARCHS)
def test_device_host_capsules(arch, ckpt, tmp_path):
    rt = _load(ckpt, arch, True)
    rt.prefill(_ids(33, 5))
    cap = rt.snapshot()
    host = cap.to("cpu")
    assert host.data.is_pinned()
    back = host.to("cuda")
    cont = _ids(6, 6)
    want = torch.stack([rt.decode(t) for t in cont])
    for c in (back, host):
        rt.restore(c)
        assert torch.equal(torch.stack([rt.decode(t) for t in cont]), want)
    flashrt.save_capsule(cap, tmp_path / "c.cap")                # made on CUDA, restored on CPU: provenance only
    cpu_rt = flashrt.load(ckpt(arch), dtype="float32", max_seq_len=256)
    cpu_rt.restore(flashrt.load_capsule(tmp_path / "c.cap"))
    assert cpu_rt.tokens == rt.tokens[:33]


def test_snapshot_into_on_cuda_and_host_capsule_reuse(ckpt, tmp_path):
    """snapshot(into=) on a 'cuda' arena (the device as tensors report it), and a pinned host
    capsule overwritten by load(into=) right after a restore from it (ordered copies)."""
    rt = flashrt.load(ckpt("qwen3_5"), device=torch.device("cuda"), dtype="float32", max_seq_len=128,
                      cuda_graphs=False)
    rt.prefill(_ids(20, 7))
    buf = rt.empty_capsule()
    a = rt.snapshot(into=buf)
    assert rt.snapshot(into=buf) is buf and a.device.index is not None
    want = rt.snapshot().to("cpu")
    flashrt.save_capsule(want, tmp_path / "w.cap")
    rt.prefill(_ids(10, 8))
    flashrt.save_capsule(rt.snapshot(), tmp_path / "other.cap")
    host = rt.empty_capsule(host=True)                           # pinned, full size: async copies
    flashrt.load_capsule(tmp_path / "w.cap", into=host)
    rt.restore(host)
    flashrt.load_capsule(tmp_path / "other.cap", into=host)      # the host buffer reused at once
    got = rt.snapshot().to("cpu")            # entry by entry: alignment gaps are never written
    assert [e.name for e in got.entries] == [e.name for e in want.entries]
    assert all(torch.equal(got.raw(e), want.raw(e)) for e in want.entries)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("arch", ARCHS)
def test_device_sampling_matches_host_sampler_on_graphs(arch, temperature, ckpt):
    """generate draws inside the captured decode step (sort, cumsum, searchsorted captured);
    the host sampler over the same replayed graphs draws the same tokens, and the state and
    RNG stream match, with a stop token inside the run."""
    kw = dict(temperature=temperature, top_k=40, top_p=0.9)
    dev, host = _load(ckpt, arch, True), _load(ckpt, arch, True)
    prompt = _ids(21, 9)
    host.prefill(prompt)
    host.seed(4)
    want = []
    for _ in range(16):
        want.append(host.sample(**kw))
        host.decode(want[-1])
    got = dev.generate(prompt, max_new_tokens=16, seed=4, ignore_eos=True, **kw)
    assert got == want
    assert torch.equal(state_bytes(dev), state_bytes(host))
    dev2 = _load(ckpt, arch, True)
    cut = dev2.generate(prompt, max_new_tokens=16, seed=4, stop=(want[9],), ignore_eos=True, **kw)
    assert cut == want[: want.index(want[9]) + 1] and dev2.finish_reason == "stop"
    assert dev2.arena["sampler.rng"].tolist() == [4, len(cut) if temperature else 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_fork_shares_captured_graphs(arch, ckpt):
    """A fork of a captured session takes turns in its arena and graphs (no capture, one state
    copy); parent and fork, alternating, continue bitwise as two sessions that ran alone."""
    parent, ref = _load(ckpt, arch, True), _load(ckpt, arch, True)
    prompt, cont = _ids(21, 20), _ids(6, 21)
    parent.prefill(prompt)
    ref.prefill(prompt)
    child = parent.fork()
    assert child.graphs is parent.graphs and child.session is parent.session
    want = torch.stack([ref.decode(t) for t in cont])
    got_p, got_c = [], []
    for t in cont:
        got_c.append(child.decode(t))
        got_p.append(parent.decode(t))
    assert torch.equal(torch.stack(got_p), want) and torch.equal(torch.stack(got_c), want)


def test_fork_shares_captured_speculative_bodies(ckpt):
    """The verify and draft graphs are captured once per arena: a fork's speculative call
    replays the parent's, bitwise like a session that captured its own."""
    parent, ref = _load(ckpt, "qwen3_5", True), _load(ckpt, "qwen3_5", True)
    parent.prefill(_ids(17, 30))
    ref.prefill(_ids(17, 30))
    child = parent.fork()
    got_p = parent.generate(max_new_tokens=8, speculative="mtp", draft_tokens=2)
    got_c = child.generate(max_new_tokens=8, speculative="mtp", draft_tokens=2)
    want = ref.generate(max_new_tokens=8, speculative="mtp", draft_tokens=2)
    assert child.speculation().steps is parent.speculation().steps
    assert got_p == got_c == want
    assert torch.equal(state_bytes(child), state_bytes(ref))


def test_restore_from_host_capsules_of_one_layout(ckpt, tmp_path):
    """Host capsules loaded from files of one layout share one entry table; each restore into
    the device arena copies from its own buffer (no address table moved across devices)."""
    rt = flashrt.load(ckpt("qwen3"), device="cuda", dtype="float32", max_seq_len=64, cuda_graphs=False)
    want = []
    for i, name in enumerate(("a.cap", "b.cap")):
        rt.reset()
        rt.prefill(_ids(12, 40 + i))
        flashrt.save_capsule(rt.snapshot(), tmp_path / name)
        want.append(state_bytes(rt))
    caps = [flashrt.load_capsule(tmp_path / n) for n in ("a.cap", "b.cap")]
    assert caps[0].entries is caps[1].entries
    for _ in range(2):
        for cap, w in zip(caps, want):
            rt.restore(cap)
            assert torch.equal(state_bytes(rt), w)

"""Non-token inputs: embedding segments (image or audio features) enter the state, and
capsules, forks, rollback and the store cover their positions (matched by content digest)."""
from __future__ import annotations

import pytest
import torch

import flashrt
from conftest import state_bytes
from flashrt.capsules import CapsuleStore

ARCH = "qwen3_5"


def _features(n, hidden, seed):
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_embeds_equal_their_token_ids(runtime):
    """prefill(embeds=embed(ids)) is the same computation as prefill(ids): bitwise."""
    a, b = runtime(ARCH), runtime(ARCH)
    ids = list(range(7, 20))
    with torch.no_grad():
        e = a.net.embed(torch.tensor(ids))
    assert torch.equal(a.prefill(embeds=e), b.prefill(ids))
    assert a.tokens[0] < 0 and a.position == b.position == len(ids)   # content ids, not token ids


def test_capsules_forks_and_rollback_cover_embedding_positions(runtime):
    rt = runtime(ARCH, checkpoint_every=8)
    H = rt.net.config.hidden_size
    img, instr = _features(6, H, 1), list(range(30, 40))
    rt.prefill(instr[:3])
    rt.prefill(embeds=img)
    rt.prefill(instr[3:])
    cap = rt.snapshot()
    hist = rt.tokens
    want = rt.generate(max_new_tokens=6)
    rt.restore(cap)
    assert rt.generate(max_new_tokens=6) == want                      # never-left: bitwise
    child = rt.fork(cap)
    assert torch.equal(state_bytes(child), state_bytes(runtime(ARCH).fork(cap)))
    assert child.generate(max_new_tokens=6) == want
    rt.rollback(5)                    # inside the image: re-run from a checkpoint below it
    ref = runtime(ARCH, checkpoint_every=8)
    ref.prefill(instr[:3])
    ref.prefill(embeds=img[:2])
    assert rt.tokens == hist[:5] and rt.position == ref.position == 5
    assert (rt.arena["meta.logits"] - ref.arena["meta.logits"]).abs().max() <= 1e-4


def test_store_matches_a_repeated_image_prefix_by_content(runtime):
    H = runtime(ARCH).net.config.hidden_size
    img, other = _features(5, H, 2), _features(5, H, 3)
    instr = list(range(50, 60))
    st = CapsuleStore(device_bytes=1 << 24)
    a = runtime(ARCH)
    a.set_context([img, *instr], store=st)
    b = runtime(ARCH)
    logits = b.set_context([img, *instr, 61, 62], store=st)
    assert b.context_reused == 15                                        # image + instruction restored
    cold = runtime(ARCH)
    cold.prefill(embeds=img)
    want = cold.prefill(instr + [61, 62])
    assert (logits - want).abs().max() <= 1e-4
    c = runtime(ARCH)
    c.set_context([other, *instr], store=st)                          # another image: no reuse
    assert c.context_reused == 0


def test_bad_inputs_are_refused_with_the_state_untouched(runtime):
    rt = runtime(ARCH)
    rt.prefill([1, 2, 3])
    before = state_bytes(rt)
    H = rt.net.config.hidden_size
    for bad, err, match in [(dict(embeds=torch.zeros(2, H + 1)), ValueError, f"\\(T >= 1, {H}\\)"),
                            (dict(embeds=torch.zeros(2, H, dtype=torch.int64)), TypeError, "floating"),
                            (dict(ids=[1], embeds=torch.zeros(1, H)), TypeError, "exactly one"),
                            (dict(ids="hello"), TypeError, "tokenize"),
                            (dict(ids=[1.5]), TypeError, "must be ints"),
                            (dict(ids=[True]), TypeError, "must be ints")]:
        with pytest.raises(err, match=match):
            rt.prefill(**bad)
    for bad in ("x", None, torch.zeros(3)):
        with pytest.raises(TypeError, match="expected a flashrt Capsule"):
            rt.restore(bad)
    with pytest.raises(TypeError, match="list of token ids"):
        rt.set_context("hello")
    assert torch.equal(state_bytes(rt), before) and rt.position == 3


def test_multimodal_rope_positions_match_transformers(runtime, ckpt):
    """Qwen3.5's interleaved 3-D rope: an image segment with (t, h, w) positions, then text
    that continues from the largest of them, equals transformers given the same positions;
    the offset lives in the arena (rope.delta), so a capsule taken after the image continues
    bitwise like the run that never left."""
    from conftest import hf_reference
    rt = runtime(ARCH)
    net, H = rt.net, rt.net.config.hidden_size
    a, b = list(range(3, 7)), list(range(40, 45))
    img = _features(6, H, 4)
    t_h_w = torch.tensor([[4, 4 + r, 4 + c] for r in range(2) for c in range(3)])   # a 2x3 grid
    ours = [rt.prefill(a, all_logits=True), rt.prefill(embeds=img, position_ids=t_h_w, all_logits=True)]
    cap = rt.snapshot()
    ours.append(rt.prefill(b, all_logits=True))
    ours = torch.cat(ours)
    text = lambda ps: [[p, p, p] for p in ps]                                      # noqa: E731
    rope = torch.tensor(text(range(4)) + t_h_w.tolist() + text(range(7, 12)))      # (15, 3)
    pos = torch.cat([torch.arange(15)[None], rope.t()])[:, None, :]               # (4, 1, 15)
    hf = hf_reference(ckpt(ARCH))
    with torch.no_grad():
        emb = torch.cat([net.embed(torch.tensor(a)), img, net.embed(torch.tensor(b))])
        want = hf(inputs_embeds=emb[None], position_ids=pos).logits[0].float()
    assert (ours - want).abs().max() <= 1e-4
    assert int(rt.arena["rope.delta"]) == 6 - 9
    other = runtime(ARCH)
    other.restore(cap)
    assert torch.equal(other.prefill(b, all_logits=True), ours[-5:])
    with pytest.raises(ValueError, match="position_ids must be"):
        rt.prefill(embeds=img, position_ids=t_h_w[:, :2])

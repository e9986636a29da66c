"""Capsule properties, each a test that could fail: never-left continuation, KV-only ablation,
fork independence, RNG travel, rollback, validation."""
from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import threading
import weakref

import pytest
import torch

import flashrt
from conftest import ARCHS, HYBRID, assert_greedy_matches, race, state_bytes, teacher_forced


def _ids(n, seed=0, vocab=512):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode_logits(rt, tokens):
    return torch.stack([rt.decode(t) for t in tokens])


@pytest.mark.parametrize("arch", ARCHS)
def test_never_left_continuation_bitwise(arch, runtime):
    """Snapshot at a non-chunk-aligned boundary, excursion, restore: every logit bitwise equal."""
    ref, rt = runtime(arch, prefill_chunk=8), runtime(arch, prefill_chunk=8)
    prompt, cont = _ids(29, 1), _ids(12, 2)          # 29: not a multiple of the chunk
    ref.prefill(prompt)
    want = _decode_logits(ref, cont)
    rt.prefill(prompt)
    cap = rt.snapshot()
    assert cap.position == 29 and cap.history == prompt
    rt.prefill(_ids(17, 3))                           # excursion: other tokens, then decode
    rt.generate(max_new_tokens=5)
    rt.restore(cap)
    assert rt.position == 29 and rt.tokens == prompt
    assert torch.equal(_decode_logits(rt, cont), want)
    # a fork from the same capsule continues bitwise like the parent
    child = rt.fork(cap)
    assert torch.equal(_decode_logits(child, cont), want)


@pytest.mark.parametrize("arch", ARCHS)
def test_restore_continues_without_reprefill(arch, runtime):
    """The last logits travel: generate right after restore matches the never-left run."""
    ref, rt = runtime(arch), runtime(arch)
    p = _ids(21, 4)
    ref.prefill(p)
    want = ref.generate(max_new_tokens=10)
    rt.prefill(p)
    cap = rt.snapshot()
    rt.reset()
    rt.restore(cap)
    assert rt.generate(max_new_tokens=10) == want


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_only_restore(arch, runtime):
    """KV-only restore diverges on hybrids (recurrent/conv state is load-bearing); on dense
    Qwen3 it equals the full restore."""
    rt = runtime(arch)
    prompt, cont = _ids(25, 5), _ids(6, 6)
    rt.prefill(prompt)
    cap = rt.snapshot()
    full = _decode_logits(rt, cont)
    rt.prefill(_ids(30, 7))                           # excursion dirties every state kind
    rt.restore(cap, kinds={"kv"})
    kv_only = _decode_logits(rt, cont)
    rt.restore(cap)
    assert torch.equal(_decode_logits(rt, cont), full)
    if arch in HYBRID:
        assert (kv_only - full).abs().max() > 1e-3, f"{arch}: KV-only restore did not diverge"
    else:
        assert torch.equal(kv_only, full)


@pytest.mark.parametrize("arch", ARCHS)
def test_fork_independence(arch, runtime):
    parent = runtime(arch)
    parent.prefill(_ids(20, 8))
    cap = parent.snapshot()
    cont = _ids(8, 9)
    want = _decode_logits(parent.fork(cap), cont)     # a pristine fork as the reference

    child = parent.fork()
    child.prefill(_ids(40, 10))                       # the child's work...
    child.generate(max_new_tokens=5, temperature=1.0)
    assert torch.equal(_decode_logits(parent, cont), want)   # ...never touches the parent
    parent.prefill(_ids(9, 11))                       # and the reverse
    child.restore(cap)
    assert torch.equal(_decode_logits(child, cont), want)


def test_forks_in_threads(runtime):
    parent = runtime("qwen3")
    parent.prefill(_ids(16, 12))
    cap = parent.snapshot()
    cont = _ids(10, 13)
    want = _decode_logits(parent.fork(cap), cont)
    kids = [parent.fork(cap) for _ in range(3)]
    out = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, _decode_logits(kids[i], cont)))
               for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(torch.equal(out[i], want) for i in range(3))


@pytest.mark.parametrize("arch", ARCHS)
def test_rng_travels_in_capsule(arch, runtime):
    rt = runtime(arch)
    rt.generate(_ids(12, 14), max_new_tokens=5, temperature=1.0, seed=123)
    cap = rt.snapshot()
    a = rt.generate(max_new_tokens=10, temperature=1.0)
    rt.restore(cap)
    b = rt.generate(max_new_tokens=10, temperature=1.0)
    assert a == b
    # fork seeds: same seed -> same stream, other seed -> other stream
    c1, c2, c3 = rt.fork(cap, seed=1), rt.fork(cap, seed=1), rt.fork(cap, seed=2)
    s1, s2, s3 = (c.generate(max_new_tokens=10, temperature=1.0) for c in (c1, c2, c3))
    assert s1 == s2 and s1 != s3
    assert rt.fork(cap).generate(max_new_tokens=10, temperature=1.0) == a  # continues parent stream


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback(arch, runtime):
    rt = runtime(arch, checkpoint_every=8, prefill_chunk=16)
    hist = _ids(37, 15)
    rt.prefill(hist[:24])
    at24 = state_bytes(rt)
    logits24 = rt.decode(hist[24])     # history continues past the checkpoint
    rt.prefill(hist[25:])
    rt.generate(max_new_tokens=4)
    # 24 is a checkpoint boundary: restored from it, nothing re-run (a re-run of hist[:24] from
    # 0 would split 16 + 8 as the original prefill did and give the same bits)
    assert 24 in rt.session.checkpoint_positions() and rt.session.rollback_source(24) == 24
    rt.rollback(24)                    # bitwise
    assert rt.position == 24 and rt.tokens == hist[:24]
    assert torch.equal(state_bytes(rt), at24)
    assert torch.equal(rt.decode(hist[24]), logits24)
    for p in (30, 19, 3):              # anywhere: within 1e-4 of a fresh prefill of p tokens
        rt.prefill(hist[rt.position: 37]) if rt.position < 37 else None
        # from the checkpoint below p (qwen3: KV rewound by position, one position re-run)
        assert rt.session.rollback_source(p) == (p - 1 if arch == "qwen3" else p // 8 * 8)
        rt.rollback(p)
        fresh = runtime(arch)
        want = fresh.prefill(hist[:p])
        assert (rt.arena["meta.logits"] - want).abs().max() <= 1e-4
        # another path (restore + re-run vs one prefill): the margin rule, teacher-forced
        toks = rt.generate(max_new_tokens=8, ignore_eos=True)
        assert_greedy_matches(teacher_forced(fresh, want, toks), toks, what=f"{arch} rollback({p})")
    with pytest.raises(ValueError, match="rollback position 99"):
        rt.rollback(99)


def test_rollback_after_restore_uses_capsule(runtime):
    rt = runtime("qwen3_5" if "qwen3_5" in ARCHS else "qwen3", checkpoint_every=1000)
    h = _ids(30, 16)
    rt.prefill(h[:20])
    cap = rt.snapshot()
    rt.reset()
    rt.restore(cap)
    rt.prefill(h[20:])
    # no checkpoint below 1000: the restored capsule serves (a re-run from 0 would prefill
    # h[:20] in one step, as the capsule was made, and give the same bits)
    assert rt.session.checkpoint_positions() == [] and rt.session.rollback_source(20) == 20
    rt.rollback(20)
    arch = "qwen3_5" if "qwen3_5" in ARCHS else "qwen3"
    restored = runtime(arch)
    restored.restore(cap)
    assert torch.equal(state_bytes(rt), state_bytes(restored))
    fresh = runtime(arch)
    fresh.prefill(h[:20])
    assert torch.equal(rt.arena["meta.logits"], fresh.arena["meta.logits"])


def test_short_step_across_a_checkpoint_boundary_is_one_step(runtime):
    """A user turn crossing a multiple of checkpoint_every runs as one step (a split costs a
    second weight pass) and the checkpoint lands at its end; long steps still split there."""
    arch = "qwen3_5" if "qwen3_5" in ARCHS else "lfm2"
    rt = runtime(arch, checkpoint_every=64)                 # short: at most 64 // 16 = 4 positions
    h = _ids(80, 19)
    rt.prefill(h[:62])
    assert rt.session.chunks(4) == [4] and rt.session.chunks(5) == [2, 3]
    rt.prefill(h[62:66])
    assert rt.session.checkpoint_positions() == [66]
    at66 = state_bytes(rt)
    rt.prefill(h[66:])
    rt.rollback(66)                                         # from the checkpoint: bitwise
    assert torch.equal(state_bytes(rt), at66)


def test_rollback_from_delta_base_without_parent(runtime):
    """A turn end stored as a delta (parent by id only, as the server's store does) is the
    base a barge-in rolls back from: its own rows and fixed state suffice, the parent's rows
    are still the arena's. Used to raise 'needs its parent ..., which is not attached'."""
    arch = "qwen3_5" if "qwen3_5" in ARCHS else "qwen3"
    rt = runtime(arch, checkpoint_every=1000)
    h = _ids(40, 18)
    rt.prefill(h[:20])
    first = rt.snapshot()
    rt.prefill(h[20:30])
    delta = rt.snapshot(parent=(first.id, first.position))
    del first
    assert delta.is_delta and delta.parent_capsule is None
    at30 = state_bytes(rt)
    rt.prefill(h[30:])
    rt.rollback(30)                    # the delta is the source: restored, not re-run
    assert rt.position == 30 and rt.tokens == h[:30]
    assert torch.equal(state_bytes(rt), at30)


def test_rollback_sources_are_strong_and_bounded(runtime):
    """Rollback sources never depend on garbage collection: the last capsule a session made
    serves rollback whether or not the caller still holds it (gc forced or disabled alike),
    and the session holds one capsule's memory, no more: an older dropped one is freed."""
    from flashrt.core.sources import MAX_ANCHORS
    arch = "qwen3_5" if "qwen3_5" in ARCHS else "qwen3"
    h = _ids(24, 17)
    results = []
    for mode in ("collect", "disabled"):
        rt = runtime(arch, checkpoint_every=1000)
        rt.prefill(h[:16])
        rt.snapshot()                      # dropped at once by the caller
        gc.collect() if mode == "collect" else gc.disable()
        try:
            rt.prefill(h[16:])
            assert rt.session.rollback_source(16) == 16   # the dropped capsule is still the source
            rt.rollback(16)
            results.append(state_bytes(rt))
        finally:
            gc.enable()
    assert torch.equal(results[0], results[1])
    ref = runtime(arch)
    ref.prefill(h[:16])
    assert torch.equal(results[0], state_bytes(ref))     # restored, not re-run: bitwise
    rt = runtime(arch, checkpoint_every=1000)
    rt.prefill(h[:4])
    first = weakref.ref(rt.snapshot())
    assert first() is not None                           # the base: held
    for _ in range(MAX_ANCHORS + 1):
        rt.snapshot()
    assert first() is None                               # replaced: freed at once
    assert len(rt.session.ancestors()) == MAX_ANCHORS    # ids only, for delta parents


@pytest.mark.parametrize("arch", ARCHS)
def test_snapshot_cost_is_live_extent(arch, runtime):
    rt = runtime(arch)
    rt.prefill(_ids(33, 17))
    cap = rt.snapshot()
    assert cap.nbytes == rt.arena.fixed_state_bytes + 33 * rt.arena.per_token_bytes
    assert {"kv", "meta", "rng"} <= cap.kinds and not cap.kinds & {"io", "scratch"}
    rt.prefill(_ids(5, 18))
    with pytest.raises(flashrt.CapsuleMismatchError, match="needs"):
        rt.snapshot(into=cap)          # 33 rows of room, 38 needed: refused, never overrun
    target = rt.empty_capsule()        # preallocated for max_seq_len
    data_ptr = target.data.data_ptr()
    for extra in (0, 7):
        rt.prefill(_ids(extra + 1, 19))
        again = rt.snapshot(into=target)
        assert again is target and target.position == rt.position
        assert target.data.data_ptr() == data_ptr
        assert torch.equal(target.view("meta.tokens"), torch.tensor(rt.tokens))


@pytest.mark.parametrize("arch", ARCHS)
def test_fixed_state_and_token_history_copy_as_one_range(arch, runtime):
    """The token history follows the fixed state in the arena and, at the same distance, in the
    capsule: snapshot and restore copy both as one range (plus one per per-token buffer), and
    the padding between them, which no view covers, travels without touching any buffer."""
    from flashrt.core.copy import copy_pairs
    rt = runtime(arch)
    a = rt.arena
    assert a.after_fixed == "meta.tokens"
    rt.prefill(_ids(21, 23))
    pad = a.data[a.fixed_end: a.slot("meta.tokens").offset]
    pad.fill_(0xAB)                     # unused bytes: whatever they hold must not matter
    cap = rt.snapshot()
    e = next(x for x in cap.entries if x.name == "meta.tokens")
    assert e.offset == a.slot("meta.tokens").offset - a.fixed_begin
    pairs = copy_pairs(a, cap, cap.entries, to_capsule=False)
    per_token = [x for x in cap.entries if x.seq]
    assert len(pairs) == len(per_token)            # fixed + history joined, then one per buffer
    assert pairs[0][0].numel() == e.offset + e.nbytes
    want_next = rt.generate(max_new_tokens=3)
    rt.prefill(_ids(9, 24))
    pad.zero_()
    rt.restore(cap)
    assert rt.tokens == cap.history and rt.generate(max_new_tokens=3) == want_next


def test_validation_refuses_and_leaves_state(runtime, ckpt):
    rt = runtime("qwen3")
    rt.prefill(_ids(12, 20))
    good = rt.snapshot()
    rt.prefill(_ids(3, 21))
    before = rt.arena.data.clone()

    def refused(cap, match):
        with pytest.raises(flashrt.CapsuleMismatchError, match=match):
            rt.restore(cap)
        assert torch.equal(rt.arena.data, before) and rt.position == 15

    other_w = flashrt.load(ckpt("qwen3", seed=1), dtype="float32", max_seq_len=256)
    refused(other_w.snapshot(), "weights")
    short = runtime("qwen3", max_seq_len=8)
    for key, val in (("config", "x"), ("dtype", "bfloat16"), ("layout", "y")):
        bad = rt.snapshot()
        bad.meta.fingerprint = {**bad.meta.fingerprint, key: val}
        refused(bad, key)
    with pytest.raises(flashrt.CapsuleMismatchError, match="max_seq_len 8"):
        short.restore(good)
    with pytest.raises(ValueError, match="non-capsule kinds"):
        rt.restore(good, kinds={"io"})
    if len(ARCHS) > 1:
        other_model = runtime([a for a in ARCHS if a != "qwen3"][0])
        refused(other_model.snapshot(), "model_type")


def test_validation_after_a_passed_restore(runtime):
    """Per-buffer checks are cached per entry table; tampering after a passed restore is
    still refused and leaves the state alone."""
    rt = runtime("qwen3")
    rt.prefill(_ids(12, 22))
    cap = rt.snapshot()
    rt.restore(cap)                                # passes; the check result is cached
    rt.prefill(_ids(3, 23))
    before = rt.arena.data.clone()
    cap.meta.fingerprint = {**cap.meta.fingerprint, "weights": "0" * 16}
    with pytest.raises(flashrt.CapsuleMismatchError, match="weights"):
        rt.restore(cap)
    cap.meta.fingerprint = dict(rt.fingerprint)
    kv = next(i for i, e in enumerate(cap.entries) if e.kind == "kv")
    bad = list(cap.entries)
    bad[kv] = dataclasses.replace(bad[kv], shape=(bad[kv].shape[0],) + (7,) * (len(bad[kv].shape) - 1))
    good_entries, cap.entries = cap.entries, bad
    with pytest.raises(flashrt.CapsuleMismatchError, match=bad[kv].name):
        rt.restore(cap)
    cap.entries = good_entries
    cap.meta.position += 1                         # the rows no longer end at the position
    with pytest.raises(flashrt.CapsuleMismatchError, match="position"):
        rt.restore(cap)
    assert torch.equal(rt.arena.data, before) and rt.position == 15
    cap.meta.position -= 1
    rt.restore(cap)
    assert rt.position == 12


def test_fingerprint_edited_in_place_after_a_passed_restore(runtime, tmp_path):
    """A restore that passed is not checked again only while nothing that decides the check
    can change: a plain-dict fingerprint edited in place is checked anew; a loaded capsule's
    fingerprint is read-only, like a snapshot's."""
    rt = runtime("qwen3")
    rt.prefill(_ids(10, 24))
    cap = rt.snapshot()
    cap.meta.fingerprint = dict(rt.fingerprint)
    rt.restore(cap)
    rt.prefill(_ids(2, 25))
    before = rt.arena.data.clone()
    cap.meta.fingerprint["weights"] = "0" * 16
    with pytest.raises(flashrt.CapsuleMismatchError, match="weights"):
        rt.restore(cap)
    assert torch.equal(rt.arena.data, before) and rt.position == 12
    flashrt.save_capsule(rt.snapshot(), tmp_path / "c.cap")
    loaded = flashrt.load_capsule(tmp_path / "c.cap")
    with pytest.raises(TypeError, match="read-only"):
        loaded.meta.fingerprint["weights"] = "0" * 16
    rt.restore(loaded)
    rt.restore(loaded)
    assert rt.position == 12


def test_moved_capsule_holds_only_its_entries(runtime):
    """Capsule.to copies the entries' bytes, not the spare capacity of a snapshot(into=) buffer
    sized for every position (a 1 MiB state in a 1 GiB buffer moves 1 MiB)."""
    rt = runtime("qwen3")
    rt.prefill(_ids(6, 40))
    big = rt.empty_capsule()
    cap = rt.snapshot(into=big)
    end = max(e.offset + e.nbytes for e in cap.entries)
    moved = cap.to("meta")
    assert end < big.data.numel() and moved.data.numel() == end and moved.device.type == "meta"
    assert [e.name for e in moved.entries] == [e.name for e in cap.entries]
    assert moved.position == cap.position and moved.meta is not cap.meta


def test_shared_metadata_is_read_only(runtime):
    """Snapshots share the session's fingerprint and provenance (no copies): editing them in
    place is refused, so one capsule can never change another's; provenance records the
    thread count of the last step, not of the snapshot."""
    rt = runtime("qwen3")
    rt.prefill(_ids(9, 31))
    a, b = rt.snapshot(), rt.snapshot()
    assert a.meta.fingerprint is b.meta.fingerprint is rt.fingerprint
    for edit in (lambda f: f.__setitem__("weights", "0"), lambda f: f.update(dtype="x"),
                 lambda f: f.pop("layout"), lambda f: f.clear(), lambda f: f.__delitem__("config")):
        with pytest.raises(TypeError, match="read-only"):
            edit(a.meta.fingerprint)
        with pytest.raises(TypeError, match="read-only"):
            edit(a.meta.provenance)
    assert rt.fingerprint["weights"] == b.meta.fingerprint["weights"] != "0" and "layout" in rt.fingerprint
    assert copy.deepcopy(a.meta.fingerprint) == rt.fingerprint
    assert pickle.loads(pickle.dumps(a.meta.provenance)) == a.meta.provenance
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert rt.snapshot().meta.provenance["threads"] == n       # no step yet at 1 thread
        rt.decode(5)
        assert rt.snapshot().meta.provenance["threads"] == 1
        assert a.meta.provenance["threads"] == n                   # earlier capsules keep theirs
    finally:
        torch.set_num_threads(n)


def test_capsule_holding_an_io_buffer_is_refused(runtime):
    """io and scratch buffers are never part of a capsule: a table naming one (a crafted
    file) is refused before any byte is written."""
    rt = runtime("qwen3")
    rt.prefill(_ids(6, 32))
    cap = rt.snapshot()
    io = rt.arena.slot("io.ids")
    extra = dataclasses.replace(cap.entries[0], name="io.ids", kind="io", dtype="int64",
                                shape=tuple(io.spec.shape), seq=False, offset=0)
    cap.entries = cap.entries + (extra,)
    before = rt.arena.data.clone()
    with pytest.raises(flashrt.CapsuleMismatchError, match="io.ids.*kind 'io'"):
        rt.restore(cap)
    assert torch.equal(rt.arena.data, before)


@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_capsules_share_one_copy_table(arch, runtime):
    """snapshot() plans from views once per position, then moves that table onto each new
    buffer (and restore of a capsule with the same entry table likewise): every such capsule
    holds exactly the arena's bytes and restores exactly, in this session and in a fork."""
    rt = runtime(arch)
    rt.prefill(_ids(13, 41))
    first = rt.snapshot()
    rt.decode(3)
    rt.restore(first)                              # a restore plan for first's entry table

    def live(cap):
        return torch.cat([rt.arena.bytes_of(e.name, e.shape[0] if e.seq else None) for e in cap.entries])

    caps, states = [], []
    for step in (7, 9, 11):
        rt.restore(first)
        rt.decode(step)                            # position 14 each time, different bytes
        caps.append(rt.snapshot())
        states.append(state_bytes(rt))
        assert torch.equal(torch.cat([caps[-1].raw(e) for e in caps[-1].entries]), live(caps[-1]))
    assert caps[1].entries is caps[0].entries and caps[2].entries is caps[0].entries
    assert not torch.equal(states[0], states[1])
    for cap, want in list(zip(caps, states))[::-1]:
        rt.restore(cap)
        assert torch.equal(state_bytes(rt), want)
        assert torch.equal(state_bytes(rt.fork(cap)), want)
    # same entry table, too small a buffer: the shared check result does not let it through
    short = flashrt.Capsule(caps[0].data[: caps[0].nbytes - 64], caps[0].entries, caps[0].meta)
    before = rt.arena.data.clone()
    with pytest.raises(flashrt.CapsuleMismatchError, match="outside the capsule data"):
        rt.restore(short)
    assert torch.equal(rt.arena.data, before)


def test_single_use_capsule_threads(runtime):
    rt = runtime("qwen3")
    rt.prefill(_ids(10, 22))
    cap = rt.snapshot(single_use=True)
    kids = [runtime("qwen3") for _ in range(8)]
    for k in kids:
        k.prefill([1, 2, 3])
    before = [k.arena.data.clone() for k in kids]
    results = race(8, lambda i: kids[i].restore(cap))
    assert results.count("ok") == 1 and results.count("consumed") == 7
    for i, k in enumerate(kids):
        if results[i] == "consumed":
            assert torch.equal(k.arena.data, before[i]) and k.position == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prefix_capsule(arch, runtime, tmp_path):
    """A child of a restored parent stores only its own rows + fixed state; restore composes."""
    rt = runtime(arch)
    rt.prefill(_ids(24, 30))
    parent = rt.snapshot()
    rt.reset()
    rt.restore(parent)
    rt.prefill(_ids(7, 31))
    full = rt.snapshot()
    child = rt.snapshot(parent=parent)
    a = rt.arena
    kv_row = sum(s.spec.row_bytes for s in a.slots if s.spec.seq_dim == 0 and s.spec.kind != "meta")
    assert child.nbytes == a.fixed_state_bytes + 7 * kv_row + 31 * a["meta.tokens"].element_size()
    assert child.nbytes < full.nbytes and child.history == full.history
    cont = _ids(6, 32)
    want = _decode_logits(rt, cont)
    other = runtime(arch)
    other.prefill(_ids(50, 33))                     # dirty arena
    other.restore(child)
    assert torch.equal(state_bytes(other), state_bytes(rt.fork(full)))
    assert torch.equal(_decode_logits(other, cont), want)
    # grandchild: a chain of deltas
    other.rollback(31)
    grand = other.snapshot(parent=child)
    third = runtime(arch)
    third.restore(grand)
    assert torch.equal(_decode_logits(third, cont), want)
    # persisted delta: refused until its parent is attached, then bitwise
    flashrt.save_capsule(child, tmp_path / "c.cap")
    loaded = flashrt.load_capsule(tmp_path / "c.cap")
    with pytest.raises(flashrt.CapsuleMismatchError, match="needs its parent"):
        third.restore(loaded)
    loaded.parent_capsule = parent
    third.restore(loaded)
    assert torch.equal(_decode_logits(third, cont), want)
    # a parent the session does not extend is refused
    fresh = runtime(arch)
    fresh.prefill(_ids(30, 34))
    with pytest.raises(flashrt.CapsuleMismatchError, match="does not extend"):
        fresh.snapshot(parent=parent)


def test_devices_compare_as_tensors_report_them():
    """'cuda' and 'cuda:0' name one device: the arena keeps its tensor's device, and the copy
    layer's comparison treats an index-less device as the same device (issue: every
    snapshot(into=) on CUDA was refused as 'capsule is on cuda:0, arena on cuda')."""
    from flashrt.core.arena import Arena, BufferSpec
    from flashrt.core.copy import _same_device
    assert _same_device(torch.device("cuda"), torch.device("cuda", 0))
    assert _same_device(torch.device("cuda", 0), torch.device("cuda"))
    assert not _same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not _same_device(torch.device("cpu"), torch.device("cuda", 0))
    a = Arena([BufferSpec("meta.x", "meta", (4,), torch.int64)], "cpu")
    assert a.device == a.data.device


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_warm_up_at_a_small_capacity(arch, runtime):
    """Capture warm-up runs every step body for real; bodies read the position and never move
    it, and the warm-up runs them at a scratch window inside the capacity, so a session whose
    max_seq_len is below the sum of the captured sizes warms up and is left as it was (before,
    warm-up walked meta.position to 1+2+...+64 = 127: a device-side assert under 127)."""
    from flashrt.core.graphs import power_of_two_sizes
    from flashrt.lm import static_step
    rt = runtime(arch, max_seq_len=20, prefill_chunk=16)
    rt.prefill(_ids(9, 40))
    before = state_bytes(rt)
    sizes = power_of_two_sizes(16)
    with torch.no_grad():
        rt.session.preserving_state(lambda: [static_step(rt.net, rt.session, T) for T in sizes],
                                    sizes[-1])
    assert torch.equal(state_bytes(rt), before) and rt.position == 9
    assert int(rt.arena["meta.position"]) == 9

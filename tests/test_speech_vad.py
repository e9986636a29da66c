"""flashrt.speech.VoiceActivity over Silero VAD with the real weights of the installed silero-vad
wheel, on real speech (tests/data/speech/*.wav, made by scripts/make_speech_wavs.sh): chunk
probabilities equal the package's TorchScript model, segments equal its get_speech_timestamps
and VADIterator, and capsules (snapshot, restore, fork, files, a store) continue bitwise."""
from __future__ import annotations

import importlib.util
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("silero_vad") is None:
    pytest.skip("silero-vad is not installed (the speech extra: pip install 'flashrt[speech]')",
                allow_module_level=True)

from flashrt.capsules import CapsuleMismatchError, CapsuleStore, load_capsule, save_capsule  # noqa: E402
from flashrt.models.silero_vad import load_silero_vad  # noqa: E402
from flashrt.speech import SpeechEnd, SpeechStart, VadRules, VoiceActivity, check_vad_model  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "speech"
WAVS = ("two_utterances", "short_pause")
RULES = [VadRules(), VadRules(min_speech_duration_ms=0), VadRules(threshold=0.3),
         VadRules(threshold=0.7, neg_threshold=0.6), VadRules(min_speech_duration_ms=700),
         VadRules(min_silence_duration_ms=300, speech_pad_ms=60),
         VadRules(min_silence_duration_ms=0, speech_pad_ms=0)]


def read_wav(name: str) -> torch.Tensor:
    """(n,) int16 samples of a 16 kHz mono 16-bit WAV."""
    with wave.open(str(DATA / f"{name}.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2)
        return torch.from_numpy(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").copy())


def as_float(pcm: torch.Tensor) -> torch.Tensor:
    return pcm.float() / 32768.0           # what VoiceActivity does with int16


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny ops contend on 2 threads


@pytest.fixture(scope="module")
def pkg():
    import silero_vad
    return silero_vad


@pytest.fixture(scope="module")
def ref(pkg):
    return pkg.load_silero_vad(onnx=False)       # the TorchScript model: the parity reference


@pytest.fixture(scope="module")
def net():
    return load_silero_vad("cpu")


def ref_probs(ref, audio: torch.Tensor) -> torch.Tensor:
    """The package model chunk by chunk (its own context), the last chunk zero-padded."""
    ref.reset_states()
    pad = torch.nn.functional.pad(audio, (0, -len(audio) % 512))
    return torch.tensor([ref(c, 16000).item() for c in pad.split(512)])


def push_split(vad: VoiceActivity, pcm: torch.Tensor, seed: int, finish: bool = True):
    """pcm in seeded random pieces (1 to 1500 samples); (probs, events) of all the pushes."""
    g, i, probs, events, c0 = torch.Generator().manual_seed(seed), 0, [], [], vad.chunks
    while i < len(pcm):
        n = int(torch.randint(1, 1500, (1,), generator=g))
        r = vad.push(pcm[i: i + n])
        assert r.first_chunk == c0 + sum(len(p) for p in probs) and vad.chunks == r.first_chunk + len(r.probs)
        probs.append(r.probs)
        events += r.events
        i += n
    if finish:
        r = vad.finish()
        probs.append(r.probs)
        events += r.events
    return torch.cat(probs), events


def segments(events) -> list[dict]:
    """Alternating SpeechStart / SpeechEnd events as get_speech_timestamps' dicts."""
    kinds = [type(e) for e in events]
    assert kinds == [SpeechStart, SpeechEnd] * (len(events) // 2), kinds
    return [{"start": s.sample, "end": e.sample} for s, e in zip(events[::2], events[1::2])]


def capsule_bytes(cap) -> bytes:
    return bytes(cap.data[: max(e.offset + e.nbytes for e in cap.entries)].numpy())


# ---- parity with the package -----------------------------------------------------------------
@pytest.mark.parametrize("name", WAVS)
def test_probabilities_equal_the_package_torchscript_model(name, net, ref):
    pcm = read_wav(name)
    want = ref_probs(ref, as_float(pcm))
    got, _ = push_split(VoiceActivity(net), pcm, seed=1)
    assert len(got) == len(want) == -(-len(pcm) // 512)
    assert (got - want).abs().max().item() <= 1e-6
    assert want.max() > 0.9 and want.min() < 0.1        # real speech and real silence in the file


@pytest.mark.parametrize("name", WAVS)
def test_probabilities_do_not_depend_on_how_audio_is_pushed(name, net):
    """Each chunk runs alone, whatever the pieces: pushes of any size, int16 or float32, agree bitwise."""
    pcm = read_wav(name)
    whole = VoiceActivity(net)
    a = torch.cat([whole.push(as_float(pcm)).probs, whole.finish().probs])
    b, _ = push_split(VoiceActivity(net), pcm, seed=2)
    c, _ = push_split(VoiceActivity(net), np.frombuffer(pcm.numpy().tobytes(), np.int16), seed=3)
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("rules", RULES, ids=lambda r: str(r)[9:-1].replace(" ", ""))
@pytest.mark.parametrize("name", WAVS)
def test_segments_equal_get_speech_timestamps(name, rules, net, ref, pkg):
    pcm = read_wav(name)
    want = pkg.get_speech_timestamps(as_float(pcm), ref, threshold=rules.threshold,
                                     neg_threshold=rules.neg_threshold,
                                     min_speech_duration_ms=rules.min_speech_duration_ms,
                                     min_silence_duration_ms=rules.min_silence_duration_ms,
                                     speech_pad_ms=rules.speech_pad_ms)
    _, events = push_split(VoiceActivity(net, rules), pcm, seed=4)
    assert want and segments(events) == want


def test_a_stream_cut_mid_utterance_ends_like_get_speech_timestamps(net, ref, pkg):
    """finish() on audio cut about min_speech after speech began (5120): the zero-padded last
    chunk and the length rule decide, as offline; some cuts keep the segment, some drop it."""
    pcm, kept = read_wav("two_utterances"), set()
    for cut in range(8700, 9800, 61):
        want = pkg.get_speech_timestamps(as_float(pcm[:cut]), ref)
        _, events = push_split(VoiceActivity(net), pcm[:cut], seed=cut)
        assert segments(events) == want, cut
        kept.add(bool(want))
    assert kept == {True, False}


def test_the_rule_sets_segment_differently(net, ref, pkg):
    """The parity above spans distinct segmentations (not one answer seven times)."""
    audio = torch.cat([as_float(read_wav(n)) for n in WAVS])
    found = {str(pkg.get_speech_timestamps(audio, ref, threshold=r.threshold, neg_threshold=r.neg_threshold,
                                           min_speech_duration_ms=r.min_speech_duration_ms,
                                           min_silence_duration_ms=r.min_silence_duration_ms,
                                           speech_pad_ms=r.speech_pad_ms)) for r in RULES}
    assert len(found) >= 5


@pytest.mark.parametrize("threshold", [0.5, 0.35, 0.8])
@pytest.mark.parametrize("name", WAVS)
def test_events_equal_vad_iterator(name, threshold, net, ref, pkg):
    """The package's streaming iterator (no min_speech rule): the same events at the same
    samples, each reported at the chunk the iterator reports it."""
    audio = as_float(read_wav(name))
    audio = audio[: len(audio) // 512 * 512]                 # the iterator takes whole chunks
    it = pkg.VADIterator(ref, threshold=threshold, min_silence_duration_ms=100, speech_pad_ms=30)
    want = []
    for j, chunk in enumerate(audio.split(512)):
        out = it(chunk)
        if out:
            want += [("start" if "start" in out else "end", out.get("start", out.get("end")), j)]
    _, events = push_split(VoiceActivity(net, VadRules(threshold=threshold, min_speech_duration_ms=0)),
                           audio, seed=5, finish=False)
    got = [("start" if isinstance(e, SpeechStart) else "end", e.sample, e.chunk) for e in events]
    assert len(want) >= 4 and got == want


def test_an_end_is_padded_without_splitting_a_short_gap(net, ref, pkg):
    """The documented difference: with min_silence under 2 x speech_pad, get_speech_timestamps
    splits a short gap between segments; the stream pads each end and start fully."""
    pcm, pad = read_wav("short_pause"), 200
    raw = pkg.get_speech_timestamps(as_float(pcm), ref, min_silence_duration_ms=0, speech_pad_ms=0)
    want = [{"start": max(0, s["start"] - 16 * pad), "end": min(len(pcm), s["end"] + 16 * pad)} for s in raw]
    split = pkg.get_speech_timestamps(as_float(pcm), ref, min_silence_duration_ms=0, speech_pad_ms=pad)
    _, events = push_split(VoiceActivity(net, VadRules(min_silence_duration_ms=0, speech_pad_ms=pad)), pcm, 6)
    assert segments(events) == want != split


# ---- capsules ------------------------------------------------------------------------------
MID = 15000 + 100       # inside the first utterance of two_utterances.wav, 100 samples into a chunk


def test_capsule_mid_utterance_continues_bitwise(net):
    pcm = read_wav("two_utterances")
    live = VoiceActivity(net)
    live.push(pcm[:MID])
    assert live.speaking and live.pending == MID % 512 and live.chunks == MID // 512
    cap = live.snapshot()
    want = push_split(live, pcm[MID:], seed=7)
    assert len(want[1]) == 3                                  # end, start, end of the rest
    for vad in (live, VoiceActivity(net)):                    # back in time, and a fresh stream
        vad.restore(cap)
        assert vad.speaking and vad.samples == MID
        got = push_split(vad, pcm[MID:], seed=8)              # other piece sizes: same bits
        assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_continuation_equals_the_stream_that_never_left(net):
    """A snapshot/restore round trip in the middle changes nothing: the whole stream's probs
    and events equal one that never stopped."""
    pcm = read_wav("two_utterances")
    a = VoiceActivity(net)
    whole = push_split(a, pcm, seed=9)
    b = VoiceActivity(net)
    first = push_split(b, pcm[:MID], seed=9, finish=False)
    cap = b.snapshot()
    c = VoiceActivity(net)
    c.restore(cap)
    rest = push_split(c, pcm[MID:], seed=10)
    assert torch.equal(torch.cat([first[0], rest[0]]), whole[0]) and first[1] + rest[1] == whole[1]


def test_forks_are_independent(net):
    pcm, other = read_wav("two_utterances"), read_wav("short_pause")
    live = VoiceActivity(net)
    live.push(pcm[:MID])
    cap = live.snapshot()
    fork = live.fork()
    f = push_split(fork, other, seed=11)                      # the fork hears something else
    w = push_split(live, pcm[MID:], seed=12)
    ref_live, ref_fork = VoiceActivity(net), VoiceActivity(net)
    ref_live.restore(cap)
    ref_fork.restore(cap)
    assert fork.net is live.net and fork.rules == live.rules
    want_w, want_f = push_split(ref_live, pcm[MID:], seed=13), push_split(ref_fork, other, seed=14)
    assert torch.equal(w[0], want_w[0]) and w[1] == want_w[1]
    assert torch.equal(f[0], want_f[0]) and f[1] == want_f[1]
    assert not torch.equal(f[0][:50], w[0][:50])


def test_save_load_and_store_round_trip(net, tmp_path):
    pcm = read_wav("two_utterances")
    live = VoiceActivity(net)
    live.push(pcm[:MID])
    cap = live.snapshot()
    want = push_split(live, pcm[MID:], seed=15)
    save_capsule(cap, tmp_path / "mid.capsule")
    loaded = load_capsule(tmp_path / "mid.capsule")
    assert capsule_bytes(loaded) == capsule_bytes(cap) and loaded.position == cap.position
    memory, disk = CapsuleStore(host_bytes=1 << 20), CapsuleStore(disk_dir=tmp_path / "store")
    key = memory.put(cap, key="mid")
    assert disk.put(cap, key="mid") == key and disk.tier(key) == "disk"
    reopened = CapsuleStore(disk_dir=tmp_path / "store")       # from its files alone
    live.restore(cap)
    live.save(tmp_path / "own.capsule")                         # the layer's own save / load
    for restore in (lambda v: v.restore(loaded), lambda v: memory.restore_into(v, key),
                    lambda v: reopened.restore_into(v, key), lambda v: v.load(tmp_path / "own.capsule")):
        vad = VoiceActivity(net)
        restore(vad)
        got = push_split(vad, pcm[MID:], seed=16)
        assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_a_capsule_of_other_weights_is_refused_state_untouched(net):
    other = load_silero_vad("cpu")
    with torch.no_grad():
        other.decoder.out.bias.add_(1.0)
    donor = VoiceActivity(other)
    donor.push(read_wav("two_utterances")[:MID])
    vad = VoiceActivity(net)
    vad.push(read_wav("short_pause")[:7000])
    before = capsule_bytes(vad.snapshot())
    with pytest.raises(CapsuleMismatchError, match="weights"):
        vad.restore(donor.snapshot())
    assert capsule_bytes(vad.snapshot()) == before


def test_reset_starts_a_fresh_stream(net):
    pcm = read_wav("short_pause")
    vad = VoiceActivity(net)
    vad.push(pcm[:20000])
    vad.reset()
    assert (vad.chunks, vad.samples, vad.pending, vad.speaking) == (0, 0, 0, False)
    got, fresh = push_split(vad, pcm, seed=17), push_split(VoiceActivity(net), pcm, seed=18)
    assert torch.equal(got[0], fresh[0]) and got[1] == fresh[1]


# ---- refusals ------------------------------------------------------------------------------
BAD = [
    (lambda x: x.double(), {}, "float32 samples in \\[-1, 1\\] or int16 samples, got torch.float64"),
    (lambda x: x.to(torch.int32), {}, "got torch.int32"),
    (lambda x: torch.cat([x[:10], torch.tensor([float("nan")]), x[10:]]), {}, "non-finite"),
    (lambda x: torch.cat([x[:10], torch.tensor([float("inf")])]), {}, "non-finite"),
    (lambda x: torch.stack([x, x]), {}, "1-D mono samples \\(n,\\), got shape \\(2, 700\\)"),
    (lambda x: x.tolist(), {}, "torch.Tensor or numpy array .* got list"),
    (lambda x: x, {"sample_rate": 8000}, "sample_rate 8000: this model takes 16000 Hz"),
    (lambda x: x, {"sample_rate": "16000"}, "sample_rate '16000'"),
]


@pytest.mark.parametrize("make, kw, match", BAD, ids=[b[2][:24] for b in BAD])
def test_bad_input_is_refused_state_untouched(make, kw, match, net):
    pcm = read_wav("two_utterances")
    vad = VoiceActivity(net)
    vad.push(pcm[:MID])
    before = capsule_bytes(vad.snapshot())
    with pytest.raises(ValueError, match=match):
        vad.push(make(as_float(pcm[MID: MID + 700])), **kw)
    assert capsule_bytes(vad.snapshot()) == before
    clean = VoiceActivity(net)
    clean.push(pcm[:MID])
    got, want = push_split(vad, pcm[MID:], seed=19), push_split(clean, pcm[MID:], seed=20)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


@pytest.mark.parametrize("kw, match", [({"threshold": 1.5}, "threshold=1.5"),
                                       ({"threshold": 0.5, "neg_threshold": 0.6}, "neg_threshold=0.6"),
                                       ({"speech_pad_ms": -1}, "speech_pad_ms=-1"),
                                       ({"min_silence_duration_ms": float("nan")}, "min_silence")])
def test_bad_rules_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        VadRules(**kw)


def test_only_a_vad_model_runs(net):
    with pytest.raises(TypeError, match="VadModel"):
        check_vad_model(torch.nn.Linear(2, 2))
    names = {s.name: s.kind for s in net.state_specs(0, torch.float32)}
    assert names == {"vad.lstm.h": "recurrent", "vad.lstm.c": "recurrent", "vad.context": "conv"}
    vad = VoiceActivity(net)
    assert vad.snapshot().nbytes < 4096          # the whole state: 3.3 KiB, 2 KiB of it pending PCM

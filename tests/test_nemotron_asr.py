"""Nemotron Speech Streaming on flashrt: parity with transformers' streaming path (the encoder
chunk by chunk, greedy RNN-T tokens, the log-mel front end) on a tiny random-weight checkpoint
in the released on-disk format, and the transcriber's capsules (restore, endpoint, forks, files).
"""
from __future__ import annotations

import math

import pytest
import torch

from flashrt.capsules import CapsuleMismatchError
from flashrt.core.session import Session, SessionOptions
from flashrt.models.checkpoint import make_checkpoint
from flashrt.models.loader import load_model
from flashrt.speech import StreamingTranscriber

transformers = pytest.importorskip("transformers")

LOOKAHEADS = (13, 6, 1, 0)
MARGIN = 1e-3          # a step whose top-2 logit gap is at most this may pick either token
SR = 16000


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("nemotron_asr_streaming", "tiny", tmp_path_factory.mktemp("nemotron"), seed=0)


@pytest.fixture(scope="module")
def lm(ckpt):
    return load_model(ckpt)


@pytest.fixture(scope="module")
def ref(ckpt):
    from transformers import NemotronAsrStreamingFeatureExtractor, NemotronAsrStreamingForRNNT
    return (NemotronAsrStreamingForRNNT.from_pretrained(ckpt).eval(),
            NemotronAsrStreamingFeatureExtractor.from_pretrained(ckpt))


def chirp(n: int, seed: int = 0) -> torch.Tensor:
    """A gliding, amplitude-modulated tone in noise: varied frames, so blanks and tokens mix."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n) / SR
    f = 200 + 150 * torch.sin(2 * math.pi * (0.7 + 0.1 * seed) * t)
    tone = torch.sin(2 * math.pi * torch.cumsum(f, 0) / SR) * (0.5 + 0.5 * torch.sin(2 * math.pi * 1.3 * t))
    return (0.3 * tone + 0.02 * torch.randn(n, generator=g)).float()


def pieces(x: torch.Tensor, sizes=(777, 1, 4096, 333, 10000)):
    """x split at odd, uneven sizes (cycled)."""
    out, i, k = [], 0, 0
    while i < x.shape[0]:
        out.append(x[i: i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    return out


def features(fe, audio: torch.Tensor) -> torch.Tensor:
    """transformers' log-mel over the whole utterance, valid frames only: (1, L // hop, mels)."""
    out = fe(audio.numpy(), sampling_rate=SR, return_tensors="pt")["input_features"]
    return out[:, : audio.shape[0] // fe.hop_length]


def mel_chunks(feats: torch.Tensor, R: int):
    """Streaming chunks: 1 + 8R mel frames, then 8(R + 1); a partial last chunk is left out."""
    f0 = 0
    while True:
        M = 1 + 8 * R if f0 == 0 else 8 * (R + 1)
        if f0 + M > feats.shape[1]:
            return
        yield feats[:, f0: f0 + M]
        f0 += M


def state_bytes(tr: StreamingTranscriber) -> torch.Tensor:
    a = tr.arena
    return a.data[a.fixed_begin: a.fixed_end].clone()


def run(tr: StreamingTranscriber, audio: torch.Tensor):
    toks, frames = [], []
    for p in pieces(audio):
        r = tr.push(p)
        toks += r.tokens
        frames += r.frames
    return toks, frames


# ---- parity with transformers ---------------------------------------------------------------
@pytest.mark.parametrize("R", LOOKAHEADS)
def test_encoder_chunks_match_transformers_cached_streaming(lm, ref, R):
    """Every chunk's encoder output (and its projection) equals get_audio_features(use_cache=True)
    with the K/V and conv caches carried chunk to chunk, once the left window has filled."""
    model, fe = ref
    net = lm.net
    feats = features(fe, chirp(4 * SR))
    opts = SessionOptions(max_seq_len=1 << 40, prefill_chunk=1 << 30, checkpoint_every=1 << 40)
    s = Session(net, [], "cpu", torch.float32, lm.fingerprint, opts)
    cache = pad = None
    worst, n = 0.0, 0
    with torch.no_grad():
        for chunk in mel_chunks(feats, R):
            o = model.get_audio_features(input_features=chunk, cache=cache, padding_cache=pad, use_cache=True,
                                         num_lookahead_tokens=R, output_attention_mask=False)
            cache, pad = o.cache, o.padding_cache
            mine = s.step(R + 1, lambda ctx: net({"mel": chunk[0], "lookahead": R}, ctx, s.arena))
            worst = max(worst, (mine["encoded"] - o.pooler_output[0]).abs().max().item(),
                        (mine["hidden"] - o.last_hidden_state[0]).abs().max().item())
            n += 1
    assert s.position > net.config.window, "the left window never filled"
    assert n >= 3 and worst <= 1e-4, f"R={R}: max |diff| {worst:.2e} over {n} chunks"


def _reference_steps(model, fe, audio, R):
    """transformers' streaming generate: its non-blank (token, frame) pairs and per-step logits."""
    logits = []
    hook = model.joint.register_forward_hook(lambda m, i, o: logits.append(o.detach().reshape(-1, o.shape[-1])))
    try:
        model.generation_config.decoder_start_token_id = model.config.blank_token_id
        with torch.no_grad():
            out = model.generate(input_features=mel_chunks(features(fe, audio), R), num_lookahead_tokens=R)
    finally:
        hook.remove()
    seq, dur = out.sequences[0], out.durations[0]
    frames = torch.cumsum(dur, 0) - dur
    pairs = [(int(t), int(f)) for t, f in zip(seq[1:], frames[1:]) if int(t) != model.config.blank_token_id]
    return pairs, torch.cat(logits[1:])        # the first joint call only encodes the first chunk


def _spy_decode(monkeypatch, net):
    steps = []
    orig = net.decode

    def spy(encoded, ctx, state, keep_logits=False):
        r = orig(encoded, ctx, state, keep_logits=True)
        steps.extend(r["logits"])
        return r
    monkeypatch.setattr(net, "decode", spy)
    return steps


def _margin_check(mine: list, theirs: torch.Tensor) -> int:
    """Walk both step sequences: tokens agree wherever the reference's top-2 gap exceeds MARGIN
    (after a tie-level disagreement the paths part: stop). Returns the decisive steps compared."""
    decisive = 0
    for i, z in enumerate(mine[: theirs.shape[0]]):
        ref_z = theirs[i]
        top = ref_z.topk(2).values
        gap = (top[0] - top[1]).item()
        assert (z - ref_z).abs().max().item() <= 1e-3, f"step {i}: logits differ"
        if int(z.argmax()) != int(ref_z.argmax()):
            assert gap <= MARGIN, f"step {i}: tokens differ at a decisive step (gap {gap:.2e})"
            return decisive
        decisive += gap > MARGIN
    assert len(mine) == theirs.shape[0], f"{len(mine)} decode steps, transformers took {theirs.shape[0]}"
    return decisive


@pytest.mark.parametrize("R", LOOKAHEADS)
def test_tokens_match_transformers_streaming_generate(lm, ref, monkeypatch, R):
    """Pushed in uneven pieces, the transcriber emits transformers' generate(<mel chunks>) tokens
    at the same frames, step by step under the top-2 margin rule; blanks, tokens and the
    max-symbols advance all occur."""
    model, fe = ref
    audio = chirp(4 * SR, seed=1)
    pairs, theirs = _reference_steps(model, fe, audio, R)
    steps = _spy_decode(monkeypatch, lm.net)
    tr = StreamingTranscriber(lm, lookahead=R)
    toks, frames = run(tr, audio)
    blank = lm.net.blank_id
    decisive = _margin_check(steps, theirs)
    assert decisive >= 100, f"only {decisive} decisive steps compared"
    n_blank = int((theirs.argmax(-1) == blank).sum())
    assert n_blank > 0 and len(pairs) > 0, f"R={R}: {n_blank} blank steps, {len(pairs)} tokens"
    if decisive == len(steps):
        assert list(zip(toks, frames)) == pairs
    assert any(frames.count(f) == lm.net.config.max_symbols for f in set(frames))


def test_incremental_features_match_the_feature_extractor(lm, ref, monkeypatch):
    """The log-mel frames the encoder received, made from the arena's sample tail over uneven
    pushes, are transformers' feature extractor frames over the whole utterance."""
    _, fe = ref
    audio = chirp(3 * SR + 123, seed=2)
    got = []
    take = lm.net.features.take
    monkeypatch.setattr(lm.net.features, "take", lambda *a: got.append(take(*a)) or got[-1])
    tr = StreamingTranscriber(lm, lookahead=6)
    run(tr, audio)
    mine = torch.cat(got)
    want = features(fe, audio)[0]
    assert mine.shape[0] >= want.shape[0] - 8 * 7
    assert (mine - want[: mine.shape[0]]).abs().max().item() <= 1e-5


def test_endpoint_flush_matches_transformers_at_zero_lookahead(lm, ref, monkeypatch):
    """A lookahead-0 stream plus its endpoint() decodes every frame inside the audio exactly
    like transformers' R=0 streaming over the same frames (the flush zero-pads the last window)."""
    model, fe = ref
    audio = chirp(1280 * 50 + 170, seed=3)       # frame 50 is inside the audio, its window is not
    _, theirs = _reference_steps(model, fe, audio, 0)
    steps = _spy_decode(monkeypatch, lm.net)
    tr = StreamingTranscriber(lm, lookahead=0)
    run(tr, audio)
    assert tr.position == 50
    end = tr.endpoint()
    assert end.final and end.end_frame == 51 and tr.position == 50
    assert _margin_check(steps, theirs) >= 100


# ---- capsules ---------------------------------------------------------------------------------
def test_capsule_mid_utterance_continues_bitwise(lm):
    """A snapshot between two pushes (mid-chunk) restored into a fresh transcriber continues
    bitwise like the stream that never left; the capsule is the same size anywhere; and how the
    audio is split does not matter."""
    audio = chirp(5 * SR, seed=4)
    cut = 2 * SR + 4321
    a = StreamingTranscriber(lm, lookahead=6)
    size0 = a.snapshot().nbytes
    run(a, audio[:cut])
    cap = a.snapshot()
    assert cap.nbytes == size0 and a.pending > 0
    rest_a = run(a, audio[cut:])
    b = StreamingTranscriber(lm, lookahead=6)
    b.push(chirp(SR, seed=9))                      # other state first: restore must replace it all
    b.restore(cap)
    rest_b = run(b, audio[cut:])
    assert rest_a == rest_b and len(rest_a[0]) > 0
    assert torch.equal(state_bytes(a), state_bytes(b))
    c = StreamingTranscriber(lm, lookahead=6)
    c.push(audio)                                  # one piece
    assert torch.equal(state_bytes(a), state_bytes(c))


def test_endpoint_leaves_the_stream_untouched(lm):
    """After endpoint() the stream continues bitwise as if it had not been called, and the
    endpoint's tokens come after those the stream gave."""
    audio = chirp(5 * SR, seed=5)
    cut = 2 * SR + 999
    a, b = StreamingTranscriber(lm, lookahead=6), StreamingTranscriber(lm, lookahead=6)
    run(a, audio[:cut])
    run(b, audio[:cut])
    before = state_bytes(a)
    end = a.endpoint()
    assert torch.equal(before, state_bytes(a))
    assert end.final and end.end_frame > a.position and all(f >= a.position for f in end.frames)
    assert a.endpoint() == end                      # the fork starts from the same state each time
    assert run(a, audio[cut:]) == run(b, audio[cut:])
    assert torch.equal(state_bytes(a), state_bytes(b))


def test_forks_are_independent(lm):
    audio, other = chirp(4 * SR, seed=6), chirp(2 * SR, seed=7)
    cut = SR + 777
    a = StreamingTranscriber(lm, lookahead=1)
    run(a, audio[:cut])
    b = a.fork()
    assert b.lookahead == 1 and b.position == a.position
    out_b = run(b, other)
    out_a = run(a, audio[cut:])
    ref_a, ref_b = StreamingTranscriber(lm, lookahead=1), StreamingTranscriber(lm, lookahead=1)
    run(ref_a, audio)
    run(ref_b, audio[:cut])
    assert out_b == run(ref_b, other)
    assert torch.equal(state_bytes(a), state_bytes(ref_a)) and torch.equal(state_bytes(b), state_bytes(ref_b))
    assert out_a[0] != out_b[0]


def test_save_load_round_trips(lm, tmp_path, ckpt):
    audio = chirp(4 * SR, seed=8)
    cut = 2 * SR + 55
    a = StreamingTranscriber(lm, lookahead=13)
    run(a, audio[:cut])
    a.save(tmp_path / "asr.cap")
    b = StreamingTranscriber(load_model(ckpt), lookahead=13)      # another load of the same files
    b.load(tmp_path / "asr.cap")
    assert torch.equal(state_bytes(a), state_bytes(b))
    assert run(a, audio[cut:]) == run(b, audio[cut:])
    other = make_checkpoint("nemotron_asr_streaming", "tiny", tmp_path / "seed1", seed=1)
    c = StreamingTranscriber(load_model(other), lookahead=13)
    before = state_bytes(c)
    with pytest.raises(CapsuleMismatchError):
        c.load(tmp_path / "asr.cap")
    assert torch.equal(before, state_bytes(c))


def test_bad_input_is_refused_with_state_untouched(lm):
    tr = StreamingTranscriber(lm, lookahead=6)
    tr.push(chirp(SR + 100))
    before = state_bytes(tr)
    bad = [((torch.zeros(100, dtype=torch.float64),), "float32"), ((torch.zeros(2, 100),), "1-D"),
           ((torch.tensor([0.0, float("nan")]),), "non-finite"), (([0.1, 0.2],), "numpy"),
           ((torch.zeros(100), 8000), "16000 Hz")]
    for args, words in bad:
        with pytest.raises(ValueError, match=words):
            tr.push(*args)
    assert torch.equal(before, state_bytes(tr))
    with pytest.raises(ValueError, match=r"one of \[13, 6, 1, 0\]"):
        StreamingTranscriber(lm, lookahead=5)
    r = tr.push(torch.zeros(0, dtype=torch.int16))
    assert r.tokens == () and r.text is None and torch.equal(before, state_bytes(tr))

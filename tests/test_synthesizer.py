"""The Synthesizer's speech-out layer on a tiny random-weight Pocket TTS: voice prompts cut as
transformers' feature extractor cuts them, voice capsules at rest, replies split as transformers'
split_text splits them, incremental text, and barge-in (rollback_to_played) that is bitwise the
run that only ever made the played frames.
"""
from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest
import torch

tf = pytest.importorskip("transformers")

from flashrt.capsules import CapsuleStore, load_capsule, save_capsule
from flashrt.models.checkpoint import make_checkpoint
from flashrt.speech import IncrementalSpeaker, SentenceRule, load_synthesizer, split_sentences

TOL = 1e-4
GREEDY = dict(temperature=0.0, eos_threshold=1e9)
SAMPLED = dict(temperature=0.7, eos_threshold=1e9)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("pocket_tts", "tiny", tmp_path_factory.mktemp("pocket_tts_s"), seed=0)


@pytest.fixture(scope="module")
def synth(ckpt):
    return load_synthesizer(ckpt, max_seq_len=256, codec_mark_every=4)


def _twin(synth):
    """Another synthesizer over the same weights: the reference run."""
    from flashrt.speech import Synthesizer
    return Synthesizer(synth.net, synth.codec, max_seq_len=256, codec_mark_every=4)


def _speech(n, seed, quiet_tail=0):
    """n samples of loud noise, then quiet_tail samples 60 dB down (a pause to cut)."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(n, generator=g) * 0.3, torch.randn(quiet_tail, generator=g) * 3e-4])


@pytest.fixture(scope="module")
def voice(synth):
    return synth.make_voice(_speech(700, 1))


def _state(s):
    cap = s.snapshot()
    return {e.name: cap.view(e.name).clone() for e in cap.entries}


def _same_state(a, b):
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    bad = [n for n in sa if not torch.equal(sa[n], sb[n])]
    assert not bad, f"buffers differ: {bad}"


def _take(gen, n=None):
    out = [next(gen) for _ in range(n)] if n is not None else list(gen)
    return torch.cat(out) if out else torch.zeros(0)


# ---- voices ---------------------------------------------------------------------------------
@pytest.mark.parametrize("end_on_pause", [True, False])
def test_voice_prompt_is_cut_and_encoded_as_transformers_does(ckpt, synth, end_on_pause):
    """The prepared PCM is bitwise the feature extractor's (trailing silence cut, faded, pause
    appended; or untouched), the voice latents are the reference codec's over its padding mask,
    and the voice capsule holds [prompt BOS, one position per latent]."""
    from transformers import PocketTTSAudioTokenizerModel, PocketTTSFeatureExtractor
    wav = _speech(3000, 2, quiet_tail=2500)
    fs, sr = synth.frame_size, synth.sample_rate
    fe = PocketTTSFeatureExtractor(frame_size=fs, pad_to_multiple_of=fs, sampling_rate=sr)
    want = fe(wav, sampling_rate=sr, end_on_pause=end_on_pause)
    n = int(want["padding_mask"][0].sum())
    rules = type(synth.voice_rules)(end_on_pause=end_on_pause)
    got = rules.prepare(wav, sr)
    assert torch.equal(got, want["input_values"][0, 0, :n])
    if end_on_pause:                         # 2500 quiet samples cut, 1920 of pause added
        assert n == 3360 + 1920 and got[3360:].abs().max() == 0
    ref = PocketTTSAudioTokenizerModel.from_pretrained(ckpt / "audio_tokenizer").eval()
    with torch.no_grad():
        enc = ref.encode(want["input_values"], want["padding_mask"])
    lat = enc.latents[0][enc.latents_mask[0].bool()]
    ours = synth.codec.encode(got)
    assert ours.shape == lat.shape and (ours - lat).abs().max() <= TOL * max(1.0, float(lat.abs().max()))
    synth.voice_rules = rules
    try:
        assert synth.make_voice(wav).position == 1 + lat.shape[0]
    finally:
        synth.voice_rules = type(rules)()


def test_saved_and_stored_voice_capsules_speak_bitwise_as_the_live_one(synth, voice, tmp_path):
    text = torch.tensor([11, 12, 13, 14])
    live = _take(synth.speak(text, voice, max_frames=12, seed=4, eos_threshold=1e9))
    save_capsule(voice, tmp_path / "voice.cap")
    memory, disk = CapsuleStore(host_bytes=1 << 24), CapsuleStore(disk_dir=tmp_path / "store")
    for store in (memory, disk):
        store.put(voice, key="voice.alice")
    for cap in (load_capsule(tmp_path / "voice.cap"), memory.get("voice.alice"),
                CapsuleStore(disk_dir=tmp_path / "store").get("voice.alice")):   # reopened
        other = _twin(synth)
        assert torch.equal(_take(other.speak(text, cap, max_frames=12, seed=4, eos_threshold=1e9)), live)
        _same_state(other, synth)


# ---- sentences ------------------------------------------------------------------------------
class _Tok:
    """A sentencepiece-like stand-in: a token is an optional space then '...', a word or a mark;
    decode drops the first token's space. ids by first sight (< 300, the tiny vocab's text)."""

    def __init__(self):
        self.vocab = {}

    def pieces(self, text):
        return [(m.group(), m.end()) for m in re.finditer(r" ?(?:\.\.\.|\w+|[^\w\s])", text)]

    def __call__(self, text):                   # IncrementalSpeaker's tokenize: (ids, ends)
        ps = self.pieces(text)
        return [self.vocab.setdefault(p, len(self.vocab)) for p, _ in ps], [e for _, e in ps]

    def encode(self, text, add_special_tokens=False):
        return self(text)[0]

    def decode(self, ids):
        inv = {v: k for k, v in self.vocab.items()}
        s = "".join(inv[i] for i in ids)
        return s[1:] if s.startswith(" ") else s

    def convert_tokens_to_ids(self, toks):
        return [self.vocab.get(t, -1) for t in toks]

    unk_token_id = -1


def _rule(tok, max_tokens=50):
    for t in (".", "!", "...", "?", ",", ";", ":"):
        tok.vocab.setdefault(t, len(tok.vocab))
    ends = frozenset(tok.convert_tokens_to_ids([".", "!", "...", "?"]))
    return SentenceRule(ends, frozenset(tok.convert_tokens_to_ids([",", ";", ":"])), max_tokens, tok.decode)


TEXTS = ["Hello there. It costs 3.14 dollars, or so! Really?! Well... fine",
         "One, two, three, four, five, six, seven, eight; nine: ten. Short one. And the end.",
         "No boundary at all here", "Wait... what? Yes. Pi is 3.5. Ok, then, so, on, and, on."]


@pytest.mark.parametrize("max_tokens", [50, 8, 4])
def test_split_matches_transformers_split_text(max_tokens):
    from transformers import PocketTTSProcessor
    tok = _Tok()
    rule = _rule(tok, max_tokens)
    proc = SimpleNamespace(tokenizer=tok, placeholder_tokens=[],
                           apply_chat_template=lambda conv: conv[0]["content"][0]["text"])
    for text in TEXTS:
        want = PocketTTSProcessor.split_text(proc, text, max_tokens=max_tokens)
        got = split_sentences(tok.encode(text), rule)
        assert [tok.decode(c) for c in got] == want, text
        assert sum(got, []) == tok.encode(text)
    if max_tokens == 50:     # "Hello there." "It costs 3.14 dollars, or so!" "Really?!" "Well..." "fine"
        assert len(split_sentences(tok.encode(TEXTS[0]), rule, merge=False)) == 5


def test_long_reply_starts_every_sentence_from_the_voice_capsule(synth, voice):
    """Greedy: each sentence's frames equal that sentence spoken alone from the voice, and no
    sentence encodes or prefills the voice again (its first frame sits at voice + text)."""
    tok = _Tok()
    rule = _rule(tok, max_tokens=5)
    ids = tok.encode("Hello there. How are you today? Fine.")
    chunks = split_sentences(ids, rule)                  # 3 + 5 + 2 tokens: three chunks
    starts, calls = [], []
    say, encode = synth.say, synth.codec.encode
    synth.say = lambda c, *a, **k: (starts.append(len(c)), say(c, *a, **k))[1]
    synth.codec.encode = lambda *a: calls.append(1) or encode(*a)
    try:
        pcm = _take(synth.speak_long(ids, voice, rule=rule, max_frames=6, **GREEDY))
        sentences = synth._reply.sentences
    finally:
        del synth.say, synth.codec.encode
    assert len(chunks) == 3 and calls == [] and starts == [len(c) for c in chunks]
    assert [s.start for s in sentences] == [voice.position + len(c) for c in chunks]
    alone = torch.cat([_take(synth.speak(c, voice, max_frames=6, **GREEDY)) for c in chunks])
    assert pcm.shape == (18 * synth.frame_size,) and torch.equal(pcm, alone)


def test_incremental_text_speaks_each_sentence_once_it_completes(synth, voice):
    """Random deltas: a sentence is spoken at the first feed whose text holds a token after its
    end mark (never before); the audio and state equal saying the whole text's sentences one by
    one; each sentence's characters (leading space included) add up to the text."""
    text = "Hello there. How are you today? Fine, thanks. Bye "
    tok = _Tok()
    rule = _rule(tok)
    knobs = dict(seed=9, **SAMPLED)
    sp = IncrementalSpeaker(synth, voice, tok, rule, max_frames=6, **knobs)
    rnd, pos, got, said = random.Random(0), 0, [], 0
    while pos < len(text):
        step = rnd.randint(1, 6)
        frames = _take(sp.feed(text[pos: pos + step]))
        pos += step
        complete = len(split_sentences(tok.encode(text[:pos]), rule, merge=False)) - 1
        assert len(synth._reply.sentences) == complete
        assert (frames.numel() > 0) == (complete > said)
        said = complete
        got.append(frames)
    assert said == 3
    got.append(_take(sp.flush()))
    ref = _twin(synth)
    ref.reply(voice, **knobs)
    ids = tok.encode(text)
    want = torch.cat([_take(ref.say(c, max_frames=6)) for c in split_sentences(ids, rule, merge=False)])
    assert torch.equal(torch.cat(got), want)
    _same_state(synth, ref)
    assert [s.chars for s in synth._reply.sentences] == [12, 19, 14, 5]     # + the last space


def test_incremental_barge_in_reports_delivered_characters_of_the_text(synth, voice):
    """Two sentences out, 1.5 of them played: the first's characters plus half the second's
    (no alignment: frames played over its frames), and the rolled-back reply takes no more text."""
    tok = _Tok()
    sp = IncrementalSpeaker(synth, voice, tok, _rule(tok), max_frames=6, seed=2, **SAMPLED)
    assert _take(sp.feed("Hello there. How are you today? Fine")).shape == (12 * synth.frame_size,)
    assert sp.rollback_to_played(9 * synth.frame_size + 7) == 12 + 19 * 3 // 6
    assert synth.frame == 3
    with pytest.raises(RuntimeError, match="rolled back"):
        sp.feed(" more")


# ---- barge-in -------------------------------------------------------------------------------
A, B, C, NEW = [21, 22, 23], [31, 32, 33, 34], [41, 42], [51, 52, 53, 54, 55]
N = 10              # frames per sentence: EOS crosses at frame 7, its countdown runs past N
EOS = dict(temperature=0.7, eos_threshold=-1e9, min_frames_before_eos=6, frames_after_eos=5)


def _reply_ahead(s, voice, c_frames=5):
    """A and B generated and queued to the player, C generation under way (5 frames)."""
    s.reply(voice, seed=5, **EOS)
    pcm = [_take(s.say(A, chars=15, max_frames=N)), _take(s.say(B, chars=20, max_frames=N))]
    return pcm + [_take(s.say(C, chars=9, max_frames=N), c_frames)]


def _reference(s, voice, plan):
    """A synthesizer that only ever made the played frames: plan = frames of A, B, ..."""
    s.reply(voice, seed=5, **EOS)
    for ids, chars, n in zip((A, B, C), (15, 20, 9), plan):
        _take(s.say(ids, chars=chars, max_frames=N), n)
    return s


@pytest.mark.parametrize("played_frames", [16, 13, 23, 9])
def test_rollback_to_played_is_bitwise_the_run_that_made_only_those_frames(synth, voice, played_frames):
    """Played A and part of B (a partial frame too), or into C, or into A: every buffer equals a
    synthesizer that made exactly those frames; so does the next sentence's audio and state.
    Frame counts off the codec marks (every 4) make the rewind re-decode kept latents; at 9 the
    EOS countdown (set at frame 7) comes from the frame log, not the mark at 8."""
    _reply_ahead(synth, voice)
    delivered = synth.rollback_to_played(played_frames * synth.frame_size + 50)
    plan = [min(played_frames, N), max(0, min(played_frames - N, N)), max(0, played_frames - 2 * N)]
    plan = [n for n in plan if n] or [0]
    ref = _reference(_twin(synth), voice, plan)
    _same_state(synth, ref)
    whole = {9: 0, 13: 15, 16: 15, 23: 35}[played_frames]
    cut = played_frames - {9: 0, 13: N, 16: N, 23: 2 * N}[played_frames]
    chars = {9: 15, 13: 20, 16: 20, 23: 9}[played_frames]
    # A and B were closed at N frames (their speech length); C still runs: its budget of N
    assert delivered == whole + chars * cut // N
    new, want = _take(synth.say(NEW, max_frames=N)), _take(ref.say(NEW, max_frames=N))
    assert torch.equal(new, want)
    _same_state(synth, ref)


def test_rollback_then_resume_continues_the_cut_sentence_bitwise(synth, voice):
    """A false barge-in: after rolling back into B, frames() goes on with B's own frames."""
    pcm = _reply_ahead(synth, voice)
    synth.rollback_to_played((N + 7) * synth.frame_size)
    assert torch.equal(_take(synth.frames(N - 7)), pcm[1][7 * synth.frame_size:])


@pytest.mark.parametrize("played_frames", [0, 10, 20])
def test_rollback_to_zero_frames_of_a_sentence_is_never_having_started_it(synth, voice, played_frames):
    _reply_ahead(synth, voice)
    delivered = synth.rollback_to_played(played_frames * synth.frame_size + synth.frame_size - 1)
    assert delivered == {0: 0, 10: 15, 20: 35}[played_frames]
    ref = _twin(synth)
    ref.reply(voice, seed=5, **EOS)
    for ids in (A, B)[: played_frames // N]:
        _take(ref.say(ids, max_frames=N))
    _same_state(synth, ref)
    assert torch.equal(_take(synth.say(NEW, max_frames=N)), _take(ref.say(NEW, max_frames=N)))
    _same_state(synth, ref)


def test_a_stream_stops_once_rolled_back(synth, voice):
    synth.reply(voice, seed=1, **SAMPLED)
    gen = synth.say(A, max_frames=N)
    _take(gen, 4)
    synth.rollback_to_played(2 * synth.frame_size)
    assert list(gen) == [] and synth.frame == 2

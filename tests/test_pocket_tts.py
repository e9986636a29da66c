"""Pocket TTS against transformers (the parity reference) on a tiny random-weight checkpoint in the
released layout, and the capsule properties of its Synthesizer.

Tolerances: 1e-4 on latents and logits; PCM within 1e-4 of the reference's peak amplitude (random
codec weights amplify to a peak near 20, where float32 reassociation alone reaches ~7e-5).
"""
from __future__ import annotations

import math

import pytest
import torch

tf = pytest.importorskip("transformers")

from flashrt.core.session import Session, SessionOptions
from flashrt.models.checkpoint import make_checkpoint
from flashrt.models.loader import load_model
from flashrt.models.protocol import CodecModel, SynthesizerModel
from flashrt.speech import Synthesizer, load_codec, load_synthesizer

TOL = 1e-4
N_FRAMES = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("pocket_tts", "tiny", tmp_path_factory.mktemp("pocket_tts"), seed=0)


@pytest.fixture(scope="module")
def ref(ckpt):
    from transformers import PocketTTSAudioTokenizerModel, PocketTTSForConditionalGeneration
    return (PocketTTSForConditionalGeneration.from_pretrained(ckpt).eval(),
            PocketTTSAudioTokenizerModel.from_pretrained(ckpt / "audio_tokenizer").eval())


@pytest.fixture(scope="module")
def ours(ckpt):
    lm = load_model(ckpt)
    codec, _ = load_codec(ckpt / "audio_tokenizer")
    assert isinstance(lm.net, SynthesizerModel) and isinstance(codec, CodecModel)
    return lm, codec


@pytest.fixture(scope="module")
def prompt(ref):
    """A voice (through the reference encoder: 5 frames of noise PCM) and 7 text ids."""
    model, codec = ref
    g = torch.Generator().manual_seed(1)
    wav = torch.randn(5 * codec.config.frame_size - 17, generator=g) * 0.3
    padded = torch.nn.functional.pad(wav, (0, 17))
    with torch.no_grad():
        voice = codec.encode(padded[None, None]).latents[0]
    c = model.config
    text = torch.randint(0, 256, (7,), generator=g)
    ids = torch.cat([torch.tensor([c.audio_prompt_bos_token_id]),
                     torch.full((voice.shape[0],), c.audio_prompt_token_id), text,
                     torch.tensor([c.audio_bos_token_id])])
    return wav, voice, text, ids


def _hf_generate(model, prompt, **kw):
    _, voice, _, ids = prompt
    with torch.no_grad():
        return model.generate(input_ids=ids[None], audio_prompt_latents=voice[None],
                              return_dict_in_generate=True, output_scores=True, **kw)


def _session(ours, voice_ids, voice, temperature=0.0, **rule):
    """Our model and codec on one session, prefilled with the prompt minus its audio BOS."""
    lm, codec = ours
    s = Session(lm.net, codec.state_specs(0, torch.float32), "cpu", torch.float32, lm.fingerprint,
                SessionOptions(max_seq_len=128))
    lm.net.begin(s.arena, temperature, **{"frames_after_eos": 2, "eos_threshold": 1e9, **rule})
    rows = torch.zeros(len(voice_ids), voice.shape[1])
    rows[1: 1 + voice.shape[0]] = voice
    with torch.no_grad():
        out = s.step(len(voice_ids), lambda ctx: lm.net({"ids": voice_ids, "voice": rows}, ctx,
                                                        s.arena, all_positions=True))
    return s, out


def _frame(ours, s, noise=None):
    net = ours[0].net
    with torch.no_grad():
        return s.step(1, lambda ctx: net({} if noise is None else {"noise": noise}, ctx, s.arena))


def test_prompt_hidden_eos_and_first_latent_match_transformers(ours, ref, prompt):
    """Backbone hidden states of every prompt position, their EOS logits and the zero-noise latent
    of the audio BOS position: the embedding scatter, LayerNorm, rope, attention, flow head."""
    model, _ = ref
    _, voice, _, ids = prompt
    with torch.no_grad():
        want = model(input_ids=ids[None], audio_prompt_latents=voice[None])
        latent = model.sample_latent(want.last_hidden_state[:, -1], torch.zeros(1, voice.shape[1]), 1)
    s, out = _session(ours, ids[:-1], voice)
    first = _frame(ours, s)
    hidden = torch.cat([out["hidden"], first["hidden"]])
    assert (hidden - want.last_hidden_state[0]).abs().max() < TOL
    eos = torch.cat([out["eos_logit"], first["eos_logit"]])
    assert (eos - want.logits[0, :, 0]).abs().max() < TOL
    assert (first["latent"] - latent).abs().max() < TOL
    assert latent.abs().max() > 0.1                      # a non-trivial latent to compare


def test_greedy_latents_over_frames_match_transformers(ours, ref, prompt):
    """Each frame's input is the previous frame's latent (history row p - 1): N greedy frames."""
    model, _ = ref
    _, voice, _, ids = prompt
    want = _hf_generate(model, prompt, do_sample=False, max_new_tokens=N_FRAMES, eos_threshold=1e9,
                        frames_after_eos=2).audio_latents[0]
    s, _ = _session(ours, ids[:-1], voice)
    got = torch.cat([_frame(ours, s)["latent"] for _ in range(N_FRAMES)])
    assert want.shape == (N_FRAMES, voice.shape[1])
    assert (ours[0].net.denormalize(got) - want).abs().max() < TOL
    assert torch.equal(s.arena["tts.latents"][len(ids) - 1: s.position], got)   # the history rows


def _threshold(scores, min_frames):
    """An EOS threshold whose first crossing at or after min_frames is at a later frame k."""
    for k in range(min_frames + 2, len(scores) - 4):
        before = max(scores[min_frames:k])
        if scores[k] > before + 0.05:
            return (scores[k] + before) / 2, k
    raise AssertionError(f"no usable EOS crossing in {scores}")


def test_stop_frame_of_the_eos_rule_matches_transformers(ours, ref, prompt):
    """The threshold rule with its countdown stops at the frame transformers stops at."""
    model, _ = ref
    _, voice, _, ids = prompt
    greedy = _hf_generate(model, prompt, do_sample=False, max_new_tokens=24, eos_threshold=1e9,
                          frames_after_eos=2)
    threshold, k = _threshold([float(x) for x in greedy.scores], 6)
    want = _hf_generate(model, prompt, do_sample=False, max_new_tokens=40, eos_threshold=threshold,
                        frames_after_eos=2, min_frames_before_eos=6)
    n_hf = want.audio_latents.shape[1]
    assert n_hf == k + 3                       # crossing frame k, then 2 more: the rule engaged
    s, _ = _session(ours, ids[:-1], voice, eos_threshold=threshold, frames_after_eos=2,
                    min_frames_before_eos=6)
    done = [bool(_frame(ours, s)["done"]) for _ in range(n_hf + 3)]
    assert done.index(True) + 1 == n_hf


def test_streamed_codec_equals_transformers_one_shot_decode(ckpt, ref, prompt):
    """Frame-by-frame decode (conv contexts, transposed-conv tails, the sliding window: 12 steps,
    crossed after 3 frames) against transformers' decode of all the latents at once."""
    model, codec = ref
    wav, voice, text, _ = prompt
    want_latents = _hf_generate(model, prompt, do_sample=False, max_new_tokens=N_FRAMES,
                                eos_threshold=1e9, frames_after_eos=2).audio_latents
    with torch.no_grad():
        want = codec.decode(want_latents).audio_values[0, 0]
    synth = load_synthesizer(ckpt, max_seq_len=128, fade_in=0.0)    # the raw decoder output
    pcm = torch.cat(list(synth.speak(text, wav, max_frames=N_FRAMES, temperature=0.0,
                                     eos_threshold=1e9)))
    assert pcm.shape == want.shape == (N_FRAMES * codec.config.frame_size,)
    peak = want.abs().max()
    assert (pcm - want).abs().max() <= TOL * max(1.0, float(peak))


def test_voice_encoder_matches_transformers(ours, ref):
    _, codec = ours
    g = torch.Generator().manual_seed(2)
    wav = torch.randn(7 * codec.frame_size + 5, generator=g) * 0.3
    padded = torch.nn.functional.pad(wav, (0, -wav.shape[0] % codec.frame_size))
    with torch.no_grad():
        want = ref[1].encode(padded[None, None]).latents[0]
    got = codec.encode(wav)
    assert got.shape == want.shape == (8, codec.latent_dim)
    assert (got - want).abs().max() <= TOL * max(1.0, float(want.abs().max()))


def test_sampled_latents_match_transformers_given_its_noise(ours, ref, prompt):
    """transformers draws the flow noise from the global torch RNG: replay the same draws."""
    model, _ = ref
    _, voice, _, ids = prompt
    torch.manual_seed(123)
    want = _hf_generate(model, prompt, do_sample=True, temperature=0.5, max_new_tokens=8,
                        eos_threshold=1e9, frames_after_eos=2).audio_latents[0]
    torch.manual_seed(123)
    noise = [torch.randn(1, voice.shape[1]) for _ in range(8)]
    s, _ = _session(ours, ids[:-1], voice, temperature=0.5)
    got = torch.cat([_frame(ours, s, n)["latent"] for n in noise])
    assert (ours[0].net.denormalize(got) - want).abs().max() < TOL


def _collect(gen, n):
    return torch.stack([next(gen) for _ in range(n)])


@pytest.fixture(scope="module")
def synth(ckpt):
    return load_synthesizer(ckpt, max_seq_len=128)


def test_mid_utterance_capsule_continues_bitwise(synth, prompt):
    """Sampled frames after a restore (here and in a fork) equal those of the run that went on:
    backbone K/V, latent history, noise RNG, EOS counters and every codec buffer come back."""
    wav, _, text, _ = prompt
    frames = synth.speak(text, wav, max_frames=40, temperature=0.7, seed=3, eos_threshold=1e9)
    _collect(frames, 5)
    cap = synth.snapshot()
    after = _collect(synth.frames(6), 6)
    state = {n: synth.arena[n].clone() for n in synth._codec_buffers + ["tts.rng", "tts.frame"]}
    synth.restore(cap)
    again = _collect(synth.frames(6), 6)
    assert torch.equal(after, again)
    assert all(torch.equal(synth.arena[n], v) for n, v in state.items())
    fork = Synthesizer(synth.net, synth.codec, {k: v for k, v in synth.fingerprint.items()
                                                if k != "layout"}, 128)
    fork.restore(cap)
    assert torch.equal(_collect(fork.frames(6), 6), after)
    assert any(float(state[n].abs().max()) > 0 for n in synth._codec_buffers if ".tail" in n)


def test_seeded_sampling_reproducible_and_forks_with_other_seeds_differ(synth, prompt):
    wav, _, text, _ = prompt
    runs = [_collect(synth.speak(text, wav, max_frames=8, seed=7, eos_threshold=1e9), 8)
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    _collect(synth.speak(text, wav, max_frames=20, seed=7, eos_threshold=1e9), 3)
    forks = []
    for seed in (11, 11, 12):
        f = synth.fork()
        f.reseed(seed)
        forks.append(_collect(f.frames(4), 4))
    assert torch.equal(forks[0], forks[1])
    assert (forks[0] - forks[2]).abs().max() > 1e-3
    greedy = [_collect(synth.speak(text, wav, max_frames=4, seed=s, temperature=0.0), 4)
              for s in (1, 2)]
    assert torch.equal(greedy[0], greedy[1])               # temperature 0 ignores the seed


def test_voice_capsule_then_text_is_bitwise_the_cold_path(ckpt, synth, prompt):
    """make_voice once, another utterance in between, then the voice capsule plus text: the PCM
    equals a fresh synthesizer's cold path (encode, prefill voice and text, frames)."""
    wav, _, text, _ = prompt
    voice = synth.make_voice(wav)
    _collect(synth.speak(torch.tensor([5, 6, 7]), max_frames=10, seed=1), 4)      # dirty the state
    warm = torch.cat(list(synth.speak(text, voice, max_frames=12, seed=5)))
    cold_synth = load_synthesizer(ckpt, max_seq_len=128)
    cold = torch.cat(list(cold_synth.speak(text, wav, max_frames=12, seed=5)))
    assert warm.shape == cold.shape and warm.shape[0] >= 7 * cold_synth.frame_size
    assert torch.equal(warm, cold)
    assert voice.position == 1 + math.ceil(wav.shape[0] / synth.frame_size)


def test_real_shape_layout_matches_transformers():
    """At the released shape (on the meta device): our parameter names and shapes are the
    checkpoint's, the counts are the released ones (89.5M with heads; codec 9.7M + 10.3M)."""
    from transformers import PocketTTSAudioTokenizerModel, PocketTTSForConditionalGeneration
    from flashrt.models import pocket_tts, pocket_tts_codec
    from flashrt.models.pocket_tts_checkpoint import build_configs
    tts_cfg, codec_cfg = build_configs("real")
    for hf_cls, cfg, mod in ((PocketTTSForConditionalGeneration, tts_cfg, pocket_tts),
                             (PocketTTSAudioTokenizerModel, codec_cfg, pocket_tts_codec)):
        with torch.device("meta"):
            hf = hf_cls(cfg)
            net = mod.Model(mod.CONFIG.from_hf(cfg.to_dict()))
        want = {k: tuple(v.shape) for k, v in hf.state_dict().items() if net.map_weight_name(k)}
        assert {k: tuple(v.shape) for k, v in net.state_dict().items()} == want
        n = sum(v.numel() for k, v in net.state_dict().items() if k.startswith(("model.", "flow", "eos")))
        if mod is pocket_tts:
            assert abs(n / 1e6 - 89.45) < 0.01
        else:
            enc = sum(v.numel() for k, v in net.state_dict().items() if k.startswith("encoder."))
            dec = sum(v.numel() for k, v in net.state_dict().items() if k.startswith(("decoder.", "latent_proj")))
            assert abs(enc / 1e6 - 9.75) < 0.01 and abs(dec / 1e6 - 10.31) < 0.01


def test_synthesizer_refuses_mismatched_models(ours):
    lm, codec = ours
    with pytest.raises(TypeError, match="SynthesizerModel"):
        Synthesizer(codec, codec)

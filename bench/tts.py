"""Speech out (Pocket TTS, the released shape): time to first audio from a reference WAV, from
stored voice latents and from a voice capsule; per-sentence time to first audio across a
5-sentence reply; the real-time factor of streaming synthesis (backbone + flow, codec); barge-in
(ready at "prompt + played frames" by rollback against re-prefilling); capsule sizes. flashrt's
Synthesizer against transformers' PocketTTS on the same weights, in one run.

Both systems load the same random-weight checkpoint (written by transformers' own classes,
`make_checkpoint("pocket_tts", size)`: the model at the root, its codec in audio_tokenizer/,
cached in ~/.cache/flashrt/checkpoints) and use the same flow noise: flashrt draws it from its
counter RNG (seeded), and the same draws are handed to transformers explicitly (its generate
would take them from the global torch RNG). The reference voice is the first 5 s of
tests/data/speech (espeak speech, 16 kHz) resampled to 24 kHz.

  flashrt        Synthesizer: make_voice(pcm | latents=) -> voice capsule; reply(voice) + say(ids)
                 streams PCM frame by frame, the codec decoding each frame as it is made
  transformers   its model's forward with its DynamicCache (the loop generate runs, with the noise
                 passed in: checked against generate itself), flow head by sample_latent, the codec's
                 decode; its decoder has no streaming state for the convolutions, so the audio of a
                 stream is decoded once at the end (time to first audio decodes the first frame)

Identity checks: the same first frame from WAV, latents and capsule (bitwise), flashrt's split
frame loop equal to frames(), transformers' loop equal to its generate, flashrt against
transformers (latents and PCM, tolerances), rollback equal to regenerating the played frames.

    python bench/tts.py                 # the released shape, 2 threads, float32
    python bench/tts.py --quick         # tiny checkpoint, 1 repeat: proves the script runs
    flashrt bench tts --frames 50
"""
from __future__ import annotations

import copy
import os
import sys
import time
import wave
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

ACCEPT_RTF, ACCEPT_TTFA_MS, ACCEPT_WAV_RATIO = 0.3, 150.0, 4.0      # the issue's acceptance lines
TEXT_TOKENS = 20                                                    # the acceptance's sentence
SENTENCE_TOKENS = (14, 20, 9, 17, 12)                               # a 5-sentence reply
DATA = C.ROOT / "tests" / "data" / "speech"
KNOBS = dict(temperature=0.7, eos_threshold=1e9)    # EOS never fires: every run makes its frames
SEED = 3


def parse(argv):
    p = C.base_parser("bench/tts.py", "Speech out (Pocket TTS): time to first audio, streaming "
                      "real-time factor, barge-in rollback, capsules; flashrt vs transformers")
    p.add_argument("--size", default=None, help="real (default: the released shape) | tiny (--quick)")
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default: a cached random one)")
    p.add_argument("--frames", type=int, default=None, help="frames per real-time-factor run "
                   "(default 40 = 3.2 s of audio; --quick 8)")
    p.add_argument("--voice-s", type=float, default=None, help="seconds of reference voice (default 5; "
                   "tiny: 0.2, its codec's frames are 4 ms)")
    p.add_argument("--made", type=int, default=None, help="frames made before the barge-in (default 24; "
                   "--quick 8)")
    p.add_argument("--played", type=int, default=None, help="frames of them played (default 13; --quick 5)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--plot", default=None, help="PNG path (default next to the JSON)")
    a = p.parse_args(argv)
    a.threads = a.threads or 2
    C.setup(a)
    a.size = a.size or ("tiny" if a.quick else "real")
    a.repeats = a.repeats or (1 if a.quick else 5)
    a.warmup = a.warmup if a.warmup is not None else 1
    a.frames = a.frames or (8 if a.quick else 40)
    a.voice_s = a.voice_s or (0.2 if a.size == "tiny" else 5.0)
    a.played = a.played or (5 if a.quick else 13)
    a.made = a.made or (8 if a.quick else 24)
    if not 0 < a.played < a.made:
        raise SystemExit(f"--played {a.played}: expected 1 to {a.made - 1} (frames made: {a.made})")
    return a


def reference_wav(sr: int, seconds: float):
    """The test speech (16 kHz), joined, resampled to sr by linear interpolation, cut to seconds."""
    import numpy as np
    import torch
    parts = []
    for n in ("short_pause", "two_utterances"):
        with wave.open(str(DATA / f"{n}.wav")) as w:
            parts.append(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2"))
    x = np.concatenate(parts).astype(np.float32) / 32768.0
    t = np.arange(int(len(x) * sr / 16000)) * (16000 / sr)
    y = np.interp(t, np.arange(len(x)), x).astype(np.float32)[: int(seconds * sr)]
    return torch.from_numpy(y)


def text_ids(n: int, limit: int, seed: int) -> list:
    """n random text ids below `limit` (the model's first audio placeholder id)."""
    return C.random_ids(n, limit, seed)


def noise_draws(seed: int, n: int, dim: int):
    """The n (1, dim) standard normal draws flashrt's frames take after reply(seed=seed)."""
    import torch

    from flashrt.core.rng import normal, seed_rng
    rng = torch.zeros(2, dtype=torch.int64)
    seed_rng(rng, seed)
    return [normal(rng, (1, dim)) for _ in range(n)]


def rel_diff(x, y) -> float:
    """max |x - y| over max(1, max |y|): PCM of random codecs peaks far above 1."""
    n = min(x.shape[0], y.shape[0])
    return float((x[:n].float() - y[:n].float()).abs().max() / max(1.0, float(y[:n].abs().max())))


# ---- transformers ----------------------------------------------------------------------------
class HF:
    """transformers' PocketTTS on the checkpoint: the calls its generate makes, noise passed in."""

    def __init__(self, path: Path, a, frame_size: int, sample_rate: int):
        import transformers
        from transformers import (PocketTTSAudioTokenizerModel, PocketTTSFeatureExtractor,
                                  PocketTTSForConditionalGeneration)
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        dt = C.torch_dtype(a.dtype)
        self.model = PocketTTSForConditionalGeneration.from_pretrained(str(path), dtype=dt).to(a.device).eval()
        self.codec = PocketTTSAudioTokenizerModel.from_pretrained(
            str(path / "audio_tokenizer"), dtype=dt).to(a.device).eval()
        self.fe = PocketTTSFeatureExtractor(frame_size=frame_size, pad_to_multiple_of=frame_size,
                                            sampling_rate=sample_rate)
        self.sr, self.cfg, self.version = sample_rate, self.model.config, transformers.__version__
        self.device = a.device
        self.scale = KNOBS["temperature"] ** 0.5

    def encode(self, wav):
        """Reference PCM -> voice latents (F, latent), cut as its feature extractor cuts them."""
        f = self.fe(wav, sampling_rate=self.sr)
        enc = self.codec.encode(f["input_values"].to(self.device, self.codec.dtype), f["padding_mask"].to(self.device))
        return enc.latents[0][enc.latents_mask[0].bool()]

    def ids(self, text=(), n_voice: int = 0, bos: bool = True):
        import torch
        c = self.cfg
        head = [c.audio_prompt_bos_token_id] + [c.audio_prompt_token_id] * n_voice if n_voice else []
        return torch.tensor(head + list(text) + ([c.audio_bos_token_id] if bos else []), device=self.device)

    def forward(self, ids, cache=None, voice=None, latents=None):
        """(last hidden (1, hidden), cache) after ids (voice / latents at their placeholders)."""
        kw = {} if voice is None else {"audio_prompt_latents": voice[None]}
        if latents is not None:
            kw["audio_latents"] = latents[None]
        out = self.model(input_ids=ids[None], cache=cache, use_cache=True, **kw)
        return out.last_hidden_state[:, -1], out.cache

    def frames(self, cond, cache, noise: list, n: int):
        """n frames from the hidden state of the audio BOS position: (latents (n, latent), cache)."""
        import torch
        out, lid = [], torch.tensor([self.cfg.audio_latent_token_id], device=self.device)
        for i in range(n):
            lat = self.model.sample_latent(cond, noise[i].to(cond.device, cond.dtype) * self.scale, 1)
            out.append(lat)
            if i + 1 < n:
                cond, cache = self.forward(lid, cache, latents=lat)
        return torch.cat(out), cache

    def decode(self, latents):
        """Normalised latents (F, latent) -> PCM (F * frame_size,), one shot."""
        lat = self.model.denormalize_latents(latents)[None].to(self.codec.dtype)
        return self.codec.decode(lat).audio_values[0, 0]

    def first_audio(self, ids, noise, cache=None, voice=None):
        cond, _ = self.forward(ids, cache, voice)
        lat, _ = self.frames(cond, None, noise, 1)
        return self.decode(lat)

    def loop_vs_generate(self, ids, voice, n: int) -> float:
        """max |diff| of this loop's n latents against transformers' own generate, both on the
        global RNG's draws from one seed (generate takes one randn(1, latent) per frame)."""
        import torch
        dev, dt = torch.device(self.device), self.model.dtype
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(0)            # generate's draws: randn(1, latent) on its device, in its dtype
            noise = [torch.randn(1, self.cfg.latent_dim, device=dev, dtype=dt) for _ in range(n)]
            cond, cache = self.forward(ids, voice=voice)
            mine = self.model.denormalize_latents(self.frames(cond, cache, noise, n)[0])
            torch.manual_seed(0)
            out = self.model.generate(input_ids=ids[None], audio_prompt_latents=voice[None], do_sample=True,
                                      temperature=KNOBS["temperature"], max_new_tokens=n, eos_threshold=1e9,
                                      frames_after_eos=2, return_dict_in_generate=True)
        return float((out.audio_latents[0] - mine).abs().max())


# ---- sections --------------------------------------------------------------------------------
def first_pcm(synth, voice, ids):
    synth.reply(voice, seed=SEED, **KNOBS)
    return next(synth.say(ids))


def ttfa_section(a, synth, hf, wav, text):
    """Reference WAV, stored latents, voice capsule: each to the first frame's PCM."""
    import torch
    latents = synth.codec.encode(synth.voice_rules.prepare(wav, synth.sample_rate).to(synth.device))
    voice = synth.make_voice(wav)
    noise = noise_draws(SEED, 1, synth.net.latent_dim)
    got = {"wav": first_pcm(synth, synth.make_voice(wav), text),
           "latents": first_pcm(synth, synth.make_voice(latents=latents), text),
           "capsule": first_pcm(synth, voice, text)}
    cases = {"flashrt wav": C.Case(lambda: first_pcm(synth, synth.make_voice(wav), text)),
             "flashrt latents": C.Case(lambda: first_pcm(synth, synth.make_voice(latents=latents), text)),
             "flashrt capsule": C.Case(lambda: first_pcm(synth, voice, text))}
    ident = {"same_first_frame_wav_latents_capsule": all(torch.equal(got["capsule"], v) for v in got.values())}
    if hf is not None:
        hf_lat = hf.encode(wav)
        ids_cold = hf.ids(text, hf_lat.shape[0])
        _, vcache = hf.forward(hf.ids(n_voice=hf_lat.shape[0], bos=False), voice=hf_lat)
        ids_text = hf.ids(text)
        cases.update({
            "transformers wav": C.Case(lambda: hf.first_audio(ids_cold, noise, voice=hf.encode(wav))),
            "transformers latents": C.Case(lambda: hf.first_audio(ids_cold, noise, voice=hf_lat)),
            "transformers voice cache": C.Case(lambda: hf.first_audio(ids_text, noise, cache=copy.deepcopy(vcache)))})
        ref = hf.first_audio(ids_cold, noise, voice=hf_lat)
        ident.update(voice_latents_rel_diff=rel_diff(latents, hf_lat),
                     first_frame_rel_diff=rel_diff(got["capsule"], ref),
                     voice_cache_first_frame_rel_diff=rel_diff(
                         hf.first_audio(ids_text, noise, cache=copy.deepcopy(vcache)), ref))
    with torch.no_grad():
        st = C.measure_alt(cases, a.repeats, a.warmup, a.device, desc="time to first audio")
    return {"stats": st, "identity": ident, "voice_frames": int(latents.shape[0]),
            "voice_seconds": wav.shape[0] / synth.sample_rate, "text_tokens": len(text)}, voice, latents


def sentences_section(a, synth, hf, voice, latents, vocab):
    """A 5-sentence reply: flashrt starts each from the voice capsule; transformers re-prefills
    the voice for each (its split_text path), or copies a voice cache."""
    import torch
    sents = [text_ids(n, vocab, 100 + i) for i, n in enumerate(SENTENCE_TOKENS)]
    per = 2                          # frames made per sentence before the next one starts
    noise = noise_draws(SEED, 1, synth.net.latent_dim)
    rows = {k: [C.Stats() for _ in sents] for k in ("flashrt", "transformers re-prefill", "transformers voice cache")}
    if hf is not None:
        _, vcache = hf.forward(hf.ids(n_voice=latents.shape[0], bos=False), voice=latents)

    def fl():
        synth.reply(voice, seed=SEED, **KNOBS)
        out = []
        for s in sents:
            t0 = time.perf_counter()
            gen = synth.say(s, max_frames=per)
            next(gen)
            C.sync(a.device)
            out.append(time.perf_counter() - t0)
            list(gen)
        return out

    def tf(cached: bool):
        out = []
        for s in sents:
            t0 = time.perf_counter()
            if cached:
                hf.first_audio(hf.ids(s), noise, cache=copy.deepcopy(vcache))
            else:
                hf.first_audio(hf.ids(s, latents.shape[0]), noise, voice=latents)
            C.sync(a.device)
            out.append(time.perf_counter() - t0)
        return out
    systems = {"flashrt": fl}
    if hf is not None:
        systems.update({"transformers re-prefill": lambda: tf(False), "transformers voice cache": lambda: tf(True)})
    names = list(systems)
    with torch.no_grad():
        for r in C.progress(range(a.warmup + a.repeats), desc="5-sentence reply"):
            for name in (names if r % 2 == 0 else names[::-1]):
                times = systems[name]()
                if r >= a.warmup:
                    for st, t in zip(rows[name], times):
                        st.samples.append(t)
    return {"sentence_tokens": list(SENTENCE_TOKENS), "frames_per_sentence": per,
            "stats": {k: v for k, v in rows.items() if v[0].samples}}


def rtf_section(a, synth, hf, voice, latents, text):
    """N frames streamed after the prompt: flashrt's frames() (total), its split loop (backbone +
    flow + EOS, codec: same PCM) and transformers' loop with its one-shot decode."""
    import torch
    net, codec, ar, N = synth.net, synth.codec, synth.arena, a.frames
    secs = N * synth.frame_size / synth.sample_rate
    noise = noise_draws(SEED, N, net.latent_dim)
    split = {"backbone": C.Stats(), "codec": C.Stats()}
    out = {}

    def start():
        synth.reply(voice, seed=SEED, **KNOBS)
        out["gen"] = synth.say(text, max_frames=N)

    def split_run():
        tb = tc = 0.0
        pcm = []
        for _ in range(N):
            def body(ctx):
                nonlocal tb, tc
                t0 = time.perf_counter()
                r = net({}, ctx, ar)
                C.sync(a.device)
                t1 = time.perf_counter()
                p = codec({"latent": net.denormalize(r["latent"])}, ctx, ar)["pcm"][0]
                C.sync(a.device)
                tc += time.perf_counter() - t1
                tb += t1 - t0
                return p
            pcm.append(synth.session.step(1, body))
        return tb, tc, torch.cat(pcm)

    def split_post(r):
        split["backbone"].samples.append(r[0])
        split["codec"].samples.append(r[1])
    cases = {"flashrt": C.Case(lambda: torch.cat(list(out["gen"])), setup=start),
             "flashrt split": C.Case(split_run, setup=start, post=split_post)}
    ident = {}
    with torch.no_grad():
        start()
        start_pos = synth.session.position
        whole = torch.cat(list(out["gen"]))
        fl_lat = ar[net.history][start_pos: start_pos + N].clone()
        start()
        ident["split_equals_frames"] = bool(torch.equal(split_run()[2], whole))
        if hf is not None:
            ids_text, ids_bos = hf.ids(text, bos=False), hf.ids()
            _, vcache = hf.forward(hf.ids(n_voice=latents.shape[0], bos=False), voice=latents)
            hf_t = {"backbone": C.Stats(), "codec": C.Stats()}
            pre = {}

            def hf_setup():
                pre["cache"] = hf.forward(ids_text, copy.deepcopy(vcache))[1]

            def hf_run():           # as flashrt's frames: the first runs the backbone on the BOS latent
                t0 = time.perf_counter()
                lat, _ = hf.frames(*hf.forward(ids_bos, pre["cache"]), noise, N)
                C.sync(a.device)
                t1 = time.perf_counter()
                pcm = hf.decode(lat)
                return t1 - t0, time.perf_counter() - t1, lat, pcm

            def hf_post(r):
                hf_t["backbone"].samples.append(r[0])
                hf_t["codec"].samples.append(r[1])
            cases["transformers"] = C.Case(hf_run, setup=hf_setup, post=hf_post)
            hf_setup()
            _, _, hl, hp = hf_run()
            n_gen = min(N, 4)
            ident.update(latents_max_diff=float((fl_lat - hl).abs().max()),
                         latents_first_frame_max_diff=float((fl_lat[0] - hl[0]).abs().max()),
                         pcm_rel_diff=rel_diff(whole, hp),
                         transformers_loop_vs_generate_max_diff=hf.loop_vs_generate(
                             hf.ids(text, latents.shape[0]), latents, n_gen),
                         transformers_loop_vs_generate_frames=n_gen)
        st = C.measure_alt(cases, a.repeats, a.warmup, a.device, desc="real-time factor")
    res = {"frames": N, "audio_seconds": secs, "flashrt": st["flashrt"], "flashrt_split": st["flashrt split"],
           "flashrt_backbone": split["backbone"], "flashrt_codec": split["codec"], "identity": ident}
    res["flashrt_rtf"] = st["flashrt"].median / secs
    if hf is not None:
        res.update(transformers=st["transformers"], transformers_backbone=hf_t["backbone"],
                   transformers_codec=hf_t["codec"], transformers_rtf=st["transformers"].median / secs,
                   ratio=C.ratio(st["flashrt"], st["transformers"]))
    return res


def bargein_section(a, synth, hf, voice, latents, text):
    """made frames streamed, played + 1/3 frame heard: rollback_to_played against re-prefilling
    prompt + played frames (flashrt's one-pass replay of their latents; transformers' forward
    over them from a voice cache) and against regenerating them."""
    import torch
    net, codec, ar, P, M = synth.net, synth.codec, synth.arena, a.played, a.made
    heard = P * synth.frame_size + synth.frame_size // 3
    keep = {}

    def made():
        synth.reply(voice, seed=SEED, **KNOBS)
        gen = synth.say(text, max_frames=M)
        keep["start"] = synth.session.position
        list(gen)
        keep["lat"] = ar[net.history][keep["start"]: keep["start"] + P].clone()

    def regenerate():
        synth.reply(voice, seed=SEED, **KNOBS)
        gen = synth.say(text, max_frames=M)
        for _ in range(P):
            next(gen)

    def reprefill():
        synth.start(text, voice, seed=SEED, **KNOBS)
        lat = keep["lat"]
        synth.session.step(P, lambda ctx: (net({"frames": lat}, ctx, ar),
                                           codec({"latent": net.denormalize(lat)}, ctx, ar)))

    def state():
        cap = synth.snapshot()
        return {e.name: cap.view(e.name).clone() for e in cap.entries}
    with torch.no_grad():
        made()
        synth.rollback_to_played(heard)
        rolled = state()
        regenerate()
        regen = state()
        reprefill()
        re = state()
        same = all(torch.equal(rolled[n], regen[n]) for n in rolled if n != "meta.position")
        kv = [n for n in rolled if n.endswith((".attn.k", ".attn.v"))]
        cod = [n for n in rolled if n.startswith("codec.") and n != "codec.position"]
        ident = {"rollback_equals_regenerated": same,
                 "reprefill_kv_max_diff": max(float((rolled[n] - re[n]).abs().max()) for n in kv),
                 "reprefill_codec_max_diff": max(float((rolled[n] - re[n]).abs().max()) for n in cod),
                 "reprefill_latents_equal": bool(torch.equal(rolled[net.history], re[net.history]))}
        cases = {"rollback_to_played": C.Case(lambda: synth.rollback_to_played(heard), setup=made),
                 "re-prefill prompt + played": C.Case(reprefill, setup=made),
                 "regenerate played frames": C.Case(regenerate, setup=made)}
        if hf is not None:
            _, vcache = hf.forward(hf.ids(n_voice=latents.shape[0], bos=False), voice=latents)
            ids = torch.cat([hf.ids(text), torch.full((P - 1,), hf.cfg.audio_latent_token_id, device=hf.device)])

            def hf_reprefill():
                hf.forward(ids, copy.deepcopy(vcache), latents=keep["lat"][:-1])
                return hf.decode(keep["lat"])
            cases["transformers re-prefill"] = C.Case(hf_reprefill, setup=made)
        st = C.measure_alt(cases, a.repeats, a.warmup, a.device, desc="barge-in")
    return {"made_frames": M, "played_frames": P, "heard_samples": heard, "stats": st, "identity": ident}


def capsule_section(a, synth, voice, text):
    import torch
    with torch.no_grad():
        synth.reply(voice, seed=SEED, **KNOBS)
        gen = synth.say(text, max_frames=a.made)
        for _ in range(a.played):
            next(gen)
        mid = synth.snapshot()
        delta = synth.session.snapshot(parent=voice)
        pre = synth.session.empty_capsule()
        st = C.measure({"restore voice": C.Case(lambda: synth.restore(voice), inner=5),
                        "snapshot mid-utterance (into)": C.Case(lambda: synth.snapshot(into=pre), inner=5)},
                       max(a.repeats, 3), 1, a.device, desc="capsules")
    kinds = {}
    for e in mid.entries:
        kinds[e.kind] = kinds.get(e.kind, 0) + e.nbytes
    codec = sum(e.nbytes for e in mid.entries if e.name.startswith("codec."))
    return {"voice_bytes": voice.nbytes, "voice_positions": voice.position, "mid_bytes": mid.nbytes,
            "mid_positions": mid.position, "mid_delta_bytes": delta.nbytes, "codec_bytes": codec,
            "mid_by_kind": kinds, "stats": st}


# ---- report ----------------------------------------------------------------------------------
def tables(a, tt, sen, rtf, bi, cap, params, hf_version, load_note):  # noqa: C901
    ms = lambda s: s.ms(1) if s is not None else "-"  # noqa: E731
    st, hf = tt["stats"], "transformers wav" in tt["stats"]
    acc = C.Table(f"Acceptance (issue): {a.size} shape, {a.threads} threads, {a.dtype}",
                  ["line", "target", "measured", "holds"])
    acc.add("streaming real-time factor, flashrt (backbone + flow + codec)", f"<= {ACCEPT_RTF}",
            f"{rtf['flashrt_rtf']:.3f}", "yes" if rtf["flashrt_rtf"] <= ACCEPT_RTF else "no")
    if rtf.get("ratio") is not None:
        acc.add("faster than transformers on the same weights (same run)", "flashrt/transformers < 1",
                C.fmt_ratio(rtf["ratio"]), "yes" if rtf["ratio"] < 1 else "no")
    cap_ms = st["flashrt capsule"].median * 1e3
    acc.add(f"time to first audio from a voice capsule, {tt['text_tokens']}-token sentence",
            f"<= {ACCEPT_TTFA_MS:.0f} ms", f"{cap_ms:.1f} ms", "yes" if cap_ms <= ACCEPT_TTFA_MS else "no")
    r = C.ratio(st["flashrt wav"], st["flashrt capsule"])
    acc.add("from the reference WAV / from the voice capsule", f">= {ACCEPT_WAV_RATIO:.0f}x",
            C.fmt_ratio(r), "yes" if r >= ACCEPT_WAV_RATIO else "no")
    acc.notes += [C.RANDOM_NOTE + f"; {params / 1e6:.1f}M parameters (backbone, heads, codec)",
                  f"measured on a shared {os.cpu_count()}-core machine (load average {load_note}); "
                  "the systems alternate round by round, so compare ratios from this run"]

    t = C.Table(f"Time to first audio ({a.device}, {a.dtype}, {a.threads} threads; ms)",
                ["start from", "flashrt", "transformers", "flashrt/tf", "flashrt / from capsule"])
    for k, lab, tk in (("wav", f"reference WAV ({tt['voice_seconds']:.1f} s): encode + prefill voice and text + frame",
                        "transformers wav"),
                       ("latents", f"stored voice latents ({tt['voice_frames']} frames): prefill voice and text + frame",
                        "transformers latents"),
                       ("capsule", "voice capsule: restore + prefill text + frame", "transformers voice cache")):
        f, h = st[f"flashrt {k}"], st.get(tk)
        t.add(lab, ms(f), ms(h), C.fmt_ratio(C.ratio(f, h)), C.fmt_ratio(C.ratio(f, st["flashrt capsule"])))
    idn = tt["identity"]
    t.notes += [f"a {tt['text_tokens']}-token sentence; the first frame is backbone + flow head + "
                "codec (80 ms of audio); transformers' row 3 is deepcopy of its voice-prefix cache "
                "(DynamicCache) + the text",
                "same first frame from WAV, latents and capsule (flashrt, bitwise): "
                + ("yes" if idn["same_first_frame_wav_latents_capsule"] else "NO")]
    if hf:
        t.notes.append(f"flashrt against transformers {hf_version}: voice latents {idn['voice_latents_rel_diff']:.1e}, "
                       f"first frame PCM {idn['first_frame_rel_diff']:.1e} (max |diff| over max(1, peak)); "
                       f"transformers' voice cache path against its cold path {idn['voice_cache_first_frame_rel_diff']:.1e}")

    s = C.Table("Per-sentence time to first audio across a 5-sentence reply (ms)",
                ["sentence", "tokens", "flashrt (voice capsule)", "transformers re-prefill voice",
                 "transformers voice cache", "flashrt/re-prefill"])
    for i, n in enumerate(sen["sentence_tokens"]):
        f = sen["stats"]["flashrt"][i]
        h1 = sen["stats"].get("transformers re-prefill", [None] * 5)[i]
        h2 = sen["stats"].get("transformers voice cache", [None] * 5)[i]
        s.add(i + 1, n, ms(f), ms(h1), ms(h2), C.fmt_ratio(C.ratio(f, h1)))
    s.notes += [f"each sentence: say() to its first PCM frame; {sen['frames_per_sentence']} frames are made "
                "before the next sentence starts (flashrt then keeps the sentence's end as a delta "
                "capsule and restores the voice); transformers: each chunk a new prompt with the voice "
                "latents (its processor's split_text path), or a deepcopy of a voice-prefix cache"]

    rt = C.Table(f"Streaming synthesis: {rtf['frames']} frames ({rtf['audio_seconds']:.2f} s of audio; ms "
                 "per run, RTF = time / audio time)",
                 ["system", "backbone + flow + EOS", "codec", "total", "per frame", "RTF"])
    per = lambda x: f"{x.median * 1e3 / rtf['frames']:.1f}"  # noqa: E731
    rt.add("flashrt frames()", "-", "-", ms(rtf["flashrt"]), per(rtf["flashrt"]), f"{rtf['flashrt_rtf']:.3f}")
    rt.add("flashrt, split loop", ms(rtf["flashrt_backbone"]), ms(rtf["flashrt_codec"]), ms(rtf["flashrt_split"]),
           per(rtf["flashrt_split"]), f"{rtf['flashrt_split'].median / rtf['audio_seconds']:.3f}")
    if "transformers" in rtf:
        rt.add("transformers (codec one shot)", ms(rtf["transformers_backbone"]), ms(rtf["transformers_codec"]),
               ms(rtf["transformers"]), per(rtf["transformers"]), f"{rtf['transformers_rtf']:.3f}")
    idn = rtf["identity"]
    rt.notes += ["flashrt streams: the codec decodes each frame as it is made (16 codec transformer "
                 "steps of 200 Hz per frame in one pass); transformers' decoder keeps no convolution "
                 "state between calls, so its audio is decoded once after the last frame",
                 "split loop: the same frames with a timer between the model and the codec; same PCM as "
                 "frames(): " + ("yes" if idn["split_equals_frames"] else "NO")]
    if "latents_max_diff" in idn:
        rt.notes.append(f"flashrt against transformers (same noise): latents max |diff| {idn['latents_max_diff']:.1e} "
                        f"(first frame {idn['latents_first_frame_max_diff']:.1e}), PCM {idn['pcm_rel_diff']:.1e} "
                        f"of max(1, peak); transformers' loop against its own generate over "
                        f"{idn['transformers_loop_vs_generate_frames']} frames: {idn['transformers_loop_vs_generate_max_diff']:.1e}")

    b = C.Table(f"Barge-in: {bi['made_frames']} frames made, {bi['played_frames']} and a third played; ready "
                "at prompt + played frames (ms)", ["path", "ms", "vs rollback"])
    roll = bi["stats"]["rollback_to_played"]
    for k, v in bi["stats"].items():
        b.add(k, ms(v), C.fmt_ratio(C.ratio(v, roll)))
    idn = bi["identity"]
    b.notes += ["rollback_to_played: the sentence's last codec mark + re-decoding the kept latents since, "
                "RNG and EOS countdown from the frame log; re-prefill: restore the voice capsule, prefill "
                "the text, one pass over the played latents (backbone and codec, no sampling); "
                "regenerate: the played frames made again from the voice capsule",
                f"rollback equals regenerating (every buffer, bitwise): {'yes' if idn['rollback_equals_regenerated'] else 'NO'}; "
                f"re-prefill against rollback: K/V max |diff| {idn['reprefill_kv_max_diff']:.1e}, codec state "
                f"{idn['reprefill_codec_max_diff']:.1e} (one pass sums in another order), latents "
                + ("equal" if idn["reprefill_latents_equal"] else "DIFFER")]

    c = C.Table("Capsules", ["capsule", "positions", "bytes"])
    c.add("voice (prompt BOS + voice latents)", cap["voice_positions"], C.fmt_bytes(cap["voice_bytes"]))
    c.add(f"mid-utterance ({a.played} frames into the sentence)", cap["mid_positions"], C.fmt_bytes(cap["mid_bytes"]))
    c.add("mid-utterance as a delta over the voice", cap["mid_positions"], C.fmt_bytes(cap["mid_delta_bytes"]))
    c.notes += ["codec decoder state (fixed size, in every capsule): " + C.fmt_bytes(cap["codec_bytes"])
                + "; by kind: " + ", ".join(f"{k} {C.fmt_bytes(v)}" for k, v in cap["mid_by_kind"].items()),
                "restore of the voice capsule " + cap["stats"]["restore voice"].ms(3) + " ms; snapshot(into=) "
                "mid-utterance " + cap["stats"]["snapshot mid-utterance (into)"].ms(3) + " ms"]
    return [acc, t, s, rt, b, c]


def plot(tt, rtf, path, a):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed ({path} not written)")
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    st, keys = tt["stats"], ("wav", "latents", "capsule")
    tf_keys = ("transformers wav", "transformers latents", "transformers voice cache")
    w = 0.38
    ax1.bar([x - w / 2 for x in range(3)], [st[f"flashrt {k}"].median * 1e3 for k in keys], w, label="flashrt")
    if tf_keys[0] in st:
        ax1.bar([x + w / 2 for x in range(3)], [st[k].median * 1e3 for k in tf_keys], w, label="transformers")
    ax1.axhline(ACCEPT_TTFA_MS, color="C2", lw=0.8, ls=":", label=f"{ACCEPT_TTFA_MS:.0f} ms")
    ax1.set_xticks(range(3), ["reference WAV", "voice latents", "voice capsule / cache"])
    ax1.set_ylabel("ms to first audio (median)")
    ax1.set_title("time to first audio", fontsize=9)
    ax1.legend(fontsize=7)
    names, bb, cc = ["flashrt"], [rtf["flashrt_backbone"].median], [rtf["flashrt_codec"].median]
    if "transformers" in rtf:
        names.append("transformers")
        bb.append(rtf["transformers_backbone"].median)
        cc.append(rtf["transformers_codec"].median)
    secs = rtf["audio_seconds"]
    ax2.bar(names, [x / secs for x in bb], label="backbone + flow + EOS")
    ax2.bar(names, [x / secs for x in cc], bottom=[x / secs for x in bb], label="codec")
    ax2.axhline(ACCEPT_RTF, color="C2", lw=0.8, ls=":", label=f"RTF {ACCEPT_RTF}")
    ax2.set_ylabel("real-time factor (median)")
    ax2.set_title("streaming synthesis", fontsize=9)
    ax2.legend(fontsize=7)
    fig.suptitle(f"Pocket TTS {a.size} shape, {a.device} {a.dtype}, {a.threads} threads (random weights)",
                 fontsize=9)
    C.save_figure(fig, path)
    return path


def main(argv=None) -> int:
    a = parse(argv)
    import torch
    info = C.banner("tts", a)
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    ckpt = Path(a.ckpt) if a.ckpt else C.cached_checkpoint("pocket_tts", a.size)
    from flashrt.speech import load_synthesizer
    # fade_in 0: the raw decoder output, as transformers' codec.decode gives it
    synth = load_synthesizer(ckpt, a.device, a.dtype, max_seq_len=512, fade_in=0.0)
    params = sum(p.numel() for p in synth.net.parameters()) + sum(p.numel() for p in synth.codec.parameters())
    c = synth.net.config
    vocab = min(c.audio_prompt_token_id, c.audio_latent_token_id, c.audio_prompt_bos_token_id,
                c.audio_bos_token_id)                       # text ids lie below the placeholders
    wav = reference_wav(synth.sample_rate, a.voice_s)
    text = text_ids(TEXT_TOKENS, vocab, 1)
    hf = None if a.no_hf else HF(ckpt, a, synth.frame_size, synth.sample_rate)
    print(f"checkpoint {C.short_path(ckpt)}: {params / 1e6:.1f}M parameters; reference voice "
          f"{wav.shape[0] / synth.sample_rate:.2f} s")
    data = {"size": a.size, "checkpoint": C.short_path(ckpt), "params": params, "repeats": a.repeats,
            "warmup": a.warmup, "torch_threads": torch.get_num_threads(), "load_average_start": load0}

    def partial(**kw):          # a run cut short (a time cap) keeps what it measured
        data.update(kw)
        C.write_json("tts", a, info, [], dict(data, partial=True), argv)

    with torch.no_grad():
        tt, voice, latents = ttfa_section(a, synth, hf, wav, text)
        partial(ttfa=tt)
        rtf = rtf_section(a, synth, hf, voice, latents, text)
        partial(rtf=rtf)
        sen = sentences_section(a, synth, hf, voice, latents, vocab)
        partial(sentences=sen)
        bi = bargein_section(a, synth, hf, voice, latents, text)
        partial(barge_in=bi)
        cap = capsule_section(a, synth, voice, text)
    load1 = os.getloadavg() if hasattr(os, "getloadavg") else None
    load_note = (f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end" if load0 and load1 else "unknown")
    data.update(capsules=cap, load_average_end=load1)
    tabs = tables(a, tt, sen, rtf, bi, cap, params, hf.version if hf else "-", load_note)
    C.print_tables(tabs)
    path = C.result_path("tts", a)
    png = plot(tt, rtf, Path(a.plot) if a.plot else path.with_suffix(".png"), a)
    data["plot"] = str(png.relative_to(C.ROOT)) if png and png.is_relative_to(C.ROOT) else png
    C.write_json("tts", a, info, tabs, data, argv)
    ok = (tt["identity"]["same_first_frame_wav_latents_capsule"] and rtf["identity"]["split_equals_frames"]
          and bi["identity"]["rollback_equals_regenerated"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

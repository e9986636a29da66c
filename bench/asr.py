"""Streaming speech recognition (Nemotron Speech Streaming, the released 0.6B shape): real-time
factor per lookahead, flashrt's StreamingTranscriber against transformers' streaming path on the
same weights; end of speech to final transcript (endpoint fork vs waiting out the lookahead vs
flushing the live stream); what a wrong endpoint guess costs; capsule size and copy times.

Both systems load the same random-weight checkpoint (written by transformers' own class,
`make_checkpoint("nemotron_asr_streaming", size)`, cached in ~/.cache/flashrt/checkpoints) and
hear the same audio: tests/data/speech/short_pause.wav + two_utterances.wav (8.2 s of espeak
speech with pauses), 16 kHz.

  flashrt        StreamingTranscriber.push() of 20 ms pieces (its log-mel front end included)
  transformers   generate(input_features=<generator of mel chunks>, num_lookahead_tokens=R), the
                 chunks made as audio arrives by its feature extractor in streaming mode
                 (center=True for the first chunk, center=False after it), inside the timed call

RTF = processing time / audio time over the whole audio; the two systems alternate round by
round (order reversed every other round), so drift of the machine hits both.

End of speech ("the speaker stops at sample E"), around the end of an utterance, at every chunk
phase (1..R+1 frames of the live stream's chunk not yet decoded):
  endpoint fork    live.endpoint(): fork the state, flush the fork with zero lookahead
  flush live       the same flush on the live stream itself (which must then restart)
  wait lookahead   keep streaming until the chunk holding the last speech frame is complete:
                   the audio still to arrive (exact, from the model's own chunk arithmetic and
                   checked by pushing it) + the compute of that chunk. "R frames" is the issue's
                   definition (R x 80 ms + compute: speech ending on a chunk's first frame);
                   "avg phase" averages the audio wait over every end position in a chunk.
The next utterance after flushing the live stream: the live stream restarted (reset) against the
untouched one (token edit distance), and the recompute that rebuilds its left context (the last
window of audio pushed again into a fresh stream).

    python bench/asr.py                  # the released shape, 2 threads, float32 (several minutes)
    python bench/asr.py --quick          # tiny checkpoint, 1 repeat: proves the script runs
    flashrt bench asr --lookaheads 6
"""
from __future__ import annotations

import os
import sys
import warnings
import wave
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

LOOKAHEADS = (0, 1, 6, 13)
ACCEPT_R, ACCEPT_RTF, ACCEPT_FORK = 6, 0.5, 2.0      # the issue's acceptance lines
WAVS = ("short_pause", "two_utterances")
DATA = C.ROOT / "tests" / "data" / "speech"


def parse(argv):
    p = C.base_parser("bench/asr.py", "Streaming ASR: real-time factor, end of speech to final "
                      "transcript, wrong-guess cost, capsules; flashrt vs transformers")
    p.add_argument("--size", default=None, help="real (default: the released 0.6B shape) | tiny "
                   "(--quick)")
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default: a cached random one)")
    p.add_argument("--lookaheads", type=int, nargs="+", default=None,
                   help="right contexts in encoder frames (default 0 1 6 13, the released ones; "
                   "--quick: 0 6)")
    p.add_argument("--piece-ms", type=int, default=20, help="audio per push (default 20 ms)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' streaming path")
    p.add_argument("--plot", default=None, help="PNG path (default next to the JSON)")
    a = p.parse_args(argv)
    a.threads = a.threads or 2
    if a.lookaheads is None:
        a.lookaheads = [0, 6] if a.quick else list(LOOKAHEADS)
    C.setup(a)
    a.size = a.size or ("tiny" if a.quick else "real")
    a.repeats = a.repeats or (1 if a.quick else 3)
    # the identity pass (one untimed run of every case) is the warm-up; --warmup adds rounds
    a.warmup = a.warmup if a.warmup is not None else 0
    return a


# ---- audio -------------------------------------------------------------------------------------
def read_audio():
    """(float32 samples of the wavs joined, their names)."""
    import numpy as np
    import torch
    parts = []
    for n in WAVS:
        with wave.open(str(DATA / f"{n}.wav")) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2), n
            parts.append(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2"))
    return torch.from_numpy(np.concatenate(parts).astype(np.float32) / 32768.0), list(WAVS)


def utterance_end(audio, sr: int, after_s: float, tail_s: float = 1.5) -> int:
    """Sample where the first pause (>= 300 ms below -45 dBFS in 20 ms frames) after `after_s`
    seconds of audio starts, with at least `tail_s` of audio left after it: an end of speech."""
    hop = sr // 50
    n = audio.shape[0] // hop
    db = 10 * (audio[: n * hop].view(n, hop).pow(2).mean(1) + 1e-10).log10()
    speech = (db > -45).tolist()
    run = 0
    for i, s in enumerate(speech):
        run = 0 if s else run + 1
        start = i - run + 1
        if run == 15 and start * hop >= after_s * sr and any(speech[:start]) \
                and audio.shape[0] - start * hop >= tail_s * sr:
            return start * hop
    raise SystemExit("no pause found in the audio for the end-of-speech cases")


# ---- the model's own chunk arithmetic ------------------------------------------------------------
def final_frames(net, E: int) -> int:
    """Encoder frames a final flush decodes for E samples of audio (every frame inside it)."""
    return net.chunk_frames(0, E, 0, final=True)


def wait_samples(net, E: int, R: int) -> int:
    """Samples after E before a live stream at lookahead R has decoded every frame of E samples:
    the chunk holding the last one needs its mel frames' windows complete."""
    F, T = final_frames(net, E), R + 1
    Q = -(-F // T) * T                                  # end of the chunk holding frame F - 1
    if Q == 0:
        return 0
    start = Q - T
    m0 = net.mel_frames(0, start) if start else 0      # mel frames consumed before that chunk
    need = net.config.hop * m0 + net.features.needed(net.mel_frames(start, T))
    return max(0, need - E)


def edit_distance(a: list, b: list) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


# ---- timing --------------------------------------------------------------------------------------
def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


# ---- flashrt -------------------------------------------------------------------------------------
def push_all(tr, audio, piece: int):
    """Push audio in pieces; (tokens, frames) of every chunk it completed."""
    toks, frames = [], []
    for i in range(0, audio.shape[0], piece):
        r = tr.push(audio[i: i + piece])
        toks += r.tokens
        frames += r.frames
    return toks, frames


def flush_live(tr):
    """What endpoint() runs on its fork, here on the live stream: every pending frame decoded
    with zero lookahead, zeros past the audio. The stream cannot continue after it."""
    import torch
    toks, frames = [], []
    with torch.no_grad():
        tr._run(tr.session, 0, True, toks, frames)
    return toks, frames


def state_bytes(tr):
    a = tr.arena
    return a.data[a.fixed_begin: a.fixed_end].clone()


# ---- transformers' streaming path ------------------------------------------------------------------
class HFStream:
    """transformers' NemotronAsrStreamingForRNNT.generate over a generator of mel chunks, each
    made when its audio has arrived by the feature extractor's streaming mode."""

    def __init__(self, path, a):
        import transformers
        from transformers import NemotronAsrStreamingFeatureExtractor, NemotronAsrStreamingForRNNT
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.model = NemotronAsrStreamingForRNNT.from_pretrained(
            str(path), dtype=C.torch_dtype(a.dtype)).to(a.device).eval()
        self.fe = NemotronAsrStreamingFeatureExtractor.from_pretrained(str(path))
        self.blank = self.model.config.blank_token_id
        self.model.generation_config.decoder_start_token_id = self.blank
        self.factor = self.model.config.encoder_config.subsampling_factor
        self.version = transformers.__version__

    def chunks(self, audio, R: int, log: list | None = None):
        """Mel chunks of 1 + 8R, then 8(R + 1) frames, each yielded once the samples its last
        frame reads (hop * last + win/2, as flashrt waits for) are there; the slice for
        center=False runs to + n_fft/2, past the window's last nonzero tap (zeros there when the
        audio is shorter: exact)."""
        import torch
        fe, f, N = self.fe, self.factor, audio.shape[0]
        hop, nfft, half = fe.hop_length, fe.n_fft, fe.win_length // 2
        m0 = 0
        while True:
            M = 1 + f * R if m0 == 0 else f * (R + 1)
            if hop * (m0 + M - 1) + half > N:
                return
            if m0 == 0:
                x, center = audio[: hop * (M - 1) + half], True
            else:
                lo, hi = hop * m0 - nfft // 2, hop * (m0 + M - 1) + nfft // 2
                x = audio[max(lo, 0): min(hi, N)]
                x = torch.nn.functional.pad(x, (max(0, -lo), max(0, hi - N)))
                center = False
            feats = fe(x.numpy(), sampling_rate=fe.sampling_rate, center=center,
                       return_tensors="pt")["input_features"][:, :M]
            if log is not None:
                log.append(feats)
            yield feats
            m0 += M

    def run(self, audio, R: int, log: list | None = None):
        import torch
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.model.generate(input_features=self.chunks(audio, R, log), num_lookahead_tokens=R)

    def steps(self, out) -> list:
        """(symbol, frame) per decoder step, blanks included (the start token left out)."""
        import torch
        seq, dur = out.sequences[0], out.durations[0]
        frames = torch.cumsum(dur, 0) - dur
        return [(int(t), int(fr)) for t, fr in zip(seq[1:], frames[1:])]

    def identity(self, audio, R: int, fl_toks: list, fl_frames: list, fl_pos: int, max_symbols: int,
                 fl_logits: list, fl_enc):
        """One untimed run with the joint's logits kept: tokens against flashrt's, and where the
        step sequences first part, the reference's top-2 logit gap there against the largest
        |logit difference| of the two over the steps before (a near-tie at float precision when
        the gap is within it)."""
        import torch
        logits, feats, enc = [], [], []
        hooks = [self.model.joint.register_forward_hook(
                     lambda m, i, o: logits.append(o.detach().float().reshape(-1, o.shape[-1]).cpu())),
                 self.model.encoder_projector.register_forward_hook(
                     lambda m, i, o: enc.append(o.detach().float().reshape(-1, o.shape[-1]).cpu()))]
        try:
            out = self.run(audio, R, feats)
        finally:
            for h in hooks:
                h.remove()
        enc_diff = None
        if fl_enc is not None and enc:
            e = torch.cat(enc)
            n = min(e.shape[0], fl_enc.shape[0])
            enc_diff = float((e[:n] - fl_enc[:n]).abs().max())
        steps = self.steps(out)
        z = torch.cat(logits[1:])                # the first joint call only encodes the first chunk
        toks = [t for t, _ in steps if t != self.blank]
        mine = []                                 # flashrt's steps: its tokens, then blank unless
        by_frame = {}                             # the frame hit max_symbols
        for t, fr in zip(fl_toks, fl_frames):
            by_frame.setdefault(fr, []).append(t)
        for fr in range(fl_pos):
            got = by_frame.get(fr, [])
            mine += [(t, fr) for t in got] + ([] if len(got) >= max_symbols else [(self.blank, fr)])
        k = next((i for i, (x, y) in enumerate(zip(mine, steps)) if x != y), None)
        if k is None and len(mine) != len(steps):
            k = min(len(mine), len(steps))
        gap = None
        if k is not None and k < z.shape[0]:
            top = z[k].topk(2).values
            gap = float(top[0] - top[1])
        n = min(len(fl_logits), z.shape[0], len(steps) if k is None else k)
        diff = float((torch.stack(fl_logits[:n]).cpu() - z[:n]).abs().max()) if n else None
        scale = float(z[:n].abs().max()) if n else None
        whole = self.fe(audio.numpy(), sampling_rate=self.fe.sampling_rate,
                        return_tensors="pt")["input_features"]
        streamed = torch.cat(feats, dim=1)
        mel_diff = float((streamed - whole[:, : streamed.shape[1]]).abs().max()) if feats else None
        frames = steps[-1][1] + 1 if steps else 0
        return {"tokens": len(toks), "frames": frames, "steps": len(steps),
                "same_tokens": toks == fl_toks, "first_diff_step": k,
                "first_diff_frame": mine[k][1] if k is not None and k < len(mine) else None,
                "equal_tokens_before_diff": sum(1 for s, _ in steps[:k] if s != self.blank) if k is not None
                else len(toks), "top2_gap_at_diff": gap, "max_logit_diff_before": diff,
                "max_abs_logit_before": scale, "streamed_mel_max_diff": mel_diff,
                "encoder_max_diff": enc_diff}


# ---- sections ------------------------------------------------------------------------------------
def rtf_section(a, lm, hf, audio, sr, piece):
    """Every lookahead, flashrt and transformers side by side; identity pass first (warm-up)."""
    from collections import Counter

    import torch

    from flashrt.speech import StreamingTranscriber
    net = lm.net
    secs = audio.shape[0] / sr
    trs = {R: StreamingTranscriber(lm, lookahead=R) for R in a.lookaheads}
    ident, fl_out = {}, {}
    orig = net.decode
    for R in C.progress(a.lookaheads, desc="identity pass"):
        tr = trs[R]
        tr.reset()
        fl_logits, fl_enc = [], []

        def spy(encoded, ctx, state, keep_logits=False, fl_logits=fl_logits, fl_enc=fl_enc):
            fl_enc.append(encoded.detach().float().cpu())
            r = orig(encoded, ctx, state, keep_logits=True)
            fl_logits.extend(r["logits"])
            return r
        net.decode = spy                          # the joint's logits of every step, this pass only
        try:
            toks, frames = push_all(tr, audio, piece)
        finally:
            del net.decode
        at_max = sum(1 for c in Counter(frames).values() if c >= net.config.max_symbols)
        fl_out[R] = {"tokens": len(toks), "frames": tr.position,
                     "symbols_per_frame": len(toks) / max(tr.position, 1),
                     "frames_at_max_symbols": at_max}
        if hf is not None:
            ident[R] = hf.identity(audio, R, toks, frames, tr.position, net.config.max_symbols, fl_logits,
                                   torch.cat(fl_enc) if fl_enc else None)
        del fl_logits, fl_enc
    cases = {}
    for R in a.lookaheads:
        tr = trs[R]
        cases[f"flashrt R={R}"] = C.Case(lambda tr=tr: push_all(tr, audio, piece), setup=tr.reset)
        if hf is not None:
            cases[f"transformers R={R}"] = C.Case(lambda R=R: hf.run(audio, R))
    st = C.measure_alt(cases, a.repeats, a.warmup, a.device, desc="real-time factor")
    rows = {}
    for R in a.lookaheads:
        f, h = st[f"flashrt R={R}"], st.get(f"transformers R={R}")
        rows[R] = {"flashrt": f, "transformers": h, "flashrt_rtf": f.median / secs,
                   "transformers_rtf": h.median / secs if h else None,
                   "ratio": C.ratio(f, h), "flashrt_out": fl_out[R], "identity": ident.get(R)}
    return rows, trs


def endpoint_section(a, lm, trs, audio, sr, U):
    """At every chunk phase around the end of speech U: endpoint fork, flush of the live stream
    and waiting out the lookahead, side by side."""
    import torch
    net, hop_f = lm.net, lm.net.frame_samples
    out = {}
    for R in a.lookaheads:
        tr, T = trs[R], R + 1
        P0 = (U // hop_f) // T * T                        # chunk holding the frame where U falls
        tr.reset()
        push_all(tr, audio[: hop_f * P0], hop_f)
        base = tr.snapshot()
        phases, caps = [], {}
        for n in range(1, T + 1):
            E = hop_f * (P0 + n - 1) + 180                # 1 mel frame into frame P0 + n - 1
            tr.restore(base)
            tr.push(audio[hop_f * P0: E])
            caps[n] = (E, tr.snapshot())
            assert tr.position == P0 and final_frames(net, E) - P0 == n, (R, n, tr.position)
        tr.endpoint()                                     # makes its scratch session (untimed)
        for n in C.progress(range(1, T + 1), desc=f"endpoint R={R}"):
            E, cap = caps[n]
            w = wait_samples(net, E, R)
            F = final_frames(net, E)
            assert w >= 1, (R, n, w)

            def pre_wait(cap=cap, E=E, w=w):
                tr.restore(cap)
                if w > 1:
                    tr.push(audio[E: E + w - 1])
                    assert tr.position < F, "the chunk completed before the computed wait"
            res = {}

            def post_wait(_r, res=res):
                res["wait_done"] = tr.position >= F

            def post_fork(r, res=res):
                res["fork_frames"] = r.end_frame - P0
            cases = {"fork": C.Case(tr.endpoint, setup=lambda cap=cap: tr.restore(cap), post=post_fork),
                     "flush": C.Case(lambda: flush_live(tr), setup=lambda cap=cap: tr.restore(cap)),
                     "wait": C.Case(lambda E=E, w=w: tr.push(audio[E + w - 1: E + w]), setup=pre_wait,
                                    post=post_wait)}
            st = C.measure_alt(cases, a.repeats, a.warmup, a.device)
            phases.append({"pending_frames": n, "end_sample": E, "wait_samples": w,
                           "final_frames": F, "wait_audio_ms": w / sr * 1e3,
                           "fork": st["fork"], "flush": st["flush"], "wait_compute": st["wait"],
                           "wait_total_ms": w / sr * 1e3 + st["wait"].median * 1e3,
                           "wait_verified": bool(res.get("wait_done")),
                           "fork_decoded_frames": res.get("fork_frames")})
        # every end position in one chunk period, from the same arithmetic
        span = range(hop_f * P0 + 1, hop_f * (P0 + T) + 1, 4)
        avg_wait_ms = mean(wait_samples(net, E, R) for E in span) / sr * 1e3
        compute = mean(p["wait_compute"].median for p in phases) * 1e3
        fork = [p["fork"].median * 1e3 for p in phases]
        flush = [p["flush"].median * 1e3 for p in phases]
        wait_R = R * net.frame_samples / sr * 1e3 + compute
        wait_avg = avg_wait_ms + compute
        out[R] = {"chunk_start_frame": P0, "phases": phases, "fork_avg_ms": mean(fork),
                  "fork_min_ms": min(fork), "fork_max_ms": max(fork), "flush_avg_ms": mean(flush),
                  "flush_min_ms": min(flush), "flush_max_ms": max(flush),
                  "chunk_compute_ms": compute, "wait_R_frames_ms": wait_R,
                  "avg_wait_audio_ms": avg_wait_ms, "wait_avg_phase_ms": wait_avg,
                  "ratio_R_frames": wait_R / mean(fork), "ratio_avg_phase": wait_avg / mean(fork),
                  "all_waits_verified": all(p["wait_verified"] for p in phases)}
        del base, caps
    return out


def next_utterance_section(a, lm, trs, audio, sr, U, piece):
    """An endpoint just after the end of speech U, where the live chunk has all its R + 1 frames
    pending (the most a fork computes): the fork guessed wrong (the speaker goes on): its compute
    wasted, the live stream continues bitwise? The live stream flushed instead: restarted (reset)
    or its left context recomputed; tokens of the rest of the audio against the untouched stream."""
    from flashrt.speech import StreamingTranscriber
    net, hop_f = lm.net, lm.net.frame_samples
    out = {}
    for R in C.progress(a.lookaheads, desc="next utterance"):
        tr, T = trs[R], R + 1
        E = hop_f * ((U // hop_f) // T * T + T - 1) + 180         # as phase R + 1 of the endpoint cases
        rest = audio[E:]
        tr.reset()
        push_all(tr, audio[:E], piece)
        pending = final_frames(net, E) - tr.position
        cap = tr.snapshot()
        live, _ = push_all(tr, rest, piece)                       # the stream never interrupted
        live_bytes = state_bytes(tr)
        tr.restore(cap)
        tr.endpoint()                                             # a wrong guess
        after_fork, _ = push_all(tr, rest, piece)
        bitwise = after_fork == live and bool((state_bytes(tr) == live_bytes).all())
        tr.restore(cap)
        flush_live(tr)
        tr.reset()                                                # restart without left context
        restarted, _ = push_all(tr, rest, piece)
        # recompute: a fresh stream re-fed the last window of audio (window - 1 frames, from a
        # frame on the live stream's chunk grid), then the rest
        s = max(0, (E // hop_f - (net.config.window - 1)) // T * T)
        fresh = StreamingTranscriber(lm, lookahead=R)

        def recompute():
            fresh.reset()
            push_all(fresh, audio[hop_f * s: E], piece)
        recompute()
        recomputed, _ = push_all(fresh, rest, piece)
        st = C.measure_alt({"fork": C.Case(tr.endpoint, setup=lambda: tr.restore(cap)),
                          "flush": C.Case(lambda: flush_live(tr), setup=lambda: tr.restore(cap)),
                          "recompute": C.Case(recompute)}, a.repeats, a.warmup, a.device)
        out[R] = {"fork": st["fork"], "flush": st["flush"], "recompute": st["recompute"],
                  "recompute_audio_s": (E - hop_f * s) / sr, "recompute_from_frame": s,
                  "endpoint_sample": E, "pending_frames": pending, "rest_seconds": rest.shape[0] / sr,
                  "fork_continues_bitwise": bitwise, "live_tokens": len(live),
                  "restarted_tokens": len(restarted), "restarted_edit": edit_distance(live, restarted),
                  "recomputed_tokens": len(recomputed),
                  "recomputed_edit": edit_distance(live, recomputed)}
        del fresh
    return out


def capsule_section(a, trs, audio, U, piece):
    import torch
    R = ACCEPT_R if ACCEPT_R in trs else a.lookaheads[0]
    tr = trs[R]
    tr.reset()
    push_all(tr, audio[:U], piece)
    pre = tr.empty_capsule()
    cap = tr.snapshot(into=pre)
    nb = cap.nbytes
    src = torch.empty(nb, dtype=torch.uint8, device=tr.device).random_(0, 256)
    dst = torch.empty_like(src)
    holder = {}
    st = C.measure({"plain_copy": C.Case(lambda: dst.copy_(src), inner=10),
                    "snapshot_into": C.Case(lambda: tr.snapshot(into=pre), inner=10),
                    "restore": C.Case(lambda: tr.restore(pre), inner=10),
                    "snapshot_fresh": C.Case(lambda: tr.snapshot(), inner=10),
                    "fork": C.Case(lambda: holder.__setitem__("f", tr.fork()), inner=3)},
                   max(a.repeats, 5), 1, a.device, desc="capsule")
    sizes = {}
    for R2, t in trs.items():                     # the same size at every lookahead and position
        sizes[R2] = t.snapshot().nbytes
    return {"lookahead": R, "bytes": nb, "same_size_everywhere": len(set(sizes.values())) == 1,
            "by_kind": _by_kind(tr), **st}


def _by_kind(tr) -> dict:
    out = {}
    for e in tr.snapshot().entries:
        out[e.kind] = out.get(e.kind, 0) + e.nbytes
    return out


# ---- report --------------------------------------------------------------------------------------
def tables(a, rtf, ep, nxt, capsule, secs, U, sr, params, hf_version, load_note, max_sym):  # noqa: C901
    ms = lambda x: f"{x:.1f}"  # noqa: E731
    acc = C.Table(f"Acceptance (issue): lookahead {ACCEPT_R}, {a.threads} threads, {a.dtype}, {a.size} shape",
                  ["line", "target", "measured", "holds"])
    if ACCEPT_R in rtf:
        r = rtf[ACCEPT_R]
        acc.add("real-time factor, flashrt", f"<= {ACCEPT_RTF}", f"{r['flashrt_rtf']:.3f}",
                "yes" if r["flashrt_rtf"] <= ACCEPT_RTF else "no")
        if r["transformers"] is not None:
            acc.add("faster than transformers' streaming path (same weights, same run)",
                    "flashrt/transformers < 1", C.fmt_ratio(r["ratio"]), "yes" if r["ratio"] < 1 else "no")
    if ACCEPT_R in ep:
        e = ep[ACCEPT_R]
        acc.add(f"end of speech -> final: waiting out {ACCEPT_R} frames / endpoint fork",
                f">= {ACCEPT_FORK:.0f}x", f"{e['ratio_R_frames']:.2f}x ({ms(e['wait_R_frames_ms'])} / "
                f"{ms(e['fork_avg_ms'])} ms)", "yes" if e["ratio_R_frames"] >= ACCEPT_FORK else "no")
        acc.add("same, waiting only as long as the chunk phase needs (avg over end positions)",
                "(not the issue's line)", f"{e['ratio_avg_phase']:.2f}x ({ms(e['wait_avg_phase_ms'])} / "
                f"{ms(e['fork_avg_ms'])} ms)", "yes" if e["ratio_avg_phase"] >= ACCEPT_FORK else "no")
    if ACCEPT_R in rtf and rtf[ACCEPT_R]["identity"] and not rtf[ACCEPT_R]["identity"]["same_tokens"]:
        r = rtf[ACCEPT_R]
        same = [f"R={R2}: {C.fmt_ratio(x['ratio'])}" for R2, x in rtf.items()
                if x["identity"] and x["identity"]["same_tokens"]]
        acc.notes.append(f"at lookahead {ACCEPT_R} the greedy paths part at a near-tie (frame "
                         f"{r['identity']['first_diff_frame']}; next table): transformers decodes "
                         f"{r['identity']['tokens']} symbols to flashrt's {r['flashrt_out']['tokens']}, "
                         "so the decode work differs"
                         + (f"; where every token agrees, flashrt/transformers is {', '.join(same)}"
                            if same else ""))
    acc.notes += [C.RANDOM_NOTE + f"; {params / 1e6:.1f}M parameters",
                  f"measured on a shared {os.cpu_count()}-core machine while other jobs ran (load "
                  f"average {load_note}); the systems alternate round by round, so compare ratios "
                  "from this run"]

    t = C.Table(f"Streaming recognition: real-time factor over {secs:.1f} s of speech "
                f"({a.device}, {a.dtype}, {a.threads} threads, {a.piece_ms} ms pushes)",
                ["lookahead", "latency ms", "flashrt ms", "flashrt RTF", "transformers ms",
                 "transformers RTF", "flashrt/tf", "frames", "tokens (fl/tf)", "symbols/frame (fl/tf)",
                 "same tokens as tf"])
    for R, r in rtf.items():
        fo, idn = r["flashrt_out"], r["identity"]
        h = r["transformers"]
        same = "-"
        if idn:
            if idn["same_tokens"]:
                same = "yes"
            else:
                gap, d = idn["top2_gap_at_diff"], idn["max_logit_diff_before"]
                same = f"first {idn['equal_tokens_before_diff']} (to frame {idn['first_diff_frame']})"
                if gap is not None and d is not None:
                    same += f"; gap {gap:.1e} vs diff {d:.1e}"
        t.add(R, (R + 1) * 80, r["flashrt"].ms(0), f"{r['flashrt_rtf']:.3f}", h.ms(0) if h else "-",
              f"{r['transformers_rtf']:.3f}" if h else "-", C.fmt_ratio(r["ratio"]), fo["frames"],
              f"{fo['tokens']}/{idn['tokens'] if idn else '-'}",
              f"{fo['symbols_per_frame']:.2f}/" + (f"{idn['tokens'] / max(idn['frames'], 1):.2f}" if idn else "-"),
              same)
    first = next(iter(rtf.values()))
    t.notes += ["RTF = processing time / audio time (lower is better; < 1 keeps up with live audio); "
                "latency = (lookahead + 1) x 80 ms of audio a chunk waits for; flashrt/tf < 1: "
                "flashrt faster",
                "flashrt: StreamingTranscriber.push() of every piece, its log-mel front end included; "
                f"transformers {hf_version}: generate(input_features=<generator of mel chunks>, "
                "num_lookahead_tokens=R), each chunk's features made by its feature extractor in "
                "streaming mode as its audio arrives, inside the timed call",
                "frames: encoder frames decoded (whole chunks only: what is left waits for more "
                "audio); symbols/frame: tokens per frame, each one a prediction-network + joint "
                "step for both systems (decode work grows with it). Random weights pick blank "
                "rarely: frames at max_symbols (" + str(max_sym) + ") for flashrt: "
                + ", ".join(f"R={R} {r['flashrt_out']['frames_at_max_symbols']}/{r['flashrt_out']['frames']}"
                            for R, r in rtf.items()) + " (a trained model emits far fewer: speech carries a few subword tokens a second, "
                "12.5 frames)",
                "same tokens: else how many agree before the greedy paths part; gap = transformers' "
                "top-2 logit gap at that step, diff = the largest |logit difference| of the two over "
                "every step before it (gap <= diff: a tie at the precision the two reach; float32 "
                "sums in another order pick the other token). From there the two decode different "
                "symbol sequences, and so different amounts of decode work"]
    if first["identity"]:
        t.notes.append("encoder outputs (projected, every frame) flashrt against transformers: max |diff| "
                       + ", ".join(f"R={R}: {r['identity']['encoder_max_diff']:.1e}" for R, r in rtf.items()
                                   if r["identity"]["encoder_max_diff"] is not None)
                       + " (larger logit differences come from the decoder side: the prediction "
                       "network carries them from token to token)")
        t.notes.append("transformers' streamed mel chunks against its whole-utterance features: max |diff| "
                       + ", ".join(f"R={R}: {r['identity']['streamed_mel_max_diff']:.1e}"
                                   for R, r in rtf.items())
                       + "; largest |joint logit| over the compared steps: "
                       + ", ".join(f"R={R}: {r['identity']['max_abs_logit_before']:.1f}" for R, r in rtf.items()
                                   if r["identity"]["max_abs_logit_before"] is not None))

    e = C.Table(f"End of speech to final transcript ({a.device}, {a.dtype}, {a.threads} threads; ms)",
                ["lookahead", "endpoint fork (avg [min-max] of phases)", "flush live stream",
                 f"wait R frames (R x 80 + chunk)", "wait, avg phase", "wait R / fork",
                 "wait avg / fork"])
    for R, x in ep.items():
        e.add(R, f"{ms(x['fork_avg_ms'])} [{ms(x['fork_min_ms'])}-{ms(x['fork_max_ms'])}]",
              f"{ms(x['flush_avg_ms'])} [{ms(x['flush_min_ms'])}-{ms(x['flush_max_ms'])}]",
              f"{ms(x['wait_R_frames_ms'])} ({R * 80} + {ms(x['chunk_compute_ms'])})",
              f"{ms(x['wait_avg_phase_ms'])} ({ms(x['avg_wait_audio_ms'])} + {ms(x['chunk_compute_ms'])})",
              f"{x['ratio_R_frames']:.2f}x", f"{x['ratio_avg_phase']:.2f}x")
    verified = all(x["all_waits_verified"] for x in ep.values())
    e.notes += [f"end of speech at sample E = 80 ms x (P0 + n - 1) + 11 ms, for n = 1..R+1 frames of "
                f"the live chunk not yet decoded (P0: the chunk holding the end of an utterance at "
                f"{U / sr:.2f} s); each phase timed side by side (median over repeats), then averaged "
                "over the phases (a uniformly placed end of speech)",
                "endpoint fork = live.endpoint(): snapshot, restore into a scratch session, flush "
                "with zero lookahead; the live stream is untouched. flush live stream = the same "
                "flush on the live stream (no copy), which then cannot continue (next table)",
                "wait R frames: the issue's definition, R x 80 ms of audio + the compute of the chunk "
                "(speech ending on a chunk's first frame; more lookahead audio never helps). "
                "wait, avg phase: the audio still needed averaged over every end position in a "
                "chunk (exact, from the model's chunk arithmetic) + the same compute; the "
                f"arithmetic was checked at every phase by pushing one sample less and then one more: "
                f"{'ok' if verified else 'MISMATCH'}",
                "an endpoint detector's own delay (e.g. a VAD's silence hangover) comes on top of all "
                "three; the fork gains most when the decision comes early",
                "chunk compute by lookahead (frames per step = R + 1): "
                + ", ".join(f"R={R}: {x['chunk_compute_ms']:.0f} ms" for R, x in ep.items())
                + "; the fork flushes its 1..R + 1 pending frames in one step, so what it saves is "
                "the audio wait, not compute: with all R + 1 frames pending the wait is that chunk's "
                "compute alone"]

    if ACCEPT_R in ep:
        x = ep[ACCEPT_R]
        ph = C.Table(f"End of speech at each chunk phase, lookahead {ACCEPT_R} (ms)",
                     ["pending frames", "audio still to come", "chunk compute", "wait total",
                      "endpoint fork", "flush live", "wait / fork"])
        for p in x["phases"]:
            ph.add(p["pending_frames"], ms(p["wait_audio_ms"]), p["wait_compute"].ms(),
                   ms(p["wait_total_ms"]), p["fork"].ms(), p["flush"].ms(),
                   f"{p['wait_total_ms'] / (p['fork'].median * 1e3):.2f}x")
        ph.notes += ["pending frames: encoder frames of the audio the live stream has not decoded "
                     "(the fork flushes them all in one zero-lookahead step); audio still to come: "
                     "what the live stream waits for before its chunk runs"]
    else:
        ph = None

    nu = C.Table(f"A wrong endpoint guess and the next utterance (endpoint just after the end of "
                 f"speech at {U / sr:.2f} s, all R + 1 frames of the live chunk pending)",
                 ["lookahead", "fork wasted ms (avg phase)", "live continues bitwise", "flush live ms",
                  "restarted: tokens / edit distance", "recompute ms (audio s)",
                  "recomputed: tokens / edit distance", "live tokens"])
    for R, x in nxt.items():
        avg = f" ({ep[R]['fork_avg_ms']:.1f})" if R in ep else ""
        nu.add(R, x["fork"].ms() + avg, "yes" if x["fork_continues_bitwise"] else "NO", x["flush"].ms(),
               f"{x['restarted_tokens']} / {x['restarted_edit']}",
               f"{x['recompute'].ms(0)} ({x['recompute_audio_s']:.2f})",
               f"{x['recomputed_tokens']} / {x['recomputed_edit']}", x["live_tokens"])
    x0 = next(iter(nxt.values()))
    nu.notes += [f"endpoint at the phase where the fork flushes the most (R + 1 frames); the rest of "
                 f"the audio after it: {x0['rest_seconds']:.2f} s (a pause, then the next utterance)",
                 "fork wasted: endpoint() when the speaker goes on: its compute is all that is lost "
                 "(in brackets: averaged over the chunk phases, from the end-of-speech table); the "
                 "live stream's later tokens and state bytes equal those of a stream never forked",
                 "flush live, then: restarted = reset() and the rest of the audio from a fresh "
                 "stream (no left context, no decoder state); recompute = a fresh stream fed again "
                 "the last window of audio (attention left context, window - 1 frames, from a "
                 "frame on the live chunk grid; the whole history when shorter), then the rest",
                 "edit distance: token-level Levenshtein distance of the tokens for the audio after "
                 "the end of speech against the stream never interrupted (random weights: the "
                 "tokens mean nothing, only whether they change)"]

    cp = C.Table(f"Capsule (lookahead {capsule['lookahead']}, mid-stream): "
                 f"{C.fmt_bytes(capsule['bytes'])}", ["operation", "ms", "vs plain copy"])
    pc = capsule["plain_copy"]
    for k, lab in (("plain_copy", "plain copy of the same bytes"), ("snapshot_into", "snapshot(into=)"),
                   ("restore", "restore"), ("snapshot_fresh", "snapshot() fresh buffer"),
                   ("fork", "fork() (new transcriber + restore)")):
        cp.add(lab, capsule[k].ms(3), C.fmt_ratio(C.ratio(capsule[k], pc)))
    cp.notes += ["bytes by kind: " + ", ".join(f"{k} {C.fmt_bytes(v)}" for k, v in capsule["by_kind"].items())
                 + f"; the same size at every lookahead and position: "
                 f"{'yes' if capsule['same_size_everywhere'] else 'no'} (every buffer is fixed-size)"]
    return [x for x in (acc, t, e, ph, nu, cp) if x is not None]


def plot(rtf, ep, path, a):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed ({path} not written)")
        return None
    Rs = list(rtf)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    w = 0.38
    xs = range(len(Rs))
    ax1.bar([x - w / 2 for x in xs], [rtf[R]["flashrt_rtf"] for R in Rs], w, label="flashrt")
    if any(rtf[R]["transformers_rtf"] for R in Rs):
        ax1.bar([x + w / 2 for x in xs], [rtf[R]["transformers_rtf"] or 0 for R in Rs], w,
                label="transformers streaming")
    ax1.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax1.axhline(ACCEPT_RTF, color="C2", lw=0.8, ls=":", label=f"RTF {ACCEPT_RTF}")
    ax1.set_xticks(list(xs), [str(R) for R in Rs])
    ax1.set_xlabel("lookahead (encoder frames of 80 ms)")
    ax1.set_ylabel("real-time factor (median)")
    ax1.set_title("streaming recognition", fontsize=9)
    ax1.legend(fontsize=7)
    Es = [R for R in Rs if R in ep]
    xs = range(len(Es))
    series = [("fork_avg_ms", "endpoint fork", "C0"), ("flush_avg_ms", "flush live stream", "C4"),
              ("wait_avg_phase_ms", "wait, avg phase", "C1"), ("wait_R_frames_ms", "wait R frames", "C3")]
    w = 0.2
    for i, (k, lab, col) in enumerate(series):
        ax2.bar([x + (i - 1.5) * w for x in xs], [ep[R][k] for R in Es], w, label=lab, color=col)
    ax2.set_xticks(list(xs), [str(R) for R in Es])
    ax2.set_xlabel("lookahead (encoder frames of 80 ms)")
    ax2.set_ylabel("ms, end of speech -> final transcript")
    ax2.set_title("end of speech to final transcript", fontsize=9)
    ax2.legend(fontsize=7)
    fig.suptitle(f"Nemotron streaming ASR {a.size} shape, {a.device} {a.dtype}, {a.threads} threads "
                 "(random weights)", fontsize=9)
    C.save_figure(fig, path)
    return path


def main(argv=None) -> int:
    a = parse(argv)
    import torch
    info = C.banner("asr", a)
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    ckpt = Path(a.ckpt) if a.ckpt else C.cached_checkpoint("nemotron_asr_streaming", a.size)
    from flashrt.models.loader import load_model
    lm = load_model(ckpt, a.device, a.dtype)
    net = lm.net
    bad = [R for R in a.lookaheads if R not in net.lookaheads]
    if bad:
        raise SystemExit(f"--lookaheads {bad}: the model takes {list(net.lookaheads)}")
    params = sum(p.numel() for p in net.parameters())
    audio, wavs = read_audio()
    sr, piece = net.sample_rate, net.sample_rate * a.piece_ms // 1000
    secs = audio.shape[0] / sr
    # an utterance end with a full left context of history before it (when the audio has one)
    left_s = (net.config.window - 1) * net.frame_samples / sr
    U = utterance_end(audio, sr, after_s=min(left_s, secs - 2.5))
    hf = None if a.no_hf else HFStream(ckpt, a)
    print(f"checkpoint {C.short_path(ckpt)}: {params / 1e6:.1f}M parameters; audio {' + '.join(wavs)} "
          f"({secs:.2f} s); end of speech for the endpoint cases at {U / sr:.2f} s")
    path = C.result_path("asr", a)
    data = {"size": a.size, "checkpoint": C.short_path(ckpt), "params": params, "audio": wavs,
            "audio_seconds": secs, "end_of_speech_sample": U, "piece_ms": a.piece_ms,
            "lookaheads": a.lookaheads, "repeats": a.repeats, "warmup": a.warmup,
            "torch_threads": torch.get_num_threads(), "load_average_start": load0}

    def partial(**kw):          # a run cut short (a time cap) keeps what it measured
        data.update(kw)
        C.write_json("asr", a, info, [], dict(data, partial=True), argv)

    rtf, trs = rtf_section(a, lm, hf, audio, sr, piece)
    partial(rtf=rtf)
    ep = endpoint_section(a, lm, trs, audio, sr, U)
    partial(endpoint=ep)
    nxt = next_utterance_section(a, lm, trs, audio, sr, U, piece)
    partial(next_utterance=nxt)
    capsule = capsule_section(a, trs, audio, U, piece)
    load1 = os.getloadavg() if hasattr(os, "getloadavg") else None
    load_note = (f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end" if load0 and load1 else "unknown")
    data.update(capsule=capsule, load_average_end=load1)
    tabs = tables(a, rtf, ep, nxt, capsule, secs, U, sr, params, hf.version if hf else "-", load_note,
                  net.config.max_symbols)
    C.print_tables(tabs)
    png = plot(rtf, ep, Path(a.plot) if a.plot else path.with_suffix(".png"), a)
    data["plot"] = str(png.relative_to(C.ROOT)) if png and png.is_relative_to(C.ROOT) else png
    C.write_json("asr", a, info, tabs, data, argv)
    ok = all(x["fork_continues_bitwise"] for x in nxt.values()) and \
        all(x["all_waits_verified"] for x in ep.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

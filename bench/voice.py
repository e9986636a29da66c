"""A voice agent, voice to voice: an 8-turn spoken conversation through flashrt.voice.VoiceAgent
(Silero VAD, Nemotron streaming 0.6B, Qwen3.5-0.8B, Pocket TTS at the released shapes), with a
barge-in at turn 4 and a context of about 2,048 tokens by turn 8. Per turn: end of the user's
speech to the first audio byte out, split by stage, for

  flashrt      every capsule feature: the recognizer's endpoint fork, a reply prepared from the
               conversation's capsule during the endpointing window (dropped by a restore when the
               user goes on), the voice capsule, barge-in rolling TTS and the model back to what
               was played; each turn prefills only its own prompt
  baseline     the same models without capsules (VoiceOptions(without_capsules=True)), as voice
               frameworks run them: the conversation re-prefilled each turn, the voice re-encoded
               per reply, the recognizer's lookahead waited out, TTS cleared on barge-in
  framework    a Pipecat pipeline (bench/voice_pipecat.py) against `flashrt serve` holding the same
               three models: Silero VAD, STT on /v1/audio/transcriptions once the VAD stops, our
               FlashRTLLMService, TTS on /v1/audio/speech, in real time on the wall clock; it
               reaches the server's conversation prefix reuse and its barge-in cancel (absent,
               with its reason, where pipecat-ai is not installed or with --no-framework)

The user's turns are espeak-ng speech (tests/data/speech/voice_*.wav, scripts/make_speech_wavs.sh):
hello; a request with a pause inside it (turn 2: the reply prepared at the pause is dropped by
a restore, or kept when the text stands); a timer; a weather question whose reply the user
speaks over 1 s into it (turn 5: voice_interrupt.wav); then three more. Between turns, room
noise (about -60 dBFS) plays until the reply was heard and the agent has caught up with the
microphone (the backlog of making a reply slower than real time is not a stage of the next
turn; each turn records it; the barge-in comes while the reply is still being made). A simulated
speaker plays each reply in real time against the microphone and reports it with played().
Timings are the agent's turn clock (flashrt.voice.TurnTimings): compute measured, audio waited
for counted in audio time. The VAD steps on one thread (its ops are too small to share); the
models use --threads.

Random weights (the VAD's are real): what is heard and said is noise, so three adjustments keep
the conversation's shape realistic, applied to both modes alike. The random recognizer emits up
to 10 tokens a frame (about 90 a second), or for long stretches none, where a trained one writes
a few words per utterance: each turn's text is its last --user-tokens recognized tokens, a
letter each, padded when fewer came (the recognizer still decodes every token). The random
language model's text has no sentence ends: the synthesizer reads every --sentence-tokens-th
token end as a full stop. Its end-of-speech head never fires (each sentence makes
min(budget, --tts-max-frames) frames). Each utterance starts 28 ms into a VAD chunk (Silero's
pauses inside a turn depend on that phase). The context reaches about --context tokens at turn 8
through a long system prompt, sized from the turns' expected growth (the template's tags, the
user's letters, a --max-reply-tokens reply; half a reply for the barge-in).

    python bench/voice.py                    # the released shapes, 2 threads, float32
    python bench/voice.py --size small       # Qwen3.5 small, tiny recognizer and synthesizer
    python bench/voice.py --quick            # all tiny, 1 repeat: proves the script runs
    flashrt bench voice --repeats 1
"""
from __future__ import annotations

import os
import sys
import time
import wave
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flashrt.speech import VoiceActivity  # noqa: E402
from flashrt.voice import (STAGES, BargeIn, FinalTranscript, ReplyAudio, TurnDone,  # noqa: E402
                           VoiceAgent, VoiceOptions, turn_prompt)

TURNS = (("voice_hello", "hello"), ("voice_pause", "pauses mid-request"), ("voice_timer", "timer"),
         ("voice_weather", "question, its reply cut off"), ("voice_interrupt", "barge-in over turn 4"),
         ("voice_music", "music"), ("voice_remind", "reminder"), ("voice_thanks", "thanks"))
BARGE_IN = 4                          # the turn whose reply the next turn speaks over
ACCEPT_RATIO, ACCEPT_AFTER = 5.0, 1.3     # the acceptance lines
BUDGET_MS = (500, 800)                # the voice-to-voice budget voice builders cite
MODES = (("flashrt", False), ("baseline", True))       # name, VoiceOptions.without_capsules
SIZES = {"real": ("real", "real", "real"), "small": ("small", "tiny", "tiny"),
         "tiny": ("tiny", "tiny", "tiny")}       # LM, recognizer, synthesizer
PIECE = 512                           # microphone samples per push (32 ms, the VAD's chunk)
BARGE_MARGIN_S = 0.6                  # reply audio left when the interruption starts, at least
LEAD_CHUNKS = 10                      # room noise before a user turn, in VAD chunks (320 ms)
PHASE = 448                           # each utterance starts 28 ms into a VAD chunk: Silero's
                                      # pauses inside a turn move with it (here all under 350 ms)
SR = 16000
DATA = C.ROOT / "tests" / "data" / "speech"
SYSTEM = ("You are a helpful voice assistant in a smart home. Answer in one or two short "
          "sentences, plainly, without lists or markup, because everything you write is spoken. ")


def parse(argv):
    p = C.base_parser("bench/voice.py", "A voice agent voice to voice: 8 turns, barge-in at turn 4, "
                      "flashrt with capsules against the same models without")
    p.add_argument("--size", choices=tuple(SIZES), default=None,
                   help="real (default: the released shapes) | small | tiny (--quick)")
    p.add_argument("--context", type=int, default=2048, help="context tokens at turn 8 (default 2048)")
    p.add_argument("--max-reply-tokens", type=int, default=24, help="reply tokens per turn (default 24)")
    p.add_argument("--tts-max-frames", type=int, default=32, help="frames per sentence (default 32 = 2.56 s)")
    p.add_argument("--user-tokens", type=int, default=12, help="recognized tokens a turn's text keeps")
    p.add_argument("--sentence-tokens", type=int, default=8, help="reply tokens a sentence ends after")
    p.add_argument("--endpointing-ms", type=float, default=400.0,
                   help="silence after the VAD's end before a reply plays (default 400)")
    p.add_argument("--lookahead", type=int, default=6, help="recognizer lookahead frames (default 6 = 560 ms)")
    p.add_argument("--barge-after-ms", type=float, default=1000.0,
                   help="reply audio played before the user speaks over it (default 1000)")
    p.add_argument("--voice-s", type=float, default=None, help="seconds of reference voice (default 5; "
                   "tiny synthesizer 0.2: its codec's frames are 4 ms)")
    p.add_argument("--no-framework", action="store_true", help="skip the Pipecat run against flashrt serve")
    p.add_argument("--plot", default=None, help="PNG path (default next to the JSON)")
    a = p.parse_args(argv)
    a.size = a.size or ("tiny" if a.quick else "real")
    a.threads = a.threads or (2 if a.size == "real" else 1)     # small ones are too small to share
    C.setup(a)
    if a.device != "cpu":
        raise SystemExit(f"--device {a.device}: this bench runs the voice agent on the CPU only")
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.voice_s = a.voice_s or (5.0 if SIZES[a.size][2] == "real" else 0.2)
    return a


# ---- parts -------------------------------------------------------------------------------------
def read_wav(name: str):
    with wave.open(str(DATA / f"{name}.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SR, 1, 2), name
        return torch.from_numpy(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").copy())


class OneThreadVAD(VoiceActivity):
    """Silero's VAD stepping on one thread whatever torch's count: its ops are too small to share
    (measured here: 0.5 ms a 32 ms chunk on one thread, 8 ms on two with the machine busy)."""

    def push(self, pcm, *args, **kw):
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return super().push(pcm, *args, **kw)
        finally:
            torch.set_num_threads(n)


class TurnText:
    """The recognizer's text: the last n token ids given, a letter each (id mod 26), "a"s in front
    when fewer came, so n tokens of the byte-level language model: a short utterance. The random
    recognizer emits up to 90 tokens a second, bytes and control characters among them, or for
    long stretches none (a turn could strip to nothing); a trained one writes a few words."""
    kind = "letters"

    def __init__(self, n: int):
        self.n = n

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids[-self.n:]).rjust(self.n, "a")

    def encode(self, text: str) -> list:
        return [ord(c) - ord("a") for c in text]


class FullStops:
    """The synthesizer's byte tokenizer, reading every n-th ">" of a text as ".". The random
    model's reply ("<205243><1187>...": its ids past the bytes written as numbers) has no sentence
    end, so the first sentence would be the whole reply; a trained model ends one every ten or
    so tokens. A sentence's text restarts the count (IncrementalSpeaker re-reads from its cut)."""
    kind = "full-stops"

    def __init__(self, tok, n: int):
        self.tok, self.n = tok, n

    def encode(self, text: str) -> list:
        ids, k = list(text.encode("utf-8")), 0
        for i, b in enumerate(ids):
            if b == ord(">"):
                k += 1
                ids[i] = ord(".") if k % self.n == 0 else b
        return ids

    def decode(self, ids) -> str:
        return self.tok.decode(ids)


def load_parts(a):
    from bench.tts import reference_wav
    from flashrt.models.loader import load_model
    from flashrt.speech import StreamingTranscriber, load_synthesizer
    lm_size, asr_size, tts_size = SIZES[a.size]
    paths = {"lm": C.checkpoint("qwen3_5", lm_size), "asr": C.cached_checkpoint("nemotron_asr_streaming", asr_size),
             "tts": C.cached_checkpoint("pocket_tts", tts_size)}
    lm = C.load_flashrt(paths["lm"], a, max_seq_len=a.context + 2048)
    asr = load_model(paths["asr"], a.device, a.dtype)
    tr = StreamingTranscriber(asr, lookahead=a.lookahead, tokenizer=TurnText(a.user_tokens))
    vad = OneThreadVAD()
    synth = load_synthesizer(paths["tts"], a.device, C.torch_dtype(a.dtype), max_seq_len=2048)
    synth.tokenizer = FullStops(synth.tokenizer, a.sentence_tokens)
    voice_pcm = reference_wav(synth.sample_rate, a.voice_s)
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in
              (("lm", lm.net), ("asr", asr.net), ("tts", synth.net), ("codec", synth.codec))}
    with torch.no_grad():               # first calls' one-off costs (allocations, kernel choice)
        lm.prefill(list(range(1, 65)))
        lm.decode(lm.sample(0.0))
        tr.push(torch.zeros(SR))
        list(synth.speak(list(range(40, 60)), synth.make_voice(voice_pcm), max_frames=2))
    return dict(lm=lm, tr=tr, vad=vad, synth=synth, voice_pcm=voice_pcm,
                voice=synth.make_voice(voice_pcm), paths=paths, params=params)


def system_prompt(a, parts, template) -> tuple[str, dict]:
    """A system prompt sized so the expected context at turn 8 is a.context tokens."""
    lm, kw = parts["lm"], {"enable_thinking": False}
    n = lambda text: len(lm.tokenizer.encode(text))  # noqa: E731
    per_user = n(parts["tr"].tokenizer.decode(list(range(a.user_tokens))))
    sys_msg = [{"role": "system", "content": ""}]
    first = n(turn_prompt(template, sys_msg, "", kw))
    tags = n(turn_prompt(template, sys_msg + [{"role": "user", "content": ""},
                                              {"role": "assistant", "content": ""}], "", kw))
    turns = len(TURNS)
    replies = (turns - 1.5) * a.max_reply_tokens
    rest = first + turns * per_user + (turns - 1) * tags + replies
    size = max(0, int(round(a.context - rest)))
    text = (SYSTEM * (size // len(SYSTEM) + 1))[:size]
    return text, {"system_tokens": n(text), "first_tags": first, "turn_tags": tags,
                  "user_tokens_expected": per_user, "reply_tokens_expected": replies}


# ---- one conversation ------------------------------------------------------------------------------
class Speaker:
    """Plays the current reply in real time against the microphone: each mic sample plays
    rate / 16000 of the reply's samples that have arrived; a barge-in stops it."""

    def __init__(self, rate: float):
        self.ratio, self.made, self.played = rate / SR, 0.0, 0.0
        self.replies = 0                # replies that began to play

    def hear(self, events) -> None:
        for e in events:
            if isinstance(e, FinalTranscript) or (isinstance(e, ReplyAudio) and e.frame == 0):
                self.made = self.played = 0.0          # a new reply (the last one is over)
            self.replies += isinstance(e, ReplyAudio) and e.frame == 0
            if isinstance(e, ReplyAudio):
                self.made += e.pcm.numel()
            elif isinstance(e, BargeIn):
                self.made = self.played

    def tick(self, mic_samples: int) -> None:
        self.played = min(self.made, self.played + mic_samples * self.ratio)

    busy = property(lambda self: self.played < self.made)


def converse(agent, utts: dict, a, seed: int) -> dict:
    """The scripted conversation; per turn its timings and what the state checks need."""
    g = torch.Generator().manual_seed(seed)
    rate = agent.synth.frame_size * agent.synth.net.frame_rate
    spk, clock = Speaker(rate), {"mic": 0, "busy": 0.0}      # busy: stream seconds the agent is free
    done, finals, barge, conv_at = [], [], [], {}

    def backlog() -> float:
        return clock["busy"] - clock["mic"] / SR

    def push(pcm) -> None:
        for i in range(0, pcm.numel(), PIECE):
            x = pcm[i: i + PIECE]
            t0 = time.perf_counter()
            ev = agent.push(x)
            dt = time.perf_counter() - t0
            clock["mic"] += x.numel()
            clock["busy"] = max(clock["busy"], clock["mic"] / SR) + dt    # as the agent's own clock
            spk.hear(ev)
            spk.tick(x.numel())
            agent.played(int(spk.played))
            for e in ev:
                turn = len(done) + 1
                if isinstance(e, FinalTranscript):
                    finals.append((turn, e.branch))
                    if e.branch != "ignored":
                        conv_at[turn] = len(agent.conversation)
                elif isinstance(e, TurnDone):
                    done.append(e)
                elif isinstance(e, BargeIn):
                    barge.append({"played_s": e.played_samples / rate, "heard_chars": len(e.heard_text),
                                  "heard": e.heard_text, "closed_turn": agent.turns,
                                  "conversation_after": len(agent.conversation)})

    def room(n: int):
        return (torch.randn(n, generator=g) * 30).to(torch.int16)      # about -60 dBFS

    def wait(until, what: str, limit_s: float = 600.0) -> None:
        for _ in range(int(limit_s * SR / PIECE)):
            if until():
                return
            push(room(PIECE))
        raise RuntimeError(f"turn {len(done) + 1}: still waiting for {what} after {limit_s:.0f} s of audio")

    caught_up = lambda: backlog() <= PIECE / SR  # noqa: E731
    barge_samples, margin = a.barge_after_ms / 1000 * rate, BARGE_MARGIN_S * rate

    def barge_now() -> bool:
        """Once barge_after of the reply has played, or earlier while margin of a wholly made
        reply is left to play."""
        if agent.turns >= BARGE_IN:
            return True
        if spk.replies < BARGE_IN:      # turn 4's reply has not begun to play
            return False
        left = spk.made - spk.played
        return spk.played >= barge_samples or (len(done) >= BARGE_IN and 0 < spk.played and left <= margin)

    busy = {"start": [], "end": []}     # ms the agent was behind the microphone around each utterance
    for i, (name, _) in enumerate(TURNS, 1):
        if i == BARGE_IN + 1:           # over turn 4's reply, once some of it has played
            wait(barge_now, "the reply to speak over")
            if agent.turns >= BARGE_IN:
                raise RuntimeError(f"turn {BARGE_IN}'s reply ended before the barge-in: raise "
                                   "--max-reply-tokens or --tts-max-frames, or lower --barge-after-ms")
        else:
            wait(lambda: agent.turns == i - 1 and not spk.busy, "the last reply to play out")
            push(room(LEAD_CHUNKS * PIECE))
            wait(caught_up, "the agent to catch up with the microphone (it hears room audio slower "
                 "than real time)")
        busy["start"].append(max(0.0, backlog()) * 1000)
        push(room((PHASE - clock["mic"]) % PIECE))        # the VAD's decisions depend on it
        push(utts[name])
        push(room(-clock["mic"] % PIECE))                # back on the chunk grid
        busy["end"].append(max(0.0, backlog()) * 1000)
    wait(lambda: agent.turns == len(TURNS) and not spk.busy, "the last reply to play out")
    turns = []
    for i, d in enumerate(done, 1):
        t = d.timings
        turns.append({"turn": i, "marks": {s: getattr(t, s) for s in STAGES}, "split": t.split(),
                      "prefill_tokens": t.prefill_tokens, "context_tokens": t.context_tokens,
                      "endpoint": t.endpoint, "branch": t.branch, "interrupted": d.interrupted,
                      "reply_chars": len(d.text), "reply": d.text,
                      "conversation_at_final": conv_at.get(i), "busy_at_start_ms": busy["start"][i - 1],
                      "busy_at_end_ms": busy["end"][i - 1],
                      "finals": [b for k, b in finals if k == i]})
    return {"turns": turns, "barge_in": barge, "finals": finals, "audio_s": clock["mic"] / SR,
            "lm_holds_conversation": agent.lm.tokens == agent.conversation,
            "conversation_tokens": len(agent.conversation), "lm_tokens": agent.lm.position,
            "turns_closed": agent.turns}


def checks(run: dict, capsules: bool) -> dict:
    """The state the conversation must show (asserted by tests/test_bench_smoke.py)."""
    t = run["turns"]
    ok = {"eight_turns": len(t) == len(TURNS) and run["turns_closed"] == len(TURNS),
          "every_stage_reached": all(None not in x["marks"].values() for x in t),
          "lm_holds_conversation": run["lm_holds_conversation"]}
    b = run["barge_in"]
    ok["one_barge_in_at_turn_4"] = len(b) == 1 and b[0]["closed_turn"] == BARGE_IN and b[0]["played_s"] > 0
    if len(t) >= BARGE_IN and b:
        full = t[BARGE_IN - 1]["reply"]
        ok["heard_is_a_cut_of_the_reply"] = full.startswith(b[0]["heard"]) and len(b[0]["heard"]) < len(full)
    if capsules:        # each turn prefilled only its own prompt, after exactly what was kept
        ok["each_turn_appended"] = all(x["context_tokens"] - x["prefill_tokens"] == x["conversation_at_final"]
                                       for x in t)
        ok["after_barge_in_appended"] = len(t) > BARGE_IN and bool(b) and \
            t[BARGE_IN]["context_tokens"] - t[BARGE_IN]["prefill_tokens"] == b[0]["conversation_after"]
        ok["endpoint_fork"] = all(x["endpoint"] == "fork" for x in t)
        ok["preemptive_reply_dropped_or_kept"] = len(t) > 1 and len(t[1]["finals"]) >= 2 and \
            t[1]["finals"][-1] in ("restarted", "kept") and t[1]["branch"] == t[1]["finals"][-1]
    else:
        ok["each_turn_reprefilled"] = all(x["prefill_tokens"] == x["context_tokens"] for x in t)
        ok["lookahead_waited"] = all(x["endpoint"] == "lookahead" for x in t)
    return ok


# ---- runs ------------------------------------------------------------------------------------------
def run_all(a, parts, system: str) -> dict:
    """Each repeat runs both modes, the order reversed every other repeat."""
    utts = {n: read_wav(n) for n, _ in TURNS}
    runs = {m: [] for m, _ in MODES}
    for r in C.progress(range(a.repeats), desc="conversations"):
        for mode, baseline in (MODES if r % 2 == 0 else MODES[::-1]):
            o = VoiceOptions(system_prompt=system, max_reply_tokens=a.max_reply_tokens,
                             tts_max_frames=a.tts_max_frames, tts_eos_threshold=1e9,
                             endpointing_ms=a.endpointing_ms, without_capsules=baseline, seed=r,
                             listen_lag_ms=100.0)
            voice = parts["voice_pcm"] if baseline else parts["voice"]
            agent = VoiceAgent(parts["lm"], parts["tr"], parts["vad"], parts["synth"], voice, o)
            t0 = time.perf_counter()
            run = converse(agent, utts, a, seed=r)
            run["wall_s"] = time.perf_counter() - t0
            run["checks"] = checks(run, capsules=not baseline)
            runs[mode].append(run)
            print(f"  repeat {r + 1} {mode}: turn 8 voice to voice "
                  f"{run['turns'][-1]['marks']['first_audio']:.0f} ms, context "
                  f"{run['turns'][-1]['context_tokens']} tokens, {run['wall_s']:.0f} s for "
                  f"{run['audio_s']:.0f} s of audio; checks "
                  f"{'ok' if all(run['checks'].values()) else [k for k, v in run['checks'].items() if not v]}",
                  flush=True)
            del agent
    return runs


def summarize(runs: dict, a) -> dict:
    """Per mode and turn: Stats (seconds) of voice to voice and of each stage's own share;
    window_bound: the first audio came when the endpointing window ended (within two pieces of
    the VAD's decision + the window), so the reply was ready before it."""
    out, slack = {}, a.endpointing_ms + 2 * PIECE / SR * 1e3
    for mode, rs in runs.items():
        turns = []
        for i in range(len(TURNS)):
            rows = [r["turns"][i] for r in rs if i < len(r["turns"])]
            st = {"v2v": C.Stats([x["marks"]["first_audio"] / 1e3 for x in rows])}
            for s in STAGES:
                st[s] = C.Stats([x["split"][s] / 1e3 for x in rows if x["split"][s] is not None])
            turns.append({"stats": st, "context_tokens": [x["context_tokens"] for x in rows],
                          "prefill_tokens": [x["prefill_tokens"] for x in rows],
                          "behind_ms": [x["busy_at_start_ms"] for x in rows],
                          "window_bound": [x["marks"]["first_audio"] <= x["marks"]["vad"] + slack for x in rows]})
        out[mode] = turns
    return out


def framework_why(a) -> str | None:
    """Why the framework run is absent, or None when it runs."""
    import importlib.util
    if a.no_framework:
        return "skipped (--no-framework)"
    missing = [m for m in ("pipecat", "fastapi", "uvicorn", "multipart") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"not measured: {', '.join(missing)} not installed (Pipecat: pip install 'flashrt[voice-clients]'; "
                "the server: the serve extra)")
    return None


def script(a) -> dict:
    """The conversation as the framework run plays it: the same utterances, pacing and barge-in."""
    from flashrt.speech import VadRules
    return {"turns": [n for n, _ in TURNS], "utts": {n: read_wav(n) for n, _ in TURNS}, "barge_in": BARGE_IN,
            "sr": SR, "piece": PIECE, "phase": PHASE, "lead_chunks": LEAD_CHUNKS, "margin_s": BARGE_MARGIN_S,
            "barge_after_s": a.barge_after_ms / 1000,
            "silence_s": (VadRules().min_silence_duration_ms + a.endpointing_ms) / 1000}


def summarize_framework(runs: list) -> list:
    """Per turn: Stats (seconds) of the framework run's voice to voice and each stage's share."""
    out = []
    for i in range(len(TURNS)):
        rows = [r["turns"][i] for r in runs if i < len(r["turns"])]
        st = {"v2v": C.Stats([x["marks"]["first_audio"] / 1e3 for x in rows if x["marks"]["first_audio"] is not None])}
        for k in (rows[0]["split"] if rows else ()):
            st[k] = C.Stats([x["split"][k] / 1e3 for x in rows if x["split"][k] is not None])
        out.append({"stats": st, "context_tokens": [x["context_tokens"] for x in rows],
                    "prefill_tokens": [x["prefill_tokens"] for x in rows], "requests": [x["requests"] for x in rows]})
    return out


# ---- report ----------------------------------------------------------------------------------------
def tables(a, s: dict, runs: dict, sysinfo: dict, params: dict, load_note: str, fw: dict) -> list:
    ms = lambda st: st.ms(0)  # noqa: E731
    med = lambda x: sorted(x)[len(x) // 2]  # noqa: E731
    fl, bl = s["flashrt"], s["baseline"]
    last = len(TURNS) - 1
    v8, b8 = fl[last]["stats"]["v2v"], bl[last]["stats"]["v2v"]
    ratio = C.ratio(b8, v8)
    plain = [i for i in range(1, len(TURNS)) if i != BARGE_IN]        # turns 2-4, 6-8 (0-based)
    ref = C.Stats([fl[i]["stats"]["v2v"].median for i in plain])
    after = C.ratio(fl[BARGE_IN]["stats"]["v2v"], ref)
    split = {st: fl[last]["stats"][st].median * 1e3 for st in STAGES}
    top = max(split, key=split.get)
    within = v8.median * 1e3 <= BUDGET_MS[1]
    bound = 2 * sum(fl[last]["window_bound"]) > len(fl[last]["window_bound"])
    waited = (f"; the first audio waited for the {a.endpointing_ms:.0f} ms endpointing window (the reply "
              "was ready before it ended)" if bound else "")
    above = "the VAD's silence rule and the endpointing window" if bound else top
    acc = C.Table(f"Acceptance (issue): turn 8, {a.size} shapes, {a.threads} threads, {a.dtype}",
                  ["line", "target", "measured", "holds"])
    acc.add("voice to voice at turn 8: baseline / flashrt (same models, same run)", f">= {ACCEPT_RATIO:.0f}x",
            f"{C.fmt_ratio(ratio)} ({ms(b8)} / {ms(v8)} ms)", "yes" if ratio and ratio >= ACCEPT_RATIO else "no")
    acc.add("turn after the barge-in (5) / median uninterrupted turn (2-4, 6-8), flashrt",
            f"<= {ACCEPT_AFTER}x", f"{C.fmt_ratio(after)} ({ms(fl[BARGE_IN]['stats']['v2v'])} / "
            f"{ref.median * 1e3:.0f} ms; its vad stage {fl[BARGE_IN]['stats']['vad'].median * 1e3:.0f} ms: "
            f"the agent was {med(fl[BARGE_IN]['behind_ms']):.0f} ms behind the microphone when the interruption "
            "began, still making turn 4's reply)",
            "yes" if after and after <= ACCEPT_AFTER else "no")
    acc.add("flashrt voice to voice at turn 8 against the budget voice builders cite",
            f"{BUDGET_MS[0]}-{BUDGET_MS[1]} ms", f"{ms(v8)} ms; largest stage: {top} "
            f"{split[top]:.0f} ms ({split[top] / max(v8.median * 1e3, 1e-9):.0%}){waited}",
            "within" if within else f"above: {above} keeps it there")
    fws = fw["summary"]
    if fws:
        f8 = fws[last]["stats"]
        fsplit = {k: v.median * 1e3 for k, v in f8.items() if k != "v2v" and v.samples}
        ftop = max(fsplit, key=fsplit.get)
        acc.add("framework pipeline (Pipecat against flashrt serve, same models) at turn 8: its voice to voice "
                "and framework / flashrt", "reported", f"{ms(f8['v2v'])} ms, {C.fmt_ratio(C.ratio(f8['v2v'], v8))}; "
                f"largest stage: {ftop} {fsplit[ftop]:.0f} ms", "-")
    ok = {m: all(all(r["checks"].values()) for r in rs) for m, rs in runs.items()}
    if fws:
        ok["framework"] = all(all(r["checks"].values()) for r in fw["runs"])
    acc.add("state checks (conversation = model, appended / re-prefilled, one barge-in, heard cut)",
            "all hold", ", ".join(f"{m} {'ok' if v else 'FAILED'}" for m, v in ok.items()),
            "yes" if all(ok.values()) else "no")
    acc.notes += [C.RANDOM_NOTE + "; parameters " + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in params.items()),
                  f"measured on a shared {os.cpu_count()}-core machine (load average {load_note}); both "
                  "modes run in each repeat, alternating which goes first"]
    if a.size != "real":
        acc.notes.append(f"the issue's lines are for the released shapes; at {a.size} shapes the "
                         "re-prefill the baseline pays is far cheaper")

    t = C.Table(f"Voice to voice per turn (ms, median [min-max] over {a.repeats}; context about "
                f"{a.context} tokens by turn 8)",
                ["turn", "user", "context tok", "prefilled tok (fl / base)", "flashrt ms",
                 "baseline ms", "baseline / flashrt", "behind at start ms (fl / base)",
                 "framework ms (prefilled / context tok)"])
    for i, (name, what) in enumerate(TURNS):
        f, b = fl[i], bl[i]
        t.add(i + 1, f"{name}: {what}", med(f["context_tokens"]),
              f"{med(f['prefill_tokens'])} / {med(b['prefill_tokens'])}", ms(f["stats"]["v2v"]),
              ms(b["stats"]["v2v"]), C.fmt_ratio(C.ratio(b["stats"]["v2v"], f["stats"]["v2v"])),
              f"{med(f['behind_ms']):.0f} / {med(b['behind_ms']):.0f}",
              f"{ms(fws[i]['stats']['v2v'])} ({med(fws[i]['prefill_tokens'])} / {med(fws[i]['context_tokens'])})"
              if fws else "not measured")
    t.notes += ["behind at start: how far the agent's clock was past the microphone when the user began "
                "(work still queued, which the turn's stages wait for); each turn begins once it caught up, "
                "except the barge-in, which comes while the reply is played and made",
                f"voice to voice: the end of the user's speech (the VAD's, padding taken off) to the first "
                f"audio frame out, on the agent's turn clock; the reply plays after {a.endpointing_ms:.0f} ms "
                "of silence in both modes (flashrt prepares it meanwhile)",
                f"context: the system prompt ({sysinfo['system_tokens']} tokens) pads the conversation to "
                f"about {a.context} at turn 8; each turn adds the template's tags, the user's text (its last "
                f"{a.user_tokens} recognized tokens, a letter each), a reply of up to {a.max_reply_tokens} "
                f"tokens (turn {BARGE_IN}'s cut at the barge-in)",
                *framework_notes(a, fw)]
    st_tabs = []
    for mode, rows in (("flashrt", fl), ("baseline", bl)):
        x = C.Table(f"Stages per turn, {mode} (ms each stage took after the one before, median)",
                    ["turn", *STAGES, "voice to voice"])
        for i in range(len(TURNS)):
            x.add(i + 1, *[f"{rows[i]['stats'][st].median * 1e3:.0f}" if rows[i]["stats"][st].samples else "-"
                           for st in STAGES], ms(rows[i]["stats"]["v2v"]))
        st_tabs.append(x)
    st_tabs[0].notes += ["vad: the VAD's end-of-speech decision (its silence rule); transcript: the endpoint "
                         "fork's flush; prefill: the turn's own prompt from the conversation's capsule; "
                         "first_token; first_sentence: the reply's tokens until the synthesizer has a "
                         "sentence; first_audio: its first frame (and the rest of the endpointing window)"]
    st_tabs[1].notes += ["transcript: waiting out the recognizer's lookahead; prefill: the endpointing window "
                         "(the reply starts when it ends) and the whole conversation re-prefilled; "
                         "first_sentence includes re-encoding the voice (made at the reply's first text)"]
    if fws:
        stages = [k for k in fws[0]["stats"] if k != "v2v"]
        x = C.Table("Stages per turn, framework (ms each stage took after the one before, median)",
                    ["turn", *stages, "voice to voice", "prefilled / context tok"])
        for i in range(len(TURNS)):
            st = fws[i]["stats"]
            x.add(i + 1, *[f"{st[k].median * 1e3:.0f}" if st[k].samples else "-" for k in stages], ms(st["v2v"]),
                  f"{med(fws[i]['prefill_tokens'])} / {med(fws[i]['context_tokens'])}")
        x.notes += ["vad: Pipecat's VAD stop (its stop_secs of silence); transcript: the server's "
                    "/v1/audio/transcriptions answer for the segment (sent at the VAD stop, so it runs inside the "
                    "turn's silence); request: the chat completion sent, once Pipecat's user_speech_timeout "
                    "ran out and the transcript came; first_token: its first streamed token; first_sentence: the "
                    "first sentence handed to the TTS; first_audio: the first chunk of /v1/audio/speech's answer "
                    "played (TTS first byte, the output transport's wait included)",
                    "prefilled / context: the chat completion's prompt tokens less its cached_tokens (the "
                    "server's capsule store) / its prompt tokens"]
        st_tabs.append(x)
    bud = C.Table(f"Turn 8 against the {BUDGET_MS[0]}-{BUDGET_MS[1]} ms budget (ms, share of voice to voice)",
                  ["stage", "flashrt ms", "flashrt share", "baseline ms", "baseline share"])
    for st in STAGES:
        f, b = fl[last]["stats"][st].median * 1e3, bl[last]["stats"][st].median * 1e3
        bud.add(st, f"{f:.0f}", f"{f / (v8.median * 1e3):.0%}", f"{b:.0f}", f"{b / (b8.median * 1e3):.0%}")
    bud.add("voice to voice", ms(v8), "100%", ms(b8), "100%")
    bud.notes += [f"on this machine flashrt's turn 8 is {'within' if within else 'above'} the budget; the "
                  f"largest stage is {top} ({split[top]:.0f} ms){waited}",
                  f"the {a.endpointing_ms:.0f} ms endpointing window (silence heard before a reply plays) "
                  "starts at the VAD's decision in both modes: flashrt computes the reply inside it, the "
                  "baseline after it"]
    return [acc, t, *st_tabs, bud]


def framework_notes(a, fw: dict) -> list:
    """The per-turn table's notes on the framework column: what it runs, how it is paced, what of
    the runtime it reaches (README, "Pipecat")."""
    reach = ("a framework pipeline reaches the server's conversation prefix reuse (each turn resends the "
             "history; what renders to the tokens the server's capsule store holds is not prefilled again), "
             "barge-in as Pipecat does it (user speech during bot speech -> InterruptionFrame -> "
             "FlashRTLLMService cancels the reply with the delivered count: the model, recurrent state included, "
             "back to the last whole sentence played) and speech from the stored voice capsule (each "
             "/v1/audio/speech request starts from it); only the native session has streaming recognition with "
             "the endpoint fork at the VAD's end (Pipecat uploads the segment once its VAD stops), preemptive "
             "replies during the endpointing window (dropped by a restore), and TTS rolled back to the last "
             "played frame (Pipecat clears its TTS and keeps whole sentences)")
    if fw["why"]:
        return [f"framework: {fw['why']}; it runs a Pipecat pipeline against `flashrt serve` "
                f"(bench/voice_pipecat.py). {reach[0].upper()}{reach[1:]}"]
    lag = max(r["mic_lag_ms"] for r in fw["runs"])
    return [f"framework: Pipecat {fw['version']} against `flashrt serve` with the same three checkpoints, "
            f"--threads {a.threads} and --asr-lookahead {a.lookahead}: Silero VAD (VADProcessor, stop_secs "
            f"{fw['vad_stop_s']}) and a user_speech_timeout of {fw['speech_timeout_s']:.1f} s (the agent's silence "
            "before a reply: its VAD rule + the endpointing window), OpenAISTTService on /v1/audio/transcriptions, "
            f"FlashRTLLMService (the same system prompt, max_completion_tokens {a.max_reply_tokens}, temperature "
            "0.7, top_p 0.95), OpenAITTSService on /v1/audio/speech, an output transport playing in real time",
            "framework pacing: the same microphone audio (WAVs, room noise, lead, chunk phase) in 32 ms "
            "InputAudioRawFrames on the wall clock, each sent once its last sample is due (the in-process runs "
            f"count that audio on the agent's turn clock; here it ran at most {lag:.0f} ms late); voice to voice "
            "from the end of the user's speech as flashrt's VAD finds it in the samples sent (the in-process "
            "runs' origin) to the first reply chunk played; the barge-in speaks over turn "
            f"{BARGE_IN}'s reply once {a.barge_after_ms:.0f} ms of it played",
            "framework adjustments for the random models: the transcript is its last "
            f"{a.user_tokens} tokens as letters (as the in-process runs'); a logit_bias keeps the reply to four "
            "letters and a space (its text then re-encodes to the tokens the server holds, as a trained "
            f"model's does) and a sentence ends at the first space past {a.sentence_tokens} tokens; the server's "
            "synthesizer keeps its own end-of-speech rule and frame budget (--tts-max-frames and the in-process "
            "runs' end-of-speech switched off have no HTTP parameter), so reply audio lasts otherwise "
            "(reply_audio_s per turn in the JSON), which moves only the waits between turns; OpenAITTSService "
            "is given the synthesizer's rate (frame size x frame rate), at which the in-process speaker plays too",
            "framework: " + reach]


def plot(s: dict, path: Path, a, fws: list | None):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed ({path} not written)")
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12.5 if fws else 11, 4))
    xs = range(1, len(TURNS) + 1)
    series = [("flashrt", "C0", s["flashrt"]), ("baseline (no capsules)", "C1", s["baseline"])]
    series += [("framework (Pipecat + flashrt serve)", "C9", fws)] if fws else []
    w = 0.8 / len(series)
    for k, (label, col, rows) in enumerate(series):
        ax1.bar([x + (k - (len(series) - 1) / 2) * w for x in xs], [t["stats"]["v2v"].median * 1e3 for t in rows],
                w, label=label, color=col, zorder=2)
    ax1.axhspan(*BUDGET_MS, color="C2", alpha=0.2, label=f"{BUDGET_MS[0]}-{BUDGET_MS[1]} ms budget", zorder=0)
    ax1.set_yscale("log")
    ax1.set_xticks(list(xs), [f"{x}{'*' if x == BARGE_IN + 1 else ''}" for x in xs])
    ax1.set_xlabel(f"turn (* after the barge-in at turn {BARGE_IN})")
    ax1.set_ylabel("voice to voice, ms (median)")
    ax1.legend(fontsize=7)
    bottom = [0.0, 0.0]
    for j, st in enumerate(STAGES):
        vals = [s[m][-1]["stats"][st].median * 1e3 for m in ("flashrt", "baseline")]
        ax2.bar([0, 1], vals, 0.6, bottom=bottom, label=st, color=f"C{j + 3}", zorder=2)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if fws:                    # its own stages (a client's view), hatched
        base = 0.0
        for j, (st, v) in enumerate((k, v) for k, v in fws[-1]["stats"].items() if k != "v2v"):
            val = v.median * 1e3 if v.samples else 0.0
            ax2.bar([2], [val], 0.6, bottom=[base], label=f"framework: {st}", color=f"C{j + 3}", hatch="//",
                    zorder=2)
            base += val
    ax2.axhspan(*BUDGET_MS, color="C2", alpha=0.2, zorder=0)
    ax2.set_xticks([0, 1, 2] if fws else [0, 1], ["flashrt", "baseline", "framework"][: 3 if fws else 2])
    ax2.set_ylabel("ms at turn 8, by stage")
    ax2.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"Voice agent, {a.size} shapes, {a.device} {a.dtype}, {a.threads} threads "
                 "(random weights)", fontsize=9)
    C.save_figure(fig, path)
    return path


def main(argv=None) -> int:
    a = parse(argv)
    import importlib.util
    if importlib.util.find_spec("silero_vad") is None:
        raise SystemExit("needs the speech extra: pip install 'flashrt[speech]' (silero-vad)")
    from flashrt.chat import ChatTemplate
    info = C.banner("voice", a)
    load0 = os.getloadavg()
    parts = load_parts(a)
    system, sysinfo = system_prompt(a, parts, ChatTemplate(parts["lm"].model.path))
    print("checkpoints: " + ", ".join(f"{k} {C.short_path(p)}" for k, p in parts["paths"].items())
          + f"; system prompt {sysinfo['system_tokens']} tokens; reference voice {a.voice_s:g} s")
    runs = run_all(a, parts, system)
    s = summarize(runs, a)
    fw = {"measured": False, "why": framework_why(a), "runs": None, "summary": None}
    if fw["why"] is None:
        from importlib.metadata import version
        from bench import voice_pipecat
        conv = script(a)
        fw.update(measured=True, version=version("pipecat-ai"), vad_stop_s=voice_pipecat.VAD_STOP_S,
                  speech_timeout_s=conv["silence_s"] - voice_pipecat.VAD_STOP_S, stages=voice_pipecat.STAGES,
                  runs=voice_pipecat.run(a, parts, system, conv))
        fw["summary"] = summarize_framework(fw["runs"])
        fw["checks"] = {k: all(r["checks"].get(k, False) for r in fw["runs"]) for k in fw["runs"][0]["checks"]}
    else:
        print(f"framework run: {fw['why']}")
    load1 = os.getloadavg()
    tabs = tables(a, s, runs, sysinfo, parts["params"], f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end",
                  fw)
    C.print_tables(tabs)
    path = C.result_path("voice", a)
    png = plot(s, Path(a.plot) if a.plot else path.with_suffix(".png"), a, fw["summary"])
    data = {"size": a.size, "shapes": dict(zip(("lm", "asr", "tts"), SIZES[a.size])),
            "checkpoints": {k: C.short_path(p) for k, p in parts["paths"].items()}, "params": parts["params"],
            "options": {k: getattr(a, k) for k in ("context", "max_reply_tokens", "tts_max_frames", "user_tokens",
                                                    "sentence_tokens", "endpointing_ms", "lookahead",
                                                    "barge_after_ms", "voice_s", "repeats")},
            "turns": [n for n, _ in TURNS], "barge_in_turn": BARGE_IN, "budget_ms": BUDGET_MS,
            "system_prompt": sysinfo, "runs": runs, "summary": s,
            "checks": {m: {k: all(r["checks"].get(k, False) for r in rs) for k in rs[0]["checks"]}
                       for m, rs in runs.items()},
            "framework": fw,
            "load_average": [load0, load1],
            "plot": str(png.relative_to(C.ROOT)) if png and png.is_relative_to(C.ROOT) else png}
    C.write_json("voice", a, info, tabs, data, argv)
    ok = all(all(v.values()) for v in data["checks"].values()) and all(fw.get("checks", {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

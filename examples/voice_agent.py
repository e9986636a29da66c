"""A spoken conversation with flashrt.voice.VoiceAgent, driven by WAV files.

    python examples/voice_agent.py [--size tiny|real] [--out agent.wav] [--endpointing-ms 400]

The user's turns are espeak-ng speech (tests/data/speech/voice_*.wav, made by
scripts/make_speech_wavs.sh): a question; a request with a pause inside it (the agent prepares a
reply at the pause and drops it with a restore when the user goes on); a question whose answer
the user interrupts (barge-in: the synthesizer and the language model roll back to what was
played). A simulated speaker plays the agent's audio in real time against the microphone and
reports it with played(); what it played goes to --out at the time it played (24 kHz at the
released shape; the tiny codec makes 96 samples per 80 ms frame, so its file is 1200 Hz).

The speech and language weights are random (the VAD's are real, from the silero-vad wheel), so
what the agent hears and says is noise: the timings and the state are what count. Each turn's
stages are printed for the agent with capsules and for the same models run the way voice
frameworks run them (VoiceOptions(without_capsules=True)): the conversation re-prefilled each
turn, the voice re-encoded per reply, the recognizer's lookahead waited out, TTS cleared on
barge-in. Default: tiny shapes, seconds from a fresh clone; --size real writes random
checkpoints at the released shapes (Qwen3.5-0.8B, Nemotron 0.6B, Pocket TTS) first: gigabytes and
minutes. Needs the speech extra (silero-vad); with jinja2 (the serve extra) the language model
speaks through the released Qwen3.5 chat template, else a plain "role: content" rendering.
"""
from __future__ import annotations

import argparse
import importlib.util
import tempfile
import wave
from pathlib import Path

import numpy as np
import torch

import flashrt
from flashrt.models.checkpoint import make_checkpoint
from flashrt.models.loader import load_model
from flashrt.speech import StreamingTranscriber, VoiceActivity, load_synthesizer
from flashrt.voice import (STAGES, BargeIn, FinalTranscript, ReplyAudio, SpeechStarted, TurnDone, VoiceAgent,
                           VoiceOptions)

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "speech"
PIECE = 512             # microphone samples per push (32 ms at 16 kHz)


def read_wav(path: Path) -> torch.Tensor:
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (16000, 1, 2), path
        return torch.from_numpy(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").copy())


def room(seconds: float, g: torch.Generator) -> torch.Tensor:
    """Room noise, about -60 dBFS, as in the WAVs' pauses."""
    return (torch.randn(int(seconds * 16000), generator=g) * 30).to(torch.int16)


class Speaker:
    """Plays the agent's audio in real time with the microphone: each mic sample plays
    out_rate / 16000 samples of what is queued; a barge-in stops it. Keeps what it played.
    out_rate: the synthesizer's frames per second times its samples per frame (24 kHz at the
    released shape; the tiny codec makes 96 samples per 80 ms frame, so 1200 Hz there)."""

    def __init__(self, out_rate: float):
        self.rate, self.queue, self.played, self.track = out_rate, [], 0, []
        self.ratio = out_rate / 16000
        self.clock = 0.0                   # output samples since the start
        self.replies = 0

    def hear(self, events) -> None:
        for e in events:
            if isinstance(e, ReplyAudio):
                if e.frame == 0:
                    self.played = 0        # a new reply: played() counts from its start
                    self.replies += 1
                self.queue.append(e.pcm)
            elif isinstance(e, BargeIn):
                self.queue.clear()

    def tick(self, mic_samples: int) -> None:
        budget = int(round(mic_samples * self.ratio))
        start = int(self.clock)
        self.clock += budget
        while budget and self.queue:
            head = self.queue[0]
            n = min(budget, head.numel())
            self.track.append((start, head[:n]))
            start, budget, self.played = start + n, budget - n, self.played + n
            self.queue[0] = head[n:]
            if not self.queue[0].numel():
                self.queue.pop(0)

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def wav(self) -> torch.Tensor:
        out = torch.zeros(int(self.clock))
        for at, pcm in self.track:
            out[at: at + pcm.numel()] = pcm[: max(0, out.numel() - at)]
        return out


def converse(agent: VoiceAgent, log) -> tuple[list, Speaker]:
    """The scripted conversation; returns the TurnDone events and the speaker."""
    g, spk, done = torch.Generator().manual_seed(0), Speaker(out_rate(agent.synth)), []
    mic = {"samples": 0}

    def push(pcm: torch.Tensor) -> None:
        for i in range(0, pcm.numel(), PIECE):
            ev = agent.push(pcm[i: i + PIECE])
            n = min(PIECE, pcm.numel() - i)
            mic["samples"] += n
            spk.hear(ev)
            spk.tick(n)
            agent.played(spk.played)
            at = f"{mic['samples'] / 16000:6.2f} s"
            for e in ev:
                if isinstance(e, SpeechStarted):
                    log(f"  {at}  user speaks" + (" over the reply" if spk.busy else ""))
                elif isinstance(e, FinalTranscript):
                    log(f"  {at}  user ({e.branch}): {e.text[:60]!r}")
                elif isinstance(e, TurnDone):
                    done.append(e)
                    log(f"  {at}  agent{' (cut off)' if e.interrupted else ''}: {e.text[:60]!r}")
                elif isinstance(e, BargeIn):
                    log(f"  {at}  barge-in after {e.played_samples / spk.rate:.2f} s of the reply: "
                        f"the conversation keeps {e.heard_text[:40]!r}")

    def wait(until, limit_s: float = 60.0) -> None:
        """Room noise until `until()` (at most limit_s of it)."""
        for _ in range(int(limit_s * 16000 / PIECE)):
            if until():
                return
            push(room(PIECE / 16000, g))

    for name in ("voice_hello", "voice_pause"):
        log(f"[{name}.wav]")
        turns = len(done)
        push(read_wav(DATA / f"{name}.wav"))
        wait(lambda: len(done) > turns and not spk.busy)       # answered, and the answer played
        push(room(0.3, g))
    log("[voice_weather.wav, then voice_interrupt.wav over the answer]")
    replies = spk.replies
    push(read_wav(DATA / "voice_weather.wav"))
    wait(lambda: spk.replies > replies and spk.played >= 0.1 * spk.rate)    # the answer plays
    turns = len(done)
    push(read_wav(DATA / "voice_interrupt.wav"))
    wait(lambda: len(done) > turns and not spk.busy)
    push(room(0.3, g))
    return done, spk


def out_rate(synth) -> float:
    return synth.frame_size * synth.net.frame_rate


def load_parts(size: str, work: Path, chat: bool):
    lm_dir = make_checkpoint("qwen3_5", size, work / "lm", chat=chat)
    asr = load_model(make_checkpoint("nemotron_asr_streaming", size, work / "asr"))
    # room for a long sentence: random text has few sentence marks to cut at
    synth = load_synthesizer(make_checkpoint("pocket_tts", size, work / "tts"), max_seq_len=4096)
    return lm_dir, asr, synth


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=("tiny", "real"), default="tiny")
    ap.add_argument("--out", default="voice_agent.wav",
                    help="what the agent said, as played (24 kHz at the released shape)")
    ap.add_argument("--endpointing-ms", type=float, default=400.0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: 1 at tiny shapes, whose ops are too small to share; "
                         "torch's own count at the released shapes)")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("silero_vad") is None:
        raise SystemExit("needs the speech extra: pip install 'flashrt[speech]' (silero-vad)")
    threads = args.threads if args.threads is not None else (1 if args.size == "tiny" else None)
    if threads:
        torch.set_num_threads(threads)
    chat = importlib.util.find_spec("jinja2") is not None
    print("NOTE: the speech and language weights are random (the VAD's are real), so what the "
          "agent hears and says is noise; the timings and the state are what count.")
    print(f"chat rendering: {'the released Qwen3.5 template' if chat else 'plain role: content'}")
    with tempfile.TemporaryDirectory() as tmp:
        lm_dir, asr, synth = load_parts(args.size, Path(tmp), chat)
        vad = VoiceActivity()
        voice_pcm = torch.nn.functional.interpolate(          # the voice prompt: 16 -> 24 kHz
            (read_wav(DATA / "voice_hello.wav").float() / 32768)[None, None],
            scale_factor=synth.sample_rate / 16000, mode="linear")[0, 0]
        results = {}
        for label, baseline in (("capsules", False), ("without capsules", True)):
            print(f"\n== {label} ==")
            opts = VoiceOptions(endpointing_ms=args.endpointing_ms, without_capsules=baseline,
                                max_reply_tokens=48 if args.size == "tiny" else 96, tts_max_frames=150)
            lm = flashrt.load(lm_dir, max_seq_len=8192, dtype="float32")
            tr = StreamingTranscriber(asr, tokenizer=asr.tokenizer)
            agent = VoiceAgent(lm, tr, vad, synth, voice_pcm, opts)
            done, spk = converse(agent, print)
            results[label] = done
            if not baseline:
                rate = round(out_rate(synth))
                _write(args.out, spk.wav(), rate)
                print(f"wrote {args.out}: what the agent said, at the time it played "
                      f"({spk.clock / rate:.1f} s at {rate} Hz)")
                print(f"the language model holds {lm.position} tokens = the conversation "
                      f"({len(agent.conversation)}): {lm.tokens == agent.conversation}")
    _table(results)
    return 0


def _write(path, pcm: torch.Tensor, rate: int) -> None:
    data = (pcm.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(data)


def _table(results: dict) -> None:
    """Per turn: each stage's mark (ms after the end of the user's speech), side by side."""
    print("\nper-turn timings, ms after the end of the user's speech (turn clock: compute plus "
          "audio waited for; random weights); first_audio is voice to voice")
    head = f"{'turn':>4} {'mode':<17}" + "".join(f"{s:>15}" for s in STAGES) + f"{'prefilled':>10}"
    print(head)
    n = max(len(v) for v in results.values())
    for i in range(n):
        for label, done in results.items():
            if i >= len(done):
                continue
            t = done[i].timings
            cells = "".join(f"{'-' if getattr(t, s) is None else f'{getattr(t, s):.1f}':>15}" for s in STAGES)
            print(f"{i + 1:>4} {label:<17}{cells}{t.prefill_tokens:>10}"
                  + ("  (cut off)" if done[i].interrupted else "") + f"  [{t.endpoint}, {t.branch}]")


if __name__ == "__main__":
    raise SystemExit(main())

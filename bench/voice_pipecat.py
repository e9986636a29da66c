"""The "framework" run of bench/voice.py: the same 8-turn conversation through a Pipecat pipeline
against `flashrt serve` (its three models: the LM checkpoint, --asr-model, --tts-model, the same
--threads), voice to voice on the wall clock. Needs the voice-clients extra (pipecat-ai).

    microphone (InputAudioRawFrames, real time) -> VADProcessor(SileroVADAnalyzer)
      -> TurnTextSTT (OpenAISTTService on /v1/audio/transcriptions: the segment after the VAD stop)
      -> context.user() -> FlashRTLLMService (/v1/chat/completions) -> LLMTextProcessor
      -> OpenAITTSService (/v1/audio/speech, a request per sentence) -> Speaker (a Pipecat output
      transport playing in real time) -> llm.played -> context.assistant()

The microphone is the audio of the in-process runs (the same WAVs, room noise, lead, chunk phase
and 512-sample pieces), each piece queued when its last sample is due on the wall clock. Voice to
voice: from the end of the user's speech, found by flashrt's VAD over the very samples sent (the
in-process runs' definition), to the first reply chunk the Speaker plays. Pipecat ends a turn after
the same silence as the agent does (its VAD's stop_secs + user_speech_timeout = the VAD's silence
rule + --endpointing-ms). The random models are adjusted as for the agent: the transcript is its
last --user-tokens ids as letters (TurnText), a logit_bias keeps the reply to letters and spaces
(so its text re-encodes to the tokens the server holds, as a trained model's does), and a sentence
ends at the first space past --sentence-tokens tokens.
"""
from __future__ import annotations

import asyncio
import io
import math
import re
import sys
import time
import wave

import httpx
import torch
from loguru import logger
from openai.types.audio import Transcription
from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.audio.vad.vad_analyzer import VADParams
from pipecat.frames.frames import (AggregatedTextFrame, BotStoppedSpeakingFrame, InputAudioRawFrame,
                                   InterruptionFrame, LLMFullResponseEndFrame, LLMTextFrame, TranscriptionFrame,
                                   TTSAudioRawFrame, VADUserStoppedSpeakingFrame)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair, LLMUserAggregatorParams
from pipecat.processors.aggregators.llm_text_processor import LLMTextProcessor
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.openai.stt import OpenAISTTService
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import TransportParams
from pipecat.turns.user_stop import SpeechTimeoutUserTurnStopStrategy
from pipecat.turns.user_turn_strategies import UserTurnStrategies
from pipecat.utils.text.base_text_aggregator import Aggregation, BaseTextAggregator, TextType
from pipecat.workers.runner import WorkerRunner

from bench import common as C
from flashrt.speech import SpeechEnd, VoiceActivity
from flashrt.voice.pipecat import FlashRTLLMService

STAGES = ("vad", "transcript", "request", "first_token", "first_sentence", "first_audio")
VAD_START_S, VAD_STOP_S = 0.2, 0.2     # Pipecat's default start_secs and stop_secs
LETTERS = "etao"                 # the reply's alphabet with a space: a space about 1 token in 5
VOICE = "alloy"                  # OpenAITTSService sends only OpenAI's voice names
WAIT_LIMIT_S = 300.0


# ---- the server ------------------------------------------------------------------------------------
def start_server(a, paths: dict, voice_pcm, rate: int):
    """`flashrt serve` with the three models and the agent's reference voice under VOICE."""
    sys.path.insert(0, str(C.ROOT / "tests"))
    from serve_util import Server
    s = Server(paths["lm"], "--asr-model", str(paths["asr"]), "--asr-sessions", "1", "--asr-lookahead",
               str(a.lookahead), "--tts-model", str(paths["tts"]), "--tts-sessions", "2", "--threads",
               str(a.threads), "--dtype", a.dtype, "--max-seq-len", str(a.context + 2048), "--max-sessions", "2")
    try:
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
            w.writeframes((voice_pcm.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes())
        r = httpx.post(s.url + "/v1/audio/voices", data={"name": VOICE},
                       files={"file": ("voice.wav", buf.getvalue(), "audio/wav")}, timeout=120)
        assert r.status_code == 200, r.text
    except BaseException:
        s.stop()
        raise
    return s


def warm_up(s, utt, bias: dict) -> None:
    """First calls' one-off costs, none of them the conversation's (another cache_salt)."""
    with httpx.Client(base_url=s.url + "/v1", timeout=300) as c:
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
            w.writeframes(utt.numpy().astype("<i2").tobytes())
        r = c.post("/audio/transcriptions", data={"model": s.asr}, files={"file": ("u.wav", buf.getvalue())})
        assert r.status_code == 200, r.text
        r = c.post("/chat/completions", json={"model": s.model, "max_tokens": 4, "logit_bias": bias,
                                              "cache_salt": "warm-up", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        r = c.post("/audio/speech", json={"model": s.tts, "voice": VOICE, "input": "hi there",
                                          "response_format": "pcm"})
        assert r.status_code == 200, r.text


# ---- Pipecat parts ---------------------------------------------------------------------------------
class TurnTextSTT(OpenAISTTService):
    """The server's transcript ("<id>" per token, bytes as themselves) as the agent's TurnText
    makes it: the last n tokens, a letter each (id mod 26), "a"s in front when fewer came."""

    def __init__(self, n: int, **kw):
        super().__init__(**kw)
        self.n = n

    async def _transcribe(self, audio: bytes) -> Transcription:
        text = (await super()._transcribe(audio)).text
        ids = [int(m[0]) if m[0] else ord(m[1]) for m in re.findall(r"<(\d+)>|(.)", text, re.S)]
        return Transcription(text="".join(chr(ord("a") + i % 26) for i in ids[-self.n:]).rjust(self.n, "a"))


class RecordingLLM(FlashRTLLMService):
    """Keeps each request's send time and each reported usage."""

    def __init__(self, log: list, **kw):
        super().__init__(**kw)
        self.log = log

    def build_chat_completion_params(self, params_from_context):
        params = super().build_chat_completion_params(params_from_context)
        self.log.append((time.perf_counter(), "request", params["messages"][-1].get("content")))
        return params

    async def start_llm_usage_metrics(self, tokens):
        self.log.append((time.perf_counter(), "usage", tokens))
        await super().start_llm_usage_metrics(tokens)


class WordCut(BaseTextAggregator):
    """A sentence ends at the first single space followed by more text once n characters (one
    token each under the reply's logit_bias) are held: the random model writes no sentence end,
    a trained one ends one every ten or so tokens (the agent's synthesizer reads every n-th token
    end as a full stop). Pipecat rejoins sentences with one space, which is what the stream had."""

    def __init__(self, n: int):
        super().__init__(aggregation_type=TextType.SENTENCE)
        self.n, self._text = n, ""

    @property
    def text(self) -> Aggregation:
        return Aggregation(text=self._text.strip(" "), type=TextType.SENTENCE)

    async def aggregate(self, text: str):
        for ch in text:
            self._text += ch
            t = self._text
            if ch != " " and len(t) >= 3 and t[-2] == " " and t[-3] != " " and len(t) - 2 >= self.n:
                self._text = t[-1]
                yield Aggregation(text=t[:-2], type=TextType.SENTENCE)

    async def flush(self):
        t, self._text = self._text, ""
        return Aggregation(text=t, type=TextType.SENTENCE) if t.strip() else None

    async def handle_interruption(self):
        self._text = ""

    async def reset(self):
        self._text = ""


class Speaker(BaseOutputTransport):
    """The output transport of a device that plays in real time: a chunk starts when the one
    before it has played; `plays` holds (start time, samples) of each reply chunk."""

    def __init__(self, rate: int):
        super().__init__(TransportParams(audio_out_enabled=True, audio_out_sample_rate=rate,
                                         audio_out_end_silence_secs=0, audio_out_auto_silence=False))
        self.plays, self.until = [], 0.0

    async def start(self, frame):
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame) -> bool:
        start = max(time.perf_counter(), self.until)
        await asyncio.sleep(start - time.perf_counter())
        n = len(frame.audio) // 2
        self.until = start + n / self.sample_rate
        if isinstance(frame, TTSAudioRawFrame):
            self.plays.append((start, n))
        return True


class Marks(FrameProcessor):
    """Passes every frame on; logs (time, name, text or audio samples) of the frames in `kinds`
    (class -> name)."""

    def __init__(self, log: list, kinds: dict):
        super().__init__()
        self.log, self.kinds = log, kinds

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        for k, name in self.kinds.items():
            if isinstance(frame, k):
                what = len(frame.audio) // 2 if isinstance(frame, TTSAudioRawFrame) else getattr(frame, "text", None)
                self.log.append((time.perf_counter(), name, what))
                break
        await self.push_frame(frame, direction)


def reply_bias(tok) -> dict:
    """logit_bias: +100 on LETTERS and a space (OpenAI's largest bias: the model's own logits only
    choose among them), each a single token whose text re-encodes to itself."""
    out = {}
    for ch in LETTERS + " ":
        ids = tok.encode(ch)
        if len(ids) != 1 or tok.decode(ids) != ch:
            raise SystemExit(f"framework run: {ch!r} is not one token of the LM's tokenizer")
        out[str(ids[0])] = 100.0
    return out


# ---- one conversation ------------------------------------------------------------------------------
async def converse(s, a, script: dict, system: str, bias: dict, rate: int, seed: int) -> dict:
    """The scripted conversation through the pipeline; what it logged, and the samples sent."""
    SR, PIECE = script["sr"], script["piece"]
    log, cancels, base = [], [], s.url + "/v1"
    stt = TurnTextSTT(a.user_tokens, base_url=base, api_key="none",
                      settings=OpenAISTTService.Settings(model=s.asr))
    llm = RecordingLLM(log, base_url=base, api_key="none", settings=FlashRTLLMService.Settings(
        model=s.model, system_instruction=system, temperature=0.7, top_p=0.95, seed=seed,
        max_completion_tokens=a.max_reply_tokens,
        # a salt per conversation: no repeat reuses another's capsules (nor the warm-up's)
        extra={"logit_bias": bias, "extra_body": {"chat_template_kwargs": {"enable_thinking": False},
                                                  "cache_salt": f"conversation-{seed}"}}))
    tts = OpenAITTSService(base_url=base, api_key="none", sample_rate=rate,
                           settings=OpenAITTSService.Settings(model=s.tts, voice=VOICE))
    vad = VADProcessor(vad_analyzer=SileroVADAnalyzer(params=VADParams(start_secs=VAD_START_S, stop_secs=VAD_STOP_S)))
    # the turn ends after the agent's silence: its VAD's rule, then the endpointing window
    stop = SpeechTimeoutUserTurnStopStrategy(user_speech_timeout=script["silence_s"] - VAD_STOP_S)
    pair = LLMContextAggregatorPair(LLMContext(), user_params=LLMUserAggregatorParams(
        user_turn_strategies=UserTurnStrategies(stop=[stop])))
    speaker = Speaker(rate)

    @llm.event_handler("on_reply_cancelled")
    async def _cancelled(service, reply_id, kept_text, answer):
        cancels.append({"t": time.perf_counter(), "kept": kept_text, "kept_tokens": answer.get("kept_tokens")})

    pipeline = Pipeline([
        vad, Marks(log, {VADUserStoppedSpeakingFrame: "vad"}), stt, Marks(log, {TranscriptionFrame: "transcript"}),
        pair.user(), llm, Marks(log, {LLMTextFrame: "token"}),
        LLMTextProcessor(text_aggregator=WordCut(a.sentence_tokens)),
        Marks(log, {AggregatedTextFrame: "sentence"}), tts,
        Marks(log, {TTSAudioRawFrame: "tts_audio", LLMFullResponseEndFrame: "made_end"}), speaker,
        Marks(log, {LLMFullResponseEndFrame: "played_end", InterruptionFrame: "interruption",
                    BotStoppedSpeakingFrame: "bot_stopped"}),
        llm.played, pair.assistant()])
    worker = PipelineWorker(pipeline, cancel_on_idle_timeout=False,
                            params=PipelineParams(audio_in_sample_rate=SR, audio_out_sample_rate=rate))
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(worker, frame):
        started.set()

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    g = torch.Generator().manual_seed(seed)
    mic = {"n": 0, "t0": 0.0, "lag": 0.0}
    sent, arrivals, starts = [], [], []       # pieces; (samples sent, time); (sample, time) per utterance

    async def push(pcm) -> None:
        for i in range(0, pcm.numel(), PIECE):
            x = pcm[i: i + PIECE]
            mic["n"] += x.numel()
            due = mic["t0"] + mic["n"] / SR          # a piece is sent once its last sample is due
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            now = time.perf_counter()
            mic["lag"] = max(mic["lag"], now - due)
            arrivals.append((mic["n"], now))
            sent.append(x)
            await worker.queue_frame(InputAudioRawFrame(audio=x.numpy().astype("<i2").tobytes(),
                                                        sample_rate=SR, num_channels=1))

    def room(n: int):
        return (torch.randn(n, generator=g) * 30).to(torch.int16)      # about -60 dBFS

    async def wait(until, what: str) -> None:
        for _ in range(int(WAIT_LIMIT_S * SR / PIECE)):
            if running.done():
                raise RuntimeError(f"framework run: the pipeline stopped while waiting for {what}")
            if until():
                return
            await push(room(PIECE))
        raise RuntimeError(f"framework run, turn {len(starts)}: still waiting for {what} after "
                           f"{WAIT_LIMIT_S:.0f} s of audio")

    def request(i: int):
        """The last LLM request of turn i (1-based; made after its utterance began), or None."""
        lo = starts[i - 1][1]
        hi = starts[i][1] if i < len(starts) else math.inf
        ts = [t for t, k, _ in log if k == "request" and lo < t < hi]
        return ts[-1] if ts else None

    def played_out(i: int) -> bool:
        r = request(i)
        return r is not None and any(k == "played_end" and t > r for t, k, _ in log) and \
            time.perf_counter() >= speaker.until

    def barge_now() -> bool:
        """Once barge_after of turn 4's reply has played, or earlier while margin of a wholly
        made reply is left to play (more than in-process by Pipecat's start_secs: its VAD confirms
        the speech that late)."""
        r = request(script["barge_in"])
        plays = [n for t, n in speaker.plays if r is not None and t > r]
        if not plays:
            return False
        played = sum(plays) - max(0.0, speaker.until - time.perf_counter()) * rate
        made = any(k == "made_end" and t > r for t, k, _ in log)
        left = sum(n for t, k, n in log if k == "tts_audio" and t > r) - played
        if made and left <= 0:
            raise RuntimeError(f"framework run: turn {script['barge_in']}'s reply ended before the barge-in: "
                               "lower --barge-after-ms")
        return played >= script["barge_after_s"] * rate or (made and left <= (script["margin_s"] + VAD_START_S) * rate)

    try:
        async with asyncio.timeout(60):
            await started.wait()
        mic["t0"] = time.perf_counter()
        for i, name in enumerate(script["turns"], 1):
            if i == script["barge_in"] + 1:
                await wait(barge_now, "the reply to speak over")
            else:
                if i > 1:
                    await wait(lambda: played_out(i - 1), "the last reply to play out")
                await push(room(script["lead_chunks"] * PIECE))
            await push(room((script["phase"] - mic["n"]) % PIECE))
            starts.append((mic["n"], time.perf_counter()))
            await push(script["utts"][name])
            await push(room(-mic["n"] % PIECE))
        n = len(script["turns"])
        await wait(lambda: played_out(n), "the last reply to play out")
    finally:
        await worker.cancel()
        await running
    return {"log": log, "cancels": cancels, "plays": speaker.plays, "starts": starts, "arrivals": arrivals,
            "pcm": torch.cat(sent), "mic_lag_s": mic["lag"]}


# ---- per turn --------------------------------------------------------------------------------------
def turns_of(got: dict, script: dict, rate: int) -> dict:
    """Per turn: the end of the user's speech (flashrt's VAD over the samples sent, padding off:
    the in-process runs' origin) on the wall clock, and each stage after it in ms."""
    SR, log, starts = script["sr"], got["log"], got["starts"]
    vad, pcm, P = VoiceActivity(), got["pcm"], script["piece"]
    pad = vad.rules.speech_pad_ms * SR / 1000
    ends = [max(0.0, e.sample - pad) for i in range(0, pcm.numel(), P) for e in vad.push(pcm[i: i + P]).events
            if isinstance(e, SpeechEnd)]
    requests = [t for t, k, _ in log if k == "request"]

    def wall(sample: float) -> float:
        n, t = next(x for x in got["arrivals"] if x[0] >= sample)
        return t - (n - sample) / SR

    def first(kind, after, before=math.inf):
        return next((x for x in log if x[1] == kind and after < x[0] < before), None)

    def reply(r: float, nxt: float) -> str:
        return "".join(x[2] or "" for x in log if x[1] == "token" and r < x[0] < nxt)

    turns, chosen = [], []             # chosen: each turn's reply request
    for i, (s0, t0) in enumerate(starts):
        s1, t1 = starts[i + 1] if i + 1 < len(starts) else (math.inf, math.inf)
        mine = [e for e in ends if s0 < e < s1]
        reqs = [t for t in requests if t0 < t < t1]
        if not mine or not reqs:
            raise RuntimeError(f"framework run, turn {i + 1}: {'no end of speech' if not mine else 'no reply'} "
                               f"(VAD ends {len(mine)}, LLM requests {len(reqs)})")
        origin, r = wall(mine[-1]), reqs[-1]
        chosen.append(r)
        nxt = next((t for t in requests if t > r), math.inf)
        before = lambda kind: [x[0] for x in log if x[1] == kind and t0 < x[0] <= r]  # noqa: E731
        play = next((t for t, _ in got["plays"] if t > r), None)
        tts_byte = first("tts_audio", r, nxt)
        tok = first("token", r, nxt)
        marks = {"vad": before("vad")[-1] if before("vad") else None,
                 "transcript": before("transcript")[-1] if before("transcript") else None,
                 "request": r, "first_token": tok[0] if tok else None,
                 "first_sentence": (first("sentence", r, nxt) or (None,))[0], "first_audio": play}
        marks = {k: None if v is None else (v - origin) * 1e3 for k, v in marks.items()}
        split, last = {}, 0.0
        for st in STAGES:
            split[st] = None if marks[st] is None else marks[st] - last
            last = last if marks[st] is None else marks[st]
        usage = first("usage", r, nxt)
        u = usage[2] if usage else None
        audio = sum(x[2] for x in log if x[1] == "tts_audio" and r < x[0] < nxt) / rate      # made
        turns.append({"turn": i + 1, "marks": marks, "split": split, "requests": len(reqs),
                      "vad_stops": len(before("vad")), "user_text": before_text(log, t0, r),
                      "context_tokens": u.prompt_tokens if u else None,
                      "cached_tokens": u.cache_read_input_tokens if u else None,
                      "prefill_tokens": u.prompt_tokens - (u.cache_read_input_tokens or 0) if u else None,
                      "tts_first_byte_ms": (tts_byte[0] - origin) * 1e3 if tts_byte else None,
                      "reply": reply(r, nxt), "reply_audio_s": audio, "origin_s": mine[-1] / SR})
    # each cancel cuts the reply of the request before it: a barge-in when that reply was still
    # playing; otherwise a reply played whole but held otherwise by Pipecat's context, or one cut
    # before it played (a turn Pipecat ended at a pause the user then went on from)
    barge, other = [], []
    for c in got["cancels"]:
        r = max(t for t in requests if t < c["t"])
        nxt = next((t for t in requests if t > r), math.inf)
        plays = [(t, n) for t, n in got["plays"] if r < t < nxt]
        cut = {"closed_turn": max(i for i, (_, t0) in enumerate(starts, 1) if t0 < r),
               "turns_reply": r in chosen,        # not a reply Pipecat dropped when the user went on
               "heard": c["kept"], "kept_tokens": c["kept_tokens"], "reply_chars": len(reply(r, nxt)),
               "played_s": sum(n for t, n in plays if t < c["t"]) / rate}
        (barge if any(t + n / rate > c["t"] for t, n in plays) else other).append(cut)
    return {"turns": turns, "barge_in": barge, "other_cancels": other}


def before_text(log: list, lo: float, hi: float) -> str:
    """The turn's transcripts (a turn Pipecat's VAD split sends each segment's)."""
    return " ".join(x[2] or "" for x in log if x[1] == "transcript" and lo < x[0] <= hi)


def checks(run: dict, script: dict) -> dict:
    """One barge-in cut a turn's reply, turn 4's (a reply Pipecat started at a pause the user then
    went on from may be cut too: not a turn's)."""
    t, b = run["turns"], [x for x in run["barge_in"] if x["turns_reply"]]
    ok = {"eight_turns": len(t) == len(script["turns"]),
          "every_stage_reached": all(None not in x["marks"].values() for x in t),
          "one_barge_in_at_turn_4": len(b) == 1 and b[0]["closed_turn"] == script["barge_in"] and b[0]["played_s"] > 0}
    if b and len(t) >= script["barge_in"]:
        full = t[script["barge_in"] - 1]["reply"]
        ok["heard_is_a_cut_of_the_reply"] = full.startswith(b[0]["heard"]) and len(b[0]["heard"]) < len(full)
    return ok


# ---- runs ------------------------------------------------------------------------------------------
def run(a, parts: dict, system: str, script: dict) -> list:
    """a.repeats conversations against one server; each run's turns, barge-in and checks."""
    logger.remove()                  # Pipecat logs every frame decision at DEBUG
    logger.add(sys.stderr, level="WARNING")
    synth = parts["synth"]
    rate = synth.frame_size * synth.net.frame_rate        # the agent's speaker plays at this rate too
    if rate != int(rate):
        raise SystemExit(f"framework run: the synthesizer's {rate} samples a second is not whole")
    rate = int(rate)
    bias = reply_bias(parts["lm"].tokenizer)
    srv = start_server(a, parts["paths"], parts["voice_pcm"], synth.sample_rate)
    srv.asr, srv.tts = parts["paths"]["asr"].name, parts["paths"]["tts"].name
    try:
        warm_up(srv, script["utts"][script["turns"][0]], bias)
        runs = []
        for r in C.progress(range(a.repeats), desc="framework conversations"):
            t0 = time.perf_counter()
            got = asyncio.run(converse(srv, a, script, system, bias, rate, seed=r))
            out = turns_of(got, script, rate)
            out.update(wall_s=time.perf_counter() - t0, audio_s=got["pcm"].numel() / script["sr"],
                       mic_lag_ms=got["mic_lag_s"] * 1e3)
            out["checks"] = checks(out, script)
            runs.append(out)
            t, bad = out["turns"], [k for k, v in out["checks"].items() if not v]
            print(f"  repeat {r + 1} framework: turn 8 voice to voice {t[-1]['marks']['first_audio']:.0f} ms, "
                  f"context {t[-1]['context_tokens']} tokens, {out['wall_s']:.0f} s for {out['audio_s']:.0f} s "
                  f"of audio; checks {bad or 'ok'}", flush=True)
    finally:
        srv.stop()
    return runs

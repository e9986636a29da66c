"""A Pipecat voice pipeline against a real `flashrt serve` (uvicorn on loopback): Silero VAD (its
real weights, shipped in Pipecat's wheel), OpenAISTTService on /v1/audio/transcriptions,
Pipecat's context aggregators, flashrt.voice.pipecat.FlashRTLLMService on /v1/chat/completions,
OpenAITTSService on /v1/audio/speech. The user's speech is the espeak-ng WAVs of
tests/data/speech, pushed in real time as 20 ms InputAudioRawFrames (as a transport hands them
on); the second utterance barges in on the reply.

The language, recognition and speech weights are random (tiny checkpoints): a transcript is
token ids as "<id>", the reply bytes, the audio noise. A logit_bias (an OpenAI parameter the
server honours) keeps the reply to a few letters, spaces and full stops, so that it has sentences
for the TTS and its text re-encodes to the very tokens the server holds, as a trained model's
does. Checked: each stage's output came from the server; the barge-in reached the server's cancel
with the played characters; and the next turn, which Pipecat builds from the played text,
appends to the conversation the server rolled back (cached_tokens = previous prompt + kept).
"""
from __future__ import annotations

import asyncio
import io
import re
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("pipecat")
pytest.importorskip("fastapi")
pytest.importorskip("multipart")
pytest.importorskip("transformers")      # make_checkpoint writes Nemotron and Pocket TTS through it

from pipecat.audio.vad.silero import SileroVADAnalyzer  # noqa: E402
from pipecat.audio.vad.vad_analyzer import VADParams  # noqa: E402
from pipecat.frames.frames import (InputAudioRawFrame, LLMFullResponseStartFrame, LLMTextFrame,  # noqa: E402
                                   TranscriptionFrame, TTSAudioRawFrame, TTSTextFrame)
from pipecat.pipeline.pipeline import Pipeline  # noqa: E402
from pipecat.pipeline.worker import PipelineParams, PipelineWorker  # noqa: E402
from pipecat.processors.aggregators.llm_context import LLMContext  # noqa: E402
from pipecat.processors.aggregators.llm_response_universal import (  # noqa: E402
    LLMContextAggregatorPair, LLMUserAggregatorParams)
from pipecat.processors.audio.vad_processor import VADProcessor  # noqa: E402
from pipecat.processors.frame_processor import FrameProcessor  # noqa: E402
from pipecat.services.openai.stt import OpenAISTTService  # noqa: E402
from pipecat.services.openai.tts import OpenAITTSService  # noqa: E402
from pipecat.turns.user_stop import SpeechTimeoutUserTurnStopStrategy  # noqa: E402
from pipecat.turns.user_turn_strategies import UserTurnStrategies  # noqa: E402
from pipecat.utils.string import TextPartForConcatenation  # noqa: E402
from pipecat.workers.runner import WorkerRunner  # noqa: E402
from serve_util import Server  # noqa: E402

from flashrt.models.checkpoint import make_checkpoint  # noqa: E402
from flashrt.models.tokenizer import ByteTokenizer  # noqa: E402
from flashrt.serve.text import ChatTemplate  # noqa: E402
from flashrt.voice.pipecat import FlashRTLLMService, _Reply  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "speech"
SR_IN, SR_TTS = 16000, 24000
PIECE = 320                                       # 20 ms microphone frames
# the reply's characters (logit_bias): three letters, spaces and full stops a little likelier, so
# that random weights still give Pipecat's sentence splitter a few sentences to speak in turn
BIAS = {**{c: 99 for c in "eta"}, " ": 100, ".": 100}
SYSTEM = "You are a voice agent."
SEED = 5            # its first reply starts with a letter: Pipecat trims a leading space (see below)


def pcm16(name: str) -> np.ndarray:
    with wave.open(str(DATA / f"{name}.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SR_IN, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").copy()


def wav24k(x16: np.ndarray) -> bytes:
    """16 kHz int16 -> a 24 kHz 16-bit WAV (linear interpolation): the voice's reference."""
    n = len(x16) * SR_TTS // SR_IN
    x = np.interp(np.arange(n) * SR_IN / SR_TTS, np.arange(len(x16)), x16).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(SR_TTS)
        w.writeframes(x.tobytes())
    return buf.getvalue()


def mic(name: str, silence_s: float = 1.0) -> list:
    """The WAV then silence in 20 ms InputAudioRawFrames."""
    x = np.concatenate([pcm16(name), np.zeros(int(silence_s * SR_IN), np.int16)])
    return [InputAudioRawFrame(audio=x[i:i + PIECE].tobytes(), sample_rate=SR_IN, num_channels=1)
            for i in range(0, len(x) - PIECE + 1, PIECE)]


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipecat")
    tts = make_checkpoint("pocket_tts", "tiny", root / "tts", seed=0)
    asr = make_checkpoint("nemotron_asr_streaming", "tiny", root / "asr", seed=0)
    s = Server(ckpt("qwen3_5", "tiny"), "--tts-model", str(tts), "--tts-sessions", "1", "--asr-model",
               str(asr), "--asr-sessions", "1", "--max-voice-s", "1", "--threads", "1",
               "--max-seq-len", "4096", log=root / "server.log")     # a transcript: ~1000 byte tokens
    s.lm, s.tts, s.asr = s.model, Path(tts).name, Path(asr).name
    # OpenAITTSService sends only OpenAI's voice names: the server's voice upload gives it one
    ref = wav24k(pcm16("voice_thanks")[:SR_IN // 2])
    r = httpx.post(s.url + "/v1/audio/voices", data={"name": "alloy"}, files={"file": ("ref.wav", ref, "audio/wav")},
                   timeout=60)
    assert r.status_code == 200, r.text
    yield s
    s.stop()


class Recorder(FrameProcessor):
    """Passes every frame on and keeps those of `kinds`."""

    def __init__(self, *kinds):
        super().__init__()
        self.kinds, self.frames = kinds, []

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, self.kinds):
            self.frames.append(frame)
        await self.push_frame(frame, direction)


class RecordingLLM(FlashRTLLMService):
    """Keeps each request's parameters (the messages the server rendered) and each reported
    usage with the number of its request (1-based)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.requests, self.usage = [], []

    def build_chat_completion_params(self, params_from_context):
        params = super().build_chat_completion_params(params_from_context)
        self.requests.append(params)
        return params

    async def start_llm_usage_metrics(self, tokens):
        self.usage.append((len(self.requests), tokens))
        await super().start_llm_usage_metrics(tokens)


async def converse(server) -> dict:
    """Turn 1 (voice_weather); at its first played sentence voice_interrupt barges in and becomes
    turn 2, which runs to its usage report. The microphone runs in real time. Returns what each
    stage produced."""
    base, key = server.url + "/v1", "none"
    stt = OpenAISTTService(base_url=base, api_key=key, settings=OpenAISTTService.Settings(model=server.asr))
    llm = RecordingLLM(base_url=base, api_key=key, settings=FlashRTLLMService.Settings(
        model=server.lm, system_instruction=SYSTEM, temperature=1.0, seed=SEED, max_completion_tokens=128,
        extra={"logit_bias": {str(ord(c)): b for c, b in BIAS.items()}}))
    tts = OpenAITTSService(base_url=base, api_key=key,
                           settings=OpenAITTSService.Settings(model=server.tts, voice="alloy"))
    # end of turn: 0.5 s of silence (VAD) then 0.2 s more (the default, Smart Turn, is a model of
    # its own); 0.5 s keeps "Wait, shorter please." one utterance
    vad = VADProcessor(vad_analyzer=SileroVADAnalyzer(params=VADParams(stop_secs=0.5)))
    stop = SpeechTimeoutUserTurnStopStrategy(user_speech_timeout=0.2)
    pair = LLMContextAggregatorPair(LLMContext(), user_params=LLMUserAggregatorParams(
        user_turn_strategies=UserTurnStrategies(stop=[stop])))
    heard, said = Recorder(TranscriptionFrame), Recorder(LLMFullResponseStartFrame, LLMTextFrame)
    out = Recorder(TTSAudioRawFrame, TTSTextFrame)     # where transport.output() goes
    spoken, cancels = [], []

    @tts.event_handler("on_tts_request")
    async def _request(service, context_id, text):
        spoken.append(text)

    @llm.event_handler("on_reply_cancelled")
    async def _cancelled(service, reply_id, kept_text, answer):
        cancels.append((reply_id, kept_text, answer))

    pipeline = Pipeline([vad, stt, heard, pair.user(), llm, said, tts, out, llm.played, pair.assistant()])
    worker = PipelineWorker(pipeline, cancel_on_idle_timeout=False,
                            params=PipelineParams(audio_in_sample_rate=SR_IN, audio_out_sample_rate=SR_TTS))
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(worker, frame):
        started.set()

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())

    async def until(cond, what, timeout=30.0):
        try:
            async with asyncio.timeout(timeout):
                while not cond():
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"{what} within {timeout} s") from None

    async def speak(name):
        for frame in mic(name):
            await worker.queue_frame(frame)
            await asyncio.sleep(PIECE / SR_IN)

    try:
        await until(started.is_set, "the pipeline did not start")
        await speak("voice_weather")
        await until(lambda: any(isinstance(f, TTSTextFrame) for f in out.frames), "no sentence was played")
        await speak("voice_interrupt")
        await until(lambda: cancels, "the barge-in sent no cancel")
        await until(lambda: any(n == 2 for n, _ in llm.usage), "turn 2 reported no usage")
    finally:
        await worker.cancel()
        await running
    return dict(heard=[f.text for f in heard.frames], said=said.frames, out=out.frames, spoken=spoken,
                cancels=cancels, requests=llm.requests, usage=[u for n, u in llm.usage if n == 2])


def test_pipecat_pipeline_barge_in_reaches_the_servers_cancel(server, ckpt):
    got = asyncio.run(asyncio.wait_for(converse(server), 55))

    # STT: our recognizer's transcripts (random weights: token ids), the LLM asked with them
    assert len(got["heard"]) >= 2 and all(re.fullmatch(r"(<\d+>)+", t) for t in got["heard"]), got["heard"]
    first, second = got["requests"][:2]
    assert first["messages"][-1] == {"role": "user", "content": got["heard"][0]}
    assert second["messages"][-1] == {"role": "user", "content": got["heard"][1]}

    # LLM: text frames of the server's stream, within the biased alphabet
    starts = [i for i, f in enumerate(got["said"]) if isinstance(f, LLMFullResponseStartFrame)]
    reply1 = "".join(f.text for f in got["said"][starts[0]:starts[1]] if isinstance(f, LLMTextFrame))
    assert reply1 and set(reply1) <= set(BIAS), reply1

    # TTS: the first sentence's audio (what came before its TTSTextFrame) is the samples
    # /v1/audio/speech gives for the text the TTS sent (bitwise: the same seed, 0, by default)
    first_text = next(i for i, f in enumerate(got["out"]) if isinstance(f, TTSTextFrame))
    pcm = b"".join(f.audio for f in got["out"][:first_text])
    body = {"model": server.tts, "voice": "alloy", "response_format": "pcm", "input": got["spoken"][0]}
    direct = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=60)
    assert direct.status_code == 200 and len(pcm) > 0 and pcm == direct.content

    # barge-in: the cancel carried the played characters (those Pipecat's context agrees on);
    # the server kept exactly their tokens
    assert len(got["cancels"]) == 1                            # turn 1 only: turn 2 is not cut
    reply_id, kept, answer = got["cancels"][0]
    assert answer["id"] == reply_id and reply_id.startswith("chatcmpl")
    assert 0 < len(kept) < len(reply1) and reply1.startswith(kept), (kept, reply1)
    assert answer["kept_tokens"] == [len(kept.encode())]      # one byte, one token

    # the next turn: Pipecat's context holds the played text, and the server appends to it
    tok, tpl = ByteTokenizer(512), ChatTemplate(ckpt("qwen3_5", "tiny"))
    assistant = second["messages"][-2]
    assert assistant["role"] == "assistant" and assistant["content"].startswith(kept)
    held = tok.encode(tpl.render(first["messages"])) + tok.encode(kept)
    nxt = tok.encode(tpl.render(second["messages"]))
    assert nxt[:len(held)] == held
    (u,) = got["usage"]
    assert (u.prompt_tokens, u.cache_read_input_tokens) == (len(nxt), len(held))


def test_kept_text_is_where_the_stream_and_pipecats_context_agree():
    """The cancel counts the streamed characters that Pipecat's context, rebuilt from the played
    sentences (their edges trimmed), also starts with: a leading space or a double space between
    sentences ends the agreement there, so the server never holds text the next prompt lacks."""
    played = [TextPartForConcatenation("ab.", False), TextPartForConcatenation("cd ee.", False)]
    assert _Reply("r", "ab. cd ee. ff", played).kept() == "ab. cd ee."
    assert _Reply("r", "ab.  cd ee. ff", played).kept() == "ab. "
    assert _Reply("r", " ab. cd ee. ff", played).kept() == ""
    assert _Reply("r", "ab. cd ee. ff", played[:1]).kept() == "ab."

"""flashrt serve's voice agent: the /v1/voice WebSocket (a plain websockets client) against a real
uvicorn server on loopback, over tiny random-weight checkpoints (Qwen3.5 with the released chat
template, Nemotron, Pocket TTS), the real Silero VAD and real speech (tests/data/speech/voice_*.wav).

The weights are random (the VAD's are real), so what is heard and said is noise: the tests check
that the socket gives exactly what flashrt.voice.VoiceAgent gives in-process on the same models
and input (transcripts, reply text, audio within 1 LSB, the conversation's token counts), that
bad input is named and leaves the server serving, that every way a client leaves frees its
session, and that 4 concurrent sessions each get what their input gives alone.
"""
from __future__ import annotations

import base64
import contextlib
import importlib.util
import json
import socket
import struct
import threading
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

if importlib.util.find_spec("silero_vad") is None:
    pytest.skip("silero-vad is not installed (the speech extra)", allow_module_level=True)
pytest.importorskip("fastapi")
pytest.importorskip("multipart")
pytest.importorskip("websockets")
pytest.importorskip("jinja2")            # the released chat template
pytest.importorskip("transformers")      # make_checkpoint writes Nemotron and Pocket TTS through it

from serve_util import Server  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

import flashrt  # noqa: E402
from flashrt.models.checkpoint import make_checkpoint  # noqa: E402
from flashrt.serve.audio_wire import decode_wav  # noqa: E402
from flashrt.serve.voice_wire import TokenIds  # noqa: E402
from flashrt.speech import VoiceActivity, load_synthesizer, load_transcriber  # noqa: E402
from flashrt.voice import (BargeIn, FinalTranscript, ReplyAudio, ReplyText, TurnDone,  # noqa: E402
                           VoiceAgent, VoiceOptions)

DATA = Path(__file__).resolve().parent / "data" / "speech"
SR, OUT_SR = 16000, 24000
PIECE = 3200                 # samples a client frame (0.2 s)
MAX_SEQ = 4096           # a random recognizer's transcript is hundreds of "<id>" tokens
IDLE_S = 3
FAST = {"max_reply_tokens": 16, "tts_max_frames": 6}


def read_wav(name: str) -> np.ndarray:
    with wave.open(str(DATA / f"{name}.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SR, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").copy()


def silence(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(seconds * SR)) * 30).astype(np.int16)


def voice_wav() -> bytes:
    """The voice prompt: 0.2 s of seeded noise at the synthesizer's rate."""
    x = (np.random.default_rng(7).standard_normal(int(0.2 * OUT_SR)) * 0.3 * 32767).astype("<i2")
    fmt = struct.pack("<HHIIHH", 1, 1, OUT_SR, OUT_SR * 2, 2, 16)
    data = x.tobytes()
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt "
            + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny ops contend on 2 threads


@pytest.fixture(scope="module")
def ckpts(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("voice-ckpts")
    return dict(lm=ckpt("qwen3_5", "tiny", chat=True),
                asr=make_checkpoint("nemotron_asr_streaming", "tiny", d / "asr", seed=0),
                tts=make_checkpoint("pocket_tts", "tiny", d / "tts", seed=0))


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    s = Server(ckpts["lm"], "--asr-model", str(ckpts["asr"]), "--asr-sessions", "1", "--tts-model",
               str(ckpts["tts"]), "--tts-sessions", "1", "--max-voice-sessions", "4", "--voice-idle-s",
               str(IDLE_S), "--max-sessions", "1", "--max-seq-len", str(MAX_SEQ), "--threads", "1",
               log=tmp_path_factory.mktemp("srv") / "server.log")
    r = httpx.post(s.url + "/v1/audio/voices", data={"name": "ana"},
                   files={"file": ("ana.wav", voice_wav(), "audio/wav")}, timeout=60)
    assert r.status_code == 200, r.text
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(ckpts):
    """make(**options) -> a VoiceAgent in-process on the server's models, voice and defaults."""
    lm_dir = ckpts["lm"]
    tr = load_transcriber(ckpts["asr"])
    tr.tokenizer = TokenIds()
    synth = load_synthesizer(ckpts["tts"])
    voice = synth.make_voice(torch.from_numpy(decode_wav(voice_wav(), OUT_SR, 30)))
    vad = VoiceActivity()

    def make(**opts) -> VoiceAgent:
        lm = flashrt.load(lm_dir, max_seq_len=MAX_SEQ, dtype="float32")
        return VoiceAgent(lm, tr, vad, synth, voice, VoiceOptions(**opts))
    return make


# ---- a client ---------------------------------------------------------------------------------
def ws_url(server) -> str:
    return server.url.replace("http", "ws") + "/v1/voice"


def update(**session) -> str:
    return json.dumps({"type": "session.update", "session": {
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": SR}}, "output": {"voice": "ana"}},
        **session}})


@contextlib.contextmanager
def open_session(server, **session):
    with connect(ws_url(server), open_timeout=30, max_size=None) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        ws.send(update(**session))
        first = json.loads(ws.recv(timeout=60))
        assert first["type"] == "session.updated", first
        yield ws


def drain(ws, until: str | None = None, timeout: float = 0) -> list:
    """What has arrived (binary frames as bytes); with `until`, up to and including the error
    event answering the event whose id is `until` (the server answers events in order)."""
    out = []
    while True:
        try:
            m = ws.recv(timeout=timeout if until else 0)
        except TimeoutError:
            if until:
                raise
            return out
        out.append(m if isinstance(m, bytes) else json.loads(m))
        if until and isinstance(out[-1], dict) and out[-1].get("type") == "error" \
                and out[-1]["error"]["event_id"] == until:
            return out[:-1]


def sync(ws, tag: str) -> list:
    """Everything the server sends for what was sent before: an unknown event, answered in
    order, marks the end."""
    ws.send(json.dumps({"type": "test.sync", "event_id": tag}))
    return drain(ws, until=tag, timeout=120)


def say(ws, pcm: np.ndarray, on_events=None) -> list:
    out = []
    for i in range(0, len(pcm), PIECE):
        ws.send(pcm[i: i + PIECE].tobytes())
        got = drain(ws)
        out += got
        if on_events is not None:
            on_events(got)
    return out


def of(events, kind: str) -> list:
    return [e for e in events if isinstance(e, dict) and e["type"] == kind]


def audio_of(events) -> np.ndarray:
    """The reply audio, base64 events or binary frames, as int16 samples."""
    raw = b"".join(e if isinstance(e, bytes) else base64.b64decode(e["delta"])
                   for e in events if isinstance(e, bytes) or e["type"] == "response.output_audio.delta")
    return np.frombuffer(raw, "<i2")


def content(events) -> list:
    """The events without their ids and clock readings: what must not depend on other sessions."""
    out = []
    for e in events:
        if isinstance(e, dict):
            r = e.get("response")
            e = {k: v for k, v in e.items() if k not in ("event_id", "item_id", "response_id", "response")}
            if r is not None:
                t = r.get("timings", {})
                kept = ("prefill_tokens", "context_tokens", "endpoint", "branch")
                e["response"] = (r["status"], r.get("output_text"), [t.get(k) for k in kept])
        out.append(e)
    return out


def held(server) -> int:
    return httpx.get(server.url + "/v1/voice/sessions", timeout=30).json()["held"]


def wait_freed(server, n: int = 0, limit_s: float = 10) -> None:
    deadline = time.time() + limit_s
    while held(server) != n:
        assert time.time() < deadline, f"{held(server)} voice sessions still held after {limit_s} s"
        time.sleep(0.1)


def local(agent: VoiceAgent, pcm: np.ndarray) -> list:
    out = []
    for i in range(0, len(pcm), PIECE):
        out += agent.push(torch.from_numpy(pcm[i: i + PIECE].copy()))
    return out


def local_audio(events) -> np.ndarray:
    pcm = [e.pcm.float().numpy() for e in events if isinstance(e, ReplyAudio)]
    return np.clip(np.rint(np.concatenate(pcm) * 32767.0), -32768, 32767).astype(np.int16)


def assert_audio_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and len(got) > 0
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1     # another process


def test_voice_off_is_404_saying_how_to_enable(ckpts):
    from starlette.testclient import TestClient, WebSocketDenialResponse

    from flashrt.serve import build
    app, _ = build(ckpts["lm"], dtype="float32", max_seq_len=256, max_sessions=1, threads=1)
    with TestClient(app, base_url="http://localhost") as c:
        r = c.get("/v1/voice/sessions")
        assert r.status_code == 404 and r.json()["error"]["code"] == "voice_not_enabled"
        with pytest.raises(WebSocketDenialResponse) as denied, c.websocket_connect("ws://localhost/v1/voice"):
            pass
        assert denied.value.status_code == 404
        assert "--max-voice-sessions" in denied.value.json()["error"]["message"]


def test_voice_sessions_need_the_speech_models():
    from flashrt.serve.options import ServeOptions
    with pytest.raises(ValueError, match="--max-voice-sessions needs --asr-model and --tts-model"):
        ServeOptions.from_settings(max_voice_sessions=1, asr_model="asr")
    with pytest.raises(ValueError, match="--voice-idle-s must be > 0"):
        ServeOptions.from_settings(voice_idle_s=0)


# ---- a conversation ---------------------------------------------------------------------------
def test_a_conversation_over_the_socket_is_the_agents(server, reference):
    """Turns from voice_hello and voice_timer (the VAD may cut one in two): speech,
    transcripts, reply text and audio, in order per turn, and all of it what VoiceAgent gives
    in-process on the same models."""
    pcm = np.concatenate([read_wav("voice_hello"), silence(1.0), read_wav("voice_timer"), silence(1.0, 1)])
    with open_session(server, options=FAST) as ws:
        ev = say(ws, pcm) + sync(ws, "end")
    kinds = [e["type"] for e in ev]
    assert "error" not in kinds
    finals = of(ev, "conversation.item.input_audio_transcription.completed")
    done = of(ev, "response.done")
    assert len(finals) >= 2 and {f["branch"] for f in finals} == {"new"}
    assert all(f["transcript"] for f in finals)
    assert len(done) == len(finals) and all(d["response"]["status"] == "completed" for d in done)
    for f, d in zip(finals, done):           # per turn: heard, transcribed, answered, in order
        rid, item = d["response"]["id"], f["item_id"]
        started = next(i for i, e in enumerate(ev) if e["type"] == "input_audio_buffer.speech_started"
                       and e["item_id"] == item)
        stopped = next(i for i, e in enumerate(ev) if e["type"] == "input_audio_buffer.speech_stopped"
                       and e["item_id"] == item)
        created = next(i for i, e in enumerate(ev) if e["type"] == "response.created"
                       and e["response"]["id"] == rid)
        said = [i for i, e in enumerate(ev) if e.get("response_id") == rid]
        assert started < stopped < ev.index(f) < created < min(said) <= max(said) < ev.index(d)
        text = "".join(e["delta"] for e in ev if e["type"] == "response.output_audio_transcript.delta"
                       and e["response_id"] == rid)
        assert text == d["response"]["output_text"] and text
        t = d["response"]["timings"]
        assert t["first_audio"] is not None and 0 < t["prefill_tokens"] <= t["context_tokens"]
    # the same input in-process
    agent = reference(**FAST)
    want = local(agent, pcm)
    assert [f["transcript"] for f in finals] == [e.text for e in want if isinstance(e, FinalTranscript)]
    assert [d["response"]["output_text"] for d in done] == [e.text for e in want if isinstance(e, TurnDone)]
    assert "".join(e["delta"] for e in of(ev, "response.output_audio_transcript.delta")) == \
        "".join(e.delta for e in want if isinstance(e, ReplyText))
    assert [(d["response"]["timings"]["prefill_tokens"], d["response"]["timings"]["context_tokens"])
            for d in done] == [(e.timings.prefill_tokens, e.timings.context_tokens)
                               for e in want if isinstance(e, TurnDone)]
    assert_audio_close(audio_of(ev), local_audio(want))
    wait_freed(server)


def test_barge_in_over_the_socket_keeps_what_was_heard(server, reference):
    """The client reports half the reply played, then speaks over it: the truncation names
    what was played and the text the user heard (the in-process agent's, given the same
    reports), and the next turn appends to that conversation."""
    opts = {"max_reply_tokens": 48, "tts_max_frames": 12}
    with open_session(server, options=opts) as ws:
        ws.send(json.dumps({"type": "output_audio_buffer.played", "samples": 0}))
        ev = say(ws, np.concatenate([read_wav("voice_weather"), silence(0.2)])) + sync(ws, "reply")
        frames = len(audio_of(ev)) // 96
        assert frames >= 4, "the reply is too short to cut"
        played = (frames // 2) * 96 + 96 // 3          # mid-frame
        ws.send(json.dumps({"type": "output_audio_buffer.played", "samples": played}))
        ev2 = say(ws, np.concatenate([read_wav("voice_interrupt"), silence(1.0)])) + sync(ws, "end")
    cut = of(ev2, "conversation.item.truncated")
    assert len(cut) == 1 and cut[0]["played_samples"] == played
    assert cut[0]["item_id"] == of(ev, "response.created")[0]["response"]["output"][0]["id"]
    said = "".join(e["delta"] for e in of(ev, "response.output_audio_transcript.delta"))
    assert said.startswith(cut[0]["transcript"]) and len(cut[0]["transcript"]) < len(said)
    assert [e["type"] for e in ev2].index("input_audio_buffer.speech_started") < ev2.index(cut[0])
    done = of(ev2, "response.done")
    assert done and done[-1]["response"]["status"] == "completed"
    t1, t2 = of(ev, "response.done")[0]["response"]["timings"], done[-1]["response"]["timings"]
    assert t2["prefill_tokens"] < t2["context_tokens"]             # appended, not re-run
    # the in-process agent, told the same
    agent = reference(**opts)
    agent.played(0)
    local(agent, np.concatenate([read_wav("voice_weather"), silence(0.2)]))
    agent.played(played)
    want = local(agent, np.concatenate([read_wav("voice_interrupt"), silence(1.0)]))
    barge = [e for e in want if isinstance(e, BargeIn)]
    assert [(b.heard_text, b.played_samples) for b in barge] == [(cut[0]["transcript"], played)]
    last = [e for e in want if isinstance(e, TurnDone)][-1].timings
    assert (t2["prefill_tokens"], t2["context_tokens"]) == (last.prefill_tokens, last.context_tokens)
    assert t2["context_tokens"] - t2["prefill_tokens"] > t1["context_tokens"] - 1
    wait_freed(server)


# ---- leaving --------------------------------------------------------------------------------
def test_sessions_are_freed_however_the_client_leaves(server):
    """Closing before or after session.update, idling past --voice-idle-s (an error naming it,
    then a 1008 close), and vanishing mid-turn without a close (the TCP socket shut) all free
    the session."""
    with connect(ws_url(server), open_timeout=30) as ws:
        ws.recv(timeout=30)
    with open_session(server, options=FAST):
        assert held(server) == 1
    wait_freed(server)
    with open_session(server, options=FAST) as ws:
        t0 = time.time()
        err = json.loads(ws.recv(timeout=IDLE_S + 30))
        assert err["type"] == "error" and err["error"]["code"] == "idle_timeout"
        assert "--voice-idle-s" in err["error"]["message"] and time.time() - t0 >= IDLE_S - 0.5
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd.code == 1008
    wait_freed(server)
    with open_session(server, options=FAST) as ws:     # mid-turn: speech sent, the reply being made
        say(ws, np.concatenate([read_wav("voice_music"), silence(0.4)]))
        ws.socket.shutdown(socket.SHUT_RDWR)
        ws.socket.close()
    wait_freed(server)
    log = Path(server.log_path).read_text()     # nothing was written to the vanished client
    assert "Traceback" not in log and "socket.send() raised exception" not in log, log[-2000:]


# ---- bad input ------------------------------------------------------------------------------
BAD_FIRST = [
    (b"\x00\x01" * 800, "session_update_expected", "binary frame"),
    ("{not json", "invalid_json", "invalid JSON"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": ""}), "session_update_expected",
     "input_audio_buffer.append"),
    (update(audio={"input": {"format": {"type": "audio/pcm", "rate": 8000}}}), "unsupported_audio_format",
     "16000 Hz"),
    (update(audio={"output": {"voice": "nobody"}}), "voice_not_found", "nobody"),
    (update(audio={"output": {"voice": "default"}}), "voice_unavailable", "POST /v1/audio/voices"),
    (update(options={"max_reply_tokens": 0}), "invalid_session", "max_reply_tokens"),
    (update(options={"without_capsules": True}), "invalid_session", "without_capsules"),
]


@pytest.mark.parametrize("first, code, words", BAD_FIRST,
                         ids=["binary", "json", "audio-first", "8kHz", "voice", "no-prompt", "option", "unknown"])
def test_a_bad_first_message_is_named_and_closed(server, first, code, words):
    with connect(ws_url(server), open_timeout=30) as ws:
        ws.recv(timeout=30)
        ws.send(first)
        err = json.loads(ws.recv(timeout=30))["error"]
        assert err["code"] == code and words in err["message"], err
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd.code == 1008
    wait_freed(server)


def test_garbage_mid_session_is_named_and_the_session_goes_on(server):
    """Torn samples, bad JSON, bad base64, an unknown event, a settings change and an oversized
    frame are each answered by an error naming them; then speech still gets its answer, and
    another session is served alongside."""
    bad = [(b"\x01\x02\x03", "invalid_audio", "3 bytes"),
           ("[1, 2", "invalid_json", "invalid JSON"),
           (json.dumps({"type": "input_audio_buffer.append", "audio": "@@@"}), "invalid_audio", "base64"),
           (json.dumps({"type": "response.create"}), "invalid_event_type", "response.create"),
           (update(), "session_fixed", "first session.update"),
           (json.dumps({"type": "output_audio_buffer.played", "samples": -1}), "invalid_event", "samples"),
           (b"\x00" * ((1 << 19) + 2), "frame_too_large", "limit")]
    with open_session(server, options=FAST) as ws:
        for msg, code, words in bad:
            ws.send(msg)
            err = json.loads(ws.recv(timeout=30))["error"]
            assert err["code"] == code and words in err["message"], err
        with open_session(server, options=FAST):
            ev = say(ws, np.concatenate([read_wav("voice_thanks"), silence(1.0)])) + sync(ws, "end")
            assert not of(ev, "error") and len(of(ev, "response.done")) == 1
            assert held(server) == 2
    wait_freed(server)


# ---- concurrency ------------------------------------------------------------------------------
def _converse(ws, name: str, box: dict) -> None:
    try:
        box[name] = content(say(ws, np.concatenate([read_wav(name), silence(1.0)])) + sync(ws, name))
    except BaseException as e:       # noqa: BLE001 (re-raised by the test)
        box[name] = e


def by_kind(events) -> dict:
    """Events grouped by type (binary audio frames as "binary"), each group in order."""
    out: dict = {}
    for e in events:
        out.setdefault(e["type"] if isinstance(e, dict) else "binary", []).append(e)
    return out


def test_four_concurrent_sessions_each_get_their_own(server):
    """Each of 4 sessions, fed a different WAV at once, gets exactly the events and audio that
    its input gives alone, kind by kind in order (how kinds interleave follows the compute: a
    reply waits while its session lags the microphone), and they differ from one another; a
    fifth is refused with a 429 naming --max-voice-sessions."""
    names = ["voice_hello", "voice_remind", "voice_weather", "voice_music"]

    def start(i):               # half the sessions take their audio as binary frames
        return open_session(server, options={**FAST, "seed": i},
                            output_audio_transport="binary" if i % 2 else "base64")
    alone: dict = {}
    for i, n in enumerate(names):
        with start(i) as ws:
            _converse(ws, n, alone)
        assert not isinstance(alone[n], BaseException), alone[n]
        assert of(alone[n], "response.done") and audio_of(alone[n]).size, n
    assert len({json.dumps([e if isinstance(e, dict) else e.hex() for e in alone[n]]) for n in names}) == 4
    wait_freed(server)
    together: dict = {}
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(start(i)) for i in range(len(names))]
        assert held(server) == 4
        with pytest.raises(InvalidStatus) as refused:
            with connect(ws_url(server), open_timeout=30):
                pass
        assert refused.value.response.status_code == 429
        assert b"--max-voice-sessions" in refused.value.response.body
        threads = [threading.Thread(target=_converse, args=(ws, n, together)) for ws, n in zip(sockets, names)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for n in names:
        assert not isinstance(together[n], BaseException), together[n]
        assert by_kind(together[n]) == by_kind(alone[n]), \
            f"{n}: a concurrent session's events differ from its run alone"
    wait_freed(server)

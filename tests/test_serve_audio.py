"""flashrt serve's speech routes: POST /v1/audio/transcriptions (the official openai client) and
the Realtime transcription WebSocket (a plain websockets client) against a real uvicorn server on
loopback, over a tiny random-weight Nemotron checkpoint and Silero VAD's real weights.

Random weights have no tokenizer: a transcript is its token ids as "<id>". Every transcript is
checked against the same recognizer run in-process (push, then the endpoint fork's flush), and
the speech spans against VoiceActivity on the real-speech WAVs of tests/data/speech/.
"""
from __future__ import annotations

import base64
import importlib.util
import json
import math
import socket
import struct
import sys
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("multipart")
pytest.importorskip("websockets")
pytest.importorskip("transformers")      # make_checkpoint writes Nemotron through transformers

from serve_util import Server  # noqa: E402
from websockets.exceptions import InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from flashrt.models.checkpoint import make_checkpoint  # noqa: E402
from flashrt.speech import SpeechStart, load_transcriber  # noqa: E402

HAS_VAD = importlib.util.find_spec("silero_vad") is not None
DATA = Path(__file__).resolve().parent / "data" / "speech"
SR = 16000
FRAME = 1280            # samples per encoder frame (80 ms)
MAX_AUDIO_S = 90


def text_of(ids) -> str:
    return "".join(f"<{t}>" for t in ids)


def read_wav(name: str) -> np.ndarray:
    with wave.open(str(DATA / f"{name}.wav")) as w:
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").copy()


def wav(samples: np.ndarray, rate: int = SR, tag: int = 1) -> bytes:
    """A WAV file of (n,) or (n, channels) samples: int16 as PCM, float32 as IEEE float (tag 3)."""
    x = samples if samples.ndim == 2 else samples[:, None]
    data = x.astype("<i2" if tag == 1 else "<f4").tobytes()
    bits, ch = (16 if tag == 1 else 32), x.shape[1]
    fmt = struct.pack("<HHIIHH", tag, ch, rate, rate * ch * bits // 8, ch * bits // 8, bits)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt "
            + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


def chirp(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    f = 200 + 150 * np.sin(2 * math.pi * 0.7 * t)
    tone = np.sin(2 * math.pi * np.cumsum(f) / SR) * (0.5 + 0.5 * np.sin(2 * math.pi * 1.3 * t))
    return (0.3 * tone * 32767).astype(np.int16)


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny ops contend on 2 threads


@pytest.fixture(scope="module")
def asr(tmp_path_factory):
    return make_checkpoint("nemotron_asr_streaming", "tiny", tmp_path_factory.mktemp("asr"), seed=0)


@pytest.fixture(scope="module")
def lm(ckpt):
    return ckpt("qwen3_5", "tiny")


@pytest.fixture(scope="module")
def server(lm, asr, tmp_path_factory):
    s = Server(lm, "--asr-model", str(asr), "--asr-sessions", "1", "--max-audio-s", str(MAX_AUDIO_S),
               "--threads", "1", log=tmp_path_factory.mktemp("srv") / "server.log")
    s.asr = Path(asr).name
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tr(asr):
    return load_transcriber(asr)


def reference(tr, pcm: np.ndarray) -> list:
    """Tokens of a whole file: pushed, then the endpoint fork's flush."""
    tr.reset()
    x = pcm.astype(np.float32) / 32768.0 if pcm.dtype == np.int16 else pcm
    return list(tr.push(x).tokens) + list(tr.endpoint().tokens)


def post(server, files=None, data=None, **kw):
    return httpx.post(server.url + "/v1/audio/transcriptions", files=files, data=data,
                      headers=server.headers(), timeout=60, **kw)


def refused(r, status: int, code: str, *words) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}, err
    assert all(w in err["message"] for w in words), err["message"]
    return err


# ---- POST /v1/audio/transcriptions ---------------------------------------------------------------
def test_transcriptions_openai_client(server, tr):
    """json, text, verbose_json (segments = the VAD's speech spans), srt and stream=True all give
    the in-process recognizer's tokens; stereo and float WAVs decode to the same samples."""
    c, pcm = server.client(), read_wav("two_utterances")
    want = text_of(reference(tr, pcm))
    f = ("speech.wav", wav(pcm), "audio/wav")
    j = c.audio.transcriptions.create(model=server.asr, file=f, language="en", prompt="ignored", temperature=0)
    assert j.text == want and j.usage.seconds == pytest.approx(len(pcm) / SR, abs=1e-3)
    assert c.audio.transcriptions.create(model=server.asr, file=f, response_format="text") == want
    v = c.audio.transcriptions.create(model=server.asr, file=f, response_format="verbose_json",
                                      timestamp_granularities=["segment"])
    assert v.text == want and v.duration == pytest.approx(len(pcm) / SR, abs=1e-3)
    assert "".join(s.text for s in v.segments) == want
    if HAS_VAD:
        from flashrt.speech import VoiceActivity
        vad = VoiceActivity()
        ev = list(vad.push(pcm).events) + list(vad.finish().events)
        spans = [(round(a.seconds, 3), round(b.seconds, 3)) for a, b in zip(ev[::2], ev[1::2])]
        assert [(s.start, s.end) for s in v.segments] == spans and len(spans) == 2
        assert all(0 <= s.no_speech_prob < 0.5 for s in v.segments)
    srt = c.audio.transcriptions.create(model=server.asr, file=f, response_format="srt")
    assert srt.startswith("1\n00:00:") and " --> " in srt
    events = list(c.audio.transcriptions.create(model=server.asr, file=f, stream=True))
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1) and len(events) > 2
    assert events[-1].type == "transcript.text.done" and events[-1].text == want
    assert "".join(e.delta for e in events[:-1]) == want
    for variant in (wav(np.stack([pcm, pcm], 1)), wav(pcm.astype(np.float32) / 32768.0, tag=3)):
        assert post(server, {"file": ("v.wav", variant)}).json()["text"] == want


def test_bad_audio_and_fields_are_400s_naming_the_problem(server):
    pcm = chirp(1.0)
    ok = wav(pcm)
    refused(post(server, {"file": ("a.wav", wav(pcm, rate=8000))}), 400, "unsupported_sample_rate",
            "8000 Hz", "16000 Hz")
    refused(post(server, {"file": ("a.mp3", b"ID3\x03\x00" + bytes(500))}), 400, "invalid_audio_format", "not a WAV")
    refused(post(server, {"file": ("a.wav", b"")}), 400, "empty_audio", "empty")
    refused(post(server, {"file": ("a.wav", wav(pcm[:0]))}), 400, "empty_audio", "no audio samples")
    refused(post(server, {"file": ("a.wav", ok[: len(ok) // 2])}), 400, "truncated_audio", "truncated", "data chunk")
    refused(post(server, {"file": ("a.wav", ok[:30])}), 400, "truncated_audio", "truncated")
    odd = ok[:40] + struct.pack("<I", len(ok) - 45) + ok[44:-1]      # a data chunk of 1999.5 samples
    refused(post(server, {"file": ("a.wav", odd)}), 400, "truncated_audio", "inside a 2-byte frame")
    long = wav(np.zeros((MAX_AUDIO_S + 1) * SR, np.int16))
    refused(post(server, {"file": ("a.wav", long)}), 400, "audio_too_long", f"{MAX_AUDIO_S} s", "--max-audio-s")
    eight_bit = bytearray(ok)
    eight_bit[34:36] = struct.pack("<H", 8)
    refused(post(server, {"file": ("a.wav", bytes(eight_bit))}), 400, "invalid_audio_format", "8-bit PCM")
    f = {"file": ("a.wav", ok)}
    assert refused(post(server, f, {"response_format": "diarized_json"}), 400, None)["param"] == "response_format"
    refused(post(server, f, {"include[]": "logprobs"}), 400, "unsupported_parameter", "not implemented")
    refused(post(server, f, {"model": "whisper-1"}), 404, "model_not_found", server.asr)
    assert post(server, {"model": (None, server.asr)}).json()["error"]["param"] == "file"   # no file part
    refused(httpx.post(server.url + "/v1/audio/transcriptions", json={"file": "x"}), 400,
            "unsupported_media_type", "multipart/form-data")


# ---- the Realtime WebSocket ----------------------------------------------------------------------
def ws_url(server, query="?intent=transcription") -> str:
    return server.url.replace("http://", "ws://") + "/v1/realtime" + query


def append(ws, pcm: np.ndarray, step: int = 1600) -> None:
    for i in range(0, len(pcm), step):
        ws.send(json.dumps({"type": "input_audio_buffer.append",
                            "audio": base64.b64encode(pcm[i: i + step].tobytes()).decode()}))


def until(ws, pred, limit: int = 10_000) -> list:
    out = []
    while len(out) < limit:
        e = json.loads(ws.recv(timeout=30))
        out.append(e)
        if pred(e):
            return out
    raise AssertionError(f"no such event in {out[-5:]}")


def vad_items(tr, pcm: np.ndarray):
    """What the server must say for pcm from a fresh stream: per utterance the VAD's start and
    end (ms) and the transcript: live tokens of frames from its start (and past the previous
    flush), then the endpoint fork flushed at the chunk that decided the end."""
    from flashrt.speech import VoiceActivity
    vad = VoiceActivity()
    tr.reset()
    x = pcm.astype(np.float32) / 32768.0
    out, live, pos, floor, start = [], [], 0, 0, 0
    for ev in vad.push(x).events:
        cut = (ev.chunk + 1) * vad.chunk_samples
        r = tr.push(x[pos:cut])
        live += zip(r.tokens, r.frames)
        pos = cut
        if isinstance(ev, SpeechStart):
            start, start_ms = ev.sample // FRAME, int(ev.sample * 1000 / SR)
            continue
        fin = tr.endpoint()
        lo = max(floor, start)
        toks = [t for t, f in live if f >= lo] + [t for t, f in zip(fin.tokens, fin.frames) if f >= lo]
        out.append((start_ms, int(ev.sample * 1000 / SR), text_of(toks)))
        floor, live = max(floor, fin.end_frame), []
    return out


@pytest.mark.skipif(not HAS_VAD, reason="server VAD needs silero-vad")
def test_realtime_server_vad_endpoint_fork(server, tr):
    """Real speech, appended in 100 ms pieces: speech_started / speech_stopped at the VAD's times,
    and at each stop the endpoint fork's final transcript at once (deltas, then completed); the
    live stream goes on untouched, so the second utterance is the uninterrupted stream's. A
    clear restarts the stream (session times go on)."""
    with connect(ws_url(server)) as ws:
        created = json.loads(ws.recv(timeout=30))
        assert created["type"] == "session.created"
        assert created["session"]["turn_detection"]["type"] == "server_vad"
        offset = 0
        for name in ("two_utterances", "short_pause"):
            pcm = read_wav(name)
            want = vad_items(tr, pcm)
            append(ws, pcm)
            got = []
            for start_ms, end_ms, transcript in want:
                evs = until(ws, lambda e: e["type"].endswith("transcription.completed"))
                kinds = [e["type"] for e in evs]
                assert kinds[0] == "input_audio_buffer.speech_started", kinds
                started, stopped = evs[0], next(e for e in evs if e["type"].endswith("speech_stopped"))
                assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("input_audio_buffer.committed")
                item = started["item_id"]
                assert started["audio_start_ms"] == offset + start_ms and stopped["audio_end_ms"] == offset + end_ms
                assert all(e.get("item_id") == item for e in evs)
                deltas = "".join(e["delta"] for e in evs if e["type"].endswith("transcription.delta"))
                assert evs[-1]["transcript"] == deltas == transcript
                got.append(item)
            assert len(got) == len(want) >= 1
            ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            assert until(ws, lambda e: e["type"] == "input_audio_buffer.cleared")[-1]["type"].endswith("cleared")
            offset += len(pcm) * 1000 // SR


def test_realtime_manual_commit_and_errors(server, tr):
    """turn_detection null: the client commits; the completed transcript is the whole audio's
    (pushed, then the endpoint flush). Bad events are error events naming the problem, and the
    connection stays usable."""
    pcm = chirp(2.5)
    with connect(ws_url(server)) as ws:
        json.loads(ws.recv(timeout=30))
        ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription",
                            "audio": {"input": {"turn_detection": None}}}}))
        assert until(ws, lambda e: e["type"] == "session.updated")[-1]["session"]["turn_detection"] is None
        bad = [({"type": "input_audio_buffer.append", "audio": "%%%", "event_id": "e1"}, "invalid_audio"),
               ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}, "invalid_audio"),
               ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty"),
               ({"type": "response.create"}, "invalid_event_type"),
               ({"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad"}}}, None),
               ({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}},
                "unsupported_audio_format")]
        for ev, code in bad:
            ws.send(json.dumps(ev))
            err = until(ws, lambda e: True)[-1]
            assert err["type"] == "error" and err["error"]["code"] == code, err
        assert err["error"]["param"] == "session.input_audio_format"
        ws.send("not json")
        assert until(ws, lambda e: True)[-1]["error"]["code"] == "invalid_json"
        ws.send(b"\x00\x01")
        assert until(ws, lambda e: True)[-1]["error"]["code"] == "invalid_event"
        append(ws, pcm)
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        evs = until(ws, lambda e: e["type"].endswith("transcription.completed"))
        assert not any(e["type"].startswith("input_audio_buffer.speech") for e in evs)
        assert evs[-1]["transcript"] == text_of(reference(tr, pcm))
        assert "".join(e["delta"] for e in evs if e["type"].endswith(".delta")) == evs[-1]["transcript"]
        if not HAS_VAD:
            return
        # server VAD switched on mid-stream, with its own rules: times count from the stream start
        from flashrt.speech import VadRules, VoiceActivity
        ws.send(json.dumps({"type": "transcription_session.update", "session": {"turn_detection": {
            "type": "server_vad", "threshold": 0.6, "silence_duration_ms": 300, "prefix_padding_ms": 50}}}))
        up = until(ws, lambda e: True)[-1]
        assert up["type"] == "transcription_session.updated" and up["session"]["turn_detection"] == {
            "type": "server_vad", "threshold": 0.6, "prefix_padding_ms": 50, "silence_duration_ms": 300}
        speech = read_wav("two_utterances")
        rules = VadRules(threshold=0.6, min_silence_duration_ms=300, speech_pad_ms=50)
        want = [int(len(pcm) * 1000 / SR + e.sample * 1000 / SR)
                for e in VoiceActivity(rules=rules).push(speech).events]
        append(ws, speech)
        got = []
        while len(got) < len(want):
            e = until(ws, lambda e: e["type"].startswith("input_audio_buffer.speech_"))[-1]
            got.append(e.get("audio_start_ms", e.get("audio_end_ms")))
        assert got == want and len(want) >= 2


def test_sessions_bounded_429_and_vanished_clients_free_them(server):
    """--asr-sessions 1: while a WebSocket holds the session, a file and a second socket get 429;
    a socket or an SSE stream whose client vanishes mid-stream frees it at once."""
    f = {"file": ("a.wav", wav(chirp(0.5)))}
    deadline = time.monotonic() + 60                # the previous test's socket frees its session
    while post(server, f).status_code == 429 and time.monotonic() < deadline:   # asynchronously
        time.sleep(0.1)
    with connect(ws_url(server)) as ws:
        json.loads(ws.recv(timeout=30))
        append(ws, chirp(0.5))
        refused(post(server, f), 429, "asr_sessions_busy", "--asr-sessions 1")
        with pytest.raises(InvalidStatus) as denied:
            connect(ws_url(server))
        assert denied.value.response.status_code == 429
        ws.socket.shutdown(socket.SHUT_RDWR)        # vanish: no close frame
    deadline = time.monotonic() + 5
    while (r := post(server, f)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    # an SSE stream of 60 s of audio, dropped after its first delta
    long = {"file": ("long.wav", wav(chirp(60.0)))}
    t0 = time.monotonic()
    full = post(server, long)
    full_s = time.monotonic() - t0
    assert full.status_code == 200
    with httpx.stream("POST", server.url + "/v1/audio/transcriptions", files=long,
                      data={"stream": "true"}, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["type"] == "transcript.text.delta"
    t0 = time.monotonic()                        # closed with most of the audio still to run
    while (r := post(server, f)).status_code == 429 and time.monotonic() - t0 < full_s:
        time.sleep(0.02)
    freed = time.monotonic() - t0
    assert r.status_code == 200 and freed < 0.5 * full_s, (freed, full_s)


def test_websocket_passes_the_guard(server):
    """Without an API key a WebSocket from another origin is refused like an HTTP request."""
    with pytest.raises(InvalidStatus) as denied:
        connect(ws_url(server), origin="http://evil.example")
    assert denied.value.response.status_code == 403
    with pytest.raises(InvalidStatus) as denied:
        connect(ws_url(server, ""))
    assert denied.value.response.status_code == 400 and b"intent=transcription" in denied.value.response.body


# ---- in-process: speech off, VAD missing, API keys ------------------------------------------------
def test_speech_off_is_404_saying_how_to_enable(lm):
    from starlette.testclient import TestClient, WebSocketDenialResponse

    from flashrt.serve import build
    app, _ = build(lm, dtype="float32", max_seq_len=256, max_sessions=1, threads=1)
    with TestClient(app, base_url="http://localhost") as c:
        r = c.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav(chirp(0.2)))})
        refused(r, 404, "asr_not_enabled", "--asr-model")
        with pytest.raises(WebSocketDenialResponse) as denied, \
                c.websocket_connect("ws://localhost/v1/realtime?intent=transcription"):
            pass
        assert denied.value.status_code == 404 and "--asr-model" in denied.value.json()["error"]["message"]


def test_without_silero_vad_server_vad_is_refused(lm, asr, tr, monkeypatch):
    """silero-vad absent: the socket says so in an error event and takes commits; turning server
    VAD on is an error event; verbose_json has one segment over the file; an API key guards the
    socket too."""
    from starlette.testclient import TestClient, WebSocketDenialResponse

    from flashrt.serve import build
    monkeypatch.setitem(sys.modules, "silero_vad", None)      # `import silero_vad` fails
    app, _ = build(lm, dtype="float32", max_seq_len=256, max_sessions=1, threads=1,
                   asr_model=str(asr), api_key="sk-test-audio-key-0123456789")
    key = {"Authorization": "Bearer sk-test-audio-key-0123456789"}
    url = "ws://localhost/v1/realtime?intent=transcription"
    pcm = chirp(1.5)
    with TestClient(app, base_url="http://localhost") as c:
        with pytest.raises(WebSocketDenialResponse) as denied, c.websocket_connect(url):
            pass
        assert denied.value.status_code == 401
        with c.websocket_connect(url, headers=key) as ws:
            assert ws.receive_json()["session"]["turn_detection"] is None
            err = ws.receive_json()
            assert err["type"] == "error" and err["error"]["code"] == "vad_unavailable"
            assert "silero-vad" in err["error"]["message"] and "commit" in err["error"]["message"]
            ws.send_json({"type": "session.update", "session": {"turn_detection": {"type": "server_vad"}}})
            assert ws.receive_json()["error"]["code"] == "vad_unavailable"
            ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm.tobytes()).decode()})
            ws.send_json({"type": "input_audio_buffer.commit"})
            while (e := ws.receive_json())["type"] != "conversation.item.input_audio_transcription.completed":
                pass
            assert e["transcript"] == text_of(reference(tr, pcm))
        v = c.post("/v1/audio/transcriptions", files={"file": ("a.wav", wav(pcm))},
                   data={"response_format": "verbose_json"}, headers=key).json()
        assert [(s["start"], s["end"]) for s in v["segments"]] == [(0.0, 1.5)]

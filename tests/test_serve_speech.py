"""flashrt serve's speech out: POST /v1/audio/speech through the official openai client and voices
(/v1/audio/voices) against a real uvicorn server on loopback, over a tiny random-weight Pocket TTS
checkpoint (its audio is noise-like: only identity of samples is checked, never how it sounds).

Every answer is checked against the same synthesizer run in-process (reply with the seed, then
say() per chunk of the text cut as the server cuts it), within 1 LSB of 16-bit PCM (another
process); answers of the server to one request are compared with each other bitwise.
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import shutil
import struct
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("multipart")
pytest.importorskip("transformers")      # make_checkpoint writes Pocket TTS through transformers

from serve_util import Server  # noqa: E402

from flashrt.models.checkpoint import make_checkpoint  # noqa: E402
from flashrt.speech import SentenceRule, load_synthesizer, split_sentences  # noqa: E402

SR = 24000
TEXT = ("the quick brown fox jumps over the lazy dog. a second sentence follows here, with a "
        "clause! and a third?")
RULE = SentenceRule(frozenset(b".!?"), frozenset(b",;:"), 50, lambda ids: bytes(ids).decode("utf-8", "replace"))


def wav(samples: np.ndarray, rate: int = SR) -> bytes:
    """A 16-bit PCM mono WAV of int16 samples."""
    data = samples.astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE" + b"fmt "
            + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)


def noise(seconds: float, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    return (g.standard_normal(int(seconds * SR)) * 0.3 * 32767).clip(-32768, 32767).astype(np.int16)


def pcm_of(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny ops contend on 2 threads


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return make_checkpoint("pocket_tts", "tiny", tmp_path_factory.mktemp("tts"), seed=0)


@pytest.fixture(scope="module")
def lm(ckpt):
    return ckpt("qwen3_5", "tiny")


def start(lm, tts, caps, log, *args, **kw):
    s = Server(lm, "--tts-model", str(tts), "--tts-sessions", "1", "--capsule-dir", str(caps),
               "--max-speech-chars", "20000", "--max-voice-s", "1", "--threads", "1", *args, log=log, **kw)
    s.tts = Path(tts).name
    return s


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    return tmp_path_factory.mktemp("caps")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two API keys, two tenants: requests here send the first."""
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("key-one\nkey-two\n")
    return ("--api-keys", str(path))


@pytest.fixture(scope="module")
def server(lm, tts, caps, keys, tmp_path_factory):
    s = start(lm, tts, caps, tmp_path_factory.mktemp("srv") / "server.log", *keys, api_key="key-one",
              key_arg=False)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def synth(tts):
    return load_synthesizer(tts, dtype="float32")


def reference(synth, text: str, voice=None, seed: int = 0) -> np.ndarray:
    """The in-process run, the text cut into chunks as the server cuts it."""
    synth.reply(voice, seed=seed)
    x = torch.cat([pcm for c in split_sentences(list(text.encode()), RULE) for pcm in synth.say(c)]).numpy()
    return np.clip(np.rint(x * 32767.0), -32768, 32767).astype(np.int32)


def close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.abs(got - want).max(initial=0) <= 1


def speak(server, **body):
    return httpx.post(server.url + "/v1/audio/speech", json={"model": server.tts, "voice": "default", **body},
                      headers=server.headers(), timeout=60)


def refused(r, status: int, code: str | None, param: str | None, *words) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == code and err["param"] == param, err
    assert all(w in err["message"] for w in words), err["message"]


def upload(server, name: str, data: bytes, **fields):
    return httpx.post(server.url + "/v1/audio/voices", data={"name": name, **fields},
                      files={"file": ("ref.wav", data, "audio/wav")}, headers=server.headers(), timeout=60)


def voices(server, headers=None) -> dict:
    r = httpx.get(server.url + "/v1/audio/voices", headers=headers or server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    return {v["id"]: v["predefined"] for v in r.json()["data"]}


# ---- POST /v1/audio/speech -----------------------------------------------------------------------
def test_speech_openai_client_stream_formats_agree(server, synth):
    """pcm through create() and with_streaming_response, wav and sse: the same samples, bitwise,
    and the in-process synthesizer's; another seed (extension) other samples."""
    c = server.client()
    ids = [m.id for m in c.models.list().data]
    assert ids[1:] == [server.tts], ids           # the language model first, then the TTS model
    kw = dict(model=server.tts, voice="default", input=TEXT)
    whole = c.audio.speech.create(response_format="pcm", **kw).content
    with c.audio.speech.with_streaming_response.create(response_format="pcm", **kw) as r:
        assert r.headers["content-type"] == "audio/pcm"
        parts = list(r.iter_bytes())
    assert b"".join(parts) == whole and len(whole) % 2 == 0
    close(pcm_of(whole), reference(synth, TEXT))

    w = c.audio.speech.create(response_format="wav", **kw).content
    riff, size, wave, fmt_id, fmt_len = struct.unpack_from("<4sI4s4sI", w)
    tag, ch, rate, byte_rate, block, bits = struct.unpack_from("<HHIIHH", w, 20)
    data_id, data_size = struct.unpack_from("<4sI", w, 36)
    assert (riff, wave, fmt_id, fmt_len, data_id) == (b"RIFF", b"WAVE", b"fmt ", 16, b"data")
    assert (tag, ch, rate, byte_rate, block, bits) == (1, 1, SR, 2 * SR, 2, 16)
    assert size == data_size == 0xFFFFFFFF and w[44:] == whole      # streamed: sizes "to the end"

    with c.audio.speech.with_streaming_response.create(response_format="pcm", stream_format="sse", **kw) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert events[-1]["type"] == "speech.audio.done" and len(deltas) == len(events) - 1
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == whole
    frames = len(whole) // 2 // synth.frame_size
    assert len(deltas) == frames                   # one event per frame, as the model made them
    assert events[-1]["usage"] == {"input_tokens": len(TEXT.encode()), "output_tokens": frames,
                                   "total_tokens": len(TEXT.encode()) + frames}

    other = c.audio.speech.create(response_format="pcm", extra_body={"seed": 7}, **kw).content
    close(pcm_of(other), reference(synth, TEXT, seed=7))
    assert other != whole


def test_speed_stretches_the_stream(server):
    """speed 2 and 0.5: round(n / speed) samples of the speed-1 answer's n, streamed as create()
    gets them (the stretch runs as frames arrive)."""
    c, kw = server.client(), dict(model=server.tts, voice="default", input=TEXT, response_format="pcm")
    n = len(c.audio.speech.create(**kw).content) // 2
    for speed in (2.0, 0.5):
        whole = c.audio.speech.create(speed=speed, **kw).content
        with c.audio.speech.with_streaming_response.create(speed=speed, **kw) as r:
            assert b"".join(r.iter_bytes()) == whole
        assert len(whole) // 2 == round(n / speed)


def test_time_stretch_keeps_the_pitch_and_its_pieces():
    """TimeStretch (WSOLA) on a 440 Hz tone: round(n / speed) samples whose spectral peak stays at
    440 Hz; pushed in uneven pieces, the same samples as pushed whole."""
    from flashrt.serve.stretch import TimeStretch
    t = np.arange(SR) / SR
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    for speed in (0.5, 1.5, 3.0):
        s = TimeStretch(speed, SR)
        whole = np.concatenate([s.push(tone), s.finish()])
        assert len(whole) == round(SR / speed)
        peak = np.argmax(np.abs(np.fft.rfft(whole))) * SR / len(whole)
        assert abs(peak - 440) <= SR / len(whole) * 1.5, (speed, peak)
        s, cuts, parts = TimeStretch(speed, SR), [0, 1, 97, 1000, 1001, 9000, SR], []
        for a, b in zip(cuts, cuts[1:]):
            parts.append(s.push(tone[a:b]))
        assert np.array_equal(np.concatenate(parts + [s.finish()]), whole)


def test_bad_requests_are_4xx_naming_the_field(server):
    """Each refusal is OpenAI's error shape naming the parameter; the server keeps serving."""
    refused(speak(server, input="hi", voice="nobody"), 404, "voice_not_found", "voice", "nobody")
    refused(speak(server, input="x" * 20001), 400, "string_above_max_length", "input", "20001", "20000")
    refused(speak(server, input="   "), 400, "empty_input", "input")
    refused(speak(server, input="hi", response_format="mp3"), 400, "unsupported_response_format",
            "response_format", "mp3", "encoder", "pcm", "wav")
    refused(speak(server, input="hi", response_format="ogg"), 400, "unsupported_response_format",
            "response_format", "ogg")
    refused(speak(server, input="hi", speed=9), 400, None, "speed", "[0.25, 4.0]")
    refused(speak(server, input="hi", stream_format="chunks"), 400, None, "stream_format", "chunks")
    refused(speak(server, input="hi", instructions="cheerful"), 400, "unsupported_parameter", "instructions")
    refused(speak(server, input="hi", volume=3), 400, "unsupported_parameter", "volume", "volume")
    refused(speak(server, input="hi", model="tts-1"), 404, "model_not_found", "model", "tts-1")
    refused(speak(server, input=7), 400, None, "input")
    refused(upload(server, "bad", b"not a wav at all"), 400, "invalid_audio_format", "file", "WAV")
    refused(upload(server, "bad", wav(noise(0.2, 1))[:60]), 400, "truncated_audio", "file", "truncated")
    refused(upload(server, "bad", wav(noise(0.2, 1), rate=16000)), 400, "unsupported_sample_rate", "file",
            "16000", "24000")
    refused(upload(server, "bad", wav(noise(1.5, 1))), 400, "audio_too_long", "file", "--max-voice-s")
    refused(upload(server, "no.dots", wav(noise(0.2, 1))), 400, "invalid_voice_name", "name")
    refused(upload(server, "default", wav(noise(0.2, 1))), 409, "voice_exists", "name", "default")
    refused(upload(server, "x", wav(noise(0.2, 1)), extra="1"), 400, "unsupported_parameter", "extra")
    r = httpx.post(server.url + "/v1/audio/voices", files={"name": (None, "nofile")}, headers=server.headers())
    refused(r, 400, None, "file", "file is required")
    assert "bad" not in voices(server)
    assert speak(server, input="still here", response_format="pcm").status_code == 200


# ---- voices ----------------------------------------------------------------------------------------
def test_voice_upload_speaks_list_delete(server, synth):
    """An uploaded voice is the in-process make_voice of the same WAV: speech from it is the
    reference's and differs from the default voice; it is listed, refuses a second upload, and
    once deleted is a 404 to speak with or delete again. `default` cannot be deleted."""
    ref = noise(0.4, 2)
    r = upload(server, "ana", wav(ref))
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "ana", "object": "audio.voice", "predefined": False}
    assert voices(server) == {"default": True, "ana": False}
    refused(upload(server, "ana", wav(ref)), 409, "voice_exists", "name", "ana")

    text = "a voice of its own."
    mine = speak(server, input=text, voice="ana", response_format="pcm")
    again = speak(server, input=text, voice={"id": "ana"}, response_format="pcm")     # OpenAI's object form
    plain = speak(server, input=text, response_format="pcm")
    assert mine.status_code == again.status_code == plain.status_code == 200
    assert mine.content == again.content and mine.content != plain.content
    voice = synth.make_voice(torch.from_numpy(ref.astype(np.float32) / 32768.0))
    close(pcm_of(mine.content), reference(synth, text, voice))
    close(pcm_of(plain.content), reference(synth, text))

    d = httpx.delete(server.url + "/v1/audio/voices/ana", headers=server.headers())
    assert d.status_code == 200 and d.json()["deleted"] is True
    refused(speak(server, input=text, voice="ana"), 404, "voice_not_found", "voice", "ana")
    refused(httpx.delete(server.url + "/v1/audio/voices/ana", headers=server.headers()), 404,
            "voice_not_found", "name", "ana")
    refused(httpx.delete(server.url + "/v1/audio/voices/default", headers=server.headers()), 400,
            "voice_predefined", "name", "default")
    assert voices(server) == {"default": True}


def test_a_client_that_goes_away_frees_its_synthesizer(server):
    """--tts-sessions 1: while a stream is read, another request gets a 429; a client that
    closes the stream after its first bytes frees the synthesizer at the next frame (the whole
    answer, 580 sentences of random-weight speech, would hold it for about a minute)."""
    long = "on and on it goes without a stop, " * 580
    body = {"model": server.tts, "voice": "default", "input": long, "response_format": "pcm"}
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, headers=server.headers(),
                      timeout=60) as r:
        assert r.status_code == 200
        body = r.iter_raw()                # held: a dropped iterator closes the connection
        assert next(body)
        refused(speak(server, input="busy?"), 429, "tts_sessions_busy", None, "--tts-sessions 1")
    deadline = time.monotonic() + 10
    while (r := speak(server, input="free?")).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.status_code == 200, r.text


def test_speech_off_is_404_saying_how(lm):
    """Without --tts-model (the app in-process): the routes say how to enable them."""
    from flashrt.serve import build
    app, engine = build(lm, max_seq_len=64, max_sessions=1)

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            return (await c.post("/v1/audio/speech", json={"model": "x", "input": "hi", "voice": "default"}),
                    await c.get("/v1/audio/voices"), await c.get("/v1/models"))
    try:
        speech, listing, models = asyncio.run(ask())
    finally:
        engine.close()
    refused(speech, 404, "tts_not_enabled", None, "--tts-model")
    refused(listing, 404, "tts_not_enabled", None, "--tts-model")
    assert [m["id"] for m in models.json()["data"]] == [Path(lm).name]


def test_checkpoint_voices_are_predefined(tts, tmp_path):
    """A checkpoint's voices/ folder: each file a predefined voice, `default` the first by name
    (latents: make_voice(latents=); a WAV: make_voice(pcm)); without one, no voice prompt."""
    from safetensors.torch import save_file

    from flashrt.serve.options import ServeOptions
    from flashrt.serve.speech import SpeechWorker
    ckpt = tmp_path / "tts"
    shutil.copytree(tts, ckpt)
    (ckpt / "voices").mkdir()
    fresh = load_synthesizer(tts, dtype="float32")       # a voice capsule holds the noise stream's state too
    latents = torch.randn(5, fresh.net.latent_dim, generator=torch.Generator().manual_seed(4))
    save_file({"audio_prompt_latents": latents}, str(ckpt / "voices" / "alba.safetensors"))
    (ckpt / "voices" / "bob.wav").write_bytes(wav(noise(0.2, 5)))
    (ckpt / "voices" / "notes.txt").write_text("not a voice")
    w = SpeechWorker(ServeOptions.from_settings(tts_model=str(ckpt), tts_sessions=1, threads=1))
    try:
        assert list(w.predefined) == ["default", "alba", "bob"]
        want = fresh.make_voice(latents=latents)
        assert torch.equal(w.predefined["default"].data, want.data)
        assert w.predefined["alba"] is w.predefined["default"]
    finally:
        w.close()
    bare = SpeechWorker(ServeOptions.from_settings(tts_model=str(tts), tts_sessions=1, threads=1))
    try:
        assert bare.predefined == {"default": None}
    finally:
        bare.close()


def test_voice_survives_a_restart_and_is_its_keys_own(server, lm, tts, caps, keys, tmp_path):
    """With --capsule-dir a voice is a file: the server restarted on its directory lists it and
    speaks with it bitwise as before (same input and seed). Another API key neither sees nor
    speaks with it. Last in the module: it restarts the module's server."""
    body = dict(input="kept across restarts.", voice="kept", response_format="pcm", seed=3)
    assert upload(server, "kept", wav(noise(0.3, 3))).status_code == 200
    before = speak(server, **body)
    assert before.status_code == 200
    server.stop()
    again = start(lm, tts, caps, tmp_path / "again.log", *keys, api_key="key-one", key_arg=False)
    try:
        assert voices(again) == {"default": True, "kept": False}
        after = speak(again, **body)
        assert after.status_code == 200 and after.content == before.content
        other = {"Authorization": "Bearer key-two"}
        assert voices(again, other) == {"default": True}
        r = httpx.post(again.url + "/v1/audio/speech", json={"model": again.tts, **body}, headers=other)
        refused(r, 404, "voice_not_found", "voice", "kept")
    finally:
        again.stop()


def test_voices_shared_through_redis_by_two_servers(lm, tts, keys, tmp_path):
    """Two servers with --capsule-redis on one redis-server: a voice uploaded to A is listed by B
    and speaks there bitwise as on A (same input and seed); its name is taken on B too; another
    key neither sees nor speaks with it; a DELETE on B removes it from A's listing and voices."""
    pytest.importorskip("redis")
    from redis_util import Server as RedisServer
    redis_srv = RedisServer(tmp_path)
    # a loaded machine can stall a call past the tier's 1 s default: the fallback is not under test
    shared = ("--capsule-redis", redis_srv.url + "?socket_timeout=10&socket_connect_timeout=10")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:     # both start at once
        made = [pool.submit(start, lm, tts, tmp_path / n, tmp_path / f"{n}.log", *keys, *shared,
                            api_key="key-one", key_arg=False) for n in "ab"]
    try:
        a, b = (f.result() for f in made)
        assert upload(a, "fleet", wav(noise(0.3, 6))).status_code == 200
        assert voices(b) == {"default": True, "fleet": False}
        body = dict(input="one voice, two servers.", voice="fleet", response_format="pcm", seed=5)
        on_a, on_b, plain = speak(a, **body), speak(b, **body), speak(b, **{**body, "voice": "default"})
        assert on_a.status_code == on_b.status_code == plain.status_code == 200
        assert on_b.content == on_a.content and on_b.content != plain.content
        refused(upload(b, "fleet", wav(noise(0.3, 7))), 409, "voice_exists", "name", "fleet")
        other = {"Authorization": "Bearer key-two"}
        assert voices(b, other) == {"default": True}
        r = httpx.post(b.url + "/v1/audio/speech", json={"model": b.tts, **body}, headers=other)
        refused(r, 404, "voice_not_found", "voice", "fleet")
        d = httpx.delete(b.url + "/v1/audio/voices/fleet", headers=b.headers())
        assert d.status_code == 200 and d.json()["deleted"] is True
        assert voices(a) == {"default": True}
        refused(speak(a, **body), 404, "voice_not_found", "voice", "fleet")
    finally:
        for f in made:
            if f.exception() is None:
                f.result().stop()
        redis_srv.kill()

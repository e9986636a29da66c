"""flashrt serve under the faults a review found: work competing for the last session, late and
repeated cancels, clients that go away, shutdown by SIGTERM, oversized or mistyped input, and
the budgets that keep one client from filling the server. Real uvicorn on loopback, tiny
random-weight checkpoints (the text is meaningless)."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from serve_util import Server, sse  # noqa: E402

from flashrt.serve.conversations import ConversationTable  # noqa: E402

LONG = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(ckpt):
    return ckpt("qwen3_5", "tiny")


@pytest.fixture(scope="module")
def pool(tiny, tmp_path_factory):
    """pool(n) -> a server with n model sessions (made once per module)."""
    made = {}

    def get(n):
        if n not in made:
            made[n] = Server(tiny, "--max-sessions", str(n), "--max-seq-len", "4096",
                             log=tmp_path_factory.mktemp(f"pool{n}") / "server.log")
        return made[n]
    yield get
    for s in made.values():
        s.stop()


@pytest.fixture
def one(pool):
    """One model session: every request beyond the first waits."""
    return pool(1)


@pytest.fixture
def two(pool):
    return pool(2)


def _first_chunk(lines):
    return json.loads(next(line for line in lines if line.startswith("data: {"))[6:])


def test_worker_call_and_queued_request_share_the_last_session(one):
    """A session create (a worker call) and a completion arrive while the only session is
    busy; when it frees, both run (the worker died of an IndexError here)."""
    res = {}

    def bg(name, path, body):
        res[name] = one.post(path, body).status_code
    with httpx.stream("POST", one.url + "/v1/completions", timeout=60,
                      json={"prompt": [1, 2, 3], "max_tokens": 150, "stream": True, **LONG}) as r:
        lines = r.iter_lines()
        _first_chunk(lines)
        ts = [threading.Thread(target=bg, args=("create", "/v1/sessions", {"prompt": [5, 6, 7]})),
              threading.Thread(target=bg, args=("queued", "/v1/completions", {"prompt": [8, 9], "max_tokens": 2}))]
        ts[0].start()
        time.sleep(0.3)
        ts[1].start()
        time.sleep(0.3)
        assert sse(lines)[-1] == "[DONE]"                     # let it finish
    for t in ts:
        t.join(60)
    assert res == {"create": 200, "queued": 200}
    assert httpx.get(one.url + "/health", timeout=10).json() == {"status": "ok"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_worker_death_fails_the_work_it_had_taken(tiny):
    """The worker dies while admitting a request, after it gave a session to a queued call in
    the same round: the call's future and the request both fail (503) instead of hanging."""
    from flashrt.serve.engine import Engine, Job
    from flashrt.serve.events import Failed
    from flashrt.serve.options import ServeOptions
    from flashrt.serve.wire import APIError
    eng = Engine(ServeOptions.from_settings(max_seq_len=64, max_sessions=3, capsule_budget_mb=0),
                 model_dir=tiny)
    gate, events = threading.Event(), []
    try:
        first = eng.call(lambda rt: gate.wait(30))           # holds one session, and the worker
        deadline = time.monotonic() + 10
        while len(eng.free) != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        taken = eng.call(lambda rt: "ran")                   # gets a session in the next round
        # a prompt that is not a token list: admission raises, the worker dies there
        eng.submit(Job("cmpl-bad", None, 1, 4, 0.0, 1.0, None, [], events.append))
        gate.set()
        assert first.result(timeout=10) is True
        with pytest.raises(APIError, match="engine worker died: TypeError"):
            taken.result(timeout=10)
        assert [type(e) for e in events] == [Failed] and events[0].error.status == 503
        with pytest.raises(APIError) as e:
            eng.call(lambda rt: None)
        assert e.value.status == 503
    finally:
        gate.set()
        eng.close()


def test_abandoned_non_streaming_request_frees_its_session(one):
    """A client that gives up on a long non-streaming session turn: the turn is cut (nothing
    was delivered, so nothing is kept) and the session freed, though tokens kept coming (the
    disconnect was seen only after 0.25 s without a token: it ran to max_tokens)."""
    sid = one.post("/v1/sessions", {"prompt": [1, 2, 3]}).json()["id"]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{one.url}/v1/sessions/{sid}/completions", timeout=1.0,
                   json={"prompt": [4], "max_tokens": 4000, **LONG})
    deadline = time.monotonic() + 60
    while httpx.get(f"{one.url}/v1/sessions/{sid}", timeout=10).json()["busy"]:
        assert time.monotonic() < deadline, "the abandoned turn still holds the session"
        time.sleep(0.1)
    assert httpx.get(f"{one.url}/v1/sessions/{sid}", timeout=10).json()["tokens"] == [1, 2, 3, 4]
    one.complete([4, 5], max_tokens=2)


def test_late_cancel_never_rewrites_a_session_that_moved_on(two):
    """A cancel of turn A while the session's turn B runs (a free session runs the cancel):
    refused, and B keeps the session (the cancel had rewritten it and cleared its busy flag,
    so a third turn ran beside B and was lost)."""
    sid = two.post("/v1/sessions", {"prompt": [10, 11, 12]}).json()["id"]
    a = two.post(f"/v1/sessions/{sid}/completions", {"prompt": [20], "max_tokens": 4, **LONG}).json()
    after_a = httpx.get(f"{two.url}/v1/sessions/{sid}").json()["tokens"]
    body = {"prompt": [30], "max_tokens": 1500, "stream": True, **LONG}
    with httpx.stream("POST", f"{two.url}/v1/sessions/{sid}/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        _first_chunk(lines)
        late = two.post(f"/v1/completions/{a['id']}/cancel", {"delivered_tokens": 1})
        assert late.status_code == 409 and "moved on" in late.json()["error"]["message"]
        info = httpx.get(f"{two.url}/v1/sessions/{sid}").json()
        assert info["busy"] and info["tokens"] == after_a           # B's turn still holds it
        again = two.post(f"/v1/sessions/{sid}/completions", {"prompt": [40], "max_tokens": 2})
        assert again.status_code == 409 and again.json()["error"]["code"] == "session_busy"
        list(lines)
    done = httpx.get(f"{two.url}/v1/sessions/{sid}").json()
    assert not done["busy"] and done["tokens"][: len(after_a) + 1] == after_a + [30]
    assert len(done["tokens"]) == len(after_a) + 1 + 1500


def test_cancel_of_the_last_turn_cuts_once_and_only_shrinks(one):
    sid = one.post("/v1/sessions", {"prompt": [10, 11, 12]}).json()["id"]
    a = one.post(f"/v1/sessions/{sid}/completions", {"prompt": [20], "max_tokens": 6, **LONG}).json()
    gen = a["choices"][0]["token_ids"]
    r3 = one.post(f"/v1/completions/{a['id']}/cancel", {"delivered_tokens": 3}).json()
    assert r3["kept_tokens"] == [3]
    assert httpx.get(f"{one.url}/v1/sessions/{sid}").json()["tokens"] == [10, 11, 12, 20] + gen[:3]
    r5 = one.post(f"/v1/completions/{a['id']}/cancel", {"delivered_tokens": 5}).json()
    assert r5["kept_tokens"] == [3]                              # what was cut stays cut
    r1 = one.post(f"/v1/completions/{a['id']}/cancel", {"delivered_tokens": 1}).json()
    assert r1["kept_tokens"] == [1]
    assert httpx.get(f"{one.url}/v1/sessions/{sid}").json()["tokens"] == [10, 11, 12, 20] + gen[:1]


def test_no_delta_after_a_cancel():
    """The stream drops deltas the worker queued before it saw the cancel: their tokens are
    being rolled back (a voice client would speak them)."""
    import asyncio
    from types import SimpleNamespace

    from flashrt.serve.app import _sse
    from flashrt.serve.engine import Cut
    from flashrt.serve.events import Delta, Done, Finished
    job = SimpleNamespace(id="cmpl-x", n=1, cancel=None, delivered=[0])
    req = SimpleNamespace(stream_options=None)

    async def run():
        q = asyncio.Queue()
        out = []
        gen = _sse(None, job, q, "text", "m", req)
        q.put_nowait(Delta(0, "a", 0, (5,)))
        out.append(await gen.__anext__())
        job.cancel = Cut("tokens", (1,))
        for ev in [Delta(0, "b", 1, (6,)), Delta(0, "c", 2, (7,)),
                   Finished(0, "cancelled", 0, (5,)), Done(2, 1, 0)]:
            q.put_nowait(ev)
        out += [x async for x in gen]
        return out
    chunks = [json.loads(c[6:]) for c in asyncio.run(run()) if c.startswith("data: {")]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[5], []]
    assert chunks[-1]["choices"][0]["finish_reason"] == "cancelled" and job.delivered == [1]


def test_eos_id_streams_in_the_finish_chunk(one):
    """An EOS id (no text) comes in the finish chunk: streamed ids equal the non-streamed."""
    for seed in range(40):                 # sampled until a choice ends on EOS
        b = {"prompt": [7, 8, 9], "max_tokens": 60, "temperature": 1.5, "seed": seed}
        plain = one.post("/v1/completions", b).json()["choices"][0]
        if plain["finish_reason"] == "stop":
            break
    assert plain["finish_reason"] == "stop", "no seed ended on EOS"
    with httpx.stream("POST", one.url + "/v1/completions", json={**b, "stream": True}, timeout=60) as r:
        ev = [e for e in sse(r.iter_lines()) if e != "[DONE]"]
    streamed = [t for e in ev for t in e["choices"][0]["token_ids"]]
    assert streamed == plain["token_ids"] and ev[-1]["choices"][0]["token_index"] == len(streamed) - 1


@pytest.mark.parametrize("body,param", [
    ({"prompt": [1], "stream": "yes"}, "stream"),
    ({"prompt": [1], "max_tokens": "2"}, "max_tokens"),
    ({"prompt": [1], "max_tokens": True}, "max_tokens"),
    ({"prompt": [True, 2]}, "prompt"),
    ({"prompt": [1], "stream_options": {"include_usage": True}}, None),
])
def test_mistyped_fields_are_refused(one, body, param):
    r = one.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or (param is None and "stream_options" in err["message"])


def test_input_limits_answer_json(one):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10 ** 6}
    r = one.post("/v1/chat/completions", chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    r = httpx.post(one.url + "/v1/completions", content=b'{"prompt": [1], "n": ' + b"9" * 5000 + b"}",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    big = httpx.post(one.url + "/v1/completions", content=(b"x" * (1 << 20) for _ in range(9)),
                     headers={"content-type": "application/json"}, timeout=30)   # chunked: no length
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    assert one.client().models.retrieve(one.model).id == one.model
    assert httpx.get(one.url + "/v1/models/nope", timeout=10).status_code == 404


def test_sigterm_flushes_the_disk_tier(tiny, tmp_path):
    """uvicorn re-raises SIGTERM after its shutdown: the engine closes (disk writer drained)
    in the app's shutdown, before that."""
    caps = tmp_path / "caps"
    s = Server(tiny, "--capsule-dir", str(caps), log=tmp_path / "term.log")
    try:
        s.complete(list(range(1, 30)), max_tokens=4)
    finally:
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(60)
        s.log.close()
    log = (tmp_path / "term.log").read_text()
    assert "turn capsules flushed" in log and "Traceback" not in log, log
    assert [p for p in caps.iterdir() if p.suffix == ".capsule"]


def test_queue_zero_serves_when_idle_and_pins_keep_half_the_budget(tiny, tmp_path):
    s = Server(tiny, "--max-sessions", "1", "--max-queue", "0", "--capsule-budget-mb", "0.5",
               log=tmp_path / "pins.log")
    try:
        s.complete([1, 2, 3], max_tokens=2)                     # idle: admitted, not a 429
        for i in range(40):                                     # one client pins 40 prefixes
            s.complete([200 + i] * 30 + [5], max_tokens=1, pin_prefix=30)
        P = list(range(1, 45))
        gen = s.complete(P, max_tokens=2)["choices"][0]["token_ids"]
        turn2 = s.complete(P + gen + [100], max_tokens=1)      # someone else's reuse survives
        assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] == len(P) + len(gen)
        whole = [300] * 20
        s.complete(whole, max_tokens=1, pin_prefix=20)          # the whole prompt: pinned too
        for i in range(20):                                     # evicts every unpinned capsule
            s.complete([400 + i] * 60, max_tokens=1)
        again = s.complete(whole + [6], max_tokens=1)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 20
    finally:
        s.stop()


def test_session_table_expires_idle_sessions_and_evicts_the_oldest():
    now = [0.0]
    t = ConversationTable(limit=2, idle_s=10, clock=lambda: now[0])
    a, b = t.create([1]), t.create([2])
    now[0] = 5
    t.get(a.id)                                  # a used more recently than b
    c = t.create([3])                            # full: b (least recently used) goes
    with pytest.raises(Exception, match="unknown session"):
        t.get(b.id)
    c.begin_turn()
    now[0] = 20                                  # a idle 15 s: expired; c busy: kept
    with pytest.raises(Exception, match="idle longer"):
        t.get(a.id)
    assert t.get(c.id) is c
    t.create([4]).begin_turn()                   # a expired: room for it
    with pytest.raises(Exception, match="every one with a turn"):
        t.create([5])


def test_disk_tier_budget_and_named_saves(tiny, tmp_path):
    """Turn files stay within --capsule-disk-mb across a restart; a named save is kept outside
    that budget, is not overwritten by accident, and loads after the restart."""
    caps, budget = tmp_path / "caps", 0.25
    args = ("--capsule-dir", str(caps), "--capsule-disk-mb", str(budget))
    turn_bytes = lambda: sum(p.stat().st_size for p in caps.glob("*.capsule"))  # noqa: E731
    for run in range(2):
        s = Server(tiny, *args, log=tmp_path / f"disk{run}.log")
        try:
            for i in range(15):
                s.complete([run * 50 + i + 1] * 40, max_tokens=2)
            if run == 0:
                sid = s.post("/v1/sessions", {"prompt": [9] * 30}).json()["id"]
                assert s.post(f"/v1/sessions/{sid}/save", {"name": "alice"}).status_code == 200
                taken = s.post(f"/v1/sessions/{sid}/save", {"name": "alice"})
                assert taken.status_code == 409 and taken.json()["error"]["code"] == "name_taken"
                assert s.post(f"/v1/sessions/{sid}/save", {"name": "alice", "overwrite": True}).status_code == 200
            else:
                assert s.post("/v1/sessions/load", {"name": "alice"}).json()["tokens"] == [9] * 30
        finally:
            s.stop()
        assert 0 < turn_bytes() <= budget * (1 << 20)

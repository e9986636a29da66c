"""Exactly-once and consume-once against real uvicorn servers (and, for the fleet, a real
redis-server): the Idempotency-Key header on /v1/chat/completions and /v1/responses replays the
recorded answer (same id, text, tool-call ids, usage; a stream's very events) without running the
model again, waits for a running first, and refuses another body (422); a response made with
flashrt.single_use is continued once: of 8 processes racing, one 200 and seven 409s naming the
winner, in one server and across two sharing Redis. "The model ran once" is read from the
server's own job counter (GET /v1/flashrt/stats). Tiny random-weight Qwen3 with its chat template."""
from __future__ import annotations

import multiprocessing
import threading
import uuid

import httpx
import pytest

pytest.importorskip("fastapi")

from serve_util import Server, sse  # noqa: E402

ROUNDS, RACERS = 20, 8
USER = [{"role": "user", "content": "Tell me something."}]


def serve(path, *extra):
    return Server(path, "--max-sessions", "2", "--max-seq-len", "1024", "--threads", "1", *extra)


@pytest.fixture(scope="module")
def path(ckpt):
    return ckpt("qwen3", "tiny", chat=True)


@pytest.fixture(scope="module")
def server(path):
    s = serve(path)
    yield s
    s.stop()


def jobs(server) -> int:
    r = httpx.get(server.url + "/v1/flashrt/stats", headers=server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["jobs"]


def post(server, path, body, key=None, **kw):
    headers = {**server.headers(), **({"Idempotency-Key": key} if key is not None else {})}
    return httpx.post(server.url + path, json={"model": server.model, **body}, headers=headers, timeout=120, **kw)


def refused(r, status: int, param: str, code: str | None = None, text: str = "") -> dict:
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["param"] == param and (code is None or e["code"] == code) and text in e["message"], e
    return e


def replayed(r) -> bool:
    return r.headers.get("Idempotency-Replayed") == "true"


def new_key() -> str:
    return str(uuid.uuid4())


# ---- exactly-once: Idempotency-Key ---------------------------------------------------------------
def test_contract_exactly_once_same_key_replays_without_running(server, path):
    """Sampled (temperature 1, no seed): a second run would differ; the replay is the first answer,
    byte for byte in JSON, with Idempotency-Replayed, and the job count moves once. A forced tool
    call's id (random per call) comes back the same. Another body: 422 naming the header; the key
    on another endpoint is another key."""
    key, body = new_key(), {"messages": USER, "temperature": 1.0, "max_tokens": 12}
    before = jobs(server)
    first, again = post(server, "/v1/chat/completions", body, key), post(server, "/v1/chat/completions", body, key)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert not replayed(first) and replayed(again)
    assert again.json() == first.json() and jobs(server) == before + 1
    refused(post(server, "/v1/chat/completions", {**body, "max_tokens": 13}, key), 422, "Idempotency-Key",
            "idempotency_key_reused", "Idempotency-Key was used with a different request body")
    other = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2}, key)
    assert other.status_code == 200 and not replayed(other)

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bias = {str(b): -100 for b in b" \n\r\t"}      # the call the grammar forces, closed quickly
    bias.update({str(tok.token_to_id(t)): 100 for t in ("<tool_call>", "</tool_call>", "<|im_end|>")})
    noop = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
    call = {"messages": USER, "tools": [noop], "tool_choice": {"type": "function", "function": {"name": "noop"}},
            "logit_bias": bias, "max_tokens": 64, "temperature": 0}
    key, before = new_key(), jobs(server)
    a, b = post(server, "/v1/chat/completions", call, key), post(server, "/v1/chat/completions", call, key)
    assert a.status_code == b.status_code == 200 and replayed(b) and b.json() == a.json()
    ids = [t["id"] for t in a.json()["choices"][0]["message"]["tool_calls"]]
    assert ids and ids == [t["id"] for t in b.json()["choices"][0]["message"]["tool_calls"]]
    assert jobs(server) == before + 1
    fresh = post(server, "/v1/chat/completions", call, new_key()).json()      # a new key: a new call
    assert fresh["id"] != a.json()["id"] and fresh["choices"][0]["message"]["tool_calls"][0]["id"] not in ids


def stream_lines(server, path_, body, key):
    headers = {**server.headers(), "Idempotency-Key": key}
    with httpx.stream("POST", server.url + path_, json={"model": server.model, **body, "stream": True},
                      headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return list(r.iter_lines()), replayed(r)


def test_stream_replays_its_events_and_a_cut_stream_frees_the_key(server):
    key, body = new_key(), {"messages": USER, "temperature": 1.0, "max_tokens": 10,
                            "stream_options": {"include_usage": True}}
    before = jobs(server)
    (first, r1), (again, r2) = stream_lines(server, "/v1/chat/completions", body, key), \
        stream_lines(server, "/v1/chat/completions", body, key)
    assert not r1 and r2 and again == first and sse(first)[-1] == "[DONE]" and jobs(server) == before + 1
    # a client gone after its first event: no record; the key runs again (after the first ends)
    key, long = new_key(), {"messages": USER, "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={"model": server.model, **long, "stream": True},
                      headers={"Idempotency-Key": key}, timeout=120) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    before = jobs(server)
    r = post(server, "/v1/chat/completions", long, key)
    assert r.status_code == 200 and not replayed(r) and r.json()["usage"]["completion_tokens"] == 900
    assert jobs(server) == before + 1


def test_contract_exactly_once_concurrent_duplicates_wait_for_the_first(server):
    """6 threads, one key and body, released together: one runs, five wait and get its answer."""
    key, body, n = new_key(), {"messages": USER, "temperature": 1.0, "max_tokens": 24}, 6
    out, barrier, before = [None] * n, threading.Barrier(n), jobs(server)

    def go(i):
        barrier.wait()
        out[i] = post(server, "/v1/chat/completions", body, key)
    ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(r.status_code == 200 for r in out), [r.text for r in out]
    assert all(r.json() == out[0].json() for r in out) and sum(not replayed(r) for r in out) == 1
    assert jobs(server) == before + 1


def test_responses_replay_plain_and_streamed(server):
    key, body = new_key(), {"input": "Hello there", "max_output_tokens": 8, "temperature": 1.0}
    before = jobs(server)
    a, b = post(server, "/v1/responses", body, key), post(server, "/v1/responses", body, key)
    assert a.status_code == b.status_code == 200 and replayed(b) and b.json() == a.json()
    assert jobs(server) == before + 1
    got = httpx.get(server.url + f"/v1/responses/{a.json()['id']}", timeout=30).json()
    assert got["output"] == a.json()["output"]                   # stored once, as it was answered
    refused(post(server, "/v1/responses", {**body, "input": "Hello"}, key), 422, "Idempotency-Key")
    key = new_key()
    (first, r1), (again, r2) = stream_lines(server, "/v1/responses", body, key), \
        stream_lines(server, "/v1/responses", body, key)
    assert not r1 and r2 and again == first and jobs(server) == before + 2
    assert any(line == "event: response.completed" or line == "event: response.incomplete" for line in first)


def test_openai_client_sends_the_key(server):
    openai = pytest.importorskip("openai")
    c, key = server.client(), new_key()
    before = jobs(server)
    kw = dict(model=server.model, messages=USER, temperature=1.0, max_tokens=8, extra_headers={"Idempotency-Key": key})
    raw1 = c.chat.completions.with_raw_response.create(**kw)
    raw2 = c.chat.completions.with_raw_response.create(**kw)
    assert raw2.headers.get("idempotency-replayed") == "true" and "idempotency-replayed" not in raw1.headers
    a, b = raw1.parse(), raw2.parse()
    assert a.id == b.id and a.choices[0].message.content == b.choices[0].message.content and a.usage == b.usage
    if hasattr(c, "responses"):
        key = new_key()
        r1 = c.responses.create(model=server.model, input="Hi", max_output_tokens=4, temperature=1.0,
                                extra_headers={"Idempotency-Key": key})
        r2 = c.responses.create(model=server.model, input="Hi", max_output_tokens=4, temperature=1.0,
                                extra_headers={"Idempotency-Key": key})
        assert r1.id == r2.id and r1.output_text == r2.output_text
        with pytest.raises(openai.UnprocessableEntityError):
            c.responses.create(model=server.model, input="Ho", max_output_tokens=4, extra_headers={"Idempotency-Key": key})
    assert jobs(server) == before + 1 + (1 if hasattr(c, "responses") else 0)


@pytest.mark.parametrize("value", ["k" * 256, "tab\there", "caf\xe9", ""], ids=["long", "tab", "latin1", "empty"])
def test_bad_key_is_400_naming_the_header(server, value):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": server.model, "messages": USER, "max_tokens": 1},
                   headers={"Idempotency-Key": value.encode("latin-1")})
    refused(r, 400, "Idempotency-Key")
    assert post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1}, "k" * 255).status_code == 200


# ---- consume-once: flashrt.single_use ------------------------------------------------------------
def _racer(i, barrier, jobs_q, results):
    """One process: for each (url, body) it is given, wait for all racers, then post it."""
    with httpx.Client(timeout=120) as client:
        while True:
            job = jobs_q.get()
            if job is None:
                return
            url, body = job
            barrier.wait()
            r = client.post(url + "/v1/responses", json=body)
            results.put((i, r.status_code, r.json()))


class Racers:
    """RACERS processes (spawned once) that post together each round."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.barrier, self.results = ctx.Barrier(RACERS), ctx.Queue()
        self.queues = [ctx.Queue() for _ in range(RACERS)]
        self.procs = [ctx.Process(target=_racer, args=(i, self.barrier, self.queues[i], self.results), daemon=True)
                      for i in range(RACERS)]
        for p in self.procs:
            p.start()

    def round(self, urls: list, body: dict) -> list:
        for i, q in enumerate(self.queues):
            q.put((urls[i], body))
        return sorted((self.results.get(timeout=300) for _ in range(RACERS)), key=lambda x: x[0])

    def close(self):
        for q in self.queues:
            q.put(None)
        for p in self.procs:
            p.join(30)


@pytest.fixture(scope="module")
def racers():
    r = Racers()
    yield r
    r.close()


def single_use(server, **kw) -> str:
    r = post(server, "/v1/responses", {"input": "Approve?", "max_output_tokens": 1, "temperature": 0,
                                       "flashrt": {"single_use": True}, **kw})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def one_winner(results, prev: str) -> str:
    """Exactly one 200; every other a 409 response_already_continued naming the winner's id."""
    wins = [body for _, status, body in results if status == 200]
    assert len(wins) == 1, results
    winner = wins[0]["id"]
    assert winner.startswith("resp") and wins[0]["previous_response_id"] == prev
    for _, status, body in results:
        if status != 200:
            assert status == 409, body
            e = body["error"]
            assert e["code"] == "response_already_continued" and e["param"] == "previous_response_id"
            assert winner in e["message"] and prev in e["message"], e
    return winner


def test_contract_consume_once_racing_processes_one_server(server, racers):
    for _ in range(ROUNDS):
        prev = single_use(server)
        body = {"model": server.model, "input": "yes", "previous_response_id": prev, "max_output_tokens": 1,
                "temperature": 0}
        winner = one_winner(racers.round([server.url] * RACERS, body), prev)
        late = post(server, "/v1/responses", {"input": "again", "previous_response_id": prev, "max_output_tokens": 1})
        refused(late, 409, "previous_response_id", "response_already_continued", f"was already continued by response {winner}")


def test_single_use_checks_and_a_failed_winner_releases(server):
    refused(post(server, "/v1/responses", {"input": "x", "flashrt": {"single_use": True, "once": 1}}), 400, "flashrt.once")
    refused(post(server, "/v1/responses", {"input": "x", "store": False, "flashrt": {"single_use": True}}), 400,
            "flashrt.single_use")
    prev = single_use(server)
    cont = {"input": "ok", "previous_response_id": prev, "max_output_tokens": 1}
    refused(post(server, "/v1/responses", {**cont, "instructions": "other"}), 400, "instructions")  # claimed, failed
    key = new_key()
    won = post(server, "/v1/responses", cont, key)                 # released: this one wins
    assert won.status_code == 200, won.text
    again = post(server, "/v1/responses", cont, key)                # its own retry replays: not a 409
    assert again.status_code == 200 and replayed(again) and again.json()["id"] == won.json()["id"]
    refused(post(server, "/v1/responses", cont), 409, "previous_response_id", "response_already_continued",
            won.json()["id"])
    plain = post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 1}).json()["id"]
    for _ in range(2):                                              # not single-use: forks as before
        assert post(server, "/v1/responses", {**cont, "previous_response_id": plain}).status_code == 200


# ---- the fleet: two servers on one redis-server --------------------------------------------------
@pytest.fixture(scope="module")
def fleet(path, tmp_path_factory):
    pytest.importorskip("redis")
    from redis_util import Server as RedisServer
    redis_srv = RedisServer(tmp_path_factory.mktemp("once-redis"))
    # a loaded machine can stall a call past the tier's 1 s default: the fallback is not under test
    url = redis_srv.url + "?socket_timeout=10&socket_connect_timeout=10"
    servers = []
    try:
        for _ in range(2):
            servers.append(serve(path, "--capsule-redis", url))
        yield servers
    finally:
        for s in servers:
            s.stop()
        redis_srv.kill()


def test_contract_exactly_once_across_two_servers_sharing_redis(fleet):
    a, b = fleet
    key, body = new_key(), {"messages": USER, "temperature": 1.0, "max_tokens": 16}
    before = jobs(a) + jobs(b)
    first = post(a, "/v1/chat/completions", body, key)
    on_b = post(b, "/v1/chat/completions", body, key)
    assert first.status_code == on_b.status_code == 200 and replayed(on_b) and on_b.json() == first.json()
    refused(post(b, "/v1/chat/completions", {**body, "max_tokens": 3}, key), 422, "Idempotency-Key")
    key, n = new_key(), 6                       # concurrent duplicates split over both servers
    out, barrier = [None] * n, threading.Barrier(n)

    def go(i):
        barrier.wait()
        out[i] = post(fleet[i % 2], "/v1/chat/completions", body, key)
    ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(r.status_code == 200 and r.json() == out[0].json() for r in out), [r.text for r in out]
    assert sum(not replayed(r) for r in out) == 1 and jobs(a) + jobs(b) == before + 2


def test_contract_consume_once_across_two_servers_sharing_redis(fleet, racers):
    """Made on A; 4 racers continue on A and 4 on B: one winner a round, whichever server."""
    a, b = fleet
    for _ in range(ROUNDS):
        prev = single_use(a)
        body = {"model": a.model, "input": "yes", "previous_response_id": prev, "max_output_tokens": 1,
                "temperature": 0}
        one_winner(racers.round([a.url] * 4 + [b.url] * 4, body), prev)
    prev = single_use(a)                        # made on A, continued on B, then refused on A
    won = post(b, "/v1/responses", {"input": "yes", "previous_response_id": prev, "max_output_tokens": 1})
    assert won.status_code == 200, won.text
    refused(post(a, "/v1/responses", {"input": "yes", "previous_response_id": prev, "max_output_tokens": 1}),
            409, "previous_response_id", "response_already_continued", f"was already continued by response {won.json()['id']}")

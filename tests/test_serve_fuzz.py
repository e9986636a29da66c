"""A bounded fuzz of flashrt serve's wire protocol (hypothesis, derandomized: the same examples on
every run). Random bodies (field-aware and arbitrary JSON, raw bytes, deep nesting, lone
surrogates), content types, methods and paths against a real uvicorn server on loopback: every
answer is a 2xx, or a 4xx in OpenAI's error shape; afterwards the server still answers a normal
request and its log holds no traceback. Bounds: FUZZ_EXAMPLES requests (env
FLASHRT_FUZZ_EXAMPLES), at most FUZZ_SECONDS of requests, 30 s each, max_seq_len 96 so no
generation runs long. FLASHRT_FUZZ_RANDOM=1 draws new examples (for local hunting)."""
from __future__ import annotations

import collections
import json
import os
import time

import httpx
import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from serve_util import Server  # noqa: E402

from flashrt.models.tokenizer import ByteTokenizer  # noqa: E402
from flashrt.serve.text import TextStream  # noqa: E402

FUZZ_EXAMPLES = int(os.environ.get("FLASHRT_FUZZ_EXAMPLES", "160"))
FUZZ_SECONDS = 60.0
SETTINGS = dict(deadline=None, database=None, derandomize=os.environ.get("FLASHRT_FUZZ_RANDOM") != "1",
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    # one torch thread: the fuzzer's own work shares the 2 cores, and a second OpenMP thread
    # spin-waiting for a busy core makes every decode step many times slower
    s = Server(ckpt("qwen3_5", "tiny"), "--max-seq-len", "96", "--max-sessions", "2", "--threads", "1",
               "--capsule-dir", str(d / "caps"), log=d / "server.log")
    s.sid = s.post("/v1/sessions", {"prompt": [1, 2, 3]}).json()["id"]
    s.rid = s.complete([4, 5], max_tokens=1)["id"]
    yield s
    s.stop()


# ---- strategies: a valid-looking body, then at most a couple of mutations ------------------------
odd_text = st.sampled_from(["\ud800", "a\udfffb", "\x00", "é€😀", "", " ", "\n" * 3, "x" * 300])
texts = st.one_of(st.text(max_size=24), odd_text)
ints = st.one_of(st.integers(-3, 8), st.sampled_from([2**31, 2**63, 10**30, -(2**70)]))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True, allow_infinity=True), texts)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(texts, c, max_size=4),
                           max_leaves=12)
ids = st.lists(st.integers(0, 511), min_size=1, max_size=40)
words = st.text(alphabet="abc xyzé.", min_size=1, max_size=30)
LIMIT = {"max_tokens": st.integers(1, 4)}       # a mutation may drop it: then the route's default
SAMPLING = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "seed": st.integers(0, 2**31), "n": st.integers(1, 2), "stop": st.one_of(words, st.lists(words, max_size=2)),
    "stream": st.booleans(), "ignore_eos": st.booleans(), "cache_salt": words, "user": words,
    "presence_penalty": st.just(0)}
MUTABLE = sorted({*SAMPLING, *LIMIT, "prompt", "messages", "position", "snapshot_id", "name", "overwrite",
                  "delivered_tokens", "delivered_chars", "stream_options", "pin_prefix", "logprobs",
                  "model", "max_completion_tokens"})
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": st.one_of(words, st.just([{"type": "text", "text": "hi"}]))}),
                    min_size=1, max_size=3)
VALID = {
    "/v1/completions": ({"prompt": st.one_of(ids, words), **LIMIT}, SAMPLING),
    "/v1/chat/completions": ({"messages": messages, **LIMIT}, SAMPLING),
    "/v1/sessions": ({}, {"prompt": st.one_of(ids, words), "cache_salt": words}),
    "/v1/sessions/{sid}/completions": ({"prompt": st.one_of(ids, words), **LIMIT}, SAMPLING),
    "/v1/sessions/{sid}/rollback": ({"position": st.integers(0, 3)}, {}),
    "/v1/sessions/{sid}/restore": ({"snapshot_id": words}, {}),
    "/v1/sessions/{sid}/save": ({"name": st.sampled_from(["fuzz", "fuzz-2"])}, {"overwrite": st.booleans()}),
    "/v1/sessions/load": ({"name": st.sampled_from(["fuzz", "nope"])}, {"cache_salt": words}),
    "/v1/completions/{rid}/cancel": ({}, {"delivered_tokens": st.integers(0, 3), "delivered_chars": st.integers(0, 9)}),
}
mutation = st.one_of(st.tuples(st.just("set"), st.one_of(st.sampled_from(MUTABLE), texts), json_values),
                     st.tuples(st.just("set"), st.sampled_from(MUTABLE), st.one_of(ints, odd_text)),
                     st.tuples(st.just("del"), st.sampled_from(MUTABLE), st.none()))


def mutated(body: dict, muts: list) -> dict:
    body = dict(body)
    for op, key, value in muts:
        if op == "set":
            body[key] = value
        else:
            body.pop(key, None)
    return body


def body_for(path):
    required, optional = VALID[path]
    return st.builds(mutated, st.fixed_dictionaries(required, optional=optional),
                     st.one_of(st.just([]), st.lists(mutation, min_size=1, max_size=2)))


OTHER = ["/v1/models", "/v1/models/{model}", "/health", "/v1/sessions/{sid}", "/v1/sessions/{sid}/snapshot",
         "/v1/sessions/{sid}/fork", "/v1/sessions/nope", "/v1/nope", "/v1/chat/completions/nope/cancel"]
raw_bodies = st.one_of(st.binary(max_size=64), st.integers(1, 3000).map(lambda n: b'{"prompt": ' + b"[" * n),
                       st.integers(900, 3000).map(lambda n: b"[" * n + b"]" * n),
                       st.sampled_from([b"", b"{", b"null", b"[]", b'{"prompt": 1e999999}',
                                        b'{"prompt": "\\ud800"}', b"\xff\xfe{}", b'{"prompt": ' + b"9" * 5000 + b"}"]))
JSON = "application/json"
content_types = st.sampled_from([JSON] * 6 + ["application/json; charset=utf-8", "text/plain", None])
requests = st.one_of(
    st.sampled_from(sorted(VALID)).flatmap(lambda path: st.tuples(
        st.just("POST"), st.just(path), body_for(path).map(lambda b: json.dumps(b).encode()), content_types)),
    st.tuples(st.sampled_from(["POST", "GET", "DELETE", "PUT"]), st.sampled_from(sorted(VALID) + OTHER),
              raw_bodies, content_types))


def check_answer(r: httpx.Response, streamed: list | None) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str), err
        assert set(err) == {"message", "type", "param", "code"}, err
        return
    if streamed is not None:
        assert streamed and streamed[-1] == "data: [DONE]", streamed[-3:]
        for line in streamed[:-1]:
            assert "error" not in json.loads(line[6:]), line[:300]
    else:
        r.json()


def test_fuzz_wire_protocol(server):
    started, count, seen = time.monotonic(), [0], collections.Counter()

    @settings(max_examples=FUZZ_EXAMPLES, **SETTINGS)
    @given(requests)
    def one(req):
        if time.monotonic() - started > FUZZ_SECONDS:     # the time bound: the rest run empty
            return
        method, path, body, ctype = req
        url = server.url + path.format(sid=server.sid, rid=server.rid, model=server.model)
        headers = {"content-type": ctype} if ctype else {}
        count[0] += 1
        with httpx.stream(method, url, content=body, headers=headers, timeout=30) as r:
            if r.status_code < 400 and r.headers.get("content-type", "").startswith("text/event-stream"):
                streamed = [x for x in r.iter_lines() if x.startswith("data: ")]
            else:
                r.read()
                streamed = None
        check_answer(r, streamed)
        seen[r.status_code] += 1
    one()
    print(f"fuzz: {count[0]} requests in {time.monotonic() - started:.1f} s, statuses {dict(seen)}")
    assert count[0] >= min(FUZZ_EXAMPLES, 20), count
    assert sum(v for k, v in seen.items() if k < 300) >= 5 and len(seen) >= 4, seen   # it reached the engine
    ok = server.complete([7, 8, 9], max_tokens=3)                     # still serving
    assert ok["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    assert "Traceback" not in server.log_path.read_text(errors="replace")


# ---- stop strings: the streamed text is exactly the text before the first stop -----------------
@settings(max_examples=300, **SETTINGS)
@given(st.lists(st.sampled_from(["a", "b", "é"]), max_size=40),
       st.lists(st.text(alphabet="abé", min_size=1, max_size=6), max_size=4))
def test_stop_strings_match_a_plain_search(chars, stops):
    tok, full = ByteTokenizer(512), "".join(chars)
    ts, out = TextStream(tok, stops), []
    for b in full.encode():
        out.append(ts.feed(b))
        assert not any(s in "".join(out) for s in stops)        # a stop string is never sent
        if ts.stopped:
            break
    out.append(ts.finish())
    cuts = [i for i in (full.find(s) for s in stops) if i >= 0]
    assert "".join(out) == (full[: min(cuts)] if cuts else full)
    assert ts.stopped == bool(cuts)

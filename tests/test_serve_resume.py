"""Response ids that survive: the durable id-to-history index (flashrt/serve/response_index.py)
and the refcounted retain API (response_store.py) against real `flashrt serve` processes.

- a retained chat completion id keeps its capsules through eviction pressure (a replay reuses the
  whole prompt) while an unretained one of the same age is evicted; released, it is evicted too;
- retain / release answer in the contract's shape: unknown ids (and another key's) are a 404
  naming the id that changes nothing, bad bodies a 400 naming the field;
- a stored response past --response-ttl-s is gone, and so is its pin;
- a restart on the same --capsule-dir keeps stored responses (GET, previous_response_id with
  cached_tokens covering the history) and refcounts;
- a SIGKILL mid-turn: every finished stored response continues after the restart (greedy: as a
  cold run of its whole prompt does), the killed one is absent, and every record file parses;
- two servers sharing one redis-server: a response made on A is continued on B;
- two seeded forks of one response: identical tokens, each a fresh run of its whole prompt;
- damaged and foreign record and capsule files under --capsule-dir: refused, the rest untouched.
Tiny random-weight Qwen3 with its chat template: the text is meaningless; ids, counts and cache
accounting are what is checked.

The resume contract (issue 34), one named test or more per property (`pytest -k contract`):
  prefix continuation    test_serve_responses.py::
                           test_contract_prefix_continuation_tool_call_then_output_chain
                         test_langgraph_resume.py::
                           test_contract_prefix_continuation_langgraph_replay_and_fork_after_eviction
  exactly-once           test_serve_once.py::test_contract_exactly_once_same_key_replays_without_running,
                         ::test_contract_exactly_once_concurrent_duplicates_wait_for_the_first,
                         ::test_contract_exactly_once_across_two_servers_sharing_redis
                         test_langgraph_resume.py::
                           test_contract_exactly_once_langgraph_interrupt_resume_runs_the_model_once
  fork determinism       test_contract_fork_determinism_seeded_forks_equal_a_fresh_run (here),
                         test_serve_responses.py::test_contract_fork_determinism_forks_independent_under_one_seed
  checkpoint validity    test_contract_checkpoint_validity_damaged_or_foreign_refused (here)
  consume-once           test_serve_once.py::test_contract_consume_once_racing_processes_one_server,
                         ::test_contract_consume_once_across_two_servers_sharing_redis
  recovery determinism   test_contract_recovery_determinism_sigkill_mid_turn_then_restart (here)"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from serve_util import Server  # noqa: E402

BASE = ("--threads", "1", "--max-seq-len", "1024")
TRAFFIC = 12                  # distinct conversations that overflow a 0.5 MB capsule store


def chat(s, text: str, key=None) -> dict:
    r = httpx.post(s.url + "/v1/chat/completions", headers=key or s.headers(), timeout=120, json={
        "model": s.model, "messages": [{"role": "user", "content": text}], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def create(s, **body) -> dict:
    r = s.post("/v1/responses", {"model": s.model, "temperature": 0, "max_output_tokens": 3, **body})
    assert r.status_code == 200, r.text
    return r.json()


def history(resp: dict) -> int:
    return resp["usage"]["input_tokens"] + resp["usage"]["output_tokens"]


def cached(resp: dict) -> int:
    u = resp["usage"]
    return (u["input_tokens_details"] if "input_tokens_details" in u else u["prompt_tokens_details"])["cached_tokens"]


def traffic(s, tag: str) -> None:
    for i in range(TRAFFIC):
        chat(s, f"{tag} {i} other traffic " * 20)


def refs(s, verb: str, ids, key=None) -> httpx.Response:
    return httpx.post(f"{s.url}/v1/flashrt/{verb}", json={"ids": ids}, headers=key or s.headers(), timeout=60)


def health(s) -> dict:
    r = httpx.get(s.url + "/v1/flashrt/stats", headers=s.headers())
    assert r.status_code == 200, r.text
    return r.json()["responses"]


@pytest.fixture(scope="module")
def tight(ckpt, tmp_path_factory):
    """One engine session and a 0.5 MB capsule store: a dozen conversations evict the rest.
    Two API keys (tenants): key-one's requests by default."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("key-two\n")
    s = Server(ckpt("qwen3", "tiny", chat=True), *BASE, "--max-sessions", "1", "--capsule-budget-mb", "0.5",
               "--response-retain-mb", "0.3", "--api-keys", str(keys), api_key="key-one")
    yield s
    s.stop()


def test_retained_chat_completion_survives_eviction(tight):
    """A LangGraph replay re-sends an identical request: with its completion id retained, the
    whole prompt is reused after traffic that evicts an unretained twin of the same age; once
    released, the same traffic evicts it too."""
    keep_text, control_text = "keep me " * 20, "control me " * 20
    kept, control = chat(tight, keep_text), chat(tight, control_text)
    prompt = kept["usage"]["prompt_tokens"]
    got = refs(tight, "retain", [kept["id"]])
    assert got.status_code == 200 and got.json() == {"retained": {kept["id"]: 1}}, got.text
    traffic(tight, "a")
    assert cached(chat(tight, control_text)) < control["usage"]["prompt_tokens"] // 4, "no eviction pressure"
    assert cached(chat(tight, keep_text)) == prompt
    got = refs(tight, "release", [kept["id"]])
    assert got.status_code == 200 and got.json() == {"released": {kept["id"]: 0}}, got.text
    again = refs(tight, "release", [kept["id"]])          # at 0: no change, still a 200
    assert again.status_code == 200 and again.json() == {"released": {kept["id"]: 0}}, again.text
    traffic(tight, "b")
    assert cached(chat(tight, keep_text)) < prompt // 4


def test_retain_refcounts_and_stored_responses(tight):
    """Refcounts count every retain; a stored response is retained by its id too and keeps its
    own pin at refcount 0; a deleted one held by a retain is gone for GET, not for release."""
    c = chat(tight, "count me")["id"]
    assert refs(tight, "retain", [c, c]).json() == {"retained": {c: 2}}
    assert refs(tight, "release", [c]).json() == {"released": {c: 1}}
    assert refs(tight, "release", [c]).json() == {"released": {c: 0}}
    r = create(tight, input="stored and retained")
    before = health(tight)["pinned_bytes"]
    assert before > 0
    assert refs(tight, "retain", [r["id"]]).json() == {"retained": {r["id"]: 1}}
    assert refs(tight, "release", [r["id"]]).json() == {"released": {r["id"]: 0}}
    assert health(tight)["pinned_bytes"] == before          # the stored response's own pin stays
    assert refs(tight, "retain", [r["id"]]).json() == {"retained": {r["id"]: 1}}
    assert httpx.delete(f"{tight.url}/v1/responses/{r['id']}", headers=tight.headers()).status_code == 200
    assert httpx.get(f"{tight.url}/v1/responses/{r['id']}", headers=tight.headers()).status_code == 404
    assert refs(tight, "release", [r["id"]]).json() == {"released": {r["id"]: 0}}
    assert health(tight)["pinned_bytes"] < before


def test_retain_unknown_ids_change_nothing(tight):
    c = chat(tight, "known")["id"]
    for ids in (["chatcmpl-nope"], [c, "chatcmpl-nope"]):
        r = refs(tight, "retain", ids)
        err = r.json()["error"]
        assert r.status_code == 404 and err["param"] == "ids" and "chatcmpl-nope" in err["message"], r.text
        r = refs(tight, "release", ids)
        assert r.status_code == 404 and "chatcmpl-nope" in r.json()["error"]["message"], r.text
    assert refs(tight, "retain", [c]).json() == {"retained": {c: 1}}      # the mixed list did not count
    other = {"Authorization": "Bearer key-two"}                            # another tenant's id is unknown
    r = refs(tight, "retain", [c], key=other)
    assert r.status_code == 404 and c in r.json()["error"]["message"], r.text
    assert refs(tight, "release", [c]).json() == {"released": {c: 0}}


BAD = [({}, "ids"), ({"ids": []}, "ids"), ({"ids": "chatcmpl-x"}, "ids"), ({"ids": [3]}, "ids[0]"),
       ({"ids": [""]}, "ids[0]"), ({"ids": ["a"], "extra": 1}, "extra")]


@pytest.mark.parametrize("body,param", BAD, ids=[json.dumps(b) for b, _ in BAD])
def test_retain_bad_body_names_field(tight, body, param):
    for verb in ("retain", "release"):
        r = httpx.post(f"{tight.url}/v1/flashrt/{verb}", json=body, headers=tight.headers())
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_stored_response_expires_with_its_pin(ckpt):
    s = Server(ckpt("qwen3", "tiny", chat=True), *BASE, "--max-sessions", "1", "--response-ttl-s", "3")
    try:
        r = create(s, input="short lived")
        h = health(s)
        assert h["stored"] == 1 and h["pinned_bytes"] > 0, h
        time.sleep(3.5)
        assert httpx.get(f"{s.url}/v1/responses/{r['id']}").status_code == 404
        assert refs(s, "retain", [r["id"]]).status_code == 404
        h = health(s)
        assert h["stored"] == 0 and h["pinned_bytes"] == 0, h
    finally:
        s.stop()


def test_restart_keeps_responses_and_refcounts(ckpt, tmp_path):
    """A clean stop, then a new server on the same --capsule-dir; a damaged record file (here
    cut in half by hand) is skipped and counted, not fatal."""
    ck, caps = ckpt("qwen3", "tiny", chat=True), str(tmp_path / "caps")
    a = Server(ck, *BASE, "--max-sessions", "1", "--capsule-dir", caps)
    try:
        r = create(a, input="remember this " * 10)
        c = chat(a, "a chat to keep")["id"]
        assert refs(a, "retain", [c, c]).json() == {"retained": {c: 2}}
    finally:
        a.stop()
    good = (tmp_path / "caps" / "responses" / f"{r['id']}.json").read_bytes()
    (tmp_path / "caps" / "responses" / "resp-cut.json").write_bytes(good[: len(good) // 2])
    b = Server(ck, *BASE, "--max-sessions", "1", "--capsule-dir", caps)
    try:
        got = httpx.get(f"{b.url}/v1/responses/{r['id']}")
        assert got.status_code == 200 and got.json() == r
        nxt = create(b, previous_response_id=r["id"], input="go on")
        assert cached(nxt) >= history(r)
        assert refs(b, "release", [c]).json() == {"released": {c: 1}}
        h = health(b)
        assert h["stored"] == 2 and h["retained"] == 1 and h["damaged_files"] == 1, h   # skipped, counted
    finally:
        b.stop()


def test_contract_recovery_determinism_sigkill_mid_turn_then_restart(ckpt, tmp_path):
    """SIGKILL while a long streamed turn runs and stored responses are being made: after the
    restart every response that had finished continues from its whole history, the killed one
    is absent, and no record file is half-written."""
    ck, caps = ckpt("qwen3", "tiny", chat=True), tmp_path / "caps"
    a = Server(ck, *BASE, "--max-sessions", "2", "--max-seq-len", "2048", "--capsule-dir", str(caps))
    done, killed = [create(a, input=f"finished {i} " * 8) for i in range(3)], threading.Event()

    def more():                                  # stored responses racing the kill
        i = 0
        while not killed.is_set():
            try:
                r = a.post("/v1/responses", {"input": f"racing {i} " * 8, "max_output_tokens": 3,
                                             "temperature": 0})
            except httpx.HTTPError:
                return
            if r.status_code == 200 and not killed.is_set():
                done.append(r.json())
            i += 1
    racer = threading.Thread(target=more)
    racer.start()
    long_id, ended = None, False
    try:
        with httpx.stream("POST", a.url + "/v1/responses", timeout=120, json={
                "input": "a long story", "stream": True, "temperature": 0, "max_output_tokens": 1800}) as s:
            for line in s.iter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                if ev["type"] == "response.created":
                    long_id = ev["response"]["id"]
                elif ev["type"] in ("response.completed", "response.incomplete"):
                    ended = True
                elif ev["type"] == "response.output_text.delta" and len(done) >= 6:
                    killed.set()          # mid-turn, with racing responses made (and in flight)
                    os.kill(a.proc.pid, signal.SIGKILL)
                    break
    except httpx.HTTPError:
        pass
    finally:
        killed.set()
        racer.join()
        a.proc.wait()
        a.stop()
    assert long_id is not None and not ended, "the long turn finished before the kill"
    records = sorted(caps.glob("responses/*.json"))
    assert len(records) >= len(done)
    for f in records:                            # each whole: the old state or the new one
        assert json.loads(f.read_bytes())["id"] == f.stem
    b = Server(ck, *BASE, "--max-sessions", "1", "--max-seq-len", "2048", "--capsule-dir", str(caps))
    try:
        assert not list(caps.glob("responses/.*"))         # a dead writer's temp file is gone
        assert httpx.get(f"{b.url}/v1/responses/{long_id}").status_code == 404
        for r in done:
            assert httpx.get(f"{b.url}/v1/responses/{r['id']}").json() == r
            nxt = create(b, previous_response_id=r["id"], input="go on", max_output_tokens=1, store=False)
            assert cached(nxt) >= history(r), r["id"]
        # the recovered state continues exactly as a cold run of the same whole prompt (greedy)
        nxt = create(b, previous_response_id=done[-1]["id"], input="go on", max_output_tokens=6)
        prompt, reply = turn_ids(caps, nxt)
        assert cached(nxt) >= history(done[-1]) and reply == cold(b, prompt, 6, "cold")
        assert health(b)["damaged_files"] == 0
    finally:
        b.stop()


def test_two_servers_share_responses_through_redis(ckpt, tmp_path):
    pytest.importorskip("redis")
    from redis_util import Server as RedisServer
    redis_srv = RedisServer(tmp_path)
    # a loaded machine can stall a call past the tier's 1 s default: the fallback is not under test
    shared = ("--capsule-redis", redis_srv.url + "?socket_timeout=10&socket_connect_timeout=10")
    ck = ckpt("qwen3", "tiny", chat=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:     # both start at once
        made = [pool.submit(Server, ck, *BASE, "--max-sessions", "1", *shared) for _ in "ab"]
    try:
        a, b = (f.result() for f in made)
        r = create(a, input="made on A " * 10)
        got = httpx.get(f"{b.url}/v1/responses/{r['id']}")
        assert got.status_code == 200 and got.json() == r
        nxt = create(b, previous_response_id=r["id"], input="continued on B")
        assert cached(nxt) >= history(r)
        c = chat(a, "a chat on A")["id"]
        assert refs(b, "retain", [c]).json() == {"retained": {c: 1}}
        assert refs(b, "release", [c]).json() == {"released": {c: 0}}
        assert httpx.delete(f"{b.url}/v1/responses/{r['id']}").status_code == 200
        assert httpx.get(f"{b.url}/v1/responses/{r['id']}").status_code == 404
    finally:
        for f in made:
            if f.exception() is None:
                f.result().stop()
        redis_srv.kill()


def test_spilled_past_the_memory_budget(ckpt, tmp_path):
    """With --capsule-dir, a stored response past --response-retain-mb is not refused: its capsule
    lives on disk (pinned there) and is put back into memory when continued, after traffic that
    evicted it from memory. Only past --capsule-disk-mb too is store=true a 507."""
    s = Server(ckpt("qwen3", "tiny", chat=True), *BASE, "--max-sessions", "1", "--capsule-budget-mb", "0.5",
               "--response-retain-mb", "0.05", "--capsule-dir", str(tmp_path / "caps"), "--capsule-disk-mb", "1")
    try:
        create(s, input="first " * 20)
        pinned = health(s)
        assert pinned["pinned_bytes"] >= 0.05 * 2**20 and pinned["spilled_bytes"] > 0, pinned
        second = create(s, input="second " * 20)
        h = health(s)
        assert h["pinned_bytes"] == pinned["pinned_bytes"] and h["spilled_bytes"] > pinned["spilled_bytes"], h
        traffic(s, "s")
        nxt = create(s, previous_response_id=second["id"], input="go on", max_output_tokens=1, store=False)
        assert cached(nxt) >= history(second)
        for i in range(20):
            r = s.post("/v1/responses", {"input": f"fill {i} " * 20, "max_output_tokens": 1})
            if r.status_code != 200:
                break
        assert r.status_code == 507 and r.json()["error"]["param"] == "store", r.text
        assert "--capsule-disk-mb" in r.json()["error"]["message"]
    finally:
        s.stop()


def text(resp: dict) -> str:
    return "".join(c["text"] for o in resp["output"] if o["type"] == "message" for c in o["content"])


def turn_ids(caps, resp: dict) -> tuple:
    """(prompt ids, reply ids) of a stored response, from its record file under caps."""
    hist = json.loads((caps / "responses" / f"{resp['id']}.json").read_bytes())["history"]
    n = resp["usage"]["input_tokens"]
    return hist[:n], hist[n:]


def cold(s, ids: list, n: int, salt: str, **kw) -> list:
    """The reply ids of a fresh run of exactly `ids` (a cache namespace of its own: a full prefill)."""
    c = s.complete(ids, max_tokens=n, cache_salt=salt, **kw)
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, c["usage"]
    return c["choices"][0]["token_ids"]


def test_contract_fork_determinism_seeded_forks_equal_a_fresh_run(ckpt, tmp_path):
    """Two forks of one response with one input and one seed (sampled, temperature 1) give the
    same tokens, and each is a fresh run of its whole prompt with that seed; another seed differs."""
    caps = tmp_path / "caps"
    s = Server(ckpt("qwen3", "tiny", chat=True), *BASE, "--max-sessions", "1", "--capsule-dir", str(caps))
    try:
        base = create(s, input="Tell me a story " * 4, max_output_tokens=4)

        def fork(seed: int) -> dict:
            return create(s, previous_response_id=base["id"], input="about a dragon", max_output_tokens=12,
                          temperature=1.0, seed=seed)
        a, b, other = fork(7), fork(7), fork(8)
        assert cached(a) >= history(base) and cached(b) >= history(base)
        (pa, ra), (pb, rb), (po, ro) = (turn_ids(caps, r) for r in (a, b, other))
        assert pa == pb == po and len(ra) == 12 and ra == rb and text(a) == text(b)
        assert ro != ra                                   # the seed decides: 12 sampled tokens apart
        assert cold(s, pa, 12, "fresh-7", temperature=1.0, seed=7) == ra
        assert cold(s, po, 12, "fresh-8", temperature=1.0, seed=8) == ro
    finally:
        s.stop()


def _damage(path) -> None:
    """Every byte of the capsule file's state rows inverted, its header kept: the checksum fails
    (a server that used it anyway would continue from garbage)."""
    import struct

    from flashrt.capsules import format as fmt
    from flashrt.errors import CapsuleCorruptError
    raw = bytearray(path.read_bytes())
    start = 8 + struct.unpack_from("<Q", raw)[0]
    raw[start:] = bytes(b ^ 0xFF for b in raw[start:])
    path.write_bytes(bytes(raw))
    with pytest.raises(CapsuleCorruptError):
        fmt.load(path)


def test_contract_checkpoint_validity_damaged_or_foreign_refused(ckpt, tmp_path):
    """A restarted server on a --capsule-dir holding (i) a damaged record file and (ii) capsule
    files it must refuse, in place of both the turn file and the spilled copy of two stored
    responses: damaged ones (state rows inverted) and foreign ones (whole, checksummed: another
    model's state after the same tokens). The damaged record is skipped and counted; the refused
    capsules are not used: the continuations' greedy tokens are those of a cold run of their
    whole prompt (a refused capsule is rebuilt from the record's tokens or prefilled); the other
    stored response is untouched: GET as before, continued from its whole history."""
    import flashrt
    from flashrt.capsules import format as fmt
    ck, caps = ckpt("qwen3", "tiny", chat=True), tmp_path / "caps"
    a = Server(ck, *BASE, "--max-sessions", "1", "--capsule-dir", str(caps))
    try:
        lost, damaged, foreign, kept = (create(a, input=f"{t} conversation " * 8)
                                        for t in ("lost", "damaged", "foreign", "kept"))
    finally:
        a.stop()
    other = flashrt.load(ckpt("qwen3", "tiny", chat=True, seed=1), dtype="float32", max_seq_len=1024)
    files = {f: fmt.load(f).history for f in caps.glob("*.capsule")}
    for resp in (damaged, foreign):
        hist = json.loads((caps / "responses" / f"{resp['id']}.json").read_bytes())["history"]
        mine = [f for f, h in files.items() if h == hist]
        assert len(mine) == 2, (resp["id"], mine)        # its turn file and its spilled copy
        for f in mine:
            if resp is damaged:
                _damage(f)
            else:
                other.reset()
                other.prefill(hist)
                cap = other.snapshot()
                assert cap.meta.fingerprint != fmt.load(f).meta.fingerprint
                fmt.save(cap, f)
    rec = caps / "responses" / f"{lost['id']}.json"
    rec.write_bytes(rec.read_bytes().replace(b'"history":[', b'"history":[[', 1))
    b = Server(ck, *BASE, "--max-sessions", "1", "--capsule-dir", str(caps))
    try:
        h = health(b)
        assert h["damaged_files"] == 1 and h["stored"] == 3, h
        assert httpx.get(f"{b.url}/v1/responses/{lost['id']}").status_code == 404
        for i, r in enumerate((damaged, foreign)):
            assert httpx.get(f"{b.url}/v1/responses/{r['id']}").json() == r     # the record stands
            nxt = create(b, previous_response_id=r["id"], input="go on", max_output_tokens=8)
            prompt, reply = turn_ids(caps, nxt)
            assert len(reply) == 8 and prompt[: history(r)] == json.loads(
                (caps / "responses" / f"{r['id']}.json").read_bytes())["history"]
            assert reply == cold(b, prompt, 8, f"cold-{i}"), r["id"]
        assert httpx.get(f"{b.url}/v1/responses/{kept['id']}").json() == kept
        nxt = create(b, previous_response_id=kept["id"], input="go on", max_output_tokens=1, store=False)
        assert cached(nxt) >= history(kept)
    finally:
        b.stop()

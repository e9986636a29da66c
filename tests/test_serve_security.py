"""flashrt serve against hostile clients (issue 32): no request stalls the others, no client
reads another's conversation, every input gets a 4xx. Real uvicorn servers on loopback (tiny
random-weight checkpoints), raw sockets where a client misbehaves below HTTP."""
from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from serve_util import Server, _one_thread, free_port, sse  # noqa: E402

from flashrt.models.tokenizer import ByteTokenizer  # noqa: E402
from flashrt.serve.conversations import ConversationTable  # noqa: E402
from flashrt.serve.text import TextStream  # noqa: E402

VOCAB = 512
KEYS = [f"tenant-{i}-{'x' * 12}" for i in range(4)]      # --api-keys FILE
ENV_KEY = "from-the-environment-key"                      # FLASHRT_API_KEY
NAMED_MB = 0.15           # three 40-token saves fit (~45 KB each), a 200-token one (~128 KB) not


def rand_ids(n, seed):
    r = random.Random(seed)
    return [r.randrange(VOCAB) for _ in range(n)]


def auth(key) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def tiny(ckpt):
    return ckpt("qwen3_5", "tiny")


@pytest.fixture(scope="module")
def caps(tiny, tmp_path_factory):
    """The open server's capsule folder, with a symbolic link planted in named/ before it starts
    (named/evil.capsule -> a valid capsule outside): a start-up scan or a load must not follow it."""
    import flashrt
    from flashrt.capsules import save_capsule
    d = tmp_path_factory.mktemp("open")
    (d / "caps" / "named").mkdir(parents=True, mode=0o700)
    (d / "caps").chmod(0o700)
    with _one_thread():
        rt = flashrt.load(tiny, dtype="float32", max_seq_len=512)
        rt.prefill(rand_ids(30, 9))
        save_capsule(rt.snapshot(), d / "outside.capsule")
    (d / "caps" / "named" / "evil.capsule").symlink_to(d / "outside.capsule")
    return d / "caps"


@pytest.fixture(scope="module")
def srv(tiny, caps, tmp_path_factory):
    """No API key: one tenant; small limits so each is reached in a few requests."""
    s = Server(tiny, "--max-sessions", "2", "--capsule-dir", str(caps), "--capsule-named-mb", str(NAMED_MB),
               "--max-named-per-key", "3", "--max-sessions-per-key", "6", "--read-timeout-s", "3",
               "--allowed-host", "flashrt.test", log=tmp_path_factory.mktemp("srv") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed(tiny, tmp_path_factory):
    """Five tenants: four keys from --api-keys FILE, one from FLASHRT_API_KEY; one model session,
    so every request runs on the session the previous one (of any key) left."""
    d = tmp_path_factory.mktemp("keyed")
    (d / "keys").write_text("# one key a line\n" + "\n".join(KEYS) + "\n")
    s = Server(tiny, "--max-sessions", "1", "--capsule-dir", str(d / "caps"), "--api-keys", str(d / "keys"),
               "--max-sessions-per-key", "4", api_key=ENV_KEY, key_arg=False,
               env={"FLASHRT_API_KEY": ENV_KEY}, log=d / "server.log")
    s.caps = d / "caps"                                     # made by the server
    yield s
    s.stop()


def post(s, path, body=None, key=None, **kw):
    headers = {**(auth(key) if key else s.headers()), **kw.pop("headers", {})}
    if isinstance(body, bytes):
        return httpx.post(s.url + path, content=body, timeout=60,
                          headers={"content-type": "application/json", **headers}, **kw)
    return httpx.post(s.url + path, json=body, timeout=60, headers=headers, **kw)


def complete(s, ids, key=None, **kw):
    r = post(s, "/v1/completions", {"prompt": ids, "temperature": 0, "max_tokens": 2, **kw}, key)
    assert r.status_code == 200, r.text
    return r.json()


def cached(reply) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def clear_named(caps):
    """Remove every named save (the folder is the only state of the server's names); the planted
    link stays."""
    for p in (caps / "named").glob("*"):
        if p.is_symlink():
            continue
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


# ---- 1. availability: a stop string cannot stall the engine ------------------------------------
def test_text_stream_holds_back_in_linear_time():
    """A 100,000-character stop string whose prefixes the text keeps matching: the hold-back is
    an automaton step per character (it tested every prefix of every stop on every token: ~5 s
    for these 80 tokens)."""
    stop = "ab" * 50_000
    t0 = time.perf_counter()
    ts = TextStream(ByteTokenizer(VOCAB), [stop])
    out = [ts.feed(b) for b in b"ab" * 40]
    elapsed = time.perf_counter() - t0
    assert out == [""] * 80 and not ts.stopped          # every byte could still begin the stop
    assert ts.finish() == "ab" * 40
    assert elapsed < 1.0, f"80 tokens took {elapsed:.2f} s against one long stop string"


def test_long_stop_strings_are_refused_and_stall_no_one(srv):
    ids = rand_ids(16, 1)
    ok = post(srv, "/v1/completions", {"prompt": ids, "max_tokens": 2, "stop": ["s" * 256] * 4})
    assert ok.status_code == 200, ok.text
    over = post(srv, "/v1/completions", {"prompt": ids, "max_tokens": 2, "stop": ["s" * 257]})
    assert over.status_code == 400 and "256" in over.json()["error"]["message"]

    def victim(i):
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": rand_ids(16, 10 + i), "max_tokens": 4,
                                                          "temperature": 0}, timeout=30)
        assert r.status_code == 200, r.text
        return time.perf_counter() - t0
    idle = max(victim(i) for i in range(4))
    attack = {}

    def attacker():                 # four 1 MB stop strings (they took ~40 s each on one thread)
        t0 = time.perf_counter()
        r = post(srv, "/v1/completions", {"prompt": ids, "max_tokens": 6, "stop": ["q" * (1 << 20)] * 4})
        attack.update(status=r.status_code, body=r.json(), s=time.perf_counter() - t0)
    t = threading.Thread(target=attacker, daemon=True)
    t.start()
    during = [victim(100 + i) for i in range(4)]
    t.join(60)
    assert attack["status"] == 400 and attack["body"]["error"]["param"] == "stop", attack
    # generous for a loaded 2-core machine: one such request held every other for ~40 s
    assert max(during) <= max(3.0, 5 * idle), (during, idle, attack.get("s"))


# ---- 2. availability: huge text is refused by its length, off the event loop ---------------------
def test_huge_text_is_refused_without_freezing_the_loop(srv):
    def health():
        t0 = time.perf_counter()
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
        return time.perf_counter() - t0
    idle = max(health() for _ in range(5))
    text = "x" * 7_800_000
    bodies = [("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
              ("/v1/completions", {"prompt": text, "max_tokens": 1}),
              ("/v1/sessions", {"prompt": text})]
    answers = []

    def flood():
        for path, body in bodies:
            raw = json.dumps(body).encode()
            t0 = time.perf_counter()
            r = post(srv, path, raw)
            e = r.json()["error"]
            answers.append((path, r.status_code, e["code"], e["message"][:120], time.perf_counter() - t0))
    t = threading.Thread(target=flood, daemon=True)
    t.start()
    lat, deadline = [], time.monotonic() + 60
    while t.is_alive() and time.monotonic() < deadline:
        lat.append(health())
        time.sleep(0.02)
    t.join(60)
    assert [a[1:3] for a in answers] == [(400, "context_length_exceeded")] * 3, answers
    # refused by its length in characters (it was tokenized first, on the event loop)
    assert all("7800000 characters cannot fit" in a[3] for a in answers), answers
    assert max(lat) < max(2.5, 10 * idle), (max(lat), idle, answers)   # it stood ~5 s a request


def test_tokenizing_runs_off_the_event_loop(tiny):
    """Templates and tokenizing run on a worker thread: encode finds no running event loop."""
    import asyncio

    from starlette.testclient import TestClient

    from flashrt.serve import build
    app, engine = build(tiny, dtype="float32", max_seq_len=256, max_sessions=1, threads=1)
    encode, on_loop = engine.tokenizer.encode, []

    def spy(text):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return encode(text)
    engine.tokenizer.encode = spy
    with TestClient(app, base_url="http://localhost") as c:
        for path, body in [("/v1/completions", {"prompt": "some text", "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 1}),
                           ("/v1/sessions", {"prompt": "more text"})]:
            assert c.post(path, json=body).status_code == 200
    assert on_loop == [False, False, False]


# ---- 3. and 5. sessions: quotas per key, empty sessions never evict, shared histories -------------
def test_session_table_quotas():
    t = ConversationTable(limit=8)
    victim = t.create([1, 2, 3])
    for _ in range(20):                         # empty sessions replace only empty ones
        t.create(())
    assert t.get(victim.id).tokens == (1, 2, 3)
    t = ConversationTable(limit=100, per_key=4)
    b = t.create([5], tenant="B")
    mine = [t.create([i + 1], tenant="A") for i in range(20)]   # A replaces its own, never B's
    assert t.get(b.id, "B") is b and len(t) == 5
    with pytest.raises(Exception, match="unknown session"):
        t.get(b.id, "A")                        # to another tenant it does not exist
    for s in mine[-4:]:
        s.begin_turn()
    with pytest.raises(Exception, match="every one with a turn") as e:
        t.create([9], tenant="A")
    assert e.value.status == 429


def test_histories_are_shared_and_counted_per_key():
    t = ConversationTable(limit=10, tokens_per_key=950)
    s = t.create(tuple(range(300)), tenant="A")
    snap = s.snapshot()
    assert s.snapshots[snap] is s.tokens                        # no copy
    f = t.create(s.history(), tenant="A")                       # a fork
    assert f.tokens is s.tokens and t.held_tokens("A") == 600
    s.rollback(200)                                             # the snapshot keeps the 300
    assert t.held_tokens("A") == 800
    s.snapshot()
    s.rollback(100)
    assert t.held_tokens("A") == 900
    s.snapshot()
    with pytest.raises(Exception, match="session-tokens-per-key") as e:
        s.rollback(60)                # a new 60-token history: 960 > 950
    assert e.value.status == 429 and len(s.tokens) == 100       # refused: nothing changed
    assert t.create(tuple(range(900)), tenant="B").held == 900  # B's budget is its own
    t.delete(f.id, "A")
    assert t.held_tokens("A") == 600


def test_sessions_holding_nothing_evict_nothing(srv, keyed):
    victim = post(srv, "/v1/sessions", {"prompt": [1, 2, 3]}).json()["id"]
    for _ in range(20):                                # 6 sessions per key: empty ones rotate
        assert post(srv, "/v1/sessions").status_code == 200
    assert httpx.get(f"{srv.url}/v1/sessions/{victim}", timeout=30).json()["tokens"] == [1, 2, 3]
    other = post(keyed, "/v1/sessions", {"prompt": [4, 5]}, key=KEYS[1]).json()["id"]
    for i in range(10):                                # 4 per key: KEYS[0] replaces its own
        assert post(keyed, "/v1/sessions", {"prompt": [i + 1]}, key=KEYS[0]).status_code == 200
    r = httpx.get(f"{keyed.url}/v1/sessions/{other}", headers=auth(KEYS[1]), timeout=30)
    assert r.status_code == 200 and r.json()["tokens"] == [4, 5]


# ---- 4. named saves: a byte budget and a count per key ---------------------------------------------
def test_named_saves_have_a_budget_and_a_count(srv, caps):
    clear_named(caps)
    sid = post(srv, "/v1/sessions", {"prompt": rand_ids(40, 2)}).json()["id"]
    for i in range(3):
        assert post(srv, f"/v1/sessions/{sid}/save", {"name": f"n{i}"}).status_code == 200
    r = post(srv, f"/v1/sessions/{sid}/save", {"name": "n3"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "named_quota"
    assert "--max-named-per-key" in r.json()["error"]["message"]
    big = post(srv, "/v1/sessions", {"prompt": rand_ids(200, 3)}).json()["id"]
    r = post(srv, f"/v1/sessions/{big}/save", {"name": "n0", "overwrite": True})
    assert r.status_code == 507 and r.json()["error"]["code"] == "named_budget_full"
    assert "--capsule-named-mb" in r.json()["error"]["message"]
    assert sum(p.stat().st_size for p in (caps / "named").glob("*.capsule")
               if not p.is_symlink()) <= NAMED_MB * (1 << 20)
    assert post(srv, "/v1/sessions/load", {"name": "n0"}).json()["tokens"] == rand_ids(40, 2)
    clear_named(caps)


# ---- 6. slow clients: a deadline on request heads and bodies ---------------------------------------
def test_slow_clients_are_cut_off(srv):
    t0 = time.monotonic()
    heads = []
    for _ in range(25):
        c = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")     # never finished
        heads.append(c)
    body = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                 b"content-length: 100\r\n\r\n{\"prompt\": ")                  # 10 of 100 bytes
    got = []
    for c in heads + [body]:
        data = b""
        while True:
            c.settimeout(max(0.1, t0 + 10 - time.monotonic()))
            try:
                part = c.recv(65536)
            except socket.timeout:
                break
            if not part:
                break
            data += part
        got.append(data)
        c.close()
    assert time.monotonic() - t0 < 10
    assert all(d.startswith(b"HTTP/1.1 408") for d in got[:-1]), got[:3]
    assert b" 408 " in got[-1] and b"request_timeout" in got[-1], got[-1]
    assert httpx.get(srv.url + "/health", timeout=30).status_code == 200


# ---- 7. isolation: reuse, cached_tokens, sessions, names and responses per key ----------------------
def test_tenants_learn_nothing_of_each_other(keyed):
    secrets_ = [rand_ids(120, 40 + i) for i in range(4)]
    for key, p in zip(KEYS, secrets_):
        assert cached(complete(keyed, p, key)) == 0
        assert cached(complete(keyed, p, key)) == 120          # a key reuses its own prompts

    def probe(i):                 # client i guesses every other client's prompt, all at once
        return [cached(complete(keyed, p, KEYS[i])) for j, p in enumerate(secrets_) if j != i]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        seen = list(ex.map(probe, range(4)))
    assert seen == [[0] * 3] * 4
    # the one model session holds a key's prompt when another key sends it: not reused either
    fresh = rand_ids(120, 50)
    complete(keyed, fresh, KEYS[0])
    assert cached(complete(keyed, fresh, KEYS[0])) == 120
    assert cached(complete(keyed, fresh, KEYS[1])) == 0
    assert cached(complete(keyed, fresh[:60], KEYS[2])) == 0
    # cache_salt partitions a key further
    assert cached(complete(keyed, secrets_[0], KEYS[0], cache_salt="s")) == 0
    assert cached(complete(keyed, secrets_[0], KEYS[0], cache_salt="s")) == 120
    assert cached(complete(keyed, secrets_[0], KEYS[0], cache_salt="t")) == 0


def test_sessions_names_and_responses_are_the_keys_own(keyed):
    a, b = KEYS[2], KEYS[3]
    sid = post(keyed, "/v1/sessions", {"prompt": [1, 2, 3]}, key=a).json()["id"]
    for method, path, body in [("GET", f"/v1/sessions/{sid}", None), ("DELETE", f"/v1/sessions/{sid}", None),
                               ("POST", f"/v1/sessions/{sid}/completions", {"prompt": [4]}),
                               ("POST", f"/v1/sessions/{sid}/fork", None),
                               ("POST", f"/v1/sessions/{sid}/snapshot", None),
                               ("POST", f"/v1/sessions/{sid}/save", {"name": "x"})]:
        r = httpx.request(method, keyed.url + path, json=body, headers=auth(b), timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", (path, r.text)
    assert post(keyed, f"/v1/sessions/{sid}/save", {"name": "same-name"}, key=a).status_code == 200
    assert post(keyed, "/v1/sessions/load", {"name": "same-name"}, key=b).status_code == 404
    other = post(keyed, "/v1/sessions", {"prompt": [9, 9]}, key=b).json()["id"]
    assert post(keyed, f"/v1/sessions/{other}/save", {"name": "same-name"}, key=b).status_code == 200
    assert post(keyed, "/v1/sessions/load", {"name": "same-name"}, key=a).json()["tokens"] == [1, 2, 3]
    assert post(keyed, "/v1/sessions/load", {"name": "same-name"}, key=b).json()["tokens"] == [9, 9]
    body = {"prompt": [5, 6], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", keyed.url + "/v1/completions", json=body, headers=auth(a), timeout=60) as r:
        lines = r.iter_lines()
        rid = json.loads(next(x for x in lines if x.startswith("data: {"))[6:])["id"]
        assert post(keyed, f"/v1/completions/{rid}/cancel", {}, key=b).status_code == 404
        assert post(keyed, f"/v1/completions/{rid}/cancel", {}, key=a).status_code == 200
        assert sse(lines)[-1] == "[DONE]"


def test_redis_and_disk_tiers_keep_namespaces_apart(tiny, tmp_path):
    import redis

    import flashrt
    from flashrt.capsules.redis_tier import RedisTier
    from flashrt.capsules.store import CapsuleStore
    from flashrt.serve.turn_store import TurnStore
    from test_redis_tier import Server as RedisServer
    with _one_thread():
        rt = flashrt.load(tiny, dtype="float32", max_seq_len=256)
        toks = rand_ids(40, 5)
        (tmp_path / "redis").mkdir()
        rs = RedisServer(tmp_path / "redis")
        try:
            one, two = RedisTier.from_url(rs.url), RedisTier.from_url(rs.url)
            a = CapsuleStore(device_bytes=64 << 20, shared=one)
            rt.set_context(toks, store=a.view("ta"))              # stored and published under "ta"
            assert one.flush(30)
            keys = [k.decode() for k in redis.Redis.from_url(rs.url).keys("*")]
            assert keys and all(":ta:" in k for k in keys), keys
            b = CapsuleStore(device_bytes=64 << 20, shared=two)     # another server of the fleet
            assert b.match(toks, rt.fingerprint, namespace="tb")[1] == 0
            assert a.match(toks, rt.fingerprint, namespace="tb")[1] == 0
            assert b.match(toks, rt.fingerprint, namespace="ta")[1] == 40
            one.close()
            two.close()
        finally:
            rs.kill()
        first = TurnStore(64 << 20, tmp_path / "caps")
        rt.reset()
        rt.prefill(toks)
        first.remember_turn(rt, "ta")
        first.flush()
        first.close()
        again = TurnStore(64 << 20, tmp_path / "caps")              # a restart reads the files back
        try:
            assert again.mem.match(toks, rt.fingerprint, namespace="tb")[1] == 0
            assert again.mem.match(toks, rt.fingerprint, namespace="ta")[1] == 40
        finally:
            again.close()


# ---- 8. no key: Host, Origin and content type keep web pages out ----------------------------------
def test_host_origin_and_content_type_without_a_key(srv):
    url, body = srv.url + "/v1/completions", json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode()

    def go(headers, content=body, path="/v1/completions"):
        return httpx.post(srv.url + path, content=content, headers=headers, timeout=30)
    js = {"content-type": "application/json"}
    assert go(js).status_code == 200
    for host in ("evil.example", "127.0.0.1.evil.example", f"evil.example:{srv.port}"):
        r = go({**js, "host": host})
        assert r.status_code == 421 and r.json()["error"]["code"] == "invalid_host", host
    for host in (f"localhost:{srv.port}", "flashrt.test", "[::1]"):
        assert go({**js, "host": host}).status_code == 200, host
    r = go({**js, "origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_origin"
    assert go({**js, "origin": "http://localhost:3000"}).status_code == 200
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        r = go({"content-type": ctype} if ctype else {})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", ctype
    assert go({"content-type": "application/json; charset=utf-8"}).status_code == 200
    assert go({}, content=b"", path="/v1/sessions").status_code == 200      # no body: nothing to type
    assert go({"content-type": "text/plain"}, content=b"", path="/v1/sessions").status_code == 415
    assert httpx.get(url.replace("/v1/completions", "/v1/models"), headers={"host": "evil.example"},
                     timeout=30).status_code == 421


# ---- 9. and 13. the API key: from the environment or a file, any case of "bearer", ASCII only -------
def test_api_key_from_env_or_file_any_bearer_case(keyed):
    cmdline = Path(f"/proc/{keyed.proc.pid}/cmdline").read_bytes().decode(errors="replace")
    assert not any(k in cmdline for k in (*KEYS, ENV_KEY))           # out of `ps`
    models = keyed.url + "/v1/models"
    for hdr in ({"Authorization": f"Bearer {ENV_KEY}"}, {"Authorization": f"bearer {KEYS[0]}"},
                {"Authorization": f"BEARER {KEYS[1]}"}, {"Authorization": f"Bearer  {KEYS[2]}"}):
        assert httpx.get(models, headers=hdr, timeout=30).status_code == 200, hdr
    for hdr in ({}, {"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": KEYS[0]},
                {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {KEYS[0]}x"}):
        r = httpx.get(models, headers=hdr, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", hdr


@pytest.mark.parametrize("where", ["argv", "env"])
def test_a_non_ascii_api_key_is_refused_at_start(tiny, where):
    key = "ключ-key"
    cmd = [sys.executable, "-m", "flashrt.cli", "serve", str(tiny), "--port", str(free_port())]
    env = dict(os.environ)
    if where == "argv":
        cmd += ["--api-key", key]
    else:
        env["FLASHRT_API_KEY"] = key
    p = subprocess.run(cmd, cwd=Path(__file__).parent, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "ASCII" in p.stderr, (p.returncode, p.stderr[-500:])


# ---- 10. and 11. capsules at rest: private files, no links, the model kept with a name ---------------
def test_capsule_files_are_private(keyed):
    caps = keyed.caps
    complete(keyed, rand_ids(30, 6), KEYS[0])                       # a turn file
    sid = post(keyed, "/v1/sessions", {"prompt": rand_ids(30, 7)}, key=KEYS[0]).json()["id"]
    assert post(keyed, f"/v1/sessions/{sid}/save", {"name": "mine"}, key=KEYS[0]).status_code == 200
    deadline = time.monotonic() + 20
    while not list(caps.glob("*.capsule")) and time.monotonic() < deadline:
        time.sleep(0.1)                                             # the background writer
    folders = [caps, caps / "named", *[p for p in (caps / "named").iterdir() if p.is_dir()]]
    files = [f for d in folders for f in d.glob("*.capsule")]
    assert len(folders) >= 3 and len(files) >= 2, (folders, files)
    for p in folders + files:
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, (p, oct(p.stat().st_mode))


def test_named_links_refused_and_the_model_checked(srv, caps, ckpt):
    import flashrt
    from flashrt.capsules import save_capsule
    r = post(srv, "/v1/sessions/load", {"name": "evil"})          # planted before the start
    assert r.status_code == 404, r.text                             # a link is never followed
    with _one_thread():                                             # a save made by another model
        other = flashrt.load(ckpt("qwen3_5", "tiny", seed=7), dtype="float32", max_seq_len=512)
        other.prefill(rand_ids(30, 7))
        save_capsule(other.snapshot(), caps / "named" / "foreign.capsule")
    r = post(srv, "/v1/sessions/load", {"name": "foreign"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_mismatch", r.text
    assert "weights" in r.json()["error"]["message"]
    sid = post(srv, "/v1/sessions", {"prompt": rand_ids(30, 8)}).json()["id"]
    assert post(srv, f"/v1/sessions/{sid}/save", {"name": "mine"}).status_code == 200
    assert post(srv, "/v1/sessions/load", {"name": "mine"}).json()["tokens"] == rand_ids(30, 8)
    clear_named(caps)


# ---- 12. bad input: every one a 4xx in OpenAI's shape (a damaged save: a JSON 5xx, moved aside) -------
def test_deep_json_and_lone_surrogates_are_4xx(srv):
    sid = post(srv, "/v1/sessions", {"prompt": [1, 2]}).json()["id"]
    rid = complete(srv, [3, 4])["id"]
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/sessions", f"/v1/sessions/{sid}/completions",
                 f"/v1/sessions/{sid}/restore", f"/v1/sessions/{sid}/rollback", f"/v1/sessions/{sid}/save",
                 "/v1/sessions/load", f"/v1/completions/{rid}/cancel"]:
        r = post(srv, path, deep)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", (path, r.text[:200])
    lone = '"a\\ud800b"'
    for path, body in [("/v1/completions", '{"prompt": %s, "max_tokens": 1}' % lone),
                       ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}' % lone),
                       ("/v1/sessions", '{"prompt": %s}' % lone),
                       (f"/v1/sessions/{sid}/completions", '{"prompt": %s}' % lone),
                       ("/v1/completions", '{"prompt": [1], "cache_salt": %s}' % lone),
                       ("/v1/completions", '{"prompt": [1], %s: 1}' % lone)]:
        r = post(srv, path, body.encode())
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)
    assert httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=30).json()["busy"] is False


def test_a_damaged_named_save_is_moved_aside(srv, caps):
    clear_named(caps)
    sid = post(srv, "/v1/sessions", {"prompt": rand_ids(30, 8)}).json()["id"]
    assert post(srv, f"/v1/sessions/{sid}/save", {"name": "dmg"}).status_code == 200
    path = caps / "named" / "dmg.capsule"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF                                              # one flipped bit of state
    path.write_bytes(bytes(data))
    r = post(srv, "/v1/sessions/load", {"name": "dmg"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "saved_session_damaged", r.text
    assert not path.exists() and list((caps / "named").glob("dmg.capsule.damaged-*"))   # kept, aside
    again = post(srv, "/v1/sessions/load", {"name": "dmg"})
    assert again.status_code == 404 and again.json()["error"]["param"] == "name"
    clear_named(caps)

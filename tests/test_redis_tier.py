"""The Redis capsule tier against a real redis-server (Debian's, started here on loopback; the
tests fail when it is missing). Two "nodes" are two runtimes with their own CapsuleStores over
one Redis; checkpoints have random weights."""
import json
import subprocess
import sys
import threading
import time

import pytest
import redis
import torch

import flashrt
from flashrt.capsules import format as fmt
from flashrt.capsules.redis_tier import RedisTier, fingerprint_digest, prefix_digests
from flashrt.capsules.store import CapsuleStore
from redis_util import Server

T1 = [(7 * i + 3) % 97 + 1 for i in range(40)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("redis"))
    yield s
    s.kill()


@pytest.fixture
def raw(server):
    r = redis.Redis.from_url(server.url)
    r.flushall()
    yield r
    r.close()


@pytest.fixture
def tiers(server, raw):
    made = []

    def make(**kw):
        made.append(RedisTier.from_url(server.url, **kw))
        return made[-1]
    yield make
    for t in made:
        t.close()


@pytest.fixture(scope="module")
def rt(runtime):
    return lambda **kw: runtime("qwen3_5", **kw)


def snap(m, tokens):
    m.reset()
    m.prefill(tokens)
    return m.snapshot()


NODE_A = """
import json, sys
import flashrt
from flashrt.capsules.redis_tier import RedisTier
from flashrt.capsules.store import CapsuleStore
path, url, t1 = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
a = flashrt.load(path, max_seq_len=256, dtype="float32")
tier = RedisTier.from_url(url)
store = CapsuleStore(host_bytes=1 << 30, shared=tier)
a.set_context(t1, store=store)
turn2 = t1 + list(a.generate(max_new_tokens=6)) + [5, 6, 7]
a.set_context(turn2, store=store)      # stored as a delta over turn 1's capsule
assert tier.flush()
print(json.dumps({"turn2": turn2, "stats": tier.stats()}))
"""


def test_turn2_on_another_node(ckpt, rt, server, tiers):
    """Turn 1 and the turn-2 boundary on node A (another process), the next turn on node B."""
    path = ckpt("qwen3_5")
    out = subprocess.run([sys.executable, "-c", NODE_A, str(path), server.url, json.dumps(T1)],
                         check=True, capture_output=True, text=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    turn2 = res["turn2"]
    assert res["stats"]["published"] == 2
    tb = tiers()
    b, cold = rt(), rt()
    sb = CapsuleStore(host_bytes=1 << 30, shared=tb)
    prompt = turn2 + [11, 12]
    logits = b.set_context(prompt, store=sb)
    assert b.context_reused == len(turn2)            # the whole stored prefix, from node A
    st = tb.stats()
    assert st["hits"] == 1 and st["corrupt"] == 0 and st["fetched_bytes"] > 0
    assert len(sb) >= 2                           # the chain now lives in B's local tiers
    lc = cold.prefill(prompt)
    for _ in range(8):                            # same greedy output as cold (top-2 margin rule)
        assert (logits - lc).abs().max() < 1e-4
        top = torch.topk(lc, 2).values
        if top[0] - top[1] > 1e-3:
            assert int(logits.argmax()) == int(lc.argmax())
        tok = int(lc.argmax())
        logits, lc = b.decode(tok), cold.decode(tok)


def test_other_fingerprints_see_nothing(rt, runtime, tiers, raw):
    ta, tb, tc = tiers(), tiers(), tiers()
    a = rt()
    other = runtime("qwen3_5", ckpt_kw={"seed": 1})          # other weights
    bf16 = rt(dtype="bfloat16")                                # same weights, other dtype
    cap = snap(a, T1)
    CapsuleStore(host_bytes=1 << 30, shared=ta).put(cap)
    assert ta.flush() and ta.stats()["published"] == 1
    for m, t in ((other, tb), (bf16, tc)):
        assert fingerprint_digest(m.fingerprint) != fingerprint_digest(a.fingerprint)
        m.set_context(T1 + [1], store=CapsuleStore(host_bytes=1 << 30, shared=t))
        assert m.context_reused == 0 and t.stats()["hits"] == 0
    assert t.lookup(T1, a.fingerprint)[1] == len(T1)         # the right model does see it
    fp = fingerprint_digest(a.fingerprint)
    assert [k.decode() for k in raw.scan_iter(f"flashrt:{{{fp}}}:m:*")] == [f"flashrt:{{{fp}}}:m:{cap.id}"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing_chunk"])
def test_damaged_value_is_a_counted_miss(rt, tiers, raw, damage):
    ta, tb = tiers(chunk_bytes=8192), tiers()
    a, b, cold = rt(), rt(), rt()
    cap = snap(a, T1)
    ta.publish(cap)
    assert ta.flush()
    P = f"flashrt:{{{fingerprint_digest(a.fingerprint)}}}:"
    chunks = sorted(raw.scan_iter(P + "c:*"))
    assert len(chunks) > 2
    k = chunks[1]
    if damage == "flip":
        v = bytearray(raw.get(k))
        v[100] ^= 0x10
        raw.set(k, bytes(v), keepttl=True)
    elif damage == "truncate":
        raw.set(k, raw.get(k)[:-1], keepttl=True)
    else:
        raw.delete(k)
    logits = b.set_context(T1 + [3], store=CapsuleStore(host_bytes=1 << 30, shared=tb))
    assert b.context_reused == 0                                 # never restored
    assert tb.stats()["corrupt"] == 1 and tb.stats()["hits"] == 0
    assert not raw.exists(P + "m:" + cap.id)                  # the damaged capsule is deleted
    assert raw.get(P + "i:" + prefix_digests(T1, [len(T1)])[len(T1)]) is None
    assert not list(raw.scan_iter(f"{P}c:{cap.id}:*"))
    assert (logits - cold.prefill(T1 + [3])).abs().max() < 1e-4


def test_dangling_index_entry_is_deleted(rt, tiers, raw):
    t = tiers()
    a = rt()
    cap = snap(a, T1)
    t.publish(cap)
    assert t.flush()
    P = f"flashrt:{{{fingerprint_digest(a.fingerprint)}}}:"
    raw.delete(P + "m:" + cap.id)                             # as if its keys had expired
    assert t.lookup(T1, a.fingerprint) == (None, 0)
    assert t.stats()["dangling"] == 1
    assert raw.get(P + "i:" + prefix_digests(T1, [len(T1)])[len(T1)]) is None


def stalls(tier, fp, n=6):
    """Seconds each of n lookups takes (all must be misses)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert tier.lookup([5] * 8, fp) == (None, 0)          # nothing stored under these
        out.append(time.perf_counter() - t0)
    return out


def test_redis_killed_mid_run(rt, tmp_path):
    srv = Server(tmp_path)
    try:
        ta = RedisTier.from_url(srv.url, failures=2, open_s=0.5)
        tb = RedisTier.from_url(srv.url, failures=2, open_s=0.5)
        a, b = rt(), rt()
        sa, sb = CapsuleStore(host_bytes=1 << 30, shared=ta), CapsuleStore(host_bytes=1 << 30, shared=tb)
        a.set_context(T1, store=sa)
        assert ta.flush()
        srv.kill()
        for i in range(3):                  # serving continues locally: no exception reaches us
            a.set_context(T1 + [i + 1, 2], store=sa)
            b.set_context(T1 + [i + 1, 3], store=sb)
            assert b.context_reused == 0
        assert ta.flush(timeout=10)
        sta, stb = ta.stats(), tb.stats()
        assert stb["breaker_opens"] >= 1 and stb["errors"] >= 2
        assert sta["dropped"] >= 1 and sta["errors"] >= 1
        t = stalls(RedisTier.from_url(srv.url, failures=2, open_s=30), a.fingerprint)
        assert max(t) < 0.6 and max(t[2:]) < 0.05             # refused, then the circuit is open
        srv.start()                          # back (empty): the tier reconnects by itself
        time.sleep(1.0)                      # once the breakers (open_s=0.5) let calls through
        a.set_context(T1 + [9, 9, 9], store=sa)
        assert ta.flush()
        b.set_context(T1 + [9, 9, 9, 4], store=sb)
        assert b.context_reused == len(T1) + 3 and tb.stats()["hits"] == 1
        # a server that stops answering: socket_timeout bounds the first calls, then the breaker
        slow = RedisTier.from_url(srv.url, client_opts={"socket_timeout": 0.2}, failures=2, open_s=30)
        assert slow.lookup(T1, a.fingerprint)[1] == len(T1)           # connected
        redis.Redis.from_url(srv.url).client_pause(3000, all=True)
        t = stalls(slow, a.fingerprint)
        assert sum(t) < 1.5 and max(t[2:]) < 0.05 and slow.stats()["breaker_opens"] == 1
        for x in (ta, tb, slow):
            x.close()
    finally:
        srv.kill()


def test_concurrent_writers_of_one_prefix(rt, tiers, raw):
    a, a2 = rt(), rt()
    caps = [snap(a, T1), snap(a2, T1)]                        # same prefix, two capsule ids
    writers = [tiers(chunk_bytes=4096) for _ in range(6)]
    go = threading.Barrier(len(writers))
    errors, flushed = [], [False] * len(writers)

    def write(i):
        try:
            go.wait()
            writers[i].publish(caps[i % 2])
            writers[i].publish(caps[(i + 1) % 2])
            flushed[i] = writers[i].flush()
        except BaseException as e:           # a raise in a thread would otherwise only warn
            errors.append((i, repr(e)))
    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(writers))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and all(flushed), (errors, flushed)    # every writer ran to the end
    P = f"flashrt:{{{fingerprint_digest(a.fingerprint)}}}:"
    metas = [k.decode() for k in raw.scan_iter(P + "m:*")]
    assert len(metas) == 1                                    # first writer of the prefix won
    assert sum(t.stats()["published"] for t in writers) == 1
    m = json.loads(raw.get(metas[0]))
    live = {f"{P}c:{m['id']}:{m['u']}:{i}".encode() for i in range(m["k"])}
    assert set(raw.scan_iter(P + "c:*")) == live              # no other upload left behind
    assert int(raw.get(P + "bytes")) == m["b"]
    got, n = tiers().lookup(T1 + [1], a.fingerprint)
    src = caps[0] if got.id == caps[0].id else caps[1]
    assert n == len(T1) and all(torch.equal(got.raw(e), src.raw(e)) for e in src.entries)


def test_publish_races_next_turn(rt, tiers, monkeypatch):
    """A lookup while a publish is in flight (its chunks written, not yet committed; held
    there until the lookup has been made, so the race always happens) is a miss, never a part
    of the capsule; once committed it is all of it."""
    ta, tb = tiers(chunk_bytes=2048), tiers()
    a = rt()
    cap = snap(a, T1)
    want = fmt.to_bytes(cap)
    uploaded, release = threading.Event(), threading.Event()
    real_run = ta._run

    def run(name, *args):                    # the publisher's commit waits for the lookup
        if name == "commit":
            uploaded.set()
            release.wait(10)
        return real_run(name, *args)
    monkeypatch.setattr(ta, "_run", run)
    assert ta.publish(cap)                   # returns at once: the upload runs in the background
    assert uploaded.wait(30), "the publish never reached its commit"
    seen = []
    got, n = tb.lookup(T1, a.fingerprint)    # in flight: a miss
    seen.append("miss" if got is None else "hit")
    release.set()
    deadline = time.monotonic() + 30
    while seen[-1] != "hit":                 # committed: all of it
        assert time.monotonic() < deadline, f"the publish never landed: {seen[-5:]}"
        got, n = tb.lookup(T1, a.fingerprint)
        if got is not None:
            assert n == len(T1) and fmt.to_bytes(got) == want
        seen.append("miss" if got is None else "hit")
    assert seen[0] == "miss", seen
    assert ta.flush() and ta.stats()["published"] == 1 and tb.stats()["corrupt"] == 0


def test_chunking_and_chunk_size_checks(rt, tiers, raw):
    with pytest.raises(ValueError, match="chunk_bytes"):
        tiers(chunk_bytes=600 << 20)
    t = tiers(chunk_bytes=1000)
    a = rt()
    cap = snap(a, T1)
    t.publish(cap)
    assert t.flush()
    P = f"flashrt:{{{fingerprint_digest(a.fingerprint)}}}:"
    size = len(fmt.to_bytes(cap))
    assert len(list(raw.scan_iter(P + "c:*"))) == -(-size // 1000)
    got, n = t.lookup(T1 + [5], a.fingerprint)
    assert n == len(T1) and fmt.to_bytes(got) == fmt.to_bytes(cap)


def test_budget_lru_and_pinned(rt, tiers, raw):
    a = rt()
    caps = [snap(a, T1[:20 + 4 * i]) for i in range(4)]
    size = max(len(fmt.to_bytes(c)) for c in caps)
    t = tiers(budget_bytes=int(2.5 * size))
    t.publish(caps[0], pin=True)
    for c in caps[1:]:
        t.publish(c)
        assert t.flush()
    P = f"flashrt:{{{fingerprint_digest(a.fingerprint)}}}:"
    live = {k.decode().rsplit(":", 1)[1] for k in raw.scan_iter(P + "m:*")}
    assert live == {caps[0].id, caps[3].id}                   # pinned kept; LRU order evicted
    assert int(raw.get(P + "bytes")) <= 2.5 * size
    assert raw.pttl(P + "m:" + caps[0].id) == -1              # a pinned capsule has no TTL
    assert t.lookup(T1[:20], a.fingerprint)[1] == 20


def test_ttl_child_use_renews_parents(rt, tiers, raw):
    t = tiers(ttl_s=2.0)
    a = rt()
    store = CapsuleStore(host_bytes=1 << 30, shared=t)
    a.set_context(T1[:30], store=store)
    a.set_context(T1, store=store)                            # a delta over the first capsule
    assert t.flush() and t.stats()["published"] == 2
    P = f"flashrt:{{{fingerprint_digest(a.fingerprint)}}}:"
    parent = next(c for c in store.keys() if store.get(c).position == 30)
    for _ in range(5):                       # 2.5 s > the TTL: kept alive by using the child
        time.sleep(0.5)                      # (1.5 s of slack per round)
        before = raw.pttl(P + "m:" + parent)
        got, n = t.lookup(T1 + [1], a.fingerprint)
        assert n == len(T1) and got.parent_capsule.id == parent
        after = raw.pttl(P + "m:" + parent)
        assert 0 < before < after <= 2000, (before, after)   # the parent's TTL renewed
    deadline = time.monotonic() + 10         # unused: expires (within the TTL, 2 s)
    while list(raw.scan_iter(P + "m:*")):
        assert time.monotonic() < deadline, "unused capsules never expired"
        time.sleep(0.1)
    assert t.lookup(T1, a.fingerprint) == (None, 0)


def test_tls_and_auth(rt, tmp_path):
    key, crt = str(tmp_path / "k.pem"), str(tmp_path / "c.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", crt,
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    srv = Server(tmp_path, "--port", "0", "--tls-port", "{port}", "--tls-cert-file", crt, "--tls-key-file",
                 key, "--tls-ca-cert-file", crt, "--tls-auth-clients", "no", "--requirepass", "s3cret",
                 probe={"ssl": True, "ssl_ca_certs": crt, "password": "s3cret"})
    tls = {"ssl_ca_certs": crt}
    try:
        a = rt()
        good = RedisTier.from_url(f"rediss://:s3cret@127.0.0.1:{srv.port}/0", client_opts=tls)
        no_password = RedisTier.from_url(f"rediss://127.0.0.1:{srv.port}/0", client_opts=tls)
        no_tls = RedisTier.from_url(f"redis://:s3cret@127.0.0.1:{srv.port}/0")
        good.publish(snap(a, T1))
        assert good.flush() and good.stats()["published"] == 1
        for t in (no_password, no_tls):      # refused: a miss and a counted error, no exception
            assert t.lookup(T1, a.fingerprint) == (None, 0) and t.stats()["errors"] == 1
        assert good.lookup(T1, a.fingerprint)[1] == len(T1)
        for t in (good, no_password, no_tls):
            t.close()
    finally:
        srv.kill()


def test_cluster_keys_share_one_slot(rt, tmp_path):
    nodes = [Server(tmp_path, "--cluster-enabled", "yes", "--cluster-config-file", "nodes-{port}.conf",
                    "--cluster-port", "{bus}") for _ in range(3)]   # port + 10000 may not exist
    try:
        subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True)
        for _ in range(200):                 # every node must know the whole slot map
            if all(redis.Redis(port=n.port).cluster("info")["cluster_state"] == "ok" for n in nodes):
                break
            time.sleep(0.05)
        t = RedisTier.cluster(startup_nodes=[("127.0.0.1", n.port) for n in nodes], chunk_bytes=4096)
        a = rt()
        store = CapsuleStore(host_bytes=1 << 30, shared=t)
        a.set_context(T1[:30], store=store)
        a.set_context(T1, store=store)                            # a delta and its parent
        assert t.flush() and t.stats()["published"] == 2
        got, n = t.lookup(T1 + [2], a.fingerprint)
        assert n == len(T1) and got.parent_capsule.position == 30
        keys = [k for n_ in nodes for k in redis.Redis(port=n_.port).keys("flashrt:*")]
        assert len(keys) > 8 and len({t.client.keyslot(k) for k in keys}) == 1
        t.close()
    finally:
        for n_ in nodes:
            n_.kill()


def test_sentinel(rt, server, raw, tmp_path):
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"sentinel monitor flashrt 127.0.0.1 {server.port} 1\n")
    sentinel = Server(tmp_path, "--sentinel", conf=conf)
    try:
        t = RedisTier.sentinel([("127.0.0.1", sentinel.port)], "flashrt")
        a = rt()
        t.publish(snap(a, T1))
        assert t.flush() and t.stats()["published"] == 1
        assert t.lookup(T1, a.fingerprint)[1] == len(T1)
        assert raw.exists(f"flashrt:{{{fingerprint_digest(a.fingerprint)}}}:lru")   # on the master
        t.close()
    finally:
        sentinel.kill()


def test_lookup_reads_past_a_page_of_other_lengths(rt, tiers):
    t = tiers()
    a = rt()
    t.publish(snap(a, T1))
    a.reset()
    a.prefill([2] * 40)
    for _ in range(70):                      # 70 other conversations' lengths in 41..110
        a.decode(3)
        t.publish(a.snapshot())
        assert t.flush()
    query = T1 + [4] * 80
    assert t.lookup(query, a.fingerprint)[1] == len(T1)           # found on the second page
    assert tiers(max_lengths=64).lookup(query, a.fingerprint) == (None, 0)   # past the bound


def test_damaged_parent_refuses_the_chain(rt, tiers, raw):
    t = tiers()
    a = rt()
    store = CapsuleStore(host_bytes=1 << 30, shared=t)
    a.set_context(T1[:30], store=store)
    a.set_context(T1, store=store)                            # a delta over the first capsule
    assert t.flush() and t.stats()["published"] == 2
    P = f"flashrt:{{{fingerprint_digest(a.fingerprint)}}}:"
    parent = json.loads(raw.get(P + "m:" + next(k for k in store.keys() if store.get(k).position == 30)))
    k = f"{P}c:{parent['id']}:{parent['u']}:0"
    v = bytearray(raw.get(k))
    v[-3] ^= 1
    raw.set(k, bytes(v), keepttl=True)
    fresh = tiers()
    assert fresh.lookup(T1 + [1], a.fingerprint) == (None, 0)    # neither the child nor the parent
    assert fresh.stats()["corrupt"] == 1 and not list(raw.scan_iter(P + "m:*"))


def test_two_server_processes_share_a_conversation(ckpt, server, raw, tmp_path):
    """Turn 1 on `flashrt serve --capsule-redis` A, turn 2 on B: B restores the conversation
    from Redis (cached_tokens = the whole of turn 1) and its greedy reply equals a cold run
    wherever the top-2 gap exceeds 1e-3. Publishing is off the request path: the test waits
    (bounded) until turn 1's end is in Redis before sending turn 2."""
    from serve_util import Reference
    from serve_util import Server as HTTPServer
    path = ckpt("qwen3_5")
    ref = Reference(path)
    a = HTTPServer(path, "--capsule-redis", server.url, "--threads", "1", log=tmp_path / "a.log")
    b = HTTPServer(path, "--capsule-redis", server.url, "--threads", "1", log=tmp_path / "b.log")
    probe = RedisTier.from_url(server.url)
    try:
        first = a.complete(T1, max_tokens=6, ignore_eos=True)
        hist = T1 + first["choices"][0]["token_ids"]
        deadline = time.monotonic() + 60
        while probe.lookup(hist, ref.rt.fingerprint)[1] < len(hist):
            assert time.monotonic() < deadline, "turn 1 never reached Redis"
            time.sleep(0.1)
        turn2 = hist + [5, 6, 7]
        second = b.complete(turn2, max_tokens=6, ignore_eos=True)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(hist)
        assert ref.check(turn2, second["choices"][0]["token_ids"]) >= 1
    finally:
        probe.close()
        a.stop()
        b.stop()


# ---- named capsules (put_named / get_named / names / drop_named) --------------------------------
def test_named_round_trip_namespaces_and_fingerprints(rt, runtime, tiers, raw):
    """A name stored by one tier is read bitwise by another, only in its namespace and only by
    its model; it is pinned (no TTL, not in the LRU, no prefix index entry), a taken name is
    refused, and drop_named removes every key it had."""
    ta, tb = tiers(ttl_s=60), tiers()
    a = rt()
    cap = snap(a, T1)
    fp, want = a.fingerprint, fmt.to_bytes(cap)
    assert ta.put_named("alice", cap) and ta.put_named("alice", cap, namespace="t1")
    got = tb.get_named("alice", fp)
    assert got is not cap and fmt.to_bytes(got) == want and got.history == T1
    assert fmt.to_bytes(tb.get_named("alice", fp, "t1")) == want
    assert tb.names(fp) == ["alice"] and tb.names(fp, "t2") == [] and tb.get_named("alice", fp, "t2") is None
    other = runtime("qwen3_5", ckpt_kw={"seed": 1})           # other weights: another key prefix
    assert tb.get_named("alice", other.fingerprint) is None and tb.names(other.fingerprint) == []
    assert tb.get_named("alice", {**fp, "codec": "x"}) is None        # a field beyond the key's five
    assert tb.names(fp) == ["alice"]                                  # ... is a miss, not damage
    assert tb.get_named("alice", fp, have=lambda cid: cap if cid == cap.id else None) is cap
    P = f"flashrt:{{{fingerprint_digest(fp)}}}:"
    sid = raw.hget(P + "names", "alice").decode()
    assert json.loads(raw.get(P + "m:" + sid))["c"] == cap.id
    assert raw.pttl(P + "m:" + sid) == -1 and all(raw.pttl(k) == -1 for k in raw.scan_iter(f"{P}c:{sid}:*"))
    assert raw.sismember(P + "pins", sid) and raw.zscore(P + "lru", sid) is None
    assert tb.lookup(T1 + [1], fp) == (None, 0)               # names are not found by tokens
    with pytest.raises(FileExistsError, match="alice"):
        tb.put_named("alice", snap(a, T1[:9]))
    assert {k.decode().split(":")[3] for k in raw.scan_iter(P + "c:*")} == {sid}   # no upload left
    with pytest.raises(ValueError, match="bad capsule name"):
        tb.put_named("../x", cap)
    assert tb.drop_named("alice", fp) is True and tb.drop_named("alice", fp) is False
    assert tb.get_named("alice", fp) is None and tb.names(fp) == []
    assert not list(raw.scan_iter(P + "m:*")) and not list(raw.scan_iter(P + "c:*"))
    assert int(raw.get(P + "bytes")) == 0 and not raw.smembers(P + "pins")
    assert tb.names(fp, "t1") == ["alice"]                    # the other namespace keeps its own
    assert ta.put_named("alice", snap(a, T1[:9]))             # the name is free again


@pytest.mark.parametrize("damage", ["flip", "missing_chunk", "dangling"])
def test_named_damaged_value_is_a_deleted_miss(rt, tiers, raw, damage):
    t = tiers(chunk_bytes=8192)
    a = rt()
    assert t.put_named("bob", snap(a, T1))
    P = f"flashrt:{{{fingerprint_digest(a.fingerprint)}}}:"
    sid = raw.hget(P + "names", "bob").decode()
    chunks = sorted(raw.scan_iter(f"{P}c:{sid}:*"))
    if damage == "flip":
        v = bytearray(raw.get(chunks[1]))
        v[100] ^= 0x10
        raw.set(chunks[1], bytes(v))
    elif damage == "missing_chunk":
        raw.delete(chunks[1])
    else:
        raw.delete(P + "m:" + sid)                            # as if someone removed the value
    fresh = tiers()
    assert fresh.get_named("bob", a.fingerprint) is None
    assert fresh.stats()["dangling" if damage == "dangling" else "corrupt"] == 1
    assert fresh.names(a.fingerprint) == [] and not list(raw.scan_iter(P + "c:*"))
    assert int(raw.get(P + "bytes")) == 0 and not raw.exists(P + "m:" + sid)


def test_named_budget_refuses_what_does_not_fit(rt, tiers, raw):
    """A name evicts unpinned capsules to find room, never a pinned or named one: what does
    not fit beside those is refused (False), its upload deleted."""
    a = rt()
    turn, one, two = snap(a, T1), snap(a, T1[:30]), snap(a, T1[:31])
    size = max(len(fmt.to_bytes(c)) for c in (turn, one, two))
    t = tiers(budget_bytes=int(1.5 * size))
    t.publish(turn)
    assert t.flush() and t.stats()["published"] == 1
    assert t.put_named("one", one)                            # the turn's capsule made room
    P = f"flashrt:{{{fingerprint_digest(a.fingerprint)}}}:"
    assert not raw.exists(P + "m:" + turn.id) and t.lookup(T1, a.fingerprint) == (None, 0)
    assert t.put_named("two", two) is False                   # only a named one left: refused
    assert t.names(a.fingerprint) == ["one"] and int(raw.get(P + "bytes")) <= 1.5 * size
    one_id = raw.hget(P + "names", "one").decode()
    assert {k.decode().split(":")[3] for k in raw.scan_iter(P + "c:*")} == {one_id}   # two's upload gone
    assert tiers(budget_bytes=size // 2).put_named("big", two) is False    # larger than the budget
    assert t.get_named("one", a.fingerprint) is not None


def test_named_with_redis_down(rt, tmp_path):
    """Redis gone: put_named False, get_named None, names and drop_named None; nothing raises,
    and once the circuit is open no call waits."""
    srv = Server(tmp_path)
    try:
        t = RedisTier.from_url(srv.url, failures=2, open_s=30)
        a = rt()
        cap = snap(a, T1)
        assert t.put_named("kept", cap)
        srv.kill()
        t0 = time.perf_counter()
        for _ in range(2):
            assert t.put_named("other", cap) is False and t.get_named("kept", a.fingerprint) is None
            assert t.names(a.fingerprint) is None and t.drop_named("kept", a.fingerprint) is None
        assert t.stats()["breaker_opens"] == 1 and time.perf_counter() - t0 < 3
        t.close()
    finally:
        srv.kill()


def test_a_voice_through_redis_speaks_bitwise_as_the_original(tiers, tmp_path):
    """A Synthesizer's voice capsule, stored as a name from one store and fetched by a fresh tier
    into a fresh store and a freshly loaded synthesizer, speaks the original's PCM bitwise."""
    pytest.importorskip("transformers")         # make_checkpoint writes Pocket TTS through it
    from flashrt.models.checkpoint import make_checkpoint
    from flashrt.speech import load_synthesizer
    path = make_checkpoint("pocket_tts", "tiny", tmp_path / "tts", seed=0)
    synth = load_synthesizer(path, max_seq_len=256)
    pcm = torch.randn(700, generator=torch.Generator().manual_seed(1)) * 0.3
    store = CapsuleStore(host_bytes=1 << 24)
    store.put(synth.make_voice(pcm), key="voice.ana")
    voice = store.get("voice.ana")
    assert tiers().put_named("ana", voice, namespace="t1")
    text, kw = torch.tensor([11, 12, 13, 14]), dict(max_frames=12, seed=4, eos_threshold=1e9)
    live = torch.cat(list(synth.speak(text, voice, **kw)))
    other = load_synthesizer(path, max_seq_len=256)
    fresh = CapsuleStore(host_bytes=1 << 24)
    fresh.put(tiers().get_named("ana", other.fingerprint, "t1"), key="voice.ana")
    again = torch.cat(list(other.speak(text, fresh.get("voice.ana"), **kw)))
    assert live.numel() > 0 and torch.equal(again, live)

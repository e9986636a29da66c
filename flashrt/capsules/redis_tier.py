"""A shared capsule tier on Redis, below a CapsuleStore's disk tier: any server of a fleet can
continue a conversation whose last turn ran on another one.

    tier = RedisTier.from_url("rediss://:password@cache:6380/0", ttl_s=3600, budget_bytes=8 << 30)
    store = CapsuleStore(host_bytes=2 << 30, disk_dir="caps", shared=tier)
    rt.set_context(tokens, store=store)   # local miss -> fetched from Redis; turn end -> published

Keys (see capsules/redis_keys.py for the full table) all start with "<ns>:{<fp>}:", where fp is a
digest of the model fingerprint (model_type, config, weights, dtype, layout): a server with other
weights, dtype or layout computes another fp and never sees these keys. The braces are a Redis
Cluster hash tag, so one model's keys share a slot and every Lua script runs on one node. A
store namespace (CapsuleStore.put/match(namespace=), a server's tenant) adds itself after the
tag: "<ns>:{<fp>}:<namespace>:", so tenants never see each other's capsules, each with its own
index, LRU and budget.

Longest-prefix lookup: per-boundary digest keys. A capsule holding tokens[:n] is indexed under
i:<blake2b(tokens[:n] as int64)>. The sorted set `lens` holds the lengths that have an entry, so a
lookup of T tokens reads the 64 largest lengths <= T, hashes only those prefixes (one incremental
pass) and MGETs their index keys: two round trips, and no trie to keep consistent under
concurrent writers. Only when none of them is a prefix of this prompt does it read the next 64,
up to max_lengths (256): a fleet holding more distinct lengths than that above a prompt's own can
miss it (a miss, never a wrong hit). A digest is never trusted alone: the fetched capsule's own
token history must equal tokens[:n].

Values are the capsule file format (format.to_bytes) in chunks of chunk_bytes (one value may
exceed Redis's 512 MB limit), uploaded under a fresh nonce, then made visible by one Lua script
(COMMIT) that checks all chunks are there and sets meta, index, LRU and byte count together.
Writes are idempotent (a capsule id already there is only touched); for one prefix the first
writer wins and later uploads are deleted. Every fetch checks the checksum (format.from_bytes); a
damaged, truncated or incomplete value is a miss, counted, logged and deleted, never restored. An
index entry whose capsule is gone is deleted by the lookup that finds it.

Delta capsules are published after their parent chain (the store's put order; a parent missing in
Redis is uploaded first), a stored child keeps its parents from eviction, and using a child renews
its parents' TTL. Budget: budget_bytes per fingerprint, least recently used first; pinned
capsules (put(pin=True)) and their ancestors have no TTL and are never evicted.

Named capsules (a voice, anything with no token history to be found by): put_named(name, cap,
namespace) stores one now, under the capsule's fingerprint and the namespace, as the one script
NAME maps the name (hash `names`) to a value of its own; get_named / names / drop_named read and
remove it from any server. A name is never evicted nor expired, and never overwritten: a taken
name raises FileExistsError (drop_named first). It counts against budget_bytes: unpinned
capsules are evicted to make room only when the pinned ones leave enough, else it is refused
(False), never stored to be evicted. A damaged value is a miss, counted and deleted with its name.

Records (put_record / get_record / drop_record): small values beside the capsules, e.g. a
server's index of response ids to token histories, so another server resolves an id made here;
each expires with its own TTL and is not counted in budget_bytes.

Faults: every public method returns a miss or drops the publish on connection errors and
timeouts (put_named: False; names, drop_named: None, telling "cannot ask" from "none").
socket_timeout bounds one call; after `failures` consecutive errors the circuit opens and for
open_s seconds no call is tried; then one probe runs and the tier reconnects by itself (redis-py
opens a new connection). Publishing runs on a background thread with a bounded queue
(full: dropped and counted); flush() waits for it.

Security: capsules hold the conversation's tokens. Use AUTH (redis://[user]:password@host, or
client_opts={"password": ...}) and TLS (rediss://, with client_opts={"ssl_ca_certs": ...,
"ssl_certfile": ..., "ssl_keyfile": ...} passed to redis-py); cluster() and sentinel() take the
same client_opts (sentinel_opts for the sentinels' own AUTH/TLS).
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time

from flashrt.errors import CapsuleCorruptError, CapsuleError

from . import format as _fmt
from . import redis_conn as _conn
from .disk import KEY
from .redis_keys import COMMIT, DROP, NAME, NAMED, TOUCH, UNNAME, fingerprint_digest, prefix_digests
from .types import FINGERPRINT_KEYS, Capsule

log = logging.getLogger(__name__)
_MAX_CHUNK = 512 * 1000 * 1000 - 1        # Redis's proto-max-bulk-len default is 512 MB
_UPLOAD_TTL_MS = 600_000                  # chunks of an upload that never commits expire
_PAGE = 64                                # prefix lengths read per lookup round trip


class RedisTier:
    """Capsules of any number of models in one Redis (or Cluster, or Sentinel-managed master)."""

    def __init__(self, client, namespace: str = "flashrt", ttl_s: float | None = 24 * 3600,
                 budget_bytes: int | None = None, chunk_bytes: int = 64 << 20,
                 queue_size: int = 64, failures: int = 2, open_s: float = 5.0,
                 max_lengths: int = 256):
        if not 1 <= chunk_bytes <= _MAX_CHUNK:
            raise ValueError(f"chunk_bytes must be in [1, {_MAX_CHUNK}] (Redis's 512 MB value limit), "
                             f"got {chunk_bytes}")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {budget_bytes}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        self.client, self.namespace = client, namespace
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else 0
        self.budget = -1 if budget_bytes is None else int(budget_bytes)
        self.chunk_bytes, self.max_lengths = chunk_bytes, max_lengths
        self.breaker = _conn.Breaker(failures, open_s)
        self._scripts = {n: client.register_script(s) for n, s in
                         (("commit", COMMIT), ("touch", TOUCH), ("drop", DROP), ("name", NAME),
                          ("named", NAMED), ("unname", UNNAME))}
        self._stats = dict.fromkeys(("hits", "misses", "fetched_bytes", "corrupt", "dangling",
                                     "published", "deduped", "dropped", "skipped", "errors"), 0)
        self._slock = threading.Lock()
        self._jobs = _conn.Background(self._work, queue_size, "flashrt-redis-publish")
        self._local = threading.local()  # a fetch putting into the store must not republish
        self._closed = False

    # ---- construction (client options: capsules/redis_conn.py) ------------------------------
    @classmethod
    def from_url(cls, url: str, client_opts: dict | None = None, **tier_opts) -> "RedisTier":
        """redis://[user:password@]host:port/db or rediss:// (TLS; ssl_* options in client_opts)."""
        return cls(_conn.url_client(url, client_opts), **tier_opts)

    @classmethod
    def cluster(cls, url: str | None = None, startup_nodes=None, client_opts: dict | None = None,
                **tier_opts) -> "RedisTier":
        """A Redis Cluster from a seed URL or a list of (host, port) startup nodes."""
        return cls(_conn.cluster_client(url, startup_nodes, client_opts), **tier_opts)

    @classmethod
    def sentinel(cls, sentinels, service_name: str, client_opts: dict | None = None,
                 sentinel_opts: dict | None = None, **tier_opts) -> "RedisTier":
        """The master of `service_name` as named by the sentinels [(host, port), ...]; password,
        ssl and timeouts in client_opts, the sentinels' own AUTH/TLS in sentinel_opts."""
        return cls(_conn.sentinel_client(sentinels, service_name, client_opts, sentinel_opts), **tier_opts)

    # ---- public API -----------------------------------------------------------------------
    def stats(self) -> dict:
        with self._slock:
            out = dict(self._stats)
        out["breaker_opens"], out["breaker_open"] = self.breaker.opens, self.breaker.is_open
        out["queued"] = self._jobs.pending
        return out

    def publish(self, cap: Capsule, store=None, pin: bool = False, namespace: str = "") -> bool:
        """Queue `cap` (and, for a delta, whatever of its parent chain Redis lacks) for
        publishing in `namespace`; returns at once. False: not queued (full, closed, or a
        single-use capsule)."""
        if cap.meta.single_use or getattr(self._local, "fetching", False) or self._closed:
            return False
        if not self._jobs.submit((cap, store, pin, _check_ns(namespace))):
            self._count("dropped")
            log.warning("redis tier: publish queue full; capsule %s not published", cap.id)
            return False
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued publish has finished (or been dropped); False on timeout."""
        return self._jobs.flush(timeout)

    def close(self) -> None:
        self._closed = True
        self._jobs.close()
        self.client.close()

    def lookup(self, tokens, fingerprint: dict, longer_than: int = 0, have=None, namespace: str = ""):
        """(capsule, n): the longest capsule in Redis (in `namespace`) holding tokens[:n] with
        n > longer_than, parent chain attached, or (None, 0). have(id) -> Capsule|None supplies
        ancestors that are held locally (not fetched again). Never raises on Redis faults: they
        are misses."""
        tokens = [int(t) for t in tokens]
        P = self._prefix(fingerprint, namespace)
        got = self._guard(self._lookup, None, P, tokens, fingerprint, longer_than, have)
        self._count("hits" if got else "misses")
        return got if got else (None, 0)

    def extend_match(self, store, tokens, fingerprint, cap, n, namespace: str = ""):
        """CapsuleStore.match's hook: a longer prefix from Redis, put into `store`'s local tiers
        (store: the store's view of `namespace`)."""
        if fingerprint is None:
            return cap, n
        got, m = self.lookup(tokens, fingerprint, n, lambda cid: _held(store, cid), namespace)
        if got is None:
            return cap, n
        self._local.fetching = True
        try:
            key = store.put(got)
            return store.get(key), m
        except (ValueError, KeyError, CapsuleError) as e:   # e.g. too large for the local tiers: use it once
            log.info("redis tier: fetched capsule %s not kept locally: %s", got.id, e)
            return got, m
        finally:
            self._local.fetching = False

    # ---- named capsules (no token history needed: a voice, a saved session) ------------------
    def put_named(self, name: str, cap: Capsule, namespace: str = "") -> bool:
        """Store `cap` as `name` of `namespace` under its own model fingerprint, now (blocking):
        pinned, never evicted nor expired. True: stored. False: not (Redis unreachable, closed, or
        the budget cannot hold it beside the pinned capsules; unpinned ones are evicted for it
        only when that makes room); logged and counted. FileExistsError: the name is taken
        (drop_named it first); ValueError: a bad name, a delta or a single-use capsule."""
        name = _check_name(name)
        if cap.is_delta or cap.meta.single_use:
            raise ValueError(f"put_named({name!r}): a named capsule stands alone; got a "
                             f"{'delta' if cap.is_delta else 'single-use'} capsule")
        P = self._prefix(cap.meta.fingerprint, namespace)
        res = "closed" if self._closed else self._guard(self._put_named, "error", P, name, cap)
        if res == "taken":
            raise FileExistsError(f"capsule name {name!r} is taken in the Redis tier")
        self._count("published" if res == "ok" else "dropped")
        if res != "ok":
            log.warning("redis tier: capsule %s not stored as %r: %s", cap.id, name, res)
        return res == "ok"

    def get_named(self, name: str, fingerprint: dict, namespace: str = "", have=None) -> Capsule | None:
        """The capsule named `name` in `namespace` of this model, or None: no such name, a damaged
        value (counted, logged and deleted with its name), a Redis fault. Every field of
        `fingerprint` must match (the key prefix covers five; a synthesizer's codec is checked
        here). have(capsule id) -> Capsule|None: a copy held locally, returned unfetched."""
        name = _check_name(name)
        P = self._prefix(fingerprint, namespace)
        got = self._guard(self._get_named, None, P, name, fingerprint, have)
        self._count("hits" if got is not None else "misses")
        return got

    def names(self, fingerprint: dict, namespace: str = "") -> list | None:
        """Sorted names of `namespace`'s named capsules of this model; None when Redis cannot
        be asked."""
        P = self._prefix(fingerprint, namespace)
        return self._guard(lambda: sorted(k.decode() for k in self.client.hkeys(P + "names")), None)

    def drop_named(self, name: str, fingerprint: dict, namespace: str = "") -> bool | None:
        """Forget `name` and its capsule: True; False when there was none; None when Redis
        cannot be asked."""
        n = self._guard(self._run, None, "unname", self._prefix(fingerprint, namespace), [],
                        _check_name(name), "")
        return None if n is None else bool(n)

    # ---- records: small values beside the capsules (a server's response index) --------------
    def put_record(self, key: str, value: bytes, fingerprint: dict, namespace: str = "",
                   ttl_s: float | None = None) -> bool:
        """Store `value` as record `key` of `namespace` under `fingerprint`'s keys, replacing it,
        expiring after ttl_s (None: the tier's TTL); not counted in budget_bytes. False: not
        stored (Redis unreachable, closed); logged. Records are not in stats()."""
        k = self._record_key(key, fingerprint, namespace)
        ms = max(1, int(ttl_s * 1000)) if ttl_s is not None else self.ttl_ms or None
        return False if self._closed else self._guard(lambda: bool(self.client.set(k, value, px=ms)), False)

    def get_record(self, key: str, fingerprint: dict, namespace: str = "") -> bytes | None:
        """The value of record `key` of `namespace` of this model, or None (none, a Redis fault)."""
        k = self._record_key(key, fingerprint, namespace)
        return None if self._closed else self._guard(self.client.get, None, k)

    def drop_record(self, key: str, fingerprint: dict, namespace: str = "") -> bool | None:
        """Forget record `key`: True; False when there was none; None when Redis cannot be asked."""
        n = None if self._closed else self._guard(self.client.delete, None,
                                                  self._record_key(key, fingerprint, namespace))
        return None if n is None else bool(n)

    def _record_key(self, key: str, fp: dict, namespace: str) -> str:
        # "r::": a namespace holds no ':', so no namespace's own keys start with it
        return self._prefix(fp) + f"r::{_check_ns(namespace)}:{_check_name(key)}"

    # ---- internals: calls -----------------------------------------------------------------
    def _prefix(self, fp: dict, namespace: str = "") -> str:
        base = f"{self.namespace}:{{{fingerprint_digest(fp)}}}:"
        return base + f"{_check_ns(namespace)}:" if namespace else base

    def _count(self, k, n=1):
        with self._slock:
            self._stats[k] += n

    def _guard(self, fn, default, *args):
        """fn(*args); Redis connection errors and timeouts trip the breaker and give `default`."""
        redis = _conn.redis_module()
        if not self.breaker.allow():
            self._count("skipped")
            return default
        try:
            out = fn(*args)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            self.breaker.fail()
            self._count("errors")
            log.warning("redis tier: %s: %s (serving continues locally)", type(e).__name__, e)
            return default
        except (redis.RedisError, ValueError, KeyError, TypeError) as e:   # e.g. foreign keys
            self._count("errors")
            log.warning("redis tier: %s: %s", type(e).__name__, e)
            return default
        self.breaker.ok()
        return out

    def _run(self, name, P, keys, *args):
        return self._scripts[name](keys=[P + "lru", *keys], args=[P, *args])

    # ---- internals: lookup ----------------------------------------------------------------
    def _lookup(self, P, tokens, fp, longer_than, have):
        for start in range(0, self.max_lengths, _PAGE):      # longest lengths first, a page a trip
            num = min(_PAGE, self.max_lengths - start)
            lens = [int(x) for x in self.client.zrevrangebyscore(
                P + "lens", len(tokens), longer_than + 1, start=start, num=num)]
            got = self._longest(P, tokens, fp, lens, have) if lens else None
            if got is not None or len(lens) < _PAGE:
                return got
        return None

    def _longest(self, P, tokens, fp, lens, have):
        dig = prefix_digests(tokens, lens)
        ids = self.client.mget([P + "i:" + dig[n] for n in lens])
        for n, cid in zip(lens, ids):
            if cid is None:
                continue
            cid = cid.decode()
            cap = self._fetch_chain(P, cid, dig[n], have)
            if cap is None:
                continue
            if cap.position != n or cap.history != tokens[:n] or not _same_fp(cap.meta.fingerprint, fp):
                self._bad(P, cid, dig[n], "its token history or fingerprint is not the one indexed")
                continue
            self._run("touch", P, [], _now_ms(), self.ttl_ms, cid)
            return cap, n
        return None

    def _fetch_chain(self, P, cid, digest, have):
        """The capsule `cid` with its ancestors attached, or None (dangling/damaged: deleted)."""
        metas, pid = [], cid
        while pid:
            raw = self.client.get(P + "m:" + pid)
            if raw is None:
                self._count("dangling")
                log.info("redis tier: dangling entry for %s (capsule %s is gone); deleted", cid, pid)
                self._run("drop", P, [], cid, digest)
                return None
            m = json.loads(raw)
            metas.append(m)
            local = have(m["p"]) if (have is not None and m["p"]) else None
            if local is not None:
                break
            pid = m["p"]
        parent = local if metas[-1]["p"] else None
        for m in reversed(metas):         # root first: each one's parent is attached
            cap = self._fetch_one(P, m, cid, digest)
            if cap is None:
                if m["id"] != cid:        # a damaged ancestor: the child cannot be restored either
                    self._run("drop", P, [], cid, digest)
                return None
            cap.parent_capsule = parent
            parent = cap
        return parent

    def _fetch_one(self, P, m, cid, digest):
        data = self._read(P, m)
        if data is None:
            self._bad(P, m["id"], digest if m["id"] == cid else "", "incomplete value (missing chunks)")
            return None
        try:
            cap = _fmt.from_bytes(data, f"redis {P}m:{m['id']}")
        except CapsuleCorruptError as e:
            self._bad(P, m["id"], digest if m["id"] == cid else "", str(e))
            return None
        if cap.id != m["id"]:
            self._bad(P, m["id"], "", f"value holds capsule {cap.id!r}")
            return None
        self._count("fetched_bytes", m["b"])
        return cap

    def _read(self, P, m) -> bytes | None:
        """The value of meta m, or None when a chunk is missing or the sizes disagree."""
        keys = [f"{P}c:{m['id']}:{m['u']}:{i}" for i in range(m["k"])]
        parts = self.client.mget(keys) if keys else []
        if any(p is None for p in parts) or sum(len(p) for p in parts) != m["b"]:
            return None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _get_named(self, P, name, fp, have):
        found = self._run("named", P, [], name)
        if not found:
            return None
        sid, raw = (x.decode() for x in found)
        if not raw:
            self._count("dangling")
            log.info("redis tier: name %r of namespace %s names a capsule that is gone; deleted", name, P)
            self._run("unname", P, [], name, sid)
            return None
        m = json.loads(raw)
        local = have(m["c"]) if have is not None else None
        if local is not None:
            return local
        data, why = self._read(P, m), "incomplete value (missing chunks)"
        if data is not None:
            try:
                cap = _fmt.from_bytes(data, f"redis {P}names[{name}]")
                why = (None if cap.id == m["c"] and _same_fp(cap.meta.fingerprint, fp)
                       else f"value holds capsule {cap.id!r} or another model's")
            except CapsuleCorruptError as e:
                why = str(e)
        if why is not None:
            self._count("corrupt")
            log.warning("redis tier: refusing capsule %r of %s: %s; deleted", name, P, why)
            self._run("unname", P, [], name, sid)
            return None
        if any(cap.meta.fingerprint.get(k) != v for k, v in fp.items()):
            log.info("redis tier: capsule %r of %s is another model's (fields past the key's differ)",
                     name, P)
            return None
        self._count("fetched_bytes", m["b"])
        return cap

    def _put_named(self, P, name, cap):
        if self.client.hexists(P + "names", name):           # refused before the upload
            return "taken"
        data = _fmt.to_bytes(cap)
        if self.budget >= 0 and len(data) > self.budget:
            return f"its {len(data)} B exceed budget_bytes"
        sid, nonce, k = "n" + secrets.token_hex(8), secrets.token_hex(4), -(-len(data) // self.chunk_bytes)
        self._upload(P, sid, nonce, data, k)
        meta = {"id": sid, "n": 0, "d": "", "b": len(data), "k": k, "u": nonce, "p": "", "x": 0, "c": cap.id}
        res = self._run("name", P, [], json.dumps(meta), name, _now_ms(), self.ttl_ms, self.budget)
        return res.decode() if isinstance(res, bytes) else res

    def _upload(self, P, cid, nonce, data, k):
        """The chunks of a value, under the upload TTL until a script makes them visible."""
        view = memoryview(data)
        pipe = self.client.pipeline(transaction=False)
        for i in range(k):
            pipe.set(f"{P}c:{cid}:{nonce}:{i}", view[i * self.chunk_bytes:(i + 1) * self.chunk_bytes],
                     px=_UPLOAD_TTL_MS)
        pipe.execute()

    def _bad(self, P, cid, digest, why):
        self._count("corrupt")
        log.warning("redis tier: refusing capsule %s: %s; deleted", cid, why)
        self._run("drop", P, [], cid, digest)

    # ---- internals: publishing ------------------------------------------------------------
    def _work(self, job):
        cap, store, pin, namespace = job
        res = self._guard(self._publish, "error", self._prefix(cap.meta.fingerprint, namespace), cap,
                          store, pin, False)
        self._count("published" if res == "ok" else "deduped" if res in ("exists", "dup") else "dropped")

    def _publish(self, P, cap, store, pin, force):
        if cap.is_delta and not self.client.exists(P + "m:" + cap.meta.parent["id"]):
            parent = cap.parent_capsule
            if parent is None and store is not None:
                key = store.key_of(cap.meta.parent["id"])
                parent = store.get(key) if key is not None else None
            if parent is None:
                log.warning("redis tier: delta %s not published: its parent is gone", cap.id)
                return "noparent"
            self._publish(P, parent, store, False, True)
        elif not force and self.client.exists(P + "m:" + cap.id):
            self._run("touch", P, [], _now_ms(), self.ttl_ms, cap.id)
            return "exists"
        data = _fmt.to_bytes(cap)
        if self.budget >= 0 and len(data) > self.budget:
            log.warning("redis tier: capsule %s (%d B) exceeds budget_bytes", cap.id, len(data))
            return "too_big"
        nonce, toks = secrets.token_hex(4), cap.history
        n = len(toks) if len(toks) == cap.position else 0
        meta = {"id": cap.id, "n": n, "d": prefix_digests(toks, [n])[n] if n else "none-" + cap.id,
                "b": len(data), "k": -(-len(data) // self.chunk_bytes), "u": nonce,
                "p": cap.meta.parent["id"] if cap.is_delta else ""}
        self._upload(P, cap.id, nonce, data, meta["k"])
        res = self._run("commit", P, [], json.dumps(meta), _now_ms(), self.ttl_ms, self.budget,
                        int(pin), int(force))
        return res.decode() if isinstance(res, bytes) else res


def _held(store, cid: str) -> Capsule | None:
    """The capsule `cid` (chain attached) if `store` holds it: ancestors are not fetched again."""
    key = store.key_of(cid)
    try:
        return store.get(key) if key is not None else None
    except (KeyError, CapsuleCorruptError):
        return None


def _check_ns(namespace: str) -> str:
    """A store namespace as a key component: no braces (the hash tag) and no ':' (separator)."""
    if not isinstance(namespace, str) or any(c in namespace for c in "{}:") or len(namespace) > 128:
        raise ValueError(f"bad capsule namespace {namespace!r} for the Redis tier")
    return namespace


def _check_name(name) -> str:
    """A capsule name: 1-200 characters of [A-Za-z0-9._-], not starting with '.' (as a file's)."""
    if not isinstance(name, str) or not KEY.match(name):
        raise ValueError(f"bad capsule name {name!r}: 1-200 characters of [A-Za-z0-9._-], "
                         "not starting with '.'")
    return name


def _now_ms() -> int:
    return int(time.time() * 1000)


def _same_fp(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in FINGERPRINT_KEYS)

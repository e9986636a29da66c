"""Exactly-once model calls: the Idempotency-Key header on POST /v1/chat/completions and POST
/v1/responses (their routes hand their handler to Idempotency.run).

A key's scope is (tenant, endpoint, key). The first request with a key claims it and runs; its
answer is recorded once it is finished: a JSON body as returned, a stream as the SSE events
sent, kept only when the stream reached its last event (a client gone, an error or a failed
response leaves no record and frees the key). Another request with the key and the same body
(sha256 of its canonical JSON: sorted keys, no blanks; headers other than the key do not count)
gets the record, with `Idempotency-Replayed: true`, and no model step runs; while the first
still runs, it waits for it. Another body is a 422. Records live --response-ttl-s (as long as
the response they hold), at most --idempotency-max-records of them, least recently used out
first; a deleted response's record still replays it.

With --capsule-redis keys live in Redis, shared by the fleet: a claim is SET NX of {body hash,
owner} with a TTL (CLAIM_S) that its owner renews while it runs, so a crashed owner's claim
lapses and frees the key; the record replaces the claim only while the owner still holds it
(the CAS script); a duplicate on any server polls until the record appears, or the claim is
gone and it claims itself. Redis cannot be reached: a request with a key is a 503 (exactly-once
cannot be promised without it); requests without one are untouched. In Redis the records are
bounded by their TTL only.

watch() tells the finish of any answer (JSON or stream); single_use.py uses it too.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from fastapi.responses import Response, StreamingResponse

from .guard import tenant_of
from .wire import APIError

log = logging.getLogger(__name__)
HEADER = "Idempotency-Key"
REPLAYED = "Idempotency-Replayed"
MAX_KEY = 255
CLAIM_S = 30.0              # a running claim's TTL in Redis, renewed every CLAIM_S / 3
POLL_S = 0.05               # how often a duplicate asks Redis whether the first has finished
# the last event of a finished stream: chat's [DONE], a Responses stream's completed / incomplete
ENDINGS = ("data: [DONE]\n\n", "event: response.completed\n", "event: response.incomplete\n")

# KEYS[1]; ARGV: expected value, op ('set' | 'del' | 'expire'), new value or ms, PX ms ('' keeps
# the TTL). Changes the key only while it still holds the expected value (its owner's claim).
CAS = r"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == 'del' then redis.call('DEL', KEYS[1])
elseif ARGV[2] == 'expire' then redis.call('PEXPIRE', KEYS[1], ARGV[3])
elseif ARGV[4] == '' then redis.call('SET', KEYS[1], ARGV[3], 'KEEPTTL')
else redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4]) end
return 1
"""


def header_key(request) -> str | None:
    """The request's Idempotency-Key, or None; a 400 naming the header when it is not one key
    of 1 to 255 printable ASCII characters."""
    values = request.headers.getlist(HEADER)
    if not values:
        return None
    key = values[0]
    if len(values) > 1:
        raise APIError(400, f"{HEADER} was sent {len(values)} times: send one", param=HEADER)
    if not 1 <= len(key) <= MAX_KEY:
        raise APIError(400, f"{HEADER} must be 1 to {MAX_KEY} characters, got {len(key)}", param=HEADER)
    if not all(" " <= c <= "~" for c in key):
        raise APIError(400, f"{HEADER} must be printable ASCII (a UUID, say): it holds a control or "
                       "non-ASCII character", param=HEADER)
    return key


def body_hash(body: bytes) -> str:
    """sha256 of the body's canonical JSON (the route parsed it already: it is JSON)."""
    canon = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()


def digest(*parts: str) -> str:
    """A Redis key component for client-chosen strings (any length or character)."""
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:32]


async def watch(out, finished, failed):
    """out (a handler's answer) with its finish reported: a dict at once, finished({"json": text});
    a stream once its last event was sent, finished({"sse": [events]}), or failed() when it ends
    otherwise (client gone, error event, failed response). failed runs in a finally: it must not
    block. Another answer (a Response) is failed()."""
    if isinstance(out, dict):
        await finished({"json": json.dumps(out)})
        return out
    if not isinstance(out, StreamingResponse):
        failed()
        return out
    out.body_iterator = _watched(out.body_iterator, finished, failed)
    return out


async def _watched(chunks, finished, failed):
    sent = []
    try:
        async with contextlib.aclosing(chunks) as it:
            async for c in it:
                yield c
                sent.append(c if isinstance(c, str) else bytes(c).decode())   # resumed: it was sent
    except BaseException:
        failed()
        raise
    if len(sent) > 1 and sent[-1].startswith(ENDINGS):
        await finished({"sse": sent})
    else:
        failed()


def replay(record: dict) -> Response:
    if "json" in record:
        return Response(record["json"], media_type="application/json", headers={REPLAYED: "true"})

    async def events():
        for c in record["sse"]:
            yield c
    return StreamingResponse(events(), media_type="text/event-stream", headers={REPLAYED: "true"})


class Shared:
    """The fleet's Redis (--capsule-redis) for idempotency keys and single-use claims: redis-py's
    blocking calls run on a thread; one that fails is a 503 naming `param`."""

    def __init__(self, url: str):
        from flashrt.capsules.redis_conn import redis_module, url_client
        self.client, self.errors = url_client(url, None), (redis_module().RedisError, OSError)
        self.cas = self.client.register_script(CAS)

    async def call(self, fn, param: str):
        try:
            return await asyncio.to_thread(fn)
        except self.errors as e:
            raise APIError(503, f"{param}: the shared store (--capsule-redis) cannot be reached "
                           f"({type(e).__name__}): retry", type="server_error", param=param,
                           code="shared_store_unavailable", headers={"Retry-After": "1"}) from None

    def later(self, fn) -> None:
        """Run fn on a thread, unwaited (a finally cannot wait): a failure is logged; what it
        would have undone lapses with its TTL."""
        def safe():
            try:
                fn()
            except self.errors as e:
                log.warning("flashrt serve: a Redis release failed (%s); it lapses with its TTL", e)
        asyncio.get_running_loop().run_in_executor(None, safe)


@dataclass
class _Running:
    h: str
    owner: str
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class LocalKeys:
    """Keys in this process (the event loop's: no lock). done: scope -> (state, expires)."""

    def __init__(self, ttl_s: float, max_records: int):
        self.ttl_s, self.max_records = ttl_s, max_records
        self._done: OrderedDict = OrderedDict()
        self._running: dict = {}

    async def claim(self, scope: tuple, h: str, owner: str) -> dict | None:
        now = asyncio.get_running_loop().time()
        while self._done and next(iter(self._done.values()))[1] <= now:   # the least recently used
            self._done.popitem(last=False)
        done = self._done.get(scope)
        if done is not None and done[1] <= now:      # used lately, so not at the front: expired all the same
            del self._done[scope]
        elif done is not None:
            self._done.move_to_end(scope)
            return done[0]
        if scope in self._running:
            return {"h": self._running[scope].h, "s": "run"}
        self._running[scope] = _Running(h, owner)
        return None

    async def wait(self, scope: tuple, timeout: float) -> None:
        r = self._running.get(scope)
        if r is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(r.ended.wait(), timeout)

    async def finish(self, scope: tuple, h: str, owner: str, record: dict) -> None:
        if self._end(scope, owner):
            self._done[scope] = ({"h": h, "s": "done", "r": record}, asyncio.get_running_loop().time() + self.ttl_s)
            while len(self._done) > self.max_records:
                self._done.popitem(last=False)

    def abandon(self, scope: tuple, h: str, owner: str) -> None:
        self._end(scope, owner)

    def _end(self, scope, owner) -> bool:
        r = self._running.get(scope)
        if r is None or r.owner != owner:
            return False
        del self._running[scope]
        r.ended.set()
        return True

    def renewing(self, scope, h, owner):
        return None


class RedisKeys:
    """Keys in Redis: flashrt:idem:<digest of the scope> holds a claim {h, s: run, o: owner}
    (TTL CLAIM_S, renewed) or a record {h, s: done, r} (TTL --response-ttl-s)."""

    def __init__(self, shared: Shared, ttl_s: float):
        self.shared, self.ttl_ms = shared, int(ttl_s * 1000)

    @staticmethod
    def _key(scope) -> str:
        return "flashrt:idem:" + digest(*scope)

    @staticmethod
    def _claim(h, owner) -> str:
        return json.dumps({"h": h, "s": "run", "o": owner})

    async def claim(self, scope: tuple, h: str, owner: str) -> dict | None:
        k, c, r = self._key(scope), self._claim(h, owner), self.shared.client

        def go():
            if r.set(k, c, nx=True, px=int(CLAIM_S * 1000)):
                return None
            v = r.get(k)                 # None: it ended between the two calls; ask again next poll
            return json.loads(v) if v is not None else {"h": h, "s": "run"}
        return await self.shared.call(go, HEADER)

    async def wait(self, scope, timeout: float) -> None:
        await asyncio.sleep(min(timeout, POLL_S))

    async def finish(self, scope, h, owner, record: dict) -> None:
        value = json.dumps({"h": h, "s": "done", "r": record})
        cas = self.shared.cas
        try:
            await self.shared.call(lambda: cas(keys=[self._key(scope)], args=[self._claim(h, owner), "set", value,
                                                                              self.ttl_ms]), HEADER)
        except APIError as e:      # the answer is given all the same; its key lapses with the claim
            log.warning("flashrt serve: an idempotency record was not kept: %s", e.message)

    def abandon(self, scope, h, owner) -> None:
        k, c = self._key(scope), self._claim(h, owner)
        self.shared.later(lambda: self.shared.cas(keys=[k], args=[c, "del", "", ""]))

    def renewing(self, scope, h, owner) -> asyncio.Task:
        k, c, cas = self._key(scope), self._claim(h, owner), self.shared.cas

        async def renew():
            while True:
                await asyncio.sleep(CLAIM_S / 3)
                with contextlib.suppress(APIError):
                    await self.shared.call(lambda: cas(keys=[k], args=[c, "expire", int(CLAIM_S * 1000), ""]), HEADER)
        return asyncio.get_running_loop().create_task(renew())


class Idempotency:
    """Idempotency-Key handling for the routes: run(request, endpoint, body, make)."""

    def __init__(self, options, shared: Shared | None):
        self.keys = (RedisKeys(shared, options.response_ttl_s) if shared is not None
                     else LocalKeys(options.response_ttl_s, options.idempotency_max_records))

    async def run(self, request, endpoint: str, body: bytes, make):
        """make(): the handler (a dict or a StreamingResponse). Without the header, just that."""
        key = header_key(request)
        if key is None:
            return await make()
        scope, h = (tenant_of(request), endpoint, key), body_hash(body)
        while True:
            owner = secrets.token_hex(8)
            cur = await self.keys.claim(scope, h, owner)
            if cur is None:
                break
            if cur["h"] != h:
                raise APIError(422, f"{HEADER} was used with a different request body: a key names one "
                               "request; send that body again, or a new key", param=HEADER,
                               code="idempotency_key_reused")
            if cur["s"] == "done":
                return replay(cur["r"])
            await self.keys.wait(scope, 0.25)
            if await request.is_disconnected():
                raise APIError(499, "client gone while the first request with its Idempotency-Key ran",
                               code="cancelled")
        renew = self.keys.renewing(scope, h, owner)

        async def finished(record):
            if renew is not None:
                renew.cancel()
            await self.keys.finish(scope, h, owner, record)

        def failed():
            if renew is not None:
                renew.cancel()
            self.keys.abandon(scope, h, owner)
        try:
            out = await make()
        except BaseException:
            failed()
            raise
        return await watch(out, finished, failed)


def shared(options) -> Shared | None:
    """The Redis of --capsule-redis for keys and claims (None without one)."""
    return Shared(options.capsule_redis) if options.capsule_redis else None

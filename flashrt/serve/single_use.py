"""Consume-once continuations: a response created with `flashrt: {"single_use": true}` (a parked
interrupt waiting for approval, say) is continued by previous_response_id once. Of k concurrent
continuations, in one server or across servers sharing --capsule-redis, one runs and k-1 get a
409 (code response_already_continued) naming the winner's response id.

The claim is decided before any model step, and before the previous response is looked up: the
new response's id is made first, then claimed on a marker the single-use response left when it
was stored ("open", for --response-ttl-s). In this process the marker is a dict entry (the event
loop's: no lock); with --capsule-redis it is flashrt:once:<digest of tenant and id>, changed by
one Lua script (CLAIM), so servers of a fleet race on one key. A response whose marker is gone
while it is stored single-use (Stored.single_use: a restart, another store) is claimed after the
lookup, the missing marker counting as open.

A winner that fails before finishing (an error, a stream cut by the client or failed) releases
its claim: the marker is open again and the continuation can be retried, since nothing of it was
stored. A finished one marks the claim done; the 409 then says "was continued by", and while the
winner runs "is being continued by ... (still running)".
"""
from __future__ import annotations

import asyncio
import contextlib
import json

from .guard import tenant_of
from .idempotency import Shared, digest, watch
from .wire import APIError

PARAM = "previous_response_id"

# KEYS[1]; ARGV: claim JSON, 1 = a missing marker counts as open, its TTL ms then -> nil: won;
# 'none': not single-use (no marker); else the value that holds it (the winner's claim)
CLAIM = r"""
local v = redis.call('GET', KEYS[1])
if v == 'open' then redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL'); return false end
if not v then
  if ARGV[2] == '1' then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3]); return false end
  return 'none'
end
return v
"""


class Continuations:
    """Single-use markers and their claims: mark(tenant, rid) when such a response is stored;
    run(request, req, rid, make) around a /v1/responses handler."""

    def __init__(self, options, shared: Shared | None):
        self.ttl_s, self.shared = options.response_ttl_s, shared
        self._local: dict = {}           # (tenant, id) -> [value, expires]; in expiry order
        self._claim = shared.client.register_script(CLAIM) if shared is not None else None

    @staticmethod
    def _key(tenant: str, rid: str) -> str:
        return "flashrt:once:" + digest(tenant, rid)

    async def mark(self, tenant: str, rid: str) -> None:
        """rid is single-use: its marker is open."""
        if self.shared is None:
            self._expire()
            self._local[(tenant, rid)] = ["open", asyncio.get_running_loop().time() + self.ttl_s]
            return
        k, r, ttl = self._key(tenant, rid), self.shared.client, int(self.ttl_s * 1000)
        await self.shared.call(lambda: r.set(k, "open", px=ttl), "flashrt.single_use")

    async def claim(self, tenant: str, prev: str, rid: str, missing_open: bool) -> str | None:
        """The claim of rid on prev's marker (its value, to settle it), None when prev is not
        single-use; a 409 naming the winner when another request holds it."""
        mine = json.dumps({"w": rid, "s": "run"})
        if self.shared is None:
            self._expire()
            cur = self._local.get((tenant, prev))
            if cur is None and missing_open:
                cur = self._local[(tenant, prev)] = ["open", asyncio.get_running_loop().time() + self.ttl_s]
            got = None if cur is None else cur[0]
            if got == "open":
                cur[0] = mine
                return mine
        else:
            k, ttl = self._key(tenant, prev), int(self.ttl_s * 1000)
            got = await self.shared.call(lambda: self._claim(keys=[k], args=[mine, int(missing_open), ttl]), PARAM)
            if got is None:
                return mine
            got = got.decode() if isinstance(got, bytes) else got
            if got == "none":
                got = None
        if got is None:
            return None
        w = json.loads(got)
        how = "was already continued by" if w["s"] == "done" else "is being continued by"
        raise APIError(409, f"response {prev} is single-use (flashrt.single_use) and {how} response "
                       f"{w['w']}" + (" (still running)" if w["s"] != "done" else ""), param=PARAM,
                       code="response_already_continued")

    def _settle(self, tenant: str, prev: str, mine: str, to: str):
        """The claim `mine` -> `to` ("open": released; done), only while it holds the marker.
        With Redis: a function to run on a thread (None without)."""
        if self.shared is None:
            cur = self._local.get((tenant, prev))
            if cur is not None and cur[0] == mine:
                cur[0] = to
            return None
        k, cas = self._key(tenant, prev), self.shared.cas
        return lambda: cas(keys=[k], args=[mine, "set", to, ""])

    def _expire(self) -> None:
        now = asyncio.get_running_loop().time()
        while self._local:
            k, (_, expires) = next(iter(self._local.items()))
            if expires > now:
                return
            del self._local[k]

    async def run(self, request, req, rid: str, make):
        """make(turn): the handler; turn.stored(prev) after its lookup of previous_response_id
        claims a stored single-use response whose marker was missing. Its claim is released
        when it fails, marked done when its answer (JSON or the whole stream) is out."""
        if req.flashrt is not None and req.flashrt.single_use and not req.store:
            raise APIError(400, "flashrt.single_use needs store: true (a response not stored cannot be "
                           "continued)", param="flashrt.single_use")
        turn = Turn(self, tenant_of(request), req.previous_response_id, rid)
        if turn.prev is not None:
            turn.claim = await self.claim(turn.tenant, turn.prev, rid, False)
        try:
            out = await make(turn)
        except BaseException:
            turn.release()
            raise
        return await watch(out, turn.done, turn.release)


class Turn:
    """One /v1/responses request's claim on the single-use response it continues (claim: None
    when it holds none)."""

    def __init__(self, owner: Continuations, tenant: str, prev: str | None, rid: str):
        self.owner, self.tenant, self.prev, self.rid = owner, tenant, prev, rid
        self.claim: str | None = None

    async def stored(self, stored) -> None:
        """prev's stored response was found: claim it if it says single-use and no claim is held."""
        if self.claim is None and getattr(stored, "single_use", False):
            self.claim = await self.owner.claim(self.tenant, self.prev, self.rid, True)

    async def done(self, record=None) -> None:
        if self.claim is not None:
            fn = self.owner._settle(self.tenant, self.prev, self.claim, json.dumps({"w": self.rid, "s": "done"}))
            if fn is not None:     # the answer is out all the same: a failure leaves "still running"
                with contextlib.suppress(APIError):
                    await self.owner.shared.call(fn, PARAM)

    def release(self) -> None:
        if self.claim is not None:
            fn = self.owner._settle(self.tenant, self.prev, self.claim, "open")
            if fn is not None:
                self.owner.shared.later(fn)
            self.claim = None

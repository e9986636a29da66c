"""ResponseStore: stored /v1/responses and retained ids over the ResponseIndex
(response_index.py), holding their capsules; POST /v1/flashrt/retain and /v1/flashrt/release.

A record is held while it is a stored response of this server or has refs > 0 (retains not
yet released): ResponseStore.wants. Records of one history (namespace + tokens) share one
Hold, taken by the first and let go by the last. A Hold pins the capsule in memory
(Engine.retain) while the pins stay within --response-retain-mb, and with --capsule-dir also
spills a full copy to disk (pinned, within --capsule-disk-mb; turn_store.py): past the memory
budget a new one lives on disk only, put back into memory when it is continued. Past both, a
new store=true request, or a retain that needs a new Hold, is a 507. With --capsule-dir the
held records are files, so a restarted server answers GET, continues previous_response_id and
keeps refcounts: at start the Holds are taken again (spilled files re-pinned, memory pins up
to the budget, from the spilled copies). A record expires at --response-ttl-s (a retain
renews it); refcounts are this server's.

The retain contract (the LangGraph checkpointer's, flashrt.integrations.langgraph):
  POST /v1/flashrt/retain  {"ids": [...]} -> 200 {"retained": {id: refcount after}}
  POST /v1/flashrt/release {"ids": [...]} -> 200 {"released": {id: refcount after}}
An id the caller's tenant does not know (never seen, expired, another tenant's) is a 404 naming
it (param "ids") and nothing changes; a release at refcount 0 answers 0 and changes nothing.
Ids: a chat completion's (choice 0's history; n > 1: choice 0 only) or a stored response's.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from . import wire
from .engine import wait
from .guard import tenant_of
from .options import MB
from .response_index import FleetRecords, Record, ResponseIndex
from .wire import APIError

log = logging.getLogger(__name__)
MAX_IDS = 1024            # ids one retain or release names
FLEET_FLUSH_S = 10.0      # a stored response's capsule is published before its record, this long at most
SWEEP_S = 1.0             # held records are checked for expiry at most this often


class IdsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    ids: list[Annotated[str, StringConstraints(min_length=1, max_length=256)]] = Field(
        min_length=1, max_length=MAX_IDS)


@dataclass
class Hold:
    """One history's capsule, kept for the records naming it."""
    tokens: list
    ns: str
    records: int = 0
    mem: int = 0                  # bytes pinned in memory (parents included)
    spill: str | None = None      # its spilled file's disk key
    disk: int = 0                 # bytes of that file
    ready: asyncio.Future | None = None   # None: taken already
    gone: bool = False            # its last record went while it was being taken


class ResponseStore:
    """Records by id (event-loop side; response_index.py keeps them) and the capsules they hold."""

    def __init__(self, engine, options):
        self.engine, self.caps = engine, engine.turns.store
        self.ttl_s, self.retain_bytes = options.response_ttl_s, int(options.response_retain_mb * MB)
        self.spills, self.disk_bytes = self.caps.disk is not None and engine.reuse, options.disk_bytes
        folder = Path(options.capsule_dir) / "responses" if options.capsule_dir else None
        fleet = self.caps.shared
        self.index = ResponseIndex(folder, FleetRecords(fleet, engine.turns.fingerprint) if fleet else None)
        self._holds: dict[tuple, Hold] = {}
        self._swept, self._spill_max = 0.0, 0
        self._load()

    @staticmethod
    def wants(rec: Record) -> bool:
        """Whether rec is held: a stored response of this server, or retained."""
        return rec.body is not None and rec.local or rec.refs > 0

    def held(self) -> int:
        """Bytes of memory pinned for held records."""
        self._sweep()
        return sum(h.mem for h in self._holds.values())

    def spilled(self) -> int:
        return sum(h.disk for h in self._holds.values())

    def stats(self) -> dict:
        self._sweep()
        held = self.index.held.values()
        return {"stored": sum(r.body is not None for r in held), "retained": sum(r.refs > 0 for r in held),
                "recent": len(self.index.recent), "pinned_bytes": self.held(), "spilled_bytes": self.spilled(),
                "damaged_files": self.index.damaged}

    def check_room(self, store: bool = True, param: str = "store") -> None:
        """A 507 when a new Hold has room neither in memory nor on disk."""
        if not store or not self.retain_bytes or self.held() < self.retain_bytes:
            return
        if self.spills and self.spilled() + self._spill_max <= self.disk_bytes:
            return                                  # room on disk for one more, as big as the biggest
        disk = (f", and {self.spilled()} bytes spilled to disk of --capsule-disk-mb's {self.disk_bytes}"
                if self.spills else " (with --capsule-dir they would be spilled to disk)")
        what = "delete some, or send store: false" if param == "store" else "release some"
        raise APIError(507, f"stored responses hold {self.held()} bytes of pinned capsules, the budget "
                       f"(--response-retain-mb) is {self.retain_bytes}{disk}: {what}", param=param,
                       code="response_store_full")

    # ---- lookup ---------------------------------------------------------------------------
    async def _lookup(self, rid: str, tenant: str) -> Record | None:
        self._sweep()
        rec = await self.index.fetch(rid, tenant)
        if rec is not None and rec.expires <= time.time():
            self._forget(rec)
            return None
        return rec

    async def get(self, rid: str, tenant: str, param: str = "response_id") -> Record:
        """The stored response rid of tenant, else a 404 naming param. For a continuation
        (param previous_response_id) its capsule is put back into memory when only spilled."""
        rec = await self._lookup(rid, tenant)
        if rec is None or rec.body is None:
            raise APIError(404, f"no stored response with id {wire._echo(rid)} (unknown, deleted, expired, "
                           "made with store: false, or not finished)", param=param, code="response_not_found")
        h = self._holds.get(rec.hold) if rec.hold is not None else None
        if param == "previous_response_id" and h is not None and h.spill and not h.mem:
            await asyncio.to_thread(self.caps.recall, h.tokens, h.ns, h.spill, self.engine.turns.fingerprint)
        return rec

    def find(self, rid: str) -> Record | None:
        """The stored response rid, if this server has it."""
        rec = self.index.get(rid)
        return rec if rec is not None and rec.body is not None else None

    # ---- changes --------------------------------------------------------------------------
    async def put(self, rid: str, rec: Record) -> None:
        """rec as the record of rid (a stored response, a chat completion, a cut), its refs
        carried over from the one it replaces; held when wanted."""
        rec.id, old = rid, self.index.get(rid)
        if old is not None:
            rec.refs = max(rec.refs, old.refs)
        hold = self._take(rec) if self.wants(rec) else None
        if old is not None:
            self._let_go(old)
        self.index.place(rec, held=self.wants(rec))
        if hold is not None:
            await self._fill(hold)
        if rec.body is not None and self.caps.shared is not None:   # another server then finds it
            await asyncio.to_thread(self.caps.shared.flush, FLEET_FLUSH_S)
        await self._save(rec)

    async def delete(self, rid: str, tenant: str) -> None:
        """A stored response is gone; its tokens stay held while it is retained."""
        rec = await self.get(rid, tenant)
        rec.body = None
        if self.wants(rec):
            await self._save(rec)
        else:
            self._forget(rec)

    def watch(self, job) -> None:
        """Record chat completion `job` (choice 0's kept history) once it has finished: before
        its answer goes out (the job ends before its Done event is posted)."""
        loop = asyncio.get_running_loop()
        job.ended.add_done_callback(lambda f: loop.call_soon_threadsafe(self._ended, job, f))

    def _ended(self, job, f) -> None:
        if f.cancelled() or f.exception() is not None or job.choices[0].finish is None:
            return                                  # failed, or cancelled before it started
        kept = f.result()[0]
        rec = Record(None, list(job.prompt) + list(job.choices[0].ids[:kept]), job.tenant, job.ns,
                     time.time() + self.ttl_s, id=job.id)
        self.index.place(rec, held=False)
        self.index.save(rec, file=False)            # its fleet copy; nothing waits for it

    async def cut(self, rid: str, tenant: str, kept: list) -> None:
        """A chat completion cancelled after it finished: its record keeps what was kept."""
        rec = self.index.get(rid)
        if rec is None or rec.body is not None or rec.tenant != tenant:
            return
        try:
            job = self.engine.job(rid)
        except APIError:
            return
        history = list(job.prompt) + list(job.choices[0].ids[: kept[0]])
        if history != rec.history.tolist():
            await self.put(rid, Record(None, history, rec.tenant, rec.ns, rec.expires))

    async def retain(self, ids: list, tenant: str) -> dict:
        recs = await self._resolve(ids, tenant, "retained")
        new = [r for r in recs.values() if not self.wants(r)]
        if new:
            self.check_room(param="ids")
        until = time.time() + self.ttl_s
        for rid in ids:
            recs[rid].refs += 1
            recs[rid].expires = max(recs[rid].expires, until)
        holds = [self._take(r) for r in new]        # taken now: a release meanwhile lets go of them
        for r in recs.values():
            self.index.place(r, held=True)
        for h in holds:
            if h is not None:
                await self._fill(h)
        for r in recs.values():
            await self._save(r)
        return {rid: recs[rid].refs for rid in ids}

    async def release(self, ids: list, tenant: str) -> dict:
        recs = await self._resolve(ids, tenant, "released")
        changed = {}
        for rid in ids:
            if recs[rid].refs > 0:
                recs[rid].refs -= 1
                changed[rid] = recs[rid]
        for r in changed.values():
            if not self.wants(r):
                self._let_go(r)
                self.index.place(r, held=False)
        for r in changed.values():
            await self._save(r)
        return {rid: recs[rid].refs for rid in ids}

    async def _resolve(self, ids: list, tenant: str, verb: str) -> dict:
        """Every id's record, or a 404 naming the first unknown one (nothing changed)."""
        out = {}
        for rid in dict.fromkeys(ids):
            out[rid] = await self._lookup(rid, tenant)
            if out[rid] is None:
                break
        for rid, rec in out.items():        # an await let other requests in: still there?
            if rec is None or self.index.get(rid) is not rec:
                raise APIError(404, f"no response or chat completion with id {wire._echo(rid)} (unknown, "
                               f"expired, or another key's): none of the ids was {verb}", param="ids",
                               code="response_not_found")
        return out

    def _forget(self, rec: Record) -> None:
        self._let_go(rec)
        self.index.forget(rec.id, rec.tenant)

    def _sweep(self) -> None:
        now = time.time()
        if now - self._swept < SWEEP_S:
            return
        self._swept = now
        for rec in [r for r in self.index.held.values() if r.expires <= now]:
            self._forget(rec)

    async def _save(self, rec: Record) -> None:
        h = self._holds.get(rec.hold) if rec.hold is not None else None
        if h is not None and h.ready is not None:
            await asyncio.shield(h.ready)
        rec.spill = h.spill if h is not None else None
        rec.retained = h.mem if h is not None else 0
        fut = self.index.save(rec)
        if fut is not None:
            await fut

    # ---- holds ----------------------------------------------------------------------------
    def _take(self, rec: Record) -> Hold | None:
        """rec's Hold, counted now; a new one (returned) is filled by _fill."""
        key = (rec.ns, hashlib.blake2b(rec.history.tobytes(), digest_size=16).hexdigest())
        rec.hold = key
        h = self._holds.get(key)
        if h is not None:
            h.records += 1
            return None
        h = self._holds[key] = Hold(rec.history.tolist(), rec.ns, 1,
                                    ready=asyncio.get_running_loop().create_future())
        return h

    async def _fill(self, h: Hold) -> None:
        """Pin h's capsule in memory (within the budget) and spill it (with a disk)."""
        try:
            if self.retain_bytes and self.held() < self.retain_bytes:
                h.mem = await wait(self.engine.retain(h.tokens, h.ns))
            if self.spills:
                inner = await wait(self.engine.remember(h.tokens, h.ns, spill=True))
                got = await wait(inner) if inner is not None else None
                if got is not None:
                    h.spill, h.disk = got
                    self._spill_max = max(self._spill_max, h.disk)
            if not (h.mem or h.spill or self.held() >= self.retain_bytes):
                log.warning("flashrt serve: the capsule of a %d-token history could not be kept (larger "
                            "than --capsule-budget-mb can hold?): its continuations prefill", len(h.tokens))
        except APIError:                            # the engine is gone: nothing is kept
            pass
        finally:
            h.ready.set_result(None)
            h.ready = None
            if h.gone:                              # let go of while it was being taken
                self._drop(h)

    def _let_go(self, rec: Record) -> None:
        key, rec.hold = rec.hold, None
        h = self._holds.get(key) if key is not None else None
        if h is None:
            return
        h.records -= 1
        if h.records <= 0:
            del self._holds[key]
            h.gone = True
            if h.ready is None:
                self._drop(h)

    def _drop(self, h: Hold) -> None:
        try:
            if h.mem:
                self.engine.retain(h.tokens, h.ns, keep=False)
        except APIError:                            # the engine is gone: nothing to unpin
            pass
        if h.spill:
            asyncio.get_running_loop().run_in_executor(None, self.caps.drop_spill, h.spill)
        h.mem = h.disk = 0

    def _load(self) -> None:
        """The held records of --capsule-dir (at start, no event loop yet): Holds taken again,
        spilled files re-pinned, memory pins up to the budget (from the spilled copies)."""
        now = time.time()
        for rec in self.index.load():
            if rec.expires <= now or not self.wants(rec):
                self.index.drop_file(rec.id)
                if rec.spill:
                    self.caps.drop_spill(rec.spill)
                continue
            self.index.place(rec, held=True)
            rec.hold = key = (rec.ns, hashlib.blake2b(rec.history.tobytes(), digest_size=16).hexdigest())
            h = self._holds.setdefault(key, Hold(rec.history.tolist(), rec.ns))
            h.records += 1
            if rec.spill and h.spill is None:
                size = self.caps.keep_spill(rec.spill)
                if size is not None:
                    h.spill, h.disk = rec.spill, size
                    self._spill_max = max(self._spill_max, size)
        for h in self._holds.values():
            if self.retain_bytes and sum(x.mem for x in self._holds.values()) < self.retain_bytes:
                if h.spill:
                    self.caps.recall(h.tokens, h.ns, h.spill, self.engine.turns.fingerprint)
                h.mem = self.engine.retain(h.tokens, h.ns).result()

    def close(self) -> None:
        self.index.close()


def add_retain_routes(app, store: ResponseStore) -> None:
    """POST /v1/flashrt/retain and /v1/flashrt/release (the module docstring's contract)."""

    @app.post("/v1/flashrt/retain")
    async def retain(request: Request):
        req = wire.parse(IdsRequest, await request.body())
        return {"retained": await store.retain(req.ids, tenant_of(request))}

    @app.post("/v1/flashrt/release")
    async def release(request: Request):
        req = wire.parse(IdsRequest, await request.body())
        return {"released": await store.release(req.ids, tenant_of(request))}

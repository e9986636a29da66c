"""ResponseIndex: response id -> token history, the durable index behind previous_response_id
and /v1/flashrt/retain. Token-level and model-free: it names no buffer and runs no model.

A Record is what a continuation or a retain needs of a finished response: its history (prompt
+ kept reply tokens), tenant and cache namespace, the stored Response body (None: a chat
completion), the instructions and tools it was rendered with, an expiry (wall clock, so it
survives a restart), a refcount (retains) and the disk key of its capsule's spilled copy.

Records live in one of two places (ResponseStore decides, by ResponseStore.wants):
- held: stored responses and retained records; kept until forgotten. With a folder
  (<capsule-dir>/responses/) each is a file <id>.json, written atomically (temp file, fsync,
  rename, fsync of the folder): a SIGKILL mid-write leaves the old file or the new one, never
  a part. load() skips and counts a damaged file; a dead writer's temp file is deleted.
- recent: other chat-completion records, an LRU bounded by count and tokens, memory only.
With a fleet tier (--capsule-redis) every record is mirrored to Redis (RedisTier.put_record:
the tier's namespace, the model's fingerprint, the tenant), expiring with it, so a server
sharing the Redis resolves an id made elsewhere: fetch() asks Redis on a local miss.
Writes run on one thread in the order they were asked for: a record's later state never
lands before an earlier one.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import time
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from flashrt.capsules.disk import make_private_dir, pid_alive, unlink

log = logging.getLogger(__name__)

RECENT = 16384                  # unreferenced chat-completion records kept (LRU) ...
RECENT_TOKENS = 8 << 20         # ... holding at most this many history tokens (4 B each)
ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")     # ids this server made (wire.new_id)
_TMP = re.compile(r"^\.(.+)\.json\.tmp-(\d+)-[0-9a-f]+$")
VERSION = 1


@dataclass
class Record:
    body: dict | None             # the Response object GET returns; None: a chat completion
    history: array                # prompt + kept reply tokens (int32): what a continuation extends
    tenant: str
    ns: str                       # the cache namespace its capsules live in
    expires: float                # time.time() past which it is gone
    instructions: str | None = None
    tools: list | None = None     # as the request gave them (rendered into the history)
    retained: int = 0             # bytes of memory pinned for it (this process; ResponseStore)
    single_use: bool = False      # flashrt.single_use: continued once (single_use.py)
    refs: int = 0                 # retains not yet released
    spill: str | None = None      # disk key of its capsule's spilled copy (ResponseStore)
    id: str = ""
    local: bool = True            # False: a copy fetched from the fleet tier, held by no one here
    hold: tuple | None = field(default=None, repr=False)   # ResponseStore's key while it holds one

    def __post_init__(self):
        if not isinstance(self.history, array):
            self.history = array("i", self.history)

    def to_json(self) -> bytes:
        return json.dumps({"v": VERSION, "id": self.id, "history": self.history.tolist(),
                           "tenant": self.tenant, "ns": self.ns, "body": self.body,
                           "instructions": self.instructions, "tools": self.tools,
                           "expires": self.expires, "single_use": self.single_use, "refs": self.refs,
                           "spill": self.spill}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Record:
        """A record from its file or Redis value; ValueError naming what is wrong."""
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"not JSON: {e}") from None
        checks = (("v", lambda v: v == VERSION), ("id", lambda v: isinstance(v, str) and ID.match(v)),
                  ("history", lambda v: isinstance(v, list) and all(type(t) is int and 0 <= t < 2**31 for t in v)),
                  ("tenant", _is(str)), ("ns", _is(str)), ("body", _is(dict, type(None))),
                  ("instructions", _is(str, type(None))), ("tools", _is(list, type(None))),
                  ("expires", lambda v: type(v) in (int, float)), ("single_use", _is(bool)),
                  ("refs", lambda v: type(v) is int and v >= 0), ("spill", _is(str, type(None))))
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        for name, ok in checks:
            if name not in d or not ok(d[name]):
                raise ValueError(f"field {name!r} missing or malformed")
        return cls(d["body"], d["history"], d["tenant"], d["ns"], float(d["expires"]), d["instructions"],
                   d["tools"], single_use=d["single_use"], refs=d["refs"], spill=d["spill"], id=d["id"])


def _is(*types):
    return lambda v: isinstance(v, types)


class ResponseIndex:
    """Records by id: held (durable) and recent (LRU); see the module docstring. folder: where
    held records are files (None: memory only); remote: a FleetRecords (None: no fleet)."""

    def __init__(self, folder=None, remote=None, recent: int = RECENT, recent_tokens: int = RECENT_TOKENS):
        self.folder = make_private_dir(folder) if folder is not None else None
        self.remote = remote
        self.held: dict[str, Record] = {}
        self.recent: OrderedDict[str, Record] = OrderedDict()
        self.recent_max, self.recent_tokens_max, self._recent_tokens = recent, recent_tokens, 0
        self.damaged = 0              # record files skipped at load
        self._closed = False
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="flashrt-response-index")
                      if folder is not None or remote is not None else None)

    # ---- lookup ---------------------------------------------------------------------------
    def get(self, rid: str) -> Record | None:
        """The local record of rid (held, or recent: touched), or None."""
        rec = self.held.get(rid)
        if rec is None and rid in self.recent:
            self.recent.move_to_end(rid)
            rec = self.recent[rid]
        return rec

    async def fetch(self, rid: str, tenant: str) -> Record | None:
        """The record of rid, from here or (a local miss) the fleet tier, where a copy found
        is kept as recent. None: unknown (another tenant's is unknown too)."""
        rec = self.get(rid)
        if rec is None and self.remote is not None and ID.match(rid):
            raw = await asyncio.get_running_loop().run_in_executor(self._pool, self.remote.get, rid, tenant)
            rec = self.get(rid)                 # made here meanwhile
            if rec is None and raw is not None:
                try:
                    rec = Record.from_json(raw)
                except ValueError as e:
                    log.warning("flashrt serve: record %s in the fleet tier is damaged: %s", rid, e)
                    return None
                if rec.id != rid or rec.tenant != tenant:
                    return None
                rec.refs, rec.spill, rec.local = 0, None, False   # refs and spills are per server
                self.place(rec, held=False)
        return rec if rec is not None and rec.tenant == tenant else None

    # ---- placement ------------------------------------------------------------------------
    def place(self, rec: Record, held: bool) -> None:
        """rec (keyed by rec.id) held, or among the recent ones (the oldest past the bounds go)."""
        self._unplace(rec.id)
        if held:
            self.held[rec.id] = rec
            return
        self.recent[rec.id] = rec
        self._recent_tokens += len(rec.history)
        while self.recent and (len(self.recent) > self.recent_max
                               or self._recent_tokens > self.recent_tokens_max):
            self._recent_tokens -= len(self.recent.popitem(last=False)[1].history)

    def _unplace(self, rid: str) -> Record | None:
        rec = self.held.pop(rid, None)
        if rec is None and rid in self.recent:
            rec = self.recent.pop(rid)
            self._recent_tokens -= len(rec.history)
        return rec

    # ---- persistence ----------------------------------------------------------------------
    def save(self, rec: Record, file: bool = True) -> asyncio.Future | None:
        """Write rec's file (held; a record no longer held loses its file; file=False: neither)
        and its fleet copy, in order after earlier writes; the returned future is done when
        they are. rec is read now."""
        held = rec.id in self.held
        file = held if file and self.folder is not None else None
        remote = self.remote is not None
        if file is None and not remote or self._closed:
            return None
        raw = rec.to_json() if held or remote else b""
        return asyncio.get_running_loop().run_in_executor(
            self._pool, self._write, rec.id, raw, rec.tenant, rec.expires - time.time(), file, remote)

    def forget(self, rid: str, tenant: str, file: bool = True) -> asyncio.Future | None:
        """rid is gone here (memory, file) and in the fleet tier."""
        self._unplace(rid)
        if self._pool is None or self._closed:
            return None
        return asyncio.get_running_loop().run_in_executor(self._pool, self._remove, rid, tenant, file)

    def _write(self, rid, raw, tenant, ttl, file, remote) -> None:
        if file:
            try:
                _atomic_write(self.folder, rid + ".json", raw)
            except OSError as e:
                log.warning("flashrt serve: record %s not written to disk: %s", rid, e)
        elif file is not None:
            unlink(os.path.join(self.folder, rid + ".json"))
        if remote and ttl > 0:
            self.remote.put(rid, tenant, raw, ttl)

    def _remove(self, rid, tenant, file) -> None:
        if file and self.folder is not None:
            unlink(os.path.join(self.folder, rid + ".json"))
        if self.remote is not None:
            self.remote.drop(rid, tenant)

    def load(self) -> list:
        """The records of the folder (none without one); a dead writer's temp file is deleted,
        a damaged file skipped, logged and counted (self.damaged). Placed by the caller."""
        out = []
        for name in sorted(os.listdir(self.folder)) if self.folder is not None else ():
            path = os.path.join(self.folder, name)
            m = _TMP.match(name)
            if m:
                if not pid_alive(int(m.group(2))):
                    unlink(path)
                continue
            if not name.endswith(".json") or os.path.islink(path):
                continue
            try:
                with open(path, "rb") as f:
                    rec = Record.from_json(f.read())
                if rec.id + ".json" != name:
                    raise ValueError(f"it holds record {rec.id!r}")
            except (OSError, ValueError) as e:
                self.damaged += 1
                log.warning("flashrt serve: skipping damaged response record %s: %s", path, e)
                continue
            out.append(rec)
        return out

    def drop_file(self, rid: str) -> None:
        """Remove a record's file now (a loaded record that is no longer held)."""
        if self.folder is not None:
            unlink(os.path.join(self.folder, rid + ".json"))

    def close(self) -> None:
        """Wait for the queued writes; later ones are not made."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _atomic_write(folder: str, name: str, data: bytes) -> None:
    """folder/name holds data, or its old content: temp file, fsync, rename, fsync the folder."""
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        unlink(tmp)
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class FleetRecords:
    """Records in the fleet tier (capsules.redis_tier.RedisTier's put_record / get_record /
    drop_record), under this model's fingerprint and the tenant; faults are misses."""

    def __init__(self, tier, fingerprint: dict):
        self.tier, self.fingerprint = tier, fingerprint

    def put(self, rid: str, tenant: str, raw: bytes, ttl_s: float) -> None:
        self.tier.put_record(rid, raw, self.fingerprint, tenant, ttl_s)

    def get(self, rid: str, tenant: str) -> bytes | None:
        return self.tier.get_record(rid, self.fingerprint, tenant)

    def drop(self, rid: str, tenant: str) -> None:
        self.tier.drop_record(rid, self.fingerprint, tenant)

"""LangGraph checkpoints that keep their model state on `flashrt serve` (the `agent-clients` extra).

RetainingSaver wraps any LangGraph checkpoint saver. Every checkpoint it stores takes one server
reference (POST /v1/flashrt/retain) on the response ids of the AI messages it holds (LangChain
keeps them in AIMessage.response_metadata["id"]), and records which ids it took in the
checkpoint's metadata ("flashrt_retained"); delete_thread, delete_for_runs and prune release
exactly what the removed checkpoints recorded, and copy_thread takes the copies' references. A
capsule behind a checkpoint so outlives any traffic that would evict it, and time travel, replay
and update_state forks resume from model state instead of re-prefilling.

idempotent(model) wraps a chat model (or a binding of one) so each call from a graph node sends an
Idempotency-Key derived from the thread, the checkpoint namespace (with its task id) and the
call's index within the task's attempt: a node re-run after interrupt() / Command(resume=...)
gets the recorded completion back without the model running again, while a replay or a fork (new
task ids) samples afresh.

    saver = RetainingSaver(InMemorySaver(), "http://127.0.0.1:8000/v1")
    llm = idempotent(ChatOpenAI(base_url=..., api_key=...).bind_tools(tools))
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections import Counter, OrderedDict
from typing import Any, Iterable

from langchain_core.runnables import Runnable, RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver

log = logging.getLogger(__name__)

META = "flashrt_retained"                 # checkpoint metadata: the ids this checkpoint retained
_IDS = re.compile(r"^(chatcmpl|resp)[-_][A-Za-z0-9_-]+$")   # the ids flashrt serve hands out
_ATTEMPTS = 1024                          # task attempts whose call counters are kept


def response_ids(checkpoint: dict) -> list[str]:
    """The flashrt response ids of the AI messages in a checkpoint's channel values, in order."""
    out: dict[str, None] = {}
    for value in (checkpoint.get("channel_values") or {}).values():
        for m in value if isinstance(value, (list, tuple)) else [value]:
            if getattr(m, "type", None) in ("ai", "AIMessageChunk"):
                rid = (getattr(m, "response_metadata", None) or {}).get("id")
                if isinstance(rid, str) and _IDS.match(rid):
                    out[rid] = None
    return list(out)


class References:
    """The server's refcounted retain / release endpoints. An id the server does not know (never
    seen, expired, another tenant's) is dropped from the request and kept in `unknown`."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 30.0, client=None):
        import httpx
        self.base = base_url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client or httpx.Client(timeout=timeout, headers=headers)
        self.unknown: list[str] = []

    def _send(self, verb: str, ids: list[str]) -> None:
        ids = list(ids)
        while ids:
            r = self.client.post(f"{self.base}/v1/flashrt/{verb}", json={"ids": ids})
            if r.status_code != 404:
                r.raise_for_status()
                return
            msg = (r.json().get("error") or {}).get("message", "")
            gone = [i for i in ids if i in msg]
            if not gone:                 # a 404 that names none of them: not the endpoint's answer
                r.raise_for_status()
            self.unknown += gone
            ids = [i for i in ids if i not in gone]

    def change(self, verb: str, ids: Iterable[str]) -> None:
        """retain or release each id once per occurrence in ids."""
        left = Counter(ids)
        while left:                      # one request per multiplicity level: {"ids"} has no counts
            self._send(verb, sorted(left))
            left = Counter({k: n - 1 for k, n in left.items() if n > 1})


class RetainingSaver(BaseCheckpointSaver):
    """A checkpoint saver that pins, on the server, the model state behind each stored checkpoint.
    Reads and writes go to `saver`; the server's references follow the checkpoints' lifetimes."""

    def __init__(self, saver: BaseCheckpointSaver, base_url: str, *, api_key: str | None = None,
                 refs: References | None = None):
        super().__init__(serde=saver.serde)
        self.saver = saver
        self.refs = refs or References(base_url, api_key)

    # ---- reads and writes that hold no reference
    def get_tuple(self, config):
        return self.saver.get_tuple(config)

    def list(self, config, *, filter=None, before=None, limit=None):
        return self.saver.list(config, filter=filter, before=before, limit=limit)

    def put_writes(self, config, writes, task_id, task_path=""):
        return self.saver.put_writes(config, writes, task_id, task_path)

    def get_next_version(self, current, channel):
        return self.saver.get_next_version(current, channel)

    # ---- references
    def _retain(self, checkpoint, metadata) -> dict:
        """Take the checkpoint's references; the metadata records what was taken (none when the
        server is unreachable: the checkpoint is stored anyway, its model state unpinned)."""
        ids = response_ids(checkpoint)
        taken: list[str] = []
        if ids:
            try:
                self.refs.change("retain", ids)
                taken = [i for i in ids if i not in self.refs.unknown]
            except Exception as e:       # the framework's checkpoint matters more than the pin
                log.warning("flashrt: could not retain %d response ids: %s", len(ids), e)
        return {**metadata, META: taken}

    def _held(self, tuples) -> dict:
        return {(t.config["configurable"]["thread_id"], t.config["configurable"].get("checkpoint_ns", ""),
                 t.config["configurable"]["checkpoint_id"]): list((t.metadata or {}).get(META, []))
                for t in tuples}

    def _thread(self, thread_id: str) -> dict:
        return self._held(self.saver.list({"configurable": {"thread_id": thread_id}}))

    def put(self, config, checkpoint, metadata, new_versions):
        metadata = self._retain(checkpoint, metadata)
        try:
            return self.saver.put(config, checkpoint, metadata, new_versions)
        except BaseException:
            self.refs.change("release", metadata[META])
            raise

    def delete_thread(self, thread_id: str) -> None:
        held = self._thread(thread_id)
        self.saver.delete_thread(thread_id)
        self.refs.change("release", [i for ids in held.values() for i in ids])

    def delete_for_runs(self, run_ids) -> None:
        runs = set(run_ids)
        held = self._held(t for t in self.saver.list(None) if (t.metadata or {}).get("run_id") in runs)
        self.saver.delete_for_runs(run_ids)
        self.refs.change("release", [i for ids in held.values() for i in ids])

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self.saver.copy_thread(source_thread_id, target_thread_id)
        copied = self._thread(target_thread_id)
        self.refs.change("retain", [i for ids in copied.values() for i in ids])

    def prune(self, thread_ids, *, strategy: str = "keep_latest") -> None:
        before = {k: v for t in thread_ids for k, v in self._thread(t).items()}
        self.saver.prune(thread_ids, strategy=strategy)
        after = {k for t in thread_ids for k in self._thread(t)}
        self.refs.change("release", [i for k, ids in before.items() if k not in after for i in ids])

    # ---- async faces: the wrapped saver's, the HTTP calls off the event loop
    async def aget_tuple(self, config):
        return await self.saver.aget_tuple(config)

    async def alist(self, config, *, filter=None, before=None, limit=None):
        async for t in self.saver.alist(config, filter=filter, before=before, limit=limit):
            yield t

    async def aput_writes(self, config, writes, task_id, task_path=""):
        return await self.saver.aput_writes(config, writes, task_id, task_path)

    async def aput(self, config, checkpoint, metadata, new_versions):
        metadata = await asyncio.to_thread(self._retain, checkpoint, metadata)
        try:
            return await self.saver.aput(config, checkpoint, metadata, new_versions)
        except BaseException:
            await asyncio.to_thread(self.refs.change, "release", metadata[META])
            raise

    async def adelete_thread(self, thread_id: str) -> None:
        held = self._held([t async for t in self.saver.alist({"configurable": {"thread_id": thread_id}})])
        await self.saver.adelete_thread(thread_id)
        await asyncio.to_thread(self.refs.change, "release", [i for ids in held.values() for i in ids])


class _Idempotent(Runnable):
    """A chat model whose calls from a graph node carry an Idempotency-Key (see idempotent)."""

    def __init__(self, model: Runnable):
        self.model = model
        self._calls: OrderedDict[int, tuple[Any, int]] = OrderedDict()   # id(scratchpad) -> (it, calls)

    def key(self, config: RunnableConfig | None = None) -> str | None:
        """This call's key, or None outside a LangGraph node (nothing to be idempotent about)."""
        from langgraph.config import get_config
        try:
            cfg = (get_config() if config is None else config).get("configurable", {})
        except RuntimeError:
            return None
        pad, thread = cfg.get("__pregel_scratchpad"), cfg.get("thread_id")
        if pad is None or thread is None:
            return None
        # one attempt of a task = one scratchpad: a re-run after interrupt() counts from 0 again
        _, n = self._calls.pop(id(pad), (pad, 0))
        self._calls[id(pad)] = (pad, n + 1)
        while len(self._calls) > _ATTEMPTS:
            self._calls.popitem(last=False)
        parts = (str(thread), cfg.get("checkpoint_ns", ""), str(cfg.get("__pregel_task_id", "")), str(n))
        return "lg-" + hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:40]

    def _kwargs(self, config, kwargs) -> dict:
        key = self.key(config)
        if key is None:
            return kwargs
        return {**kwargs, "extra_headers": {**kwargs.get("extra_headers", {}), "Idempotency-Key": key}}

    def invoke(self, input, config: RunnableConfig | None = None, **kwargs):
        return self.model.invoke(input, config, **self._kwargs(None, kwargs))

    async def ainvoke(self, input, config: RunnableConfig | None = None, **kwargs):
        return await self.model.ainvoke(input, config, **self._kwargs(None, kwargs))

    def stream(self, input, config: RunnableConfig | None = None, **kwargs):
        yield from self.model.stream(input, config, **self._kwargs(None, kwargs))

    async def astream(self, input, config: RunnableConfig | None = None, **kwargs):
        async for chunk in self.model.astream(input, config, **self._kwargs(None, kwargs)):
            yield chunk


def idempotent(model: Runnable) -> Runnable:
    """`model` (a ChatOpenAI pointed at flashrt serve, or a binding of one) with an Idempotency-Key
    on each call made inside a LangGraph node."""
    return _Idempotent(model)

"""LeaseWorker: a speech model on a thread of its own, its sessions leased to requests.

One thread loads the model (setup(), which makes the slots: forks over one set of weights) and
then runs every call on them in order; a route leases a slot (a 429 when all are busy) and hands
it work; a lease ends when its client does, however it goes (release() is idempotent, and calls
still queued for a released lease are dropped). audio.py's recognizer and speech.py's
synthesizer are the two kinds; LeasedStream is a streamed body that releases its lease.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from .wire import APIError


@dataclass(eq=False)
class Lease:
    slot: object
    closed: bool = False
    fresh: bool = True             # its first call resets the slot (the last client's state)


class LeaseWorker:
    """Subclasses set `what` and `flag` (for the 429's words) and implement setup() and reset()."""
    what = "session"
    flag = "--sessions"
    busy_code = "sessions_busy"

    def __init__(self, options, thread_name: str):
        """Run setup() on a thread of its own, which then runs all of this worker's calls."""
        self.options = options
        self.slots: list = []
        self._lock = threading.Lock()
        self._free: list = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._load_error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._thread.join()
            raise self._load_error

    def setup(self) -> list:
        """Load the model (on the worker thread); returns the slots."""
        raise NotImplementedError

    def reset(self, slot) -> None:
        """A slot's first call under a new lease: forget the last client's state."""

    def _run(self) -> None:
        try:
            self.slots = self.setup()
            self._free = list(self.slots)
        except BaseException as e:                  # noqa: BLE001 (re-raised by __init__)
            self._load_error = e
            return
        finally:
            self._ready.set()
        while (job := self._jobs.get()) is not None:
            self._step(*job)
        while not self._jobs.empty():               # closed: what was queued after fails
            job = self._jobs.get()
            if job is not None and job[2].set_running_or_notify_cancel():
                job[2].set_exception(APIError(503, f"{self.what} worker stopped", type="server_error"))

    def _step(self, lease: Lease, fn, fut) -> None:
        if lease.closed:                # its client is gone (nobody awaits this), the slot maybe
            fut.cancel()                # another's already
            return
        if not fut.set_running_or_notify_cancel():
            return
        try:
            if lease.fresh:
                lease.fresh = False
                self.reset(lease.slot)
            fut.set_result(fn(lease.slot))
        except BaseException as e:                  # noqa: BLE001 (handed to the route)
            fut.set_exception(e)

    # ---- called from the event loop -----------------------------------------------------------
    def acquire(self) -> Lease:
        """A free slot, or a 429."""
        with self._lock:
            if not self._free:
                n = len(self.slots)
                raise APIError(429, f"all {n} {self.what} session(s) are busy ({self.flag} {n}): "
                               "retry later", type="rate_limit_error", code=self.busy_code,
                               headers={"Retry-After": "1"})
            return Lease(self._free.pop())

    def release(self, lease: Lease) -> None:
        """Give the slot back (idempotent): calls still queued for the lease are dropped, and
        the next lease's first call, queued after them, resets it."""
        with self._lock:
            if not lease.closed:
                lease.closed = True
                self._free.append(lease.slot)

    async def run(self, lease: Lease, fn):
        """fn(slot) on the worker thread; shielded, so a cancelled route leaves the worker's
        future alone (the lease's release drops what is still queued)."""
        fut = concurrent.futures.Future()
        self._jobs.put((lease, fn, fut))
        return await asyncio.shield(asyncio.wrap_future(fut))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)


def close_on_shutdown(app: FastAPI, worker) -> None:
    """worker.close() when the app shuts down (after the app's own shutdown): a LeaseWorker's
    thread stops; anything else with close() (speech.py's VoiceBook) is closed too."""
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        try:
            async with inner(a) as state:
                yield state
        finally:
            await asyncio.to_thread(worker.close)
    app.router.lifespan_context = lifespan


class LeasedStream(StreamingResponse):
    """A stream that gives its lease back however it ends (a client gone before the body
    started included: then the generator never runs its own finally)."""

    def __init__(self, body, worker: LeaseWorker, lease: Lease, media_type: str = "text/event-stream",
                 headers: dict | None = None):
        super().__init__(body, media_type=media_type, headers=headers)
        self._release = lambda: worker.release(lease)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def need(worker, code: str, off: str):
    """A route's accessor of its worker: the worker, or a 404 (off: how to turn it on)."""
    def get():
        if worker is None:
            raise APIError(404, off, code=code)
        return worker
    return get

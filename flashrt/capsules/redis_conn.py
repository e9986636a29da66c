"""Connections of the Redis tier (capsules/redis_tier.py): clients for a URL, a Cluster or a
Sentinel-managed master, with timeouts that bound a stall; the circuit breaker; the background
queue that keeps publishing off the request path."""
from __future__ import annotations

import logging
import queue
import threading
import time

log = logging.getLogger(__name__)


def redis_module():
    import redis                          # optional extra: pip install 'flashrt[redis]'
    return redis


def client_opts(kw: dict | None) -> dict:
    """redis-py keyword arguments: ours, overridden by the caller's (ssl_*, password, ...)."""
    redis_module()
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    # the breaker, not redis-py's retries, decides how long a dead server can stall a request
    return dict(socket_timeout=1.0, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)) | (kw or {})


def url_client(url: str, opts: dict | None):
    return redis_module().Redis.from_url(url, **client_opts(opts))


def cluster_client(url: str | None, startup_nodes, opts: dict | None):
    from redis.cluster import ClusterNode, RedisCluster
    o = client_opts(opts)
    if url is not None:
        return RedisCluster.from_url(url, **o)
    if not startup_nodes:
        raise ValueError("RedisTier.cluster: give a seed url or startup_nodes [(host, port), ...]")
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in startup_nodes], **o)


def sentinel_client(sentinels, service_name: str, opts: dict | None, sentinel_opts: dict | None):
    from redis.sentinel import Sentinel
    o = client_opts(opts)
    return Sentinel(sentinels, sentinel_kwargs=sentinel_opts, **o).master_for(service_name, **o)


class Breaker:
    """Consecutive-failure circuit breaker: open for open_s after `failures` errors in a row;
    once open_s has passed, the next call is a probe (half-open)."""

    def __init__(self, failures: int = 2, open_s: float = 5.0):
        self.failures, self.open_s = failures, open_s
        self._n, self._until, self.opens = 0, 0.0, 0
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return time.monotonic() < self._until

    def allow(self) -> bool:
        return not self.is_open

    def ok(self) -> None:
        with self._lock:
            self._n = 0

    def fail(self) -> None:
        with self._lock:
            self._n += 1
            if self._n >= self.failures:
                self._n, self._until = 0, time.monotonic() + self.open_s
                self.opens += 1


class Background:
    """A bounded queue of jobs run by one daemon thread; flush() waits until it is drained."""

    def __init__(self, run, size: int, name: str):
        self._run, self._name = run, name
        self._q: queue.Queue = queue.Queue(maxsize=size)
        self.pending, self._idle = 0, threading.Condition()
        self._worker: threading.Thread | None = None

    def submit(self, job) -> bool:
        """Queue `job`; False when the queue is full (the job is not run)."""
        with self._idle:                  # counted before the worker can finish it
            try:
                self._q.put_nowait(job)
            except queue.Full:
                return False
            self.pending += 1
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._worker.start()
        return True

    def flush(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        with self._idle:
            while self.pending:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> None:
        if self._worker is not None:
            try:
                self._q.put(None, timeout=timeout)
            except queue.Full:
                return
            self._worker.join(timeout)

    def _work(self):
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                self._run(job)
            except Exception:             # never kill the worker: one job fails, not the queue
                log.exception("%s: job failed", self._name)
            finally:
                with self._idle:
                    self.pending -= 1
                    self._idle.notify_all()

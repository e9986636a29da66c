"""Helpers for test_serve.py: a real `flashrt serve` process on a free loopback port, and
the in-process greedy reference (random weights: only token identity and timing matter)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MARGIN = 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listens(pid: int, port: int) -> bool:
    """Whether process pid holds the listening TCP socket on `port` (Linux /proc; True where
    /proc cannot tell)."""
    try:
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:    # LISTEN
                    inodes.add(f"socket:[{f[9]}]")
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return True
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            pass
    return False


def wait_until_up(url, proc, timeout: float, what: str, headers=None, port=None, log=None) -> bool:
    """Poll GET url/v1/models until proc itself answers 200 (the port was free when chosen,
    so another server may hold it by now: it must be proc's listening socket). False when proc
    exited because the port was taken (its log says so); raise if it exits otherwise or time
    runs out."""
    deadline = time.time() + timeout
    while True:
        try:
            if (httpx.get(url + "/v1/models", headers=headers or {}, timeout=2).status_code == 200
                    and (port is None or listens(proc.pid, port))):
                return True
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            if log is not None and "address already in use" in Path(log).read_text(errors="replace"):
                return False
            raise RuntimeError(f"{what} did not start (exit {proc.poll()})")
        if time.time() > deadline:
            raise RuntimeError(f"{what} did not start in {timeout} s")
        time.sleep(0.2)


class Server:
    """`python -m flashrt.cli serve CKPT` in a subprocess; stop() is a graceful Ctrl-C. A port
    another process took before ours bound it: started again on a new one (3 tries).
    api_key: the key this object's requests send, passed as --api-key unless key_arg=False
    (then the caller hands it over otherwise, e.g. env={"FLASHRT_API_KEY": key})."""

    def __init__(self, ckpt, *args, api_key=None, log=None, env=None, key_arg=True):
        self.key = api_key
        self._own_log = log is None              # then a temporary file, removed by stop()
        if log is None:
            fd, log = tempfile.mkstemp(prefix="flashrt-serve-", suffix=".log")
            os.close(fd)
        log = Path(log)
        self.log_path = log
        for _ in range(3):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [sys.executable, "-m", "flashrt.cli", "serve", str(ckpt), "--port", str(self.port),
                   "--dtype", "float32", "--max-seq-len", "512", *args]
            if api_key and key_arg:
                cmd += ["--api-key", api_key]
            self.log = open(log, "w")
            # run from tests/ (this file's folder) so the installed package is the one imported
            self.proc = subprocess.Popen(cmd, cwd=Path(__file__).parent, stdout=self.log, stderr=self.log,
                                         env={**os.environ, **env} if env else None)
            try:
                up = wait_until_up(self.url, self.proc, 120, f"flashrt serve (see {log})",
                                   self.headers(), port=self.port, log=log)
            except BaseException:
                self.stop()
                raise
            if up:
                return
            self.log.close()
        raise RuntimeError(f"flashrt serve: the port was taken 3 times (see {log})")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def client(self):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.key or "none", max_retries=0)

    def post(self, path, body=None, **kw):
        return httpx.post(self.url + path, json=body, headers=self.headers(), timeout=60, **kw)

    def complete(self, ids, **kw) -> dict:
        body = {"model": self.model, "prompt": ids, "temperature": 0, "max_tokens": 8, **kw}
        r = self.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()

    @property
    def model(self) -> str:
        return httpx.get(self.url + "/v1/models", headers=self.headers()).json()["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self._own_log:
            self.log_path.unlink(missing_ok=True)


def sse(lines) -> list:
    """Parsed `data:` payloads of an SSE stream up to [DONE] (the string "[DONE]" kept last)."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            out.append("[DONE]")
            break
        out.append(json.loads(line[6:]))
    return out


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread while the reference computes: the server process shares these 2
    cores, and two OpenMP teams fighting for them make a tiny decode step ~10x slower. The
    count is put back, so later tests run with the thread count they would alone."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Reference:
    """Cold greedy decode in-process: tokens and their top-2 logit margins."""

    def __init__(self, ckpt):
        import flashrt
        with _one_thread():
            self.rt = flashrt.load(ckpt, dtype="float32", max_seq_len=512)

    def greedy(self, ids, n) -> tuple[list, list]:
        with _one_thread():
            self.rt.reset()
            logits = self.rt.prefill(ids)
            toks, margins = [], []
            for _ in range(n):
                top = logits.topk(2).values
                tok = int(logits.argmax())
                toks.append(tok)
                margins.append(float(top[0] - top[1]))
                logits = self.rt.decode(tok)
            return toks, margins

    def check(self, ids, got) -> int:
        """Assert `got` equals the cold greedy continuation of ids wherever the top-2 gap exceeds
        MARGIN (up to the first near-tie); returns how many tokens were compared."""
        ref, margins = self.greedy(ids, len(got))
        n = next((i for i, m in enumerate(margins) if m <= MARGIN), len(got))
        assert got[:n] == ref[:n], f"greedy differs from cold prefill: {got[:n]} vs {ref[:n]}"
        return n

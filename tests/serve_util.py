"""Helpers for test_serve.py: a real `flashrt serve` process on a free loopback port, and
the in-process greedy reference (random weights: only token identity and timing matter)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MARGIN = 1e-3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url, proc, timeout: float, what: str, headers=None) -> None:
    """Poll GET url/v1/models until it answers 200; raise if proc exits or time runs out."""
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url + "/v1/models", headers=headers or {}, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{what} did not start (exit {proc.poll()})")
        time.sleep(0.2)


class Server:
    """`python -m flashrt.cli serve CKPT` in a subprocess; stop() is a graceful Ctrl-C."""

    def __init__(self, ckpt, *args, api_key=None, log=None):
        self.port, self.key = free_port(), api_key
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "flashrt.cli", "serve", str(ckpt), "--port", str(self.port),
               "--dtype", "float32", "--max-seq-len", "512", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(log or os.devnull, "w")
        # run from tests/ (this file's folder) so the installed package is the one imported
        self.proc = subprocess.Popen(cmd, cwd=Path(__file__).parent, stdout=self.log, stderr=self.log)
        wait_until_up(self.url, self.proc, 120, f"flashrt serve (see {log})", self.headers())

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


class Reference:
    """Cold greedy decode in-process: tokens and their top-2 logit margins."""

    def __init__(self, ckpt):
        import flashrt
        import torch
        # one intra-op thread: the server process shares these 2 cores, and two OpenMP teams
        # fighting for them make a tiny decode step ~10x slower
        torch.set_num_threads(1)
        self.rt = flashrt.load(ckpt, dtype="float32", max_seq_len=512)

    def greedy(self, ids, n) -> tuple[list, list]:
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

"""Shared Redis tier: turn 2 of a conversation on another node.

Node A ran turn 1 and published its capsule to Redis (flashrt/capsules/redis_tier.py). Node B, with an
empty local store, gets turn 2 (turn 1's context + a user message): with the shared tier it
fetches turn 1's capsule and prefills only the new tokens; without it, it re-prefills all of
them. Second table: the tier's fetch (lookup + chunks + checksum + capsule) against a plain MGET
of the same chunk keys, i.e. what the bytes alone cost over loopback.

    python bench/redis_tier.py            # qwen3_5 small, 512-token turn 1
    python bench/redis_tier.py --quick    # tiny, 128-token turn 1
Starts its own redis-server on loopback unless --redis URL is given.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402


def parse(argv):
    p = C.base_parser("bench/redis_tier.py", "Redis tier: turn 2 on another node")
    p.add_argument("--arch", default="qwen3_5")
    p.add_argument("--size", default=None, help="default small (tiny with --quick)")
    p.add_argument("--prefix", type=int, nargs="+", default=None,
                   help="turn-1 context tokens (512 2048; 128 with --quick)")
    p.add_argument("--user", type=int, default=16, help="new tokens in turn 2")
    p.add_argument("--chunk-mib", type=float, default=64, help="chunk size of the tier's values")
    p.add_argument("--redis", default=None, help="redis:// URL (default: start a redis-server)")
    a = p.parse_args(argv)
    C.setup(a)
    a.size = a.size or ("tiny" if a.quick else "small")
    a.prefix = a.prefix or ([128] if a.quick else [512, 2048])
    a.repeats = a.repeats or (2 if a.quick else 5)
    a.warmup = 1 if a.warmup is None else a.warmup
    return a


def start_redis():
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found: run ./run.sh setup (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", tempfile.mkdtemp()], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise SystemExit("redis-server did not start")


def one_prefix(a, path, url, n):
    import json

    import redis

    from flashrt.capsules import CapsuleStore
    from flashrt.capsules.redis_tier import RedisTier, fingerprint_digest, prefix_digests
    max_len = n + a.user + 8
    node_a, node_b, cold = (C.load_flashrt(path, a, max_len) for _ in range(3))
    ids = C.random_ids(n + a.user, node_a.net.vocab_size, seed=n)
    turn1, turn2 = ids[:n], ids
    chunk = int(a.chunk_mib * 2**20)
    ta, tb = RedisTier.from_url(url, chunk_bytes=chunk), RedisTier.from_url(url, chunk_bytes=chunk)
    node_a.set_context(turn1, store=CapsuleStore(host_bytes=8 << 30, shared=ta))
    assert ta.flush(timeout=300), "publish did not finish"
    fp = node_b.fingerprint
    reused = []

    def shared_turn2():
        node_b.reset()              # a node that never saw this conversation, empty local store
        store = CapsuleStore(host_bytes=8 << 30, shared=tb)
        out = node_b.set_context(turn2, store=store, remember=False)
        reused.append(node_b.context_reused)
        return out
    cases = {"B: shared tier + prefill new tokens": C.Case(shared_turn2),
             "B: re-prefill everything": C.Case(lambda: (cold.reset(), cold.prefill(turn2))[1])}
    ttft = C.measure(cases, a.repeats, a.warmup, a.device, desc=f"turn 2 @{n}")
    lb = shared_turn2()
    cold.reset()
    dlogit = float((lb - cold.prefill(turn2)).abs().max())

    raw = redis.Redis.from_url(url)
    P = f"flashrt:{{{fingerprint_digest(fp)}}}:"
    cid = raw.get(P + "i:" + prefix_digests(turn1, [n])[n]).decode()
    m = json.loads(raw.get(P + "m:" + cid))
    keys = [f"{P}c:{cid}:{m['u']}:{i}" for i in range(m["k"])]
    fetch = C.measure({"tier.lookup (index, chunks, checksum, capsule)":
                       C.Case(lambda: tb.lookup(turn2, fp)),
                       "plain MGET of the same chunk keys": C.Case(lambda: raw.mget(keys))},
                      a.repeats, a.warmup, "cpu", desc=f"fetch @{n}")
    raw.close()
    for t in (ta, tb):
        t.close()
    return {"prefix": n, "turn2_tokens": len(turn2), "value_bytes": m["b"], "chunks": m["k"],
            "reused": reused, "max_dlogit_vs_cold": dlogit, "ttft": ttft, "fetch": fetch}


def main(argv=None) -> int:
    a = parse(argv)
    info = C.banner("redis_tier", a)
    path = C.checkpoint(a.arch, a.size)
    proc, url = (None, a.redis) if a.redis else start_redis()
    try:
        res = [one_prefix(a, path, url, n) for n in a.prefix]
    finally:
        if proc is not None:
            proc.kill()
    t1 = C.Table(f"Turn 2 on another node, {C.label(a.arch, a.size)} ({a.device}, {a.dtype}), "
                 f"{a.user} new tokens", ["turn-1 tokens", "capsule", "shared tier ms",
                                          "re-prefill ms", "speed-up", "reused", "max |dlogit|"])
    t2 = C.Table("Fetch from Redis (loopback) vs the bytes alone",
                 ["turn-1 tokens", "capsule", "chunks", "tier fetch ms", "plain MGET ms", "overhead"])
    for r in res:
        sh, co = r["ttft"].values()
        fe, pl = r["fetch"].values()
        t1.add(r["prefix"], C.fmt_bytes(r["value_bytes"]), sh.ms(), co.ms(), C.fmt_ratio(C.ratio(co, sh)),
               f"{min(r['reused'])}-{max(r['reused'])}", f"{r['max_dlogit_vs_cold']:.2e}")
        t2.add(r["prefix"], C.fmt_bytes(r["value_bytes"]), r["chunks"], fe.ms(2), pl.ms(2),
               C.fmt_ratio(C.ratio(fe, pl)))
    t1.notes.append("shared tier: B's store is empty; set_context fetches turn 1's capsule from "
                    "Redis (checksummed), restores it and prefills the new tokens")
    t2.notes.append("tier fetch = lengths + index MGET + meta GET + chunk MGET + checksum + "
                    "capsule copy + touch script; one client process, server on the same machine")
    C.print_tables([t1, t2])
    C.write_json("redis_tier", a, info, [t1, t2], {"runs": res}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

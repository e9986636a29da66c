"""The README demo: generation, then capsules (snapshot, fork, restore, save/load) and
time-to-first-token from a capsule against a cold prefill of the same prefix."""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

SYSTEM = ("You are a helpful agent. Tools: search(query), read(url), python(code), "
          "calendar(date), email(to, body). Answer step by step. ")


def _ms(f, n=3, sync=False):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        out = f()
        if sync:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def run_demo(arch="qwen3_5", size="small", prefix=512, device="cpu") -> int:
    import flashrt
    from flashrt.models.checkpoint import default_checkpoint

    path = default_checkpoint(arch, size)
    rt = flashrt.load(path, device=device, max_seq_len=max(2048, prefix + 256))
    sync = rt.model.device.type == "cuda"
    tok = rt.tokenizer
    print(f"FlashRT {flashrt.__version__} demo — {arch} ({size}) at {path}")
    print("NOTE: random weights (no model hub here): generated text is meaningless; "
          "speed, state and exactness are what this shows.\n")
    a = rt.arena
    print(f"arena: {len(a.slots)} named buffers, {a.nbytes / 2**20:.1f} MiB; capsule state = "
          f"{a.fixed_state_bytes / 2**20:.2f} MiB fixed + {a.per_token_bytes} B/token "
          f"(dtype {rt.model.dtype}, device {rt.model.device})")
    print("\n".join(rt.layout().splitlines()[:12]) + "\n  ...\n")

    # 1. plain generation
    prompt = tok.encode("Hello from FlashRT. ")
    t0 = time.perf_counter()
    rt.prefill(prompt)
    ttft = (time.perf_counter() - t0) * 1e3
    t1 = time.perf_counter()
    out = rt.generate(max_new_tokens=24, ignore_eos=True)
    tps = len(out) / (time.perf_counter() - t1)
    print(f"[generate] {len(prompt)}-token prompt: TTFT {ttft:.1f} ms, {tps:.1f} tok/s")
    print(f"  ids: {out[:12]} ...  text: {tok.decode(out)[:60]!r}\n")

    # 2. TTFT: capsule restore + suffix vs cold prefill of prefix + suffix
    ids = (tok.encode(SYSTEM) * (prefix // len(tok.encode(SYSTEM)) + 1))[:prefix]
    suffix = tok.encode("User: what is on my calendar?")[:16]
    rt.reset()
    rt.prefill(ids)
    cap = rt.snapshot()
    target = rt.empty_capsule(prefix)
    snap_ms, _ = _ms(lambda: rt.snapshot(into=target), sync=sync)

    def cold():
        rt.reset()
        return rt.prefill(ids + suffix)

    def warm():
        rt.restore(cap)
        return rt.prefill(suffix)
    cold_ms, l_cold = _ms(cold, sync=sync)
    cold_toks = rt.generate(max_new_tokens=16, ignore_eos=True)
    restore_ms, _ = _ms(lambda: rt.restore(cap), sync=sync)
    warm_ms, l_warm = _ms(warm, sync=sync)
    warm_toks = rt.generate(max_new_tokens=16, ignore_eos=True)
    print(f"[capsule] prefix {prefix} tokens, suffix {len(suffix)}: capsule {cap.nbytes / 2**20:.2f} MiB; "
          f"snapshot {snap_ms:.2f} ms, restore {restore_ms:.2f} ms")
    print(f"  TTFT cold prefill {cold_ms:.1f} ms vs capsule {warm_ms:.1f} ms -> {cold_ms / warm_ms:.1f}x; "
          f"max |logit diff| {(l_cold - l_warm).abs().max():.2e}; first 16 greedy tokens "
          f"{'identical' if cold_toks == warm_toks else 'differ (different chunking paths)'}\n")

    # 3. forks: same capsule, own sampling streams, parent untouched
    rt.restore(cap)
    want = rt.generate(max_new_tokens=8, ignore_eos=True)
    kids = [rt.fork(cap, seed=s) for s in (1, 2, 3)]
    for s, k in zip((1, 2, 3), kids):
        print(f"[fork seed={s}] {k.generate(max_new_tokens=8, temperature=1.0, top_p=0.95)}")
    rt.restore(cap)
    again = rt.generate(max_new_tokens=8, ignore_eos=True)
    print(f"[parent] after forks, greedy from the capsule: {again} "
          f"({'bitwise the same run' if again == want else 'CHANGED'})\n")

    # 4. persistence: atomic save, validated load, byte-exact restore
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "prefix.capsule"
        save_ms, _ = _ms(lambda: flashrt.save_capsule(cap, f), n=1)
        load_ms, loaded = _ms(lambda: flashrt.load_capsule(f, device=device), n=1)
        rt.restore(loaded)
        from_disk = rt.generate(max_new_tokens=8, ignore_eos=True)
        print(f"[disk] saved {f.stat().st_size / 2**20:.2f} MiB in {save_ms:.1f} ms, loaded+verified in "
              f"{load_ms:.1f} ms; continuation {'identical' if from_disk == want else 'DIFFERENT'}")
    return 0

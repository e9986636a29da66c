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


PROMPTS = ("import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
           "    def push(self, item):\n        self",
           "    if not isinstance(name, str):\n        raise TypeError(")


def _trained_section(rt, tok) -> None:
    """Completions of Python code (sampled, seeded; greedy loops on a model this small), then
    greedy with and without MTP speculative decoding."""
    from flashrt.lm.speculative import last_stats
    for text in PROMPTS:
        rt.reset()
        out = rt.generate(tok.encode(text), max_new_tokens=48, temperature=0.7, top_p=0.9, seed=0)
        print(f"[complete] temperature 0.7, top-p 0.9, seed 0\n{text}{tok.decode(out)}\n" + "-" * 60)
    ids = tok.encode(PROMPTS[0])
    runs = {}
    for name, kw in (("plain", {}), ("mtp k=2", dict(speculative="mtp", draft_tokens=2))):
        rt.reset()
        rt.generate(ids, max_new_tokens=8, ignore_eos=True, **kw)      # warm-up
        rt.reset()
        t0 = time.perf_counter()
        out = rt.generate(ids, max_new_tokens=64, ignore_eos=True, **kw)
        runs[name] = (out, 64 / (time.perf_counter() - t0), last_stats(rt) if kw else None)
    (p_out, p_tps, _), (s_out, s_tps, st) = runs["plain"], runs["mtp k=2"]
    acc = st["accepted"] / max(1, st["drafted"])
    print(f"[speculative] 64 greedy tokens: plain {p_tps:.1f} tok/s, MTP k=2 {s_tps:.1f} tok/s "
          f"({s_tps / p_tps:.2f}x), {acc:.0%} of drafts accepted; output "
          f"{'identical to plain greedy' if s_out == p_out else 'DIFFERS from plain greedy'}\n")


def run_demo(arch="qwen3_5", size="small", prefix=512, device="cpu", random=False, model=None) -> int:
    """The trained default model (model=None, random=False), a given checkpoint directory, or
    a random-weight checkpoint of arch/size (random=True)."""
    from flashrt.assets import trained_model_path
    from flashrt.capsules import load_capsule, save_capsule
    from flashrt.lm import load
    from flashrt.models.checkpoint import default_checkpoint
    from flashrt.version import __version__

    path = default_checkpoint(arch, size) if random else Path(model or trained_model_path())
    rt = load(path, device=device, max_seq_len=max(2048, prefix + 256))
    sync = rt.model.device.type == "cuda"
    tok = rt.tokenizer
    info = rt.model.info
    if rt.model.random_weights or not info.get("trained"):
        print(f"FlashRT {__version__} demo — {rt.model.model_type} at {path}")
        print("NOTE: random weights (no model hub here): generated text is meaningless; "
              "speed, state and exactness are what this shows.\n")
    else:
        print(f"FlashRT {__version__} demo — {path.name}: a {info['params'] / 1e6:.1f}M-param "
              f"Qwen3.5-shaped hybrid trained here on CPython {info['corpus']['python']}'s stdlib "
              f"(held-out loss {info['heldout']['main_loss']:.2f} nats/token). A tiny model: the code "
              "looks like Python, it is rarely correct.\n")
    a = rt.arena
    print(f"arena: {len(a.slots)} named buffers, {a.nbytes / 2**20:.1f} MiB; capsule state = "
          f"{a.fixed_state_bytes / 2**20:.2f} MiB fixed + {a.per_token_bytes} B/token "
          f"(dtype {rt.model.dtype}, device {rt.model.device})")
    print("\n".join(rt.layout().splitlines()[:12]) + "\n  ...\n")

    # 1. plain generation
    if info.get("trained"):
        _trained_section(rt, tok)
        rt.reset()
    prompt = tok.encode("Hello from FlashRT. " if not info.get("trained") else PROMPTS[1])
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
        toks = k.generate(max_new_tokens=8, temperature=1.0, top_p=0.95)
        print(f"[fork seed={s}] {toks}" + (f" {tok.decode(toks)!r}" if info.get("trained") else ""))
    rt.restore(cap)
    again = rt.generate(max_new_tokens=8, ignore_eos=True)
    print(f"[parent] after forks, greedy from the capsule: {again} "
          f"({'bitwise the same run' if again == want else 'CHANGED'})\n")

    # 4. persistence: atomic save, validated load, byte-exact restore
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "prefix.capsule"
        save_ms, _ = _ms(lambda: save_capsule(cap, f), n=1)
        load_ms, loaded = _ms(lambda: load_capsule(f, device=device), n=1)
        rt.restore(loaded)
        from_disk = rt.generate(max_new_tokens=8, ignore_eos=True)
        print(f"[disk] saved {f.stat().st_size / 2**20:.2f} MiB in {save_ms:.1f} ms, loaded+verified in "
              f"{load_ms:.1f} ms; continuation {'identical' if from_disk == want else 'DIFFERENT'}")
    return 0

"""Where one decode step goes: flashrt's step at the Qwen3.5-0.8B shape split by op group, next
to the bytes each group must stream and the GB/s it reaches.

One step = what generate() does per token on the CPU: sample the next token from the last
logits (greedy), then run it through the model at the session's position. Groups:

  projections    q/k/v/o of the attention layers and Gated DeltaNet's in/out projections (a
                 LinearPack's one call for q/k/v or the four GDN inputs)
  MLP            gate/up/down (gate/up one LinearPack call)
  vocab head     the (vocab, hidden) head over the last hidden state
  GDN rule       Gated DeltaNet's per-token recurrent update (nn/linear_attn.py; on the CPU its
                 gated block: decay, beta, rule and the output's gated norm in one call)
  conv           the causal depthwise conv of Gated DeltaNet's qkv (and its state shift)
  attention      K/V written into the arena, then SDPA over the live rows
  rope, norms    rotary embedding; RMSNorms (q/k norms, layer norms, GDN's gated norm)
  sampling       the next token from meta.logits
  between groups the rest: the Python of the blocks and of the step, residual adds, gates,
                 casts, the embedding, the step's bookkeeping

Each group's time is the wall time of its calls (perf_counter around them, swapped in for the
profile only, alternated with plain steps); its ops are the top-level aten ops under it,
counted in a separate pass under torch.profiler (whose own cost per op would swamp the small
ones' times). "op floor" = ops x the least a small aten op costs from Python here: what a group
pays whatever its bytes. Bytes: the weights a group reads, plus the state it must read and
write (recurrent state, conv state, K/V rows up to the position), counted once; GB/s = those
bytes / the group's time.

    python bench/decode_profile.py                    # Qwen3.5-0.8B shape, float32 + bfloat16, 2 threads
    python bench/decode_profile.py --formats bfloat16 int8 --position 2048
    python bench/decode_profile.py --quick            # tiny shape: proves the script runs
"""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

GROUPS = ("projections", "MLP", "vocab head", "GDN rule", "conv", "attention", "rope", "norms",
          "sampling", "other ops")      # "other ops": aten ops under no group (ops count only)
MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "gate_up")    # gate_up: the gate/up LinearPack
# format name -> (activation dtype, weights): int8 runs float32 activations (see bench/decode.py)
FORMATS = {"float32": ("float32", "float"), "bfloat16": ("bfloat16", "float"),
           "int8": ("float32", "int8")}


def parse(argv):
    p = C.base_parser("bench/decode_profile.py", "One decode step split by op group, with the "
                      "bytes each group streams")
    p.add_argument("--size", default=None, help="qwen3_5 checkpoint size (default real; --quick tiny)")
    p.add_argument("--formats", nargs="+", default=None, choices=sorted(FORMATS),
                   help="weight formats (default float32 bfloat16)")
    p.add_argument("--position", type=int, default=None, help="context length (default 512)")
    p.add_argument("--steps", type=int, default=None, help="decode steps per timed run (default 8)")
    a = p.parse_args(argv)
    a.threads = a.threads or 2
    C.setup(a)
    a.size = a.size or ("tiny" if a.quick else "real")
    a.formats = a.formats or ["float32", "bfloat16"]
    a.position = a.position or (32 if a.quick else 512)
    a.steps = a.steps or (2 if a.quick else 8)
    a.repeats = a.repeats or (1 if a.quick else 5)
    a.warmup = 1 if a.warmup is None else a.warmup
    return a


# ---- bytes --------------------------------------------------------------------------------------
def tensor_bytes(t) -> int:
    """A weight's bytes as a step reads them (an Int8Weight: its int8 rows and row scales)."""
    scale = getattr(t, "scale", None)
    return t.numel() * t.element_size() + (0 if scale is None else scale.numel() * scale.element_size())


def group_of_linear(name: str) -> str:
    return "MLP" if name.rsplit(".", 1)[-1] in MLP_NAMES else "projections"


def step_bytes(rt, position: int) -> dict:
    """Bytes one decode step at `position` must stream, by group: weights read once, state read
    and written once, K/V rows [0, position] read (and one row written). The MTP layer does not
    run in a plain decode step and is left out."""
    from flashrt.nn.layers import RMSNorm
    from flashrt.nn.linear import Linear
    net, arena = rt.net, rt.arena
    out = dict.fromkeys(GROUPS, 0)
    for name, m in net.named_modules():
        if name.startswith("mtp"):
            continue
        if isinstance(m, Linear):
            out[group_of_linear(name)] += tensor_bytes(m.weight)
        elif isinstance(m, RMSNorm):
            out["norms"] += tensor_bytes(m.weight)
    cfg = net.config
    head = net.embed_tokens.weight if cfg.tie_word_embeddings else net.lm_head.weight
    out["vocab head"] = tensor_bytes(head)
    for layer in net.layers:
        if layer.linear:
            g = layer.linear_attn
            out["GDN rule"] += 2 * arena[g.rec_name].nbytes
            out["conv"] += 2 * arena[g.conv_name].nbytes + tensor_bytes(g.conv1d.weight)
        else:
            k = arena[layer.self_attn.k_name]
            row = k[0].nbytes
            out["attention"] += 2 * row * (position + 1) + 2 * row
    out["sampling"] = cfg.vocab_size * 4
    return out


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """This machine's memory bandwidth at torch's thread count: a copy of nbytes into another
    buffer (read + write bytes counted, as STREAM's copy), and a read of them (a sum), each the
    best of `repeats` in GB/s."""
    import torch
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best_copy = best_read = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t0)
        t0 = time.perf_counter()
        src.sum()
        best_read = min(best_read, time.perf_counter() - t0)
    return {"bytes": nbytes, "copy_gbs": 2 * nbytes / best_copy / 1e9, "read_gbs": nbytes / best_read / 1e9}


# ---- labels (for the profile only) ------------------------------------------------------------------
def profiled(fn, label: str):
    """fn inside a torch.profiler range named `label` (the profile pass: ops per group)."""
    import torch

    def run(*args, **kw):
        with torch.profiler.record_function(label):
            return fn(*args, **kw)
    return run


class Clock:
    """Wall time per group from perf_counter around each call, a nested group's time taken out
    of the one around it (the timed pass: no profiler, ~0.3 us a call)."""

    def __init__(self):
        self.s, self.stack = dict.fromkeys(GROUPS, 0.0), []

    def __call__(self, fn, label: str):
        def run(*args, **kw):
            t0 = time.perf_counter()
            self.stack.append(0.0)
            try:
                return fn(*args, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.s[label] += dt - self.stack.pop()
                if self.stack:
                    self.stack[-1] += dt
        return run


@contextlib.contextmanager
def labels(rt, wrap=profiled):
    """Every group's calls wrapped by wrap(fn, group): module forwards and the model file's
    functions are swapped for the duration, then put back. Under the profiler the extension's
    small-M kernel (no aten op) is one range, "kernel", so it counts as one op."""
    import flashrt.models.qwen3_5 as q35
    import flashrt.native as native
    from flashrt.nn.layers import RMSNorm
    from flashrt.nn.linear import Linear, LinearPack
    net, undo = rt.net, []

    def swap(obj, attr, label, instance=False):
        old = getattr(obj, attr)
        setattr(obj, attr, (wrap if label != "kernel" else profiled)(old, label))
        undo.append((obj, attr, None if instance else old))
    for name, m in net.named_modules():
        if isinstance(m, (Linear, LinearPack)):     # a pack: its members' one call
            swap(m, "forward", group_of_linear(name), instance=True)
        elif isinstance(m, RMSNorm):
            swap(m, "forward", "norms", instance=True)
    for fn, label in (("causal_conv", "conv"), ("recurrent_gated_delta_rule", "GDN rule"),
                      ("gated_delta_block", "GDN rule"),
                      ("chunk_gated_delta_rule", "GDN rule"), ("attend_cached", "attention"),
                      ("apply_rotary", "rope")):
        swap(q35, fn, label)
    swap(net, "head", "vocab head", instance=True)
    swap(net.rotary, "forward", "rope", instance=True)
    swap(rt, "sample", "sampling", instance=True)
    if wrap is profiled:
        for fn in ("small_m_linear", "small_m_linear_int8", "gemv_bf16"):
            swap(native, fn, "kernel")
    try:
        yield
    finally:
        for obj, attr, old in reversed(undo):
            if old is None:
                delattr(obj, attr)            # the instance attribute goes: the class's is back
            else:
                setattr(obj, attr, old)


def op_counts(events, steps: int) -> tuple[dict, dict]:
    """({group: top-level ops per step}, {group: calls per step}) from the profiler's events: an
    aten op (or the "kernel" range) counts for its innermost group range, "other ops" when it
    is under none; ops an op calls are its own."""
    ops, calls = dict.fromkeys(GROUPS, 0), dict.fromkeys(GROUPS, 0)
    for e in events:
        if e.name in GROUPS:
            calls[e.name] += 1
            continue
        if e.name != "kernel" and not e.name.startswith(("aten::", "mkldnn::")):
            continue
        p, group = e.cpu_parent, "other ops"
        while p is not None:
            if p.name.startswith(("aten::", "mkldnn::")) or p.name == "kernel":
                group = None              # a child op
                break
            if p.name in GROUPS:
                group = p.name
                break
            p = p.cpu_parent
        if group is not None:
            ops[group] += 1
    return {g: v // steps for g, v in ops.items()}, {g: v // steps for g, v in calls.items()}


def op_floor_us() -> float:
    """The least a small aten op costs from Python here (a 1024-float multiply, best of 20
    loops of 1,000): the dispatch floor each op of a group pays whatever its bytes."""
    import torch
    x, w, best = torch.randn(1024), torch.randn(1024), float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        for _ in range(1000):
            x.mul(w)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


# ---- one format ----------------------------------------------------------------------------------
def profile_format(a, path, fmt: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from flashrt.lm import load
    dtype, weights = FORMATS[fmt]
    rt = load(path, device=a.device, dtype=dtype, weights=weights, max_seq_len=a.position + a.steps + 8)
    ids = C.random_ids(a.position, rt.net.vocab_size, seed=1)
    rt.prefill(ids)
    cap = rt.snapshot()

    def run():
        rt.restore(cap)
        t0 = time.perf_counter()
        rt.generate(max_new_tokens=a.steps, temperature=0.0, ignore_eos=True)
        return (time.perf_counter() - t0) / a.steps

    for _ in range(a.warmup):
        run()
    walls, timed, groups = [], [], []
    clock = Clock()
    for _ in range(a.repeats):             # plain and timed steps alternated
        walls.append(run())
        with labels(rt, clock):
            clock.s = dict.fromkeys(GROUPS, 0.0)
            timed.append(run())
            groups.append({g: v / a.steps for g, v in clock.s.items()})
    k = sorted(range(a.repeats), key=lambda i: timed[i])[a.repeats // 2]    # the median timed run
    with labels(rt):
        rt.restore(cap)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rt.generate(max_new_tokens=a.steps, temperature=0.0, ignore_eos=True)
    ops, calls = op_counts(prof.events(), a.steps)
    return {"format": fmt, "dtype": dtype, "weights": weights, "linear_kernel": rt.model.linear_kernel,
            "wall": C.Stats(walls), "wall_timed": C.Stats(timed), "group_ms": {g: v * 1e3 for g, v in groups[k].items()},
            "timed_ms": timed[k] * 1e3, "between_ms": (timed[k] - sum(groups[k].values())) * 1e3,
            "ops": ops, "calls": calls,
            "ops_per_step": sum(ops.values()), "bytes": step_bytes(rt, a.position + a.steps // 2),
            "params": sum(p.numel() for p in rt.net.parameters())}


def table(r: dict, a, bw: dict, floor_us: float) -> "C.Table":
    wall = r["timed_ms"]            # the timed step the groups come from: shares add up to 100%
    t = C.Table(f"One decode step at position {a.position}, {r['format']} ({a.size} shape, "
                f"{a.threads} threads; linear kernel {r['linear_kernel']}): {r['wall'].ms(1)} ms",
                ["group", "calls", "ops", "ms", "share", "op floor ms", "bytes", "GB/s",
                 "ms at copy bandwidth"])
    for g in GROUPS[:-1]:
        b, ms, n = r["bytes"][g], r["group_ms"][g], r["ops"][g]
        t.add(g, r["calls"][g] or "-", n, f"{ms:.2f}", f"{100 * ms / wall:.1f}%",
              f"{n * floor_us / 1e3:.2f}", C.fmt_bytes(b) if b else "-",
              f"{b / ms / 1e6:.1f}" if b and ms else "-", f"{b / bw['copy_gbs'] / 1e6:.2f}" if b else "-")
    n = r["ops"]["other ops"]
    t.add("between groups", "-", n, f"{r['between_ms']:.2f}", f"{100 * r['between_ms'] / wall:.1f}%",
          f"{n * floor_us / 1e3:.2f}", "-", "-", "-")
    tb, n = sum(r["bytes"].values()), r["ops_per_step"]
    t.add("step", "-", n, f"{wall:.2f}", "100%", f"{n * floor_us / 1e3:.2f}", C.fmt_bytes(tb),
          f"{tb / wall / 1e6:.1f}", f"{tb / bw['copy_gbs'] / 1e6:.2f}")
    t.notes += [f"ms: wall time of each group's calls per step in the median timed run (perf_counter "
                f"around them, Python included; steps timed so: {r['wall_timed'].ms(1)} ms, plain steps "
                f"alternated with them: {r['wall'].ms(1)}); "
                "between groups: the rest of that step (the Python of the blocks and the step, "
                "residual adds, gates, casts, the embedding, bookkeeping); ops: top-level aten ops "
                "a step, counted under torch.profiler",
                f"op floor = ops x {floor_us:.2f} us, the least one small aten op costs from Python "
                "here: the part of a group that no kernel can stream away",
                "bytes: weights read once, recurrent/conv state read and written once, K/V rows up to "
                "the position read; GB/s = bytes / ms; ms at copy bandwidth = bytes / this machine's "
                f"copy bandwidth ({bw['copy_gbs']:.1f} GB/s, read {bw['read_gbs']:.1f} GB/s, "
                f"{a.threads} threads), the floor for a kernel that only streams",
                f"{r['params'] / 1e6:.1f}M parameters loaded ({C.RANDOM_NOTE})"]
    return t


def main(argv=None) -> int:
    a = parse(argv)
    info = C.banner("decode_profile", a)
    path = C.checkpoint("qwen3_5", a.size)
    bw = copy_bandwidth(1 << (26 if a.quick else 30))
    print(f"copy bandwidth {bw['copy_gbs']:.1f} GB/s (read + write), read {bw['read_gbs']:.1f} GB/s")
    floor = op_floor_us()
    runs = []
    for f in C.progress(a.formats, desc="formats"):
        runs.append(profile_format(a, path, f))
        C.free_memory()                  # one model in memory at a time
    tabs = [table(r, a, bw, floor) for r in runs]
    C.print_tables(tabs)
    C.write_json("decode_profile", a, info, tabs,
                 {"size": a.size, "position": a.position, "steps": a.steps, "bandwidth": bw,
                  "op_floor_us": floor, "checkpoint": C.short_path(path), "runs": runs}, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

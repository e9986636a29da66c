"""Capsule state per model at the real released shapes, computed from the model code.

Builds each model on the meta device (no weights, no memory) and sums the arena layout it
declares: fixed-size capsule state (recurrent, conv, MTP hidden, RNG, metadata) and
per-token state (KV rows, MTP KV rows, token history). Writes
bench/results/state_sizes-<dtype>.json (bf16 by default).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def layout_table(arch: str, size: str, dtype: str, max_seq_len: int) -> str:
    """The arena table a runtime of this shape would print (rt.layout()), without weights."""
    from flashrt.core.arena import format_table, plan_slots
    from flashrt.models.checkpoint import build_config
    slots, total = plan_slots(_specs(build_config(arch, size).to_dict(), dtype, max_seq_len))
    fixed = sum(s.spec.nbytes for s in slots if s.spec.seq_dim is None and s.spec.kind not in ("io", "scratch"))
    per_tok = sum(s.spec.row_bytes for s in slots if s.spec.kind not in ("io", "scratch"))
    return format_table(slots, total, fixed, per_tok)


def _specs(hf: dict, dtype: str, max_seq_len: int) -> list:
    """The buffer specs of a language model of config hf (a config.json dict), on the meta device."""
    import torch

    from flashrt.lm.model import Options, lm_specs
    from flashrt.models import model_module
    mod = model_module(hf)
    with torch.device("meta"):
        net = mod.Model(mod.CONFIG.from_hf(hf))
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    return net.state_specs(max_seq_len, dt) + lm_specs(Options(max_seq_len=max_seq_len), net.vocab_size)


def capsule_specs(hf: dict, dtype: str) -> list:
    from flashrt.core.arena import CAPSULE_KINDS
    return [s for s in _specs(hf, dtype, 1) if s.kind in CAPSULE_KINDS]


def capsule_cost(hf: dict, dtype: str) -> tuple:
    """(fixed bytes, bytes per token) of one capsule of a model of config hf."""
    specs = capsule_specs(hf, dtype)
    return sum(s.nbytes for s in specs if s.seq_dim is None), sum(s.row_bytes for s in specs if s.seq_dim == 0)


def state_sizes(arch: str, size: str, dtype: str) -> dict:
    from flashrt.models.checkpoint import build_config
    specs = capsule_specs(build_config(arch, size).to_dict(), dtype)
    fixed, per_tok = capsule_cost(build_config(arch, size).to_dict(), dtype)
    by_kind = {}
    for s in specs:
        key = f"{s.kind}{'/token' if s.seq_dim == 0 else ''}"
        by_kind[key] = by_kind.get(key, 0) + (s.row_bytes if s.seq_dim == 0 else s.nbytes)
    return {"arch": arch, "size": size, "dtype": dtype, "buffers": len(specs),
            "fixed_bytes": fixed, "per_token_bytes": per_tok, "by_kind": by_kind,
            "capsule_bytes_at_2048": fixed + 2048 * per_tok}


def main(argv=None) -> int:
    from bench import common as C
    ap = C.base_parser("bench/state_sizes.py", "Capsule state per model at released shapes")
    ap.add_argument("--size", default="real")
    ap.add_argument("--layout", metavar="ARCH", help="print the full arena table of ARCH at this size")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    args = ap.parse_args(argv)
    args.device, args.dtype = "cpu", args.dtype or "bfloat16"
    if args.layout:
        print(layout_table(args.layout, args.size, args.dtype, args.max_seq_len))
        return 0
    table = C.Table(f"Capsule state per model ({args.size} shapes, {args.dtype}), from the model code",
                    ["model", "fixed state", "per token", "capsule at 2048 tokens", "by kind (bytes)"])
    rows = []
    for arch in ("qwen3", "qwen3_5", "lfm2"):
        try:
            r = state_sizes(arch, args.size, args.dtype)
        except Exception as e:  # a family whose model file is missing is reported, not hidden
            table.add(arch, "-", "-", "-", f"{type(e).__name__}: {e}")
            continue
        rows.append(r)
        table.add(C.label(arch, args.size), C.fmt_bytes(r["fixed_bytes"]), f"{r['per_token_bytes']} B",
                  C.fmt_bytes(r["capsule_bytes_at_2048"]),
                  ", ".join(f"{k} {v}" for k, v in r["by_kind"].items()))
    table.notes.append("fixed: recurrent + conv + MTP hidden + RNG + last logits + position; per token: "
                       "KV rows (+ MTP KV) + token id; computed by `python bench/state_sizes.py`")
    C.print_tables([table])
    C.write_json("state_sizes", args, C.machine_info("cpu", args.dtype), [table], {"rows": rows}, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Capsule state per model at the real released shapes, computed from the model code.

Builds each model on the meta device (no weights, no memory) and sums the arena layout it
declares: fixed-size capsule state (recurrent, conv, MTP hidden, RNG, metadata) and
per-token state (KV rows, MTP KV rows, token history). Writes bench/results/state_sizes.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def state_sizes(arch: str, size: str, dtype: str) -> dict:
    import torch

    from flashrt.arena import CAPSULE_KINDS
    from flashrt.models import model_module
    from flashrt.models.checkpoint import build_config
    from flashrt.runtime import Options, runtime_specs
    hf = build_config(arch, size).to_dict()
    mod = model_module(hf)
    with torch.device("meta"):
        net = mod.Model(mod.CONFIG.from_hf(hf))
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    specs = net.state_specs(1, dt) + runtime_specs(Options(max_seq_len=1, prefill_chunk=1), net.vocab_size)
    specs = [s for s in specs if s.kind in CAPSULE_KINDS]
    fixed = sum(s.nbytes for s in specs if s.seq_dim is None)
    per_tok = sum(s.row_bytes for s in specs if s.seq_dim == 0)
    by_kind = {}
    for s in specs:
        key = f"{s.kind}{'/token' if s.seq_dim == 0 else ''}"
        by_kind[key] = by_kind.get(key, 0) + (s.row_bytes if s.seq_dim == 0 else s.nbytes)
    return {"arch": arch, "size": size, "dtype": dtype, "buffers": len(specs),
            "fixed_bytes": fixed, "per_token_bytes": per_tok, "by_kind": by_kind,
            "capsule_bytes_at_2048": fixed + 2048 * per_tok}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--size", default="real")
    args = ap.parse_args(argv)
    rows = []
    for arch in ("qwen3", "qwen3_5", "lfm2"):
        try:
            rows.append(state_sizes(arch, args.size, args.dtype))
        except Exception as e:  # a family whose model file is missing is reported, not hidden
            rows.append({"arch": arch, "size": args.size, "error": f"{type(e).__name__}: {e}"})
    for r in rows:
        if "error" in r:
            print(f"{r['arch']:8s} {r['error']}")
        else:
            print(f"{r['arch']:8s} {r['size']} {r['dtype']}: fixed {r['fixed_bytes'] / 2**20:8.2f} MiB, "
                  f"{r['per_token_bytes']:7d} B/token, capsule at 2048 tokens "
                  f"{r['capsule_bytes_at_2048'] / 2**20:8.2f} MiB  {r['by_kind']}")
    out = ROOT / "bench" / "results" / "state_sizes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs the Triton decode-attention kernel under Triton's CPU interpreter and prints one JSON line
per case. Run as a script in a fresh process (tests/test_decode_attention.py does): the
interpreter is chosen when a kernel is defined, so it is switched on here before triton is
imported (in main, so that importing grid() from the tests changes nothing in their process)."""
from __future__ import annotations

import json
import os
import sys

DTYPES = ("float32", "bfloat16", "float16")


def _inputs(T, Hq, Hkv, D, cap, L, dtype, seed, device="cpu"):
    import torch
    g = torch.Generator().manual_seed(seed)
    q, K, V = (torch.randn(*s, generator=g).to(device, dtype) for s in ((T, Hq, D), (cap, Hkv, D), (cap, Hkv, D)))
    return q, K, V, torch.arange(L - T, L, device=device)   # the step's T tokens end at live length L


def grid():
    """(name, kwargs): dtype x head dim, GQA ratio and T cycling, each at lengths 1, mid, cap."""
    ratios, i = ((8, 8), (8, 4), (8, 2), (16, 2), (8, 1)), 0
    for dt in DTYPES:
        for D in ((64, 80, 128, 256) if dt == "float32" else (64, 128, 256)):   # 80: a masked tail
            for L in ("1", "mid", "cap"):
                Hq, Hkv = ratios[i % len(ratios)]
                T = 1 if L == "1" else (1, 3)[i % 2]
                cap = 96 + 37 * (i % 3)                  # not a multiple of the key tile
                n = {"1": 1, "mid": cap // 2 + 1, "cap": cap}[L]
                split = (None, 64)[i % 2]
                yield (f"{dt}-D{D}-g{Hq // Hkv}-T{T}-L{L}",
                       dict(T=T, Hq=Hq, Hkv=Hkv, D=D, cap=cap, L=n, dtype=dt, split=split, seed=i))
                i += 1
    # 16 tokens x 8 query heads: several row blocks per KV head, one causal step
    yield "float32-D64-g8-T16-Lcap", dict(T=16, Hq=8, Hkv=1, D=64, cap=150, L=150, dtype="float32",
                                          split=32, seed=99)
    # 19 splits of 32 keys: the combine kernel takes them 8 at a time (BLOCK_S for D=256)
    yield "bfloat16-D256-g4-T2-L590", dict(T=2, Hq=8, Hkv=2, D=256, cap=600, L=590, dtype="bfloat16",
                                           split=32, seed=98)


def run_case(T, Hq, Hkv, D, cap, L, dtype, split, seed, device="cpu"):
    """On CPU under the interpreter (main), or in-process on CUDA (tests/test_decode_attention.py)."""
    import torch
    from flashrt.kernels.decode_attention import decode_attention, decode_attention_ref
    from flashrt.nn.layers import attend_static
    q, K, V, pos = _inputs(T, Hq, Hkv, D, cap, L, getattr(torch, dtype), seed, device)
    ref = decode_attention_ref(q, K, V, pos, D ** -0.5).float()
    out = decode_attention(q, K, V, pos, D ** -0.5, split=split)
    # stale rows past the live length hold NaN / Inf: never read, so the bits do not change
    Ks, Vs = K.clone(), V.clone()
    Ks[L:], Vs[L:] = float("nan"), float("inf")
    if L < cap:
        Ks[-1], Vs[-1] = float("-inf"), float("nan")
    stale = decode_attention(q, Ks, Vs, pos, D ** -0.5, split=split)
    # the model's graph-safe entry point, both bodies
    via_layers = attend_static(q, K, V, pos, D ** -0.5, kernel="triton").float()
    torch_body = attend_static(q, K, V, pos, D ** -0.5, kernel="torch").float()
    return dict(err=float((out.float() - ref).abs().max()), ref_max=float(ref.abs().max()),
                stale_equal=bool(torch.equal(stale, out)), stale_finite=bool(stale.isfinite().all()),
                layers_err=float((via_layers - ref).abs().max()),
                torch_body_err=float((torch_body - ref).abs().max()), dtype=str(out.dtype),
                shape_ok=out.shape == q.shape and out.dtype == q.dtype)


def interpreter_defect() -> str | None:
    """Why this Triton's interpreter cannot run a loop bounded by a program id, or None. Triton
    3.6's (torch 2.11's) calls int() on a 1-element array, which NumPy >= 2.4 refuses."""
    import numpy as np
    import triton
    import triton.language as tl

    @triton.jit
    def probe(X):
        for i in range(tl.program_id(0), 2):
            tl.store(X + i, i)
    import torch
    x = torch.full((2,), -1, dtype=torch.int32)
    try:
        probe[(1,)](x)
    except Exception as e:  # noqa: BLE001 - only the known defect is reported; others re-raise
        if "0-dimensional arrays can be converted to Python scalars" not in repr(e):
            raise
        return (f"Triton {triton.__version__}'s interpreter cannot run a loop bounded by a program id "
                f"with NumPy {np.__version__} ({e!r}); Triton 3.9's can")
    assert x.tolist() == [0, 1], f"the interpreter probe stored {x.tolist()}"
    return None


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"      # before triton is first imported (in run_case)
    if (why := interpreter_defect()) is not None:
        print(json.dumps({"interpreter_defect": why}), flush=True)
        sys.exit(0)
    only = set(sys.argv[1:])
    for name, kw in grid():
        if not only or name in only:
            print(json.dumps({"name": name, **run_case(**kw)}), flush=True)

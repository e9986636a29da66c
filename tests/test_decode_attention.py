"""The Triton decode-attention kernel (flashrt/kernels/decode_attention.py) against its pure-torch
reference over a grid of head dims, GQA ratios, step sizes, live lengths (1, mid, capacity) and
dtypes, on CPU under Triton's interpreter (run in a subprocess: the interpreter must be on before
triton is imported). Also: stale rows holding NaN/Inf past the live length change no bit of the
output, and the model's graph-safe entry point (layers.attend_static) gives the same answer."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed (./run.sh setup installs it)")

from triton_interp_cases import grid  # noqa: E402

HERE = Path(__file__).parent
CASES = [name for name, _ in grid()]
# on a GPU every case compiles two kernels cold (~1-2 s each on the check's first call): the model
# shapes (bf16, D 128/256), fp16, and fp32 with a masked head-dim tail
CUDA_CASES = [n for n in CASES if n.startswith(("bfloat16-D128", "bfloat16-D256", "float16-D128",
                                                "float32-D80"))]
# relative to max(1, |ref|): fp32 IEEE dots; fp16/bf16 outputs may round one ulp the other way
REL = {"torch.float32": 1e-5, "torch.float16": 2 ** -9, "torch.bfloat16": 2 ** -6}


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(HERE / "triton_interp_cases.py")], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    if lines and "interpreter_defect" in lines[0]:
        pytest.skip(lines[0]["interpreter_defect"])
    return {d["name"]: d for d in lines}


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference(results, name):
    _check_case(results[name])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", CUDA_CASES)
def test_kernel_on_cuda(name):
    """The same grid compiled for and run on the GPU (bench/gpu_check.sh runs it)."""
    from triton_interp_cases import run_case
    _check_case(run_case(**dict(grid())[name], device="cuda"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("T", [1, 4])
def test_cuda_graph_serves_every_position(T):
    """Capture once, then change the positions (a device tensor) and the query, replay several
    times: each replay attends over exactly the new live length."""
    from flashrt.kernels.decode_attention import decode_attention, decode_attention_ref
    g = torch.Generator(device="cuda").manual_seed(T)
    cap, Hq, Hkv, D, dt = 1000, 16, 8, 128, torch.bfloat16
    K, V = (torch.randn(cap, Hkv, D, generator=g, device="cuda").to(dt) for _ in range(2))
    q = torch.randn(T, Hq, D, generator=g, device="cuda").to(dt)
    pos = torch.arange(T, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        decode_attention(q, K, V, pos, D ** -0.5)          # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, K, V, pos, D ** -0.5)
    for L in (T, 17, 513, cap, 40):
        q.copy_(torch.randn(T, Hq, D, generator=g, device="cuda").to(dt))
        pos.copy_(torch.arange(L - T, L, device="cuda"))
        graph.replay()
        ref = decode_attention_ref(q, K, V, pos, D ** -0.5).float()
        assert (out.float() - ref).abs().max() <= REL["torch.bfloat16"] * max(1.0, ref.abs().max().item()), L


def _check_case(r):
    tol = REL[r["dtype"]] * max(1.0, r["ref_max"])
    assert r["shape_ok"]
    assert r["err"] <= tol, f"kernel vs reference {r['err']:.3g} > {tol:.3g}"
    assert r["layers_err"] <= tol, f"attend_static(kernel='triton') {r['layers_err']:.3g} > {tol:.3g}"
    assert r["torch_body_err"] <= tol, f"attend_static(kernel='torch') {r['torch_body_err']:.3g}"
    assert r["stale_equal"] and r["stale_finite"], "NaN/Inf in rows past the live length leaked"


def _bad(**kw):
    from flashrt.kernels.decode_attention import decode_attention
    a = dict(q=torch.zeros(2, 8, 64), k_cache=torch.zeros(32, 2, 64), v_cache=torch.zeros(32, 2, 64),
             positions=torch.tensor([3, 4]), scale=0.125)
    a.update(kw)
    with pytest.raises(ValueError) as e:
        decode_attention(**a)
    return str(e.value)


def test_launcher_refuses_bad_inputs():
    assert "multiple of KV heads" in _bad(q=torch.zeros(2, 7, 64))
    assert "share one dtype" in _bad(q=torch.zeros(2, 8, 64, dtype=torch.float16))
    assert "share one dtype" in _bad(q=torch.zeros(2, 8, 64, dtype=torch.float64),
                                     k_cache=torch.zeros(32, 2, 64, dtype=torch.float64),
                                     v_cache=torch.zeros(32, 2, 64, dtype=torch.float64))
    assert "positions" in _bad(positions=torch.tensor([3]))
    assert "positions" in _bad(positions=torch.tensor([3.0, 4.0]))
    assert "contiguous" in _bad(positions=torch.tensor([3, 0, 4, 0])[::2])
    assert "head dim" in _bad(q=torch.zeros(2, 8, 32))
    assert "v_cache" in _bad(v_cache=torch.zeros(31, 2, 64))
    assert "unit stride" in _bad(k_cache=torch.zeros(32, 64, 2).transpose(1, 2))
    assert "out must be" in _bad(out=torch.zeros(2, 8, 64, dtype=torch.float16))


@pytest.mark.parametrize("cap", [1, 63, 64, 1000, 16384, 1 << 20])
def test_plan_covers_capacity(cap):
    from flashrt.kernels.decode_attention import plan
    for (T, Hq, Hkv, D), fp32 in itertools.product(((1, 16, 8, 128), (16, 8, 2, 256), (3, 8, 8, 80)),
                                                   (False, True)):
        p = plan(T, Hq, Hkv, D, cap, programs=528, fp32=fp32)
        assert p["split"] % p["BLOCK_N"] == 0 and p["n_split"] * p["split"] >= cap
        assert (p["n_split"] - 1) * p["split"] < cap                   # no empty trailing split
        assert p["n_split"] <= 128                                      # MAX_SPLITS
        assert p["m_blocks"] * p["BLOCK_M"] >= T * (Hq // Hkv) and p["BLOCK_D"] >= D


# ---- ahead-of-time compile for the H100/H200 (sm_90): no GPU needed ----------------------------
_PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}


def _compile_sm90(kernel, types: dict, constexprs: dict, num_warps: int, ints: dict):
    """Compiled as a launch specialises it: ints equal to 1 become constants, pointers and ints
    divisible by 16 carry that hint (it turns on cp.async pipelining, and its shared memory)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    constexprs = {**constexprs, **{n: 1 for n, v in ints.items() if v == 1}}
    sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if sig[n] != "constexpr" and (sig[n].startswith("*") or ints.get(n, 1) % 16 == 0)}
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def _resources(kernel, tool: Path, tmp_path) -> dict:
    """{"REG": .., "STACK": .., "SHARED": .., "LOCAL": ..} of a compiled kernel (cuobjdump)."""
    import re
    f = tmp_path / "k.cubin"
    f.write_bytes(kernel.asm["cubin"])
    text = subprocess.run([str(tool), "--dump-resource-usage", str(f)], capture_output=True,
                          text=True, check=True).stdout
    got = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    assert {"REG", "STACK", "LOCAL"} <= set(got), text
    return {k: int(v) for k, v in got.items()}


# the models' attention shapes (Hq, Hkv, D): Qwen3-0.6B, Qwen3.5-0.8B's full attention, LFM2-350M
_MODELS = {"qwen3": (16, 8, 128), "qwen3_5": (8, 2, 256), "lfm2": (16, 8, 64)}


@pytest.mark.filterwarnings("ignore::UserWarning")     # Triton 3.9's notice about its FP-fusion default
@pytest.mark.parametrize("dtype,T,Hq,Hkv,D", [
    *[(dt, T, *_MODELS[m]) for dt in (torch.bfloat16, torch.float32) for m in _MODELS for T in (1, 64)],
    (torch.bfloat16, 16, 8, 2, 256),      # Qwen3.5-0.8B's 16-token graph
    (torch.float16, 1, 32, 4, 64),
    (torch.float32, 4, 8, 8, 80)])        # a masked head-dim tail
def test_kernels_compile_for_sm90(dtype, T, Hq, Hkv, D, tmp_path):
    """The GPU path is not what the interpreter runs: compile both kernels to sm_90 machine code
    with the launcher's own plan (Triton's ptxas), so type or shape errors show up here; the
    plan's tiles fit the registers (no local-memory spills, which the fp32 tiles had)."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")
    from flashrt.kernels.decode_attention import _combine_kernel, _split_kernel, plan
    cap = 4096
    p = plan(T, Hq, Hkv, D, cap=cap, programs=4 * 132, fp32=dtype == torch.float32)
    ptr = _PTR[dtype]
    ints = dict(T=T, Hq=Hq, D=D, cap=cap, split=p["split"])
    split = _compile_sm90(_split_kernel, dict(Q=ptr, K=ptr, V=ptr, POS="*i64", M_WS="*fp32", L_WS="*fp32",
                                              ACC_WS="*fp32", scale="fp32"),
                          dict(G=p["G"], BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_D=p["BLOCK_D"],
                               PREC="ieee" if dtype == torch.float32 else "tf32"),
                          num_warps=p["warps"],
                          ints=dict(ints, sq_t=Hq * D, sq_h=D, sk_n=Hkv * D, sk_h=D, sv_n=Hkv * D, sv_h=D))
    combine = _compile_sm90(_combine_kernel, dict(M_WS="*fp32", L_WS="*fp32", ACC_WS="*fp32", POS="*i64",
                                                  OUT=ptr), dict(BLOCK_S=p["BLOCK_S"], BLOCK_D=p["BLOCK_D"]),
                            num_warps=4, ints=dict(ints, so_t=Hq * D, so_h=D))
    for k in (split, combine):
        assert k.asm["cubin"] and ".target sm_90" in k.asm["ptx"]
        assert k.metadata.shared <= 227 * 1024          # an H100/H200 block's shared memory
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip(f"compiled; the spill check needs the cuobjdump Triton ships ({tool} is missing)")
    for k in (split, combine):
        r = _resources(k, tool, tmp_path)
        assert r["STACK"] == 0 and r["LOCAL"] == 0, f"{k.name} spills: {r}, plan {p}"

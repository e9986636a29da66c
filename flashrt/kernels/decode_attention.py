"""Length-aware attention of a short step over arena KV: reads only the live rows.

Query token t (absolute position positions[t]) sees keys [0, positions[t] + 1). The lengths are
read from the device tensor `positions`, so one captured CUDA graph serves every position, and
the cost is O(live length), not O(capacity). Stale rows past the live length are never loaded, so
NaN/Inf left there cannot leak into the output.

Layout: split-K ("flash decoding"). Program (m, h, s) takes a block of packed (token, query head
of KV head h) rows and keys [s * split, (s + 1) * split) clipped to the live length, keeps an
online softmax in fp32 and writes (max, sum, unnormalised output) to a workspace; splits wholly
past the live length do nothing. The combine kernel merges the splits of each row.

Order: kernels -> launcher (checks shapes/dtypes, plans the grid from static shapes on the
host) -> `decode_attention(..., out=)` -> `decode_attention_ref`, the pure-torch reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MAX_SPLITS = 128          # the combine kernel reads every split of a row


@triton.jit
def _split_kernel(Q, K, V, POS, M_WS, L_WS, ACC_WS, scale, T, Hq, D, cap, split,
                  sq_t, sq_h, sk_n, sk_h, sv_n, sv_h,
                  G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, PREC: tl.constexpr):
    pid_m, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)        # packed (token t, member j of group h)
    row_ok = rows < T * G
    t = rows // G
    qh = h * G + rows % G
    # (BLOCK_M,) keys visible to each row; 0 for padding rows; never past the capacity
    length = tl.minimum(tl.load(POS + t, mask=row_ok, other=-1).to(tl.int32) + 1, cap)
    hi = tl.max(length, axis=0)
    lo = s * split
    end = tl.minimum(lo + split, hi)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # bf16/fp16 are upcast in registers: exact in tf32, and Triton's interpreter has no bf16 dot
    q = tl.load(Q + t[:, None] * sq_t + qh[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < end                                    # only live rows are loaded
        kv_mask = n_ok[:, None] & d_ok[None, :]
        row = n.to(tl.int64)[:, None]                     # capacity x row stride may pass 2^31
        k = tl.load(K + row * sk_n + h * sk_h + d[None, :], mask=kv_mask, other=0.0)
        sc = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PREC) * scale   # (M, N)
        sc = tl.where((n[None, :] < length[:, None]) & n_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no key yet: no NaN
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(sc - m_ref[:, None])
        v = tl.load(V + row * sv_n + h * sv_h + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PREC)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    ws = (s * T + t) * Hq + qh                            # workspace row (S, T, Hq)
    ok = row_ok & ((tl.zeros([BLOCK_M], tl.int32) + lo) < hi)   # a (M,) mask: the interpreter needs one
    tl.store(M_WS + ws, m_i, mask=ok)
    tl.store(L_WS + ws, l_i, mask=ok)
    tl.store(ACC_WS + ws[:, None] * D + d[None, :], acc, mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(M_WS, L_WS, ACC_WS, POS, OUT, T, Hq, D, cap, split, so_t, so_h,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)                                  # t * Hq + query head
    t = r // Hq
    qh = r % Hq
    length = tl.minimum(tl.load(POS + t).to(tl.int32) + 1, cap)
    n_split = (length + split - 1) // split               # splits holding this row's keys
    stride = T * Hq
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # BLOCK_S splits per iteration: independent loads in flight, not one round trip per split
    sp = tl.arange(0, BLOCK_S)
    m_max = tl.max(tl.load(M_WS + sp * stride + r, mask=sp < n_split, other=float("-inf")), axis=0)
    for s0 in range(BLOCK_S, n_split, BLOCK_S):
        m = tl.load(M_WS + (s0 + sp) * stride + r, mask=s0 + sp < n_split, other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m, axis=0))
    l_sum = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for s0 in range(0, n_split, BLOCK_S):
        ok = s0 + sp < n_split
        ws = (s0 + sp) * stride + r
        w = tl.exp(tl.load(M_WS + ws, mask=ok, other=float("-inf")) - m_max)      # 0 past n_split
        l_sum += w * tl.load(L_WS + ws, mask=ok, other=0.0)
        acc += w[:, None] * tl.load(ACC_WS + ws[:, None] * D + d[None, :],
                                    mask=ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc, axis=0) / tl.sum(l_sum, axis=0)
    tl.store(OUT + t * so_t + qh * so_h + d, out.to(OUT.dtype.element_ty), mask=d_ok)


# ---- launcher ------------------------------------------------------------------------------
def _check(q, k_cache, v_cache, positions, out):
    if q.dim() != 3 or k_cache.dim() != 3:
        raise ValueError(f"decode_attention: q must be (T, Hq, D) and the caches (capacity, Hkv, D); "
                         f"got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention: v_cache {tuple(v_cache.shape)} must match k_cache "
                         f"{tuple(k_cache.shape)}")
    (T, Hq, D), (cap, Hkv, Dk) = q.shape, k_cache.shape
    if D != Dk or not 0 < D <= MAX_HEAD_DIM:
        raise ValueError(f"decode_attention: head dim of q ({D}) and caches ({Dk}) must be equal "
                         f"and in 1..{MAX_HEAD_DIM}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"decode_attention: query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"decode_attention: q, k_cache, v_cache must share one dtype of "
                         f"{[str(d) for d in DTYPES]}; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if positions.shape != (T,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"decode_attention: positions must be int32/int64 of shape ({T},); got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if T > 1 and positions.stride(0) != 1:     # the kernels read POS + t
        raise ValueError(f"decode_attention: positions must be contiguous; got stride "
                         f"{positions.stride(0)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"decode_attention: out must be {q.dtype} {tuple(q.shape)}; got "
                         f"{out.dtype} {tuple(out.shape)}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("positions", positions),
                    ("out", out)):
        if x is not None and x.device != q.device:
            raise ValueError(f"decode_attention: {name} is on {x.device}, q on {q.device}")
        if x is not None and x.dim() == 3 and x.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name} needs a unit stride in its last dim; "
                             f"got strides {x.stride()}")


def plan(T: int, Hq: int, Hkv: int, D: int, cap: int, programs: int, split: int | None = None,
         fp32: bool = False):
    """Host-side launch plan from static shapes only (so it is fixed for a captured graph).
    programs: how many programs fill the device; split: keys per split (None: chosen here);
    fp32: float32 inputs (IEEE dots hold more live registers than tf32 ones)."""
    G = Hq // Hkv
    block_d = max(16, triton.next_power_of_2(D))
    # tiles that sm_90 holds in registers, no local-memory spills, under Triton 3.6 and 3.9
    # (tests/test_decode_attention.py checks the compiled kernels): tl.dot needs M, N >= 16
    block_m = max(16, triton.next_power_of_2(min(T * G, 64 if block_d <= 128 else 32)))
    if fp32:
        block_n, warps = 16, (4 if block_m * block_d <= 2048 else 8)
    else:
        block_n, warps = (64, 4) if block_d <= 128 else (32, 8)
    m_blocks = triton.cdiv(T * G, block_m)
    if split is None:   # enough splits that a full-capacity step fills the device, each >= 2 tiles;
        # a split writes and reads back T*G fp32 rows of D: >= 4*T*G keys keeps that under half its KV
        split = max(2 * block_n, 4 * T * G, triton.cdiv(cap, max(1, triton.cdiv(programs, Hkv * m_blocks))),
                    triton.cdiv(cap, MAX_SPLITS))
    split = triton.cdiv(max(split, 1), block_n) * block_n
    return dict(G=G, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, m_blocks=m_blocks, warps=warps,
                split=split, n_split=triton.cdiv(cap, split), BLOCK_S=16 if block_d <= 128 else 8)


def decode_attention(q, k_cache, v_cache, positions, scale: float, out=None, split: int | None = None):
    """softmax(q K[:L_t]^T * scale) V[:L_t] for each query token t, L_t = positions[t] + 1.

    q: (T, Hq, D); k_cache, v_cache: (capacity, Hkv, D), same dtype (fp32/fp16/bf16), rows
    [0, max(positions) + 1) written; positions: (T,) device tensor. Returns out (T, Hq, D).
    Math in fp32 (fp32 inputs: IEEE dots; fp16/bf16: tf32 dots, exact on their values).
    """
    _check(q, k_cache, v_cache, positions, out)
    (T, Hq, D), (cap, Hkv, _) = q.shape, k_cache.shape
    sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
           if q.device.type == "cuda" else 4)
    p = plan(T, Hq, Hkv, D, cap, programs=4 * sms, split=split, fp32=q.dtype == torch.float32)
    out = torch.empty_like(q) if out is None else out
    m_ws = torch.empty((p["n_split"], T, Hq), dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty((p["n_split"], T, Hq, D), dtype=torch.float32, device=q.device)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _split_kernel[(p["m_blocks"], Hkv, p["n_split"])](
        q, k_cache, v_cache, positions, m_ws, l_ws, acc_ws, float(scale), T, Hq, D, cap, p["split"],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        G=p["G"], BLOCK_M=p["BLOCK_M"], BLOCK_N=p["BLOCK_N"], BLOCK_D=p["BLOCK_D"], PREC=prec,
        num_warps=p["warps"])
    _combine_kernel[(T * Hq,)](m_ws, l_ws, acc_ws, positions, out, T, Hq, D, cap, p["split"],
                               out.stride(0), out.stride(1), BLOCK_S=p["BLOCK_S"], BLOCK_D=p["BLOCK_D"],
                               num_warps=4)
    return out


# ---- reference -----------------------------------------------------------------------------
def decode_attention_ref(q, k_cache, v_cache, positions, scale: float) -> torch.Tensor:
    """Pure torch, fp32, one query token at a time over the sliced live rows. (T, Hq, D)."""
    T, Hq, D = q.shape
    G = Hq // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for t, pos in enumerate(positions.tolist()):
        k = k_cache[: pos + 1].float().repeat_interleave(G, dim=1)   # (L, Hq, D)
        v = v_cache[: pos + 1].float().repeat_interleave(G, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q[t].float(), k) * scale).softmax(-1)
        out[t] = torch.einsum("hl,lhd->hd", probs, v)
    return out.to(q.dtype)

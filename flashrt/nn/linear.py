"""Projection matmuls: one `linear` every model file's projections and heads call, and the
choice of kernel per load (oneDNN, the extension's small-M kernel, or F.linear), probed once.

Weights in 8 bits (load(..., weights="int8")): an `Int8Weight` carries its per-row scale, and
`linear` sends it to `int8_linear` (the extension's small-M kernel, or torch's int8 weight-only
kernel, for a few rows; the float GEMM on dequantized weights for a prefill chunk);
`Int8Embedding` is a tied table's lookup.

The compile custom op keeps the chosen kernel whole inside torch.compile'd bodies."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashrt import native


LINEAR_KERNELS = ("aten", "onednn", "flashrt")
WEIGHT_FORMATS = ("float", "int8")      # "float": the weights in the model's dtype
# "flashrt" resolves to this for bf16 weights where oneDNN has no bf16 inner product (AVX2-only
# CPUs): there F.linear's bf16 GEMM runs ~0.5 ms per row of a 3584x1024 weight (bench/linear.py)
WIDEN = "flashrt-widen"


def small_m_rows(kernel: str, dtype: torch.dtype) -> tuple[int, int]:
    """Rows [lo, hi] of a step that the small-M kernel takes under `kernel`, for weights of
    `dtype` (torch.int8: an Int8Weight); (1, 0): none. One row runs as its GEMV."""
    if kernel not in ("flashrt", WIDEN):
        return 1, 0
    if dtype == torch.float32:
        return 1, native.SMALL_M_MAX
    if dtype == torch.bfloat16:
        return 1, native.SMALL_M_MAX if kernel == WIDEN else native.SMALL_M_MAX_BF16
    if dtype == torch.int8 and native.SMALL_M_INT8:
        return 1, native.SMALL_M_MAX_INT8
    return 1, 0


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, kernel: str = "aten"):
    """x @ w.T (+ b). kernel "onednn": oneDNN's inner product on the unchanged (out, in) weight,
    the op torch.compile's CPU backend emits; "flashrt": the same, except a few rows (a decode
    step; a short step: a user turn, a speculative verify) go to the extension's small-M
    kernel (small_m_rows): float32 at 1..SMALL_M_MAX rows, bf16 weights at
    1..SMALL_M_MAX_BF16 (summed in float32, rounded to bf16 once); WIDEN: bf16 weights at
    1..SMALL_M_MAX rows on the small-M kernel, longer steps on oneDNN in float32 from weights
    widened per call (exact), rounded to bf16 once; "aten": F.linear. An Int8Weight w goes to
    int8_linear whatever the kernel."""
    if isinstance(w, Int8Weight):
        y = int8_linear(x, w, kernel)
        return y if b is None else y + b
    if kernel != "aten" and torch.compiler.is_compiling():
        y = torch.ops.flashrt.linear(x, w, kernel)    # opaque to inductor: our kernels, not F.linear
        return y if b is None else y + b
    if kernel == "aten":
        return F.linear(x, w, b)
    lo, hi = small_m_rows(kernel, x.dtype)
    if (kernel != "onednn" and x.dim() == 2 and lo <= x.shape[0] <= hi and w.is_contiguous()
            and w.dtype == x.dtype):
        if b is None and x.shape[0] == 1 and x.dtype == torch.bfloat16 and native.GEMV_BF16:
            return native.gemv_bf16(x.contiguous(), w)   # the same bits, no float32 copies
        # a strided x (e.g. Gated DeltaNet's output, (T, 2048) in the Qwen3.5 shape) is a few
        # KiB to copy; oneDNN would stream the weights at half the speed
        y = native.small_m_linear(x.contiguous().float(), w)
    elif kernel == WIDEN and x.dtype == torch.bfloat16:
        # (out, in) float32 copy per call: at >32 rows the GEMM outweighs widening the weight
        y = torch.ops.mkldnn._linear_pointwise(x.float(), w.float(), None, "none", [], "")
    else:
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return y if b is None else y + b
    y = y if b is None else y + b          # float32 + a bf16 bias: still float32
    return y.to(x.dtype)


class Int8Weight(nn.Parameter):
    """An (out, in) int8 weight with its per-row bf16 scale (out,): w ~= q * scale[:, None],
    symmetric, |q| <= 127 (quantize_int8). What a Linear, or a tied vocabulary table, holds
    under weights="int8"; linear() reads the scale from it."""

    def __new__(cls, q: torch.Tensor, scale: torch.Tensor):
        t = super().__new__(cls, q, requires_grad=False)
        t.scale = scale
        return t


# torch's int8 kernel steps k by 16 with no tail (any other width reads past the row) and
# is vectorized for bf16 activations only (float32 runs a scalar loop, ~15x slower)
INT8_K_MULTIPLE = 16
# rows of a step on the int8 kernel: it re-reads the weights every 4 rows (a 14.7M-weight
# matrix, 1 thread: 3.4 ms at 16 rows, 46 at 64, where dequantizing + a GEMM takes ~11)
INT8_MAX_ROWS = 32


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Per output row: scale = max|w| / 127 rounded to bf16 (a zero row: 1), q = round(w /
    scale) in float32, clamped to +-127; deterministic. w: (out, in), any float dtype, in a
    multiple of INT8_K_MULTIPLE."""
    if w.dim() != 2 or w.shape[1] % INT8_K_MULTIPLE:
        raise ValueError(f"quantize_int8: an (out, in) weight with in a multiple of "
                         f"{INT8_K_MULTIPLE}, got shape {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(torch.bfloat16)
    q = torch.round(wf / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale)


def dequantize_int8(w: Int8Weight) -> torch.Tensor:
    """The float32 weights w stands for, exactly (a 7-bit integer times an 8-bit-mantissa
    scale fits float32's 24 bits)."""
    return w.float() * w.scale.float()[:, None]


def int8_linear(x: torch.Tensor, w: Int8Weight, kernel: str = "aten") -> torch.Tensor:
    """x (..., in) @ dequant(w).T -> (..., out) in x's dtype. The rows small_m_rows(kernel,
    torch.int8) gives (under "flashrt", on CPU): the extension's small-M kernel, x in float32
    (bf16 widened exactly), one float32 sum per output times the row's scale, rounded to x's
    dtype once. Otherwise up to INT8_MAX_ROWS rows: torch's weight-only int8 kernel (what
    torchao and gpt-fast call), which takes x rounded to bf16, sums in float32 and rounds the
    result to bf16. More rows (a prefill chunk): `kernel`'s float32 GEMM on dequantize_int8(w)
    made for the call, x in float32."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])     # (M, in); a step's x is 2-D
    lo, hi = small_m_rows(kernel, torch.int8)
    if lo <= x2.shape[0] <= hi and x2.device.type == "cpu":
        if torch.compiler.is_compiling():
            y = torch.ops.flashrt.int8_small_m(x2, w, w.scale)
        else:
            y = native.small_m_linear_int8(x2.contiguous().float(), w, w.scale)
    elif x2.shape[0] > INT8_MAX_ROWS:
        y = linear(x2.float(), dequantize_int8(w), None, kernel)
    else:
        xb = x2.to(torch.bfloat16)
        if not xb.is_contiguous() or xb.data_ptr() % 64:    # the kernel's loads of x are aligned
            xb = xb.clone(memory_format=torch.contiguous_format)
        y = torch.ops.aten._weight_int8pack_mm(xb, w, w.scale)
    y = y.to(x.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], w.shape[0])


class Int8Embedding(nn.Module):
    """A token-embedding table in int8 whose rows are dequantized on lookup (to `dtype`); under
    tied embeddings the vocabulary head multiplies by the same Int8Weight through linear()."""

    def __init__(self, weight: Int8Weight, dtype: torch.dtype):
        super().__init__()
        self.weight, self.dtype = weight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:        # (T,) -> (T, hidden)
        w = self.weight
        return (w[ids].float() * w.scale[ids, None].float()).to(self.dtype)


@torch.library.custom_op("flashrt::linear", mutates_args=())
def _linear_op(x: torch.Tensor, w: torch.Tensor, kernel: str) -> torch.Tensor:
    """linear() without bias as one op torch.compile keeps whole (the oneDNN and small-M
    kernels are not traceable); eager calls go to linear() directly."""
    return linear(x, w, None, kernel)


@_linear_op.register_fake
def _(x, w, kernel):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("flashrt::int8_small_m", mutates_args=())
def _int8_small_m_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8_linear's small-M call as one op for torch.compile'd bodies: (M, in) -> float32 (M, out)."""
    return native.small_m_linear_int8(x.contiguous().float(), q, scale)


@_int8_small_m_op.register_fake
def _(x, q, scale):
    return x.new_empty((x.shape[0], q.shape[0]), dtype=torch.float32)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose matmul kernel is chosen at load
    (`select_linear_kernel`); every model file uses it for its projections."""
    kernel = "aten"

    def forward(self, x):
        return linear(x, self.weight, self.bias, self.kernel)


class LinearPack(nn.Module):
    """Linears that read one input (q/k/v, gate/up, Gated DeltaNet's four input projections),
    run as one matmul over their concatenated rows where the small-M kernel takes the step:
    a decode step then streams one weight per pack, not one per member, and makes one call.
    The members keep their parameters and checkpoint names (they are not submodules here);
    pack_linears makes their weights views of the pack's (sum of outs, in) tensor. Each output
    is the same sum either way (the kernel's sums are per row), so the results are the members'
    bits. A member whose weight no longer views the pack (moved, replaced) runs on its own."""

    def __init__(self, *members: Linear):
        super().__init__()
        object.__setattr__(self, "members", members)   # plain tuple: no second state-dict name
        self.packed = self.packed_bias = None          # plain tensors, set by pack()
        self.views: tuple = ()                         # the members' weight data_ptrs when packed
        self.sizes = [m.out_features for m in members]

    def pack(self) -> bool:
        """Concatenate the members' weights (and biases) and make theirs views of the result;
        only on the CPU under a small-M kernel, for members alike in input width, dtype and
        bias. Returns whether it packed."""
        ms = self.members
        ws = [m.weight for m in ms]
        alike = (len({(w.dtype, w.shape[1], w.device.type, m.kernel, m.bias is None)
                      for w, m in zip(ws, ms)}) == 1 and all(w.is_contiguous() for w in ws))
        if not alike or ws[0].device.type != "cpu" or small_m_rows(ms[0].kernel, ws[0].dtype)[1] < 1:
            return False
        with torch.no_grad():
            if isinstance(ws[0], Int8Weight):
                q, s = torch.cat([w.data for w in ws]), torch.cat([w.scale for w in ws])
                packed = Int8Weight(q, s)
                parts = [Int8Weight(a, b) for a, b in zip(q.split(self.sizes), s.split(self.sizes))]
            else:
                packed = torch.cat([w.data for w in ws])
                parts = [nn.Parameter(a, requires_grad=False) for a in packed.split(self.sizes)]
            if ms[0].bias is not None:
                object.__setattr__(self, "packed_bias", torch.cat([m.bias.data for m in ms]))
                for m, b in zip(ms, self.packed_bias.split(self.sizes)):
                    m.bias = nn.Parameter(b, requires_grad=False)
        object.__setattr__(self, "packed", packed)   # not a parameter of this module
        for m, p in zip(ms, parts):
            m.weight = p
        self.remember_views()
        return True

    def tensors(self) -> list:
        """The pack's own tensors (not parameters of any module): weight, its int8 scale, bias."""
        w = self.packed
        return [t for t in (w, getattr(w, "scale", None), self.packed_bias) if t is not None]

    def remember_views(self) -> None:
        """Note where the members' weights are: pack() and a move of the pack's storage call it."""
        self.views = tuple(m.weight.data_ptr() for m in self.members)

    def forward(self, x: torch.Tensor) -> list:
        """[member(x) for each member]: (T, in) -> [(T, out_i)]."""
        ms, w = self.members, self.packed
        lo, hi = small_m_rows(ms[0].kernel, w.dtype) if w is not None else (1, 0)
        if (not lo <= x.shape[0] <= hi or x.dim() != 2 or torch.compiler.is_compiling()
                or any(m.weight.data_ptr() != p for m, p in zip(ms, self.views))):
            return [m(x) for m in ms]
        ys = linear(x, w, self.packed_bias, ms[0].kernel).split(self.sizes, dim=-1)
        return list(ys) if x.shape[0] == 1 else [y.contiguous() for y in ys]   # (1, n): contiguous


def pack_linears(net: nn.Module) -> int:
    """pack() every LinearPack in `net` (after its weights and kernel are set); returns how many packed."""
    return sum(m.pack() for m in net.modules() if isinstance(m, LinearPack))


def select_linear_kernel(net: nn.Module, device: torch.device, dtype: torch.dtype, want: str = "auto") -> str:
    """Set the kernel of every Linear in `net` (and `net.linear_kernel`, for heads); returns it.

    auto: oneDNN on CPU when it runs this dtype here and agrees with F.linear on a probe
    (measured on a 2-core AVX2 EPYC, fp32: one-token steps 2-3x faster than MKL's GEMV for
    (out, in) weights, 512-token prefill GEMMs 10-20% faster), with short steps on the
    extension's small-M kernel where it runs (x86-64 AVX2 + FMA, torch's OpenMP; fp32 at 2-32
    rows, bf16 at 1-8: faster than oneDNN there, bench/linear.py); for bf16 where oneDNN has no
    bf16 inner product (AVX2 only) the small-M kernel up to 32 rows and oneDNN on widened weights
    above (WIDEN); aten elsewhere (CUDA; CPUs with neither)."""
    if want not in ("auto",) + LINEAR_KERNELS:
        raise ValueError(f"linear kernel {want!r}: expected auto, aten, onednn or flashrt")
    kernel = "aten"
    if want != "aten":
        no_onednn = _onednn_unusable(device, dtype)
        no_small_m = None if want == "onednn" else _small_m_unusable(dtype)
        widen = (no_onednn and want != "onednn" and not no_small_m and dtype == torch.bfloat16
                 and not _onednn_unusable(device, torch.float32))
        if widen:
            kernel = WIDEN
        elif no_onednn or (want == "flashrt" and no_small_m):
            if want != "auto":
                raise ValueError(f"linear kernel {want!r} unavailable: {no_onednn or no_small_m}")
        else:
            kernel = "onednn" if no_small_m else "flashrt"
    for m in net.modules():
        if isinstance(m, Linear):
            m.kernel = kernel
    net.linear_kernel = kernel
    return kernel


def _onednn_unusable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return f"device {device.type} (oneDNN linear is a CPU path)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g).to(dtype), torch.randn(48, 64, generator=g).to(dtype)
    try:
        y = linear(x, w, kernel="onednn")
    except RuntimeError as e:
        return f"oneDNN refused a {dtype} inner product on this CPU ({str(e).splitlines()[0][:80]})"
    ref = F.linear(x.float(), w.float())
    if not torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max())):
        return "oneDNN probe disagreed with F.linear"
    return None


def _small_m_unusable(dtype: torch.dtype) -> str | None:
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the small-M kernel takes float32 or bfloat16 weights, not {dtype}"
    if not native.SMALL_M_LINEAR:
        return f"the extension's small-M kernel does not run here ({native.ext_status()})"
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 67, generator=g), torch.randn(13, 67, generator=g).to(dtype)
    if not torch.allclose(native.small_m_linear(x, w), F.linear(x, w.float()), rtol=1e-4, atol=1e-4):
        return "small-M kernel probe disagreed with F.linear"
    return None

"""Python face of the native extension ``flashrt._C``.

What the runtime needs from native code:

* ``copy_segments`` / ``SegmentPlan``: copy many (src, dst) byte ranges at
  once. On CPU the extension splits the bytes over threads with the GIL
  released (torch's own OpenMP threads when it shares torch's runtime); on CUDA it copies all segments with one kernel launch on the
  current stream (``flashrt._C.copy_segments_cuda``; the segment table is
  passed in the kernel parameters, up to 1024 segments per launch).
* ``xxh64``: the standard XXH64 checksum, identical with or without the
  extension (the fallback is the pure-Python ``hash_fallback.xxh64_py``).
* ``xxh3``: XXH3-64 (seed 0), from the vendored reference implementation
  (fallback ``hash_fallback.xxh3_py``).
* ``hash_blocks`` / ``read_blocks_hashed``: the capsule file checksum, an
  XXH3-64 per fixed-size block of a byte stream given as spans of a buffer;
  blocks are hashed on all cores, and a reader hashes each block right after
  reading it, while it is still in cache (capsule load walks the payload once).
* ``load_known_table``: a whole capsule load (header, metadata, payload and
  checksums) in one call, for a file whose entry table the target already
  holds; no fallback (the general reader in capsules/format.py does the same).

Without the extension every function still works through torch copies and
pure Python, after a single warning naming the import error.
"""
from __future__ import annotations

import ctypes
import functools
import os
import struct
import warnings
from typing import Sequence, Tuple

import numpy as np
import torch

from .hash_fallback import xxh3_py, xxh64_py

# What this module calls in the extension; a build from older sources lacks some, and is
# then not used (the bench scripts attach an installed build only if it has them all).
NEEDS = ("copy_segments_cpu", "xxh64", "xxh3_parts", "xxh3_isa", "zero_spans",
         "hash_blocks", "read_blocks_hashed", "load_known_table", "openmp_runtime", "CpuCopyPlan",
         "has_cuda", "version", "small_m_linear_isa", "small_m_linear_weight_dtypes")

try:
    from . import _C
    _missing = [n for n in NEEDS if not hasattr(_C, n)]
    if _missing:
        raise ImportError(f"flashrt._C {getattr(_C, 'version', '?')} was built from older sources "
                          f"(it lacks {', '.join(_missing)}): rebuild it (pip install .)")
    _IMPORT_ERROR: ImportError | None = None
except ImportError as _e:  # not built, built for another Python/platform, or stale
    _C = None
    _IMPORT_ERROR = _e

HAVE_EXT: bool = _C is not None
HAVE_CUDA_EXT: bool = HAVE_EXT and bool(_C.has_cuda())


def _torch_openmp_runtime() -> str | None:
    """Path of the OpenMP runtime torch's CPU kernels call (what omp_get_max_threads resolves to
    from libtorch_cpu), or None when it cannot be told (no such library, no dladdr)."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(lib):
        return None

    class _DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]
    try:
        # already loaded by `import torch`: RTLD_NOLOAD only looks it up; dlsym on its handle
        # searches it and its dependencies, as its own calls resolve
        fn = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_get_max_threads
        info = _DlInfo()
        if not ctypes.CDLL(None).dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)):
            return None
    except (OSError, AttributeError):
        return None
    return os.fsdecode(info.dli_fname) if info.dli_fname else None


def _copies_on_torch_threads() -> bool:
    """Whether the extension's parallel CPU copy runs on torch's own intra-op threads: it was
    built with OpenMP and bound to the runtime torch calls (loaded first, same soname).
    Otherwise its threads would compete with torch's spinning ones, and large copies go
    through torch instead (see SegmentPlan)."""
    if not HAVE_EXT or not _C.openmp_runtime():
        return False
    theirs = _torch_openmp_runtime()
    return theirs is not None and os.path.realpath(theirs) == os.path.realpath(_C.openmp_runtime())


COPIES_ON_TORCH_THREADS: bool = _copies_on_torch_threads()

# The small-M projection kernel runs here: built (x86-64), the CPU has AVX2 + FMA, and
# its threads are torch's (a second OpenMP pool would fight torch's spinning workers).
SMALL_M_LINEAR: bool = HAVE_EXT and bool(_C.small_m_linear_isa()) and COPIES_ON_TORCH_THREADS
SMALL_M_MAX = 32      # measured: 1.3-1.8x oneDNN at M = 2..32; oneDNN's blocked GEMM wins above
# bf16 weights: 1.2-1.7x oneDNN's bf16 inner product at M = 1..8 (its AVX512-BF16 dot products
# win from ~10 rows on: bench/linear.py --dtype bfloat16)
SMALL_M_MAX_BF16 = 8

__all__ = ["HAVE_EXT", "HAVE_CUDA_EXT", "ext_status", "SegmentPlan", "copy_segments", "xxh64",
           "xxh3", "xxh3_parts", "zero_spans", "hash_blocks", "read_blocks_hashed",
           "load_known_table", "small_m_linear"]

Pair = Tuple[torch.Tensor, torch.Tensor]


def ext_status() -> str:
    """One line saying which native paths are in use (for logs and bug reports)."""
    if not HAVE_EXT:
        return (f"flashrt._C unavailable ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}); "
                "using torch copies and Python/numpy hashing")
    cuda = "CUDA segmented copy" if _C.has_cuda() else "no CUDA kernel (built without CUDA)"
    threads = ("torch's OpenMP threads" if COPIES_ON_TORCH_THREADS else
               f"OpenMP at {_C.openmp_runtime()}, not torch's" if _C.openmp_runtime() else
               "own thread pool")
    lin = (f"small-M linear ({_C.small_m_linear_isa()})" if SMALL_M_LINEAR else
           "no small-M linear" + ("" if _C.small_m_linear_isa() else " (needs x86-64 AVX2 + FMA)"))
    return (f"flashrt._C {_C.version}: CPU segmented copy ({threads}), xxh64, xxh3 "
            f"({_C.xxh3_isa()}), block checksums, {lin}, {cuda}")


@functools.lru_cache(maxsize=None)
def _warn_fallback() -> None:
    # lru_cache makes this fire once per process without a mutable flag.
    warnings.warn(f"{ext_status()}; native copies and hashing will be slower",
                  RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------- copies

_TORCH_MIN_BYTES = 512 << 10   # below, one native call on the calling thread is cheaper
_TORCH_MAX_RUNS = 8             # each torch copy costs a few microseconds of dispatch


def _nbytes_of(i: int, name: str, t) -> int:
    """Byte count of a valid segment view; ValueError naming the segment otherwise."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"segment {i}: {name} is {type(t).__name__}, not a torch.Tensor")
    shape = t.shape
    if t.dtype is not torch.uint8 or len(shape) != 1 or not t.is_contiguous():
        raise ValueError(f"segment {i}: {name} must be a contiguous 1-D uint8 view, got "
                         f"dtype={t.dtype}, shape={tuple(shape)}, contiguous={t.is_contiguous()}")
    return shape[0]


def _strided_runs(pairs, src, dst, sizes) -> list:
    """Consecutive segments of one size whose sources, and whose destinations, are equally
    spaced in one storage each, as (src, dst) 2-D strided views: [(k, size) views]. A capsule's
    per-token buffers (K and V of every layer: same row size, allocated back to back) collapse
    into one or a few such pairs."""
    def storage(t):
        return t.untyped_storage().data_ptr()

    runs, i, n = [], 0, len(pairs)
    while i < n:
        size, j = sizes[i], i + 1
        ss = src[j] - src[i] if j < n else 0
        ds = dst[j] - dst[i] if j < n else 0
        if ss >= size and ds >= size:
            ps, pd = storage(pairs[i][0]), storage(pairs[i][1])
            while (j < n and sizes[j] == size and src[j] - src[j - 1] == ss
                   and dst[j] - dst[j - 1] == ds and storage(pairs[j][0]) == ps
                   and storage(pairs[j][1]) == pd):
                j += 1
        s0, d0 = pairs[i]
        if j - i == 1:
            runs.append((s0, d0))
        else:
            runs.append((s0.as_strided((j - i, size), (ss, 1), s0.storage_offset()),
                         d0.as_strided((j - i, size), (ds, 1), d0.storage_offset())))
        i = j
    return runs


class SegmentPlan:
    """A fixed list of (src, dst) byte copies, validated once and run many times.

    Validation and the address tables (``src``, ``dst``, ``nbytes``: int64
    numpy arrays) are built at construction, so ``run()`` is one native call;
    reuse plans on hot paths. The plan keeps its tensors alive, but it
    records their addresses: re-allocating a tensor (``resize_``, ``set_``)
    makes it stale. Destinations must not overlap each other or any source.
    ``num_threads`` (CPU only): None or 0 = all hardware threads; copies
    under 512 KiB always run on the calling thread.

    Execution path, chosen at construction:
      * all CPU   -> ``_C.copy_segments_cpu`` (threads split the bytes; GIL released;
        one OpenMP region on torch's own threads when ``COPIES_ON_TORCH_THREADS``);
        without that, from 512 KiB with num_threads None/0 when the segments coalesce
        into at most 8 equally spaced runs, one torch copy per run as 2-D strided views
        (torch's intra-op threads do it: see ``_strided_runs``).
      * all on one CUDA device -> ``_C.copy_segments_cuda``: one kernel on the
        current stream (more only past 1024 segments), asynchronous like any
        CUDA op, capturable in a CUDA graph once it has run outside capture
        (the kernel is loaded lazily on first use).
      * anything else (CUDA <-> CPU, several GPUs) or no extension -> one
        ``dst.copy_(src, non_blocking=True)`` per segment; between CUDA and CPU
        run() returns once the copies are done (the stream is synchronised), so
        the host buffer may be reused or read at once.
    ``mode`` records the choice: "cpu", "strided", "cuda", "torch" or "empty".
    """

    def __init__(self, pairs: Sequence[Pair], num_threads: int | None = None):
        self.num_threads = 0 if num_threads is None else int(num_threads)
        if self.num_threads < 0:
            raise ValueError("num_threads must be >= 0 or None")
        # One pass, few tensor attribute reads: each costs ~0.2 us and
        # copy_segments() builds a plan per call.
        self.pairs, src, dst, sizes, devices = [], [], [], [], set()
        for i, pair in enumerate(pairs):
            try:
                s, d = pair
            except (TypeError, ValueError):
                raise ValueError(f"segment {i}: expected a (src, dst) pair of tensors") from None
            n, m = _nbytes_of(i, "src", s), _nbytes_of(i, "dst", d)
            if n != m:
                raise ValueError(f"segment {i}: src has {n} bytes, dst has {m}")
            if n:
                self.pairs.append((s, d))
                src.append(s.data_ptr())
                dst.append(d.data_ptr())
                sizes.append(n)
                devices.add(s.device)
                devices.add(d.device)
        self.src = np.array(src, dtype=np.int64)
        self.dst = np.array(dst, dtype=np.int64)
        self.nbytes = np.array(sizes, dtype=np.int64)
        # host <-> device copies return only once done: a pinned host capsule may then be
        # overwritten (a load(into=)) or read (a save) at once; unordered otherwise
        self._sync = any(d.type == "cuda" for d in devices) and any(d.type == "cpu" for d in devices)
        self.device = devices.pop() if len(devices) == 1 else None
        if self.device is None:
            self.mode = "torch" if self.pairs else "empty"
        elif self.device.type == "cpu":
            self.mode = "cpu" if HAVE_EXT else "torch"
            # Without torch's own OpenMP threads, large copies run as a few strided torch copies:
            # a second pool would fight torch's still-spinning threads (see bench/README.md).
            if self.num_threads == 0 and sum(sizes) >= _TORCH_MIN_BYTES and not (
                    HAVE_EXT and COPIES_ON_TORCH_THREADS):
                runs = _strided_runs(self.pairs, src, dst, sizes)
                if len(runs) <= _TORCH_MAX_RUNS:
                    self.mode, self.pairs = "strided", runs
        elif self.device.type == "cuda":
            self.mode = "cuda" if HAVE_CUDA_EXT else "torch"
        else:
            self.mode = "torch"
        if self.mode == "torch" and not HAVE_EXT:
            _warn_fallback()
        # the table goes to the extension once: run() converts no arrays
        self._cpu = _C.CpuCopyPlan(self.src, self.dst, self.nbytes) if self.mode == "cpu" else None

    @classmethod
    def from_table(cls, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                   device: torch.device, keep: tuple = ()) -> "SegmentPlan | None":
        """A plan over raw addresses (int64 arrays, validated by whoever made them: e.g. a
        checked plan's table moved onto another buffer of the same layout, which builds no
        views). `keep` holds the buffers behind the addresses alive. None where a plan from
        views would copy through torch (no extension; large CPU copies off torch's threads):
        build that one from views."""
        if not HAVE_EXT:
            return None
        if device.type == "cpu":
            if not COPIES_ON_TORCH_THREADS and int(nbytes.sum()) >= _TORCH_MIN_BYTES:
                return None
            mode = "cpu"
        elif device.type == "cuda" and HAVE_CUDA_EXT:
            mode = "cuda"
        else:
            return None
        self = cls.__new__(cls)
        self.num_threads, self.pairs, self.device, self.mode = 0, [], device, mode
        self.src, self.dst, self.nbytes, self._keep, self._sync = src, dst, nbytes, keep, False
        self._cpu = _C.CpuCopyPlan(src, dst, nbytes) if mode == "cpu" else None
        return self

    def __len__(self) -> int:
        """Copies per run: torch copies over views, else native segments."""
        return len(self.pairs) if self.mode in ("strided", "torch") else len(self.nbytes)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def run(self) -> None:
        if self.mode == "cpu":
            self._cpu.run(self.num_threads)
        elif self.mode == "cuda":
            # The kernel launches on the current device, which must own the stream.
            with torch.cuda.device(self.device):
                _C.copy_segments_cuda(self.src, self.dst, self.nbytes,
                                      torch.cuda.current_stream().cuda_stream)
        elif self.mode == "strided":
            for src, dst in self.pairs:
                dst.copy_(src)
        elif self.mode == "torch":
            for src, dst in self.pairs:
                dst.copy_(src, non_blocking=True)
            if self._sync:
                torch.cuda.current_stream().synchronize()


def small_m_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ w (N, K).T as float32 (M, N) with the extension's small-M kernel (see
    csrc/linear_cpu.cpp; callers check SMALL_M_LINEAR). x is float32; w float32 or bfloat16
    (widened in registers). ValueError names a bad argument."""
    if not (HAVE_EXT and _C.small_m_linear_isa()):
        raise RuntimeError(f"small_m_linear unavailable: {ext_status()}")
    for name, t, dtypes in (("x", x, (torch.float32,)), ("w", w, (torch.float32, torch.bfloat16))):
        if t.dtype not in dtypes or t.dim() != 2 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"small_m_linear: {name} must be a contiguous 2-D "
                             f"{' or '.join(str(d)[6:] for d in dtypes)} CPU tensor, got "
                             f"{t.dtype}, shape {tuple(t.shape)}, strides {t.stride()}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}, {t.device}")
    (m, k), (n, k2) = x.shape, w.shape
    if k != k2 or m == 0 or n == 0 or k == 0:
        raise ValueError(f"small_m_linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (m, n) or not out.is_contiguous() \
            or out.device.type != "cpu":
        raise ValueError(f"small_m_linear: out must be a contiguous float32 CPU ({m}, {n}) tensor")
    _C.small_m_linear(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k,
                      bf16_weights=w.dtype == torch.bfloat16)
    return out


def copy_segments(pairs: Sequence[Pair], num_threads: int | None = None) -> None:
    """Copy every (src, dst) pair of contiguous 1-D uint8 tensors; see SegmentPlan.

    Raises ValueError naming the first bad segment (dtype, shape, layout or
    length mismatch). Zero-length segments are skipped.
    """
    SegmentPlan(pairs, num_threads).run()


# --------------------------------------------------------------------------- xxh64

_M64 = 0xFFFFFFFFFFFFFFFF


def xxh64(data, seed: int = 0) -> int:
    """XXH64 of the raw bytes of ``data`` as an unsigned int.

    ``data``: a contiguous tensor of any dtype and shape (CUDA tensors are
    copied to the host first), or anything exposing a C-contiguous buffer
    (bytes, bytearray, memoryview, numpy array). ``seed`` is taken modulo 2**64.
    """
    seed &= _M64
    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise ValueError("xxh64: tensor must be contiguous (its raw bytes are hashed)")
        t = data.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if HAVE_EXT:
            return _C.xxh64(t.data_ptr(), t.numel() * t.element_size(), seed)
        _warn_fallback()
        return xxh64_py(t.reshape(-1).view(torch.uint8).numpy(), seed)
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("xxh64: buffer must be C-contiguous")
    mv = mv.cast("B")
    if HAVE_EXT:
        arr = np.frombuffer(mv, dtype=np.uint8)  # zero-copy; exposes the address
        return _C.xxh64(arr.ctypes.data if arr.size else 0, arr.size, seed)
    _warn_fallback()
    return xxh64_py(mv, seed)


def xxh3(data) -> int:
    """XXH3-64 (seed 0, default secret) of the raw bytes of ``data`` (a contiguous CPU tensor
    or anything exposing a C-contiguous buffer), as an unsigned int."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError("xxh3: tensor must be contiguous and in host memory")
        data = data.reshape(-1).view(torch.uint8).numpy()
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("xxh3: buffer must be C-contiguous")
    return xxh3_parts([mv.cast("B")])


def xxh3_parts(parts) -> int:
    """XXH3-64 (seed 0) of bytes-like parts concatenated, without joining them."""
    if HAVE_EXT:
        return _C.xxh3_parts(list(parts))
    _warn_fallback()
    return xxh3_py(b"".join(bytes(memoryview(p).cast("B")) for p in parts))


def zero_spans(buf: torch.Tensor, offsets, nbytes) -> None:
    """Zero the spans (offsets[i], nbytes[i]) of the uint8 CPU tensor `buf`."""
    offsets, nbytes = _spans(buf, offsets, nbytes, 1, "zero_spans")
    if HAVE_EXT:
        _C.zero_spans(buf.data_ptr(), buf.numel(), offsets, nbytes)
        return
    for o, n in zip(offsets.tolist(), nbytes.tolist()):
        buf[o:o + n].zero_()


def _spans(buf: torch.Tensor, offsets, nbytes, block: int, who: str):
    """The spans as int64 arrays; the extension checks them itself, the fallbacks here."""
    if buf.device.type != "cpu" or buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"{who}: the buffer must be a contiguous 1-D uint8 CPU tensor")
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    nbytes = np.ascontiguousarray(nbytes, dtype=np.int64)
    if not HAVE_EXT and (block <= 0 or (offsets < 0).any() or (nbytes < 0).any()
                         or (offsets + nbytes > buf.numel()).any()):
        raise ValueError(f"{who}: bad block size or a span outside the buffer")
    return offsets, nbytes


def _blocks_py(buf: torch.Tensor, offsets, nbytes, block: int) -> bytes:
    """Fallback: the block digests, one Python/numpy XXH3 per block."""
    mv = memoryview(buf.numpy())
    stream = b"".join(mv[o:o + n] for o, n in zip(offsets.tolist(), nbytes.tolist()))
    return b"".join(struct.pack("<Q", xxh3_py(stream[i:i + block]))
                    for i in range(0, len(stream), block))


def hash_blocks(buf: torch.Tensor, offsets, nbytes, block: int) -> bytes:
    """Block digests of the stream formed by spans (offsets[i], nbytes[i]) of the uint8 CPU
    tensor `buf`, in order: for each `block`-byte block of the stream (the last may be shorter)
    its XXH3-64 (seed 0), as little-endian u64 bytes. Independent of the thread count."""
    offsets, nbytes = _spans(buf, offsets, nbytes, block, "hash_blocks")
    if HAVE_EXT:
        return _C.hash_blocks(buf.data_ptr(), buf.numel(), offsets, nbytes, block)
    _warn_fallback()
    return _blocks_py(buf, offsets, nbytes, block)


def read_blocks_hashed(f, file_offset: int, buf: torch.Tensor, offsets, nbytes,
                       block: int) -> bytes | None:
    """Read the stream from the binary file `f` (a file object or descriptor) at byte
    `file_offset` (positioned reads: the file position is untouched) into the spans of `buf`;
    return ``hash_blocks`` of them, or None when the file ends first. Each block is hashed
    right after it is read."""
    offsets, nbytes = _spans(buf, offsets, nbytes, block, "read_blocks_hashed")
    fd = f if isinstance(f, int) else f.fileno()
    if HAVE_EXT:
        return _C.read_blocks_hashed(fd, file_offset, buf.data_ptr(), buf.numel(),
                                     offsets, nbytes, block)
    _warn_fallback()
    mv, pos = memoryview(buf.numpy()), file_offset
    for o, n in zip(offsets.tolist(), nbytes.tolist()):
        got = os.preadv(fd, [mv[o:o + n]], pos) if n else 0
        while got < n:
            more = os.preadv(fd, [mv[o + got:o + n]], pos + got)
            if not more:
                return None
            got += more
        pos += n
    return _blocks_py(buf, offsets, nbytes, block)


def load_known_table(fd: int, keys, fixed, base: int, size: int, offsets, nbytes, gap_offsets,
                     gap_nbytes, block: int):
    """A capsule file read into the host buffer [base, base + size) in one native call (header,
    metadata, payload with its block checksums, file checksum) when its metadata has exactly
    `keys` and the (key, value) pairs `fixed`, among them the "entries" table the payload spans
    (int64 arrays offsets, nbytes: buffer offsets in file order) and the gap spans were derived
    from. Returns (status, metadata):

    * ("loaded", md): payload in the buffer, gaps zeroed, checksum verified;
    * ("short", md) / ("mismatch", md): the payload ended early / failed the checksum; the
      buffer was written;
    * ("not_fast", None): the header is not in the form save writes, or differs from what is
      expected; nothing was written, and the caller reads the file the general way.

    None without the extension (the general reader does it all). The extension bounds every
    span by the buffer and takes int64 arrays only, so the tables go as they are: this is
    called once per load."""
    if not HAVE_EXT:
        return None
    return _C.load_known_table(fd, keys, fixed, base, size, offsets, nbytes, gap_offsets,
                               gap_nbytes, block)

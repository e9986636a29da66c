"""Python face of the native extension ``flashrt._C``.

What the runtime needs from native code:

* ``copy_segments`` / ``SegmentPlan``: copy many (src, dst) byte ranges at
  once. On CPU the extension splits the bytes over threads with the GIL
  released (torch's own OpenMP threads when it shares torch's runtime); on CUDA it copies all segments with one kernel launch on the
  current stream (``flashrt._C.copy_segments_cuda``; the segment table is
  passed in the kernel parameters, up to 1024 segments per launch).
* ``xxh64``: the standard XXH64 checksum, identical with or without the
  extension (the fallback is the pure-Python ``_xxh64_py``).
* ``xxh3``: XXH3-64 (seed 0), from the vendored reference implementation
  (fallback ``_xxh3_py``).
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

# What this module calls in the extension; a build from older sources lacks some, and is
# then not used (the bench scripts attach an installed build only if it has them all).
NEEDS = ("copy_segments_cpu", "xxh64", "xxh3_parts", "xxh3_isa", "zero_spans",
         "hash_blocks", "read_blocks_hashed", "load_known_table", "openmp_runtime", "CpuCopyPlan",
         "has_cuda", "version", "small_m_linear_isa")

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

# The small-M float32 projection kernel runs here: built (x86-64), the CPU has AVX2 + FMA, and
# its threads are torch's (a second OpenMP pool would fight torch's spinning workers).
SMALL_M_LINEAR: bool = HAVE_EXT and bool(_C.small_m_linear_isa()) and COPIES_ON_TORCH_THREADS
SMALL_M_MAX = 32      # measured: 1.3-1.8x oneDNN at M = 2..32; oneDNN's blocked GEMM wins above

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
        ``dst.copy_(src, non_blocking=True)`` per segment. For CUDA <-> CPU
        this is asynchronous only when the CPU side is pinned; after a
        device-to-host copy synchronise the stream before reading dst.
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
        self.device = devices.pop() if len(devices) == 1 else None
        if self.device is None:
            self.mode = "torch" if self.pairs else "empty"
        elif self.device.type == "cpu":
            self.mode = "cpu" if HAVE_EXT else "torch"
            # The extension's parallel copy runs on torch's own OpenMP threads when it shares
            # torch's runtime: one call, one parallel region. Otherwise large copies that
            # coalesce into a few strided views run as torch copies: right after a model step
            # torch's threads are still spinning on the cores, and a second pool of copy
            # threads competes with them (measured 2-3x slower than one torch copy at 4-16 MiB
            # on 2 cores).
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
        self.src, self.dst, self.nbytes, self._keep = src, dst, nbytes, keep
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


def small_m_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ w (N, K).T as float32 (M, N) with the extension's small-M kernel (see
    csrc/linear_cpu.cpp; callers check SMALL_M_LINEAR). ValueError names a bad argument."""
    if not (HAVE_EXT and _C.small_m_linear_isa()):
        raise RuntimeError(f"small_m_linear unavailable: {ext_status()}")
    for name, t in (("x", x), ("w", w)):
        if t.dtype != torch.float32 or t.dim() != 2 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"small_m_linear: {name} must be a contiguous 2-D float32 CPU tensor, got "
                             f"{t.dtype}, shape {tuple(t.shape)}, {t.device}")
    (m, k), (n, k2) = x.shape, w.shape
    if k != k2 or m == 0 or n == 0 or k == 0:
        raise ValueError(f"small_m_linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (m, n) or not out.is_contiguous() \
            or out.device.type != "cpu":
        raise ValueError(f"small_m_linear: out must be a contiguous float32 CPU ({m}, {n}) tensor")
    _C.small_m_linear(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k)
    return out


def copy_segments(pairs: Sequence[Pair], num_threads: int | None = None) -> None:
    """Copy every (src, dst) pair of contiguous 1-D uint8 tensors; see SegmentPlan.

    Raises ValueError naming the first bad segment (dtype, shape, layout or
    length mismatch). Zero-length segments are skipped.
    """
    SegmentPlan(pairs, num_threads).run()


# --------------------------------------------------------------------------- xxh64

_M64 = 0xFFFFFFFFFFFFFFFF
_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_P5 = 0x27D4EB2F165667C5


def _xxh64_py(data, seed: int = 0) -> int:
    """Reference XXH64 (xxhash_spec.md) in pure Python: slow, but the fallback
    must produce the same checksums as the extension."""
    buf = memoryview(data).cast("B")
    n = len(buf)
    seed &= _M64

    def rnd(acc, lane):
        acc = (acc + lane * _P2) & _M64
        return (((acc << 31) | (acc >> 33)) * _P1) & _M64

    def rotl(x, r):
        return ((x << r) | (x >> (64 - r))) & _M64

    nstripes = n // 32
    words = struct.unpack_from(f"<{n // 8}Q", buf)
    if nstripes:
        v1, v2, v3, v4 = (seed + _P1 + _P2) & _M64, (seed + _P2) & _M64, seed, (seed - _P1) & _M64
        for i in range(0, nstripes * 4, 4):
            v1 = rnd(v1, words[i])
            v2 = rnd(v2, words[i + 1])
            v3 = rnd(v3, words[i + 2])
            v4 = rnd(v4, words[i + 3])
        h = (rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18)) & _M64
        for v in (v1, v2, v3, v4):
            h = ((h ^ rnd(0, v)) * _P1 + _P4) & _M64
    else:
        h = (seed + _P5) & _M64
    h = (h + n) & _M64
    pos = nstripes * 32
    for w in words[nstripes * 4:]:
        h = (rotl(h ^ rnd(0, w), 27) * _P1 + _P4) & _M64
        pos += 8
    if n - pos >= 4:
        (w,) = struct.unpack_from("<I", buf, pos)
        h = (rotl(h ^ ((w * _P1) & _M64), 23) * _P2 + _P3) & _M64
        pos += 4
    for b in buf[pos:]:
        h = (rotl(h ^ ((b * _P5) & _M64), 11) * _P1) & _M64
    h ^= h >> 33
    h = (h * _P2) & _M64
    h ^= h >> 29
    h = (h * _P3) & _M64
    return h ^ (h >> 32)


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
        return _xxh64_py(t.reshape(-1).view(torch.uint8).numpy(), seed)
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("xxh64: buffer must be C-contiguous")
    mv = mv.cast("B")
    if HAVE_EXT:
        arr = np.frombuffer(mv, dtype=np.uint8)  # zero-copy; exposes the address
        return _C.xxh64(arr.ctypes.data if arr.size else 0, arr.size, seed)
    _warn_fallback()
    return _xxh64_py(mv, seed)


# --------------------------------------------------------------------------- xxh3
# XXH3-64 with seed 0 and the default secret, the capsule file checksum. The extension runs the
# vendored reference (csrc/third_party/xxhash); this is the same algorithm for installs without
# it, in numpy for long inputs (tested against the extension at every length class).
_XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_MX1, _MX2 = 0x165667919E3779F9, 0x9FB21C651E98DF25


def _r64(b, i: int) -> int:
    return int.from_bytes(b[i:i + 8], "little")


def _fold(a: int, b: int) -> int:
    p = a * b
    return (p ^ (p >> 64)) & _M64


def _avalanche3(h: int) -> int:
    h ^= h >> 37
    h = (h * _MX1) & _M64
    return h ^ (h >> 32)


def _avalanche64(h: int) -> int:
    h ^= h >> 33
    h = (h * _P2) & _M64
    h ^= h >> 29
    h = (h * _P3) & _M64
    return h ^ (h >> 32)


def _mix16(b, i: int, k: int) -> int:
    return _fold(_r64(b, i) ^ _r64(_XXH3_SECRET, k), _r64(b, i + 8) ^ _r64(_XXH3_SECRET, k + 8))


def _xxh3_long(b: bytes, n: int) -> int:
    sec = np.frombuffer(_XXH3_SECRET, np.uint8)
    keys = np.stack([sec[8 * s: 8 * s + 64].view("<u8") for s in range(16)])   # (16 stripes, 8)
    swap = [1, 0, 3, 2, 5, 4, 7, 6]

    def stripes_sum(d, k):   # (..., stripes, 8) data and keys -> summed per lane, mod 2**64
        dk = d ^ k
        return ((dk & np.uint64(0xFFFFFFFF)) * (dk >> np.uint64(32)) + d[..., swap]).sum(axis=-2)

    acc = np.array([_P32_3, _P1, _P2, _P3, _P4, _P32_2, _P5, _P32_1], dtype=np.uint64)
    nb_blocks = (n - 1) // 1024
    if nb_blocks:      # blocks only interact through the scramble: accumulate them all at once
        d = np.frombuffer(b, "<u8", nb_blocks * 128).reshape(nb_blocks, 16, 8)
        sums = stripes_sum(d, keys)
        scramble = sec[128:192].view("<u8")
        for row in sums:
            acc += row
            acc ^= acc >> np.uint64(47)
            acc ^= scramble
            acc *= np.uint64(_P32_1)
    nb_stripes = ((n - 1) - 1024 * nb_blocks) // 64
    if nb_stripes:
        d = np.frombuffer(b, "<u8", nb_stripes * 8, 1024 * nb_blocks).reshape(nb_stripes, 8)
        acc += stripes_sum(d, keys[:nb_stripes])
    acc += stripes_sum(np.frombuffer(b, "<u8", 8, n - 64).reshape(1, 8), sec[121:185].view("<u8"))
    a = [int(x) for x in acc]
    h = (n * _P1) & _M64
    for i in range(4):
        h += _fold(a[2 * i] ^ _r64(_XXH3_SECRET, 11 + 16 * i), a[2 * i + 1] ^ _r64(_XXH3_SECRET, 19 + 16 * i))
    return _avalanche3(h & _M64)


def _xxh3_py(data) -> int:
    """XXH3-64 (seed 0, default secret) in Python/numpy: the extension's fallback."""
    b = bytes(memoryview(data).cast("B"))
    n, S = len(b), _XXH3_SECRET
    if n == 0:
        return _avalanche64(_r64(S, 56) ^ _r64(S, 64))
    if n <= 3:
        combined = (b[0] << 16) | (b[n >> 1] << 24) | b[n - 1] | (n << 8)
        return _avalanche64(combined ^ (int.from_bytes(S[0:4], "little") ^ int.from_bytes(S[4:8], "little")))
    if n <= 8:
        x = int.from_bytes(b[n - 4:n], "little") + (int.from_bytes(b[0:4], "little") << 32)
        h = x ^ (_r64(S, 8) ^ _r64(S, 16))
        h ^= ((h << 49 | h >> 15) ^ (h << 24 | h >> 40)) & _M64
        h = (h * _MX2) & _M64
        h ^= (h >> 35) + n
        h = (h * _MX2) & _M64
        return h ^ (h >> 28)
    if n <= 16:
        lo = _r64(b, 0) ^ (_r64(S, 24) ^ _r64(S, 32))
        hi = _r64(b, n - 8) ^ (_r64(S, 40) ^ _r64(S, 48))
        swapped = int.from_bytes(lo.to_bytes(8, "little"), "big")
        return _avalanche3((n + swapped + hi + _fold(lo, hi)) & _M64)
    if n <= 128:
        acc = n * _P1
        for i in range((n - 1) // 32, -1, -1):   # pairs from the middle out, as the reference
            acc += _mix16(b, 16 * i, 32 * i) + _mix16(b, n - 16 * (i + 1), 32 * i + 16)
        return _avalanche3(acc & _M64)
    if n <= 240:
        acc = n * _P1
        for i in range(8):
            acc += _mix16(b, 16 * i, 16 * i)
        acc_end = _mix16(b, n - 16, 136 - 17)
        acc = _avalanche3(acc & _M64)
        for i in range(8, n // 16):
            acc_end += _mix16(b, 16 * i, 16 * (i - 8) + 3)
        return _avalanche3((acc + acc_end) & _M64)
    return _xxh3_long(b, n)


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
    return _xxh3_py(b"".join(bytes(memoryview(p).cast("B")) for p in parts))


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
    return b"".join(struct.pack("<Q", _xxh3_py(stream[i:i + block]))
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

"""Python face of the native extension ``flashrt._C``.

Two services the runtime needs on its hot path:

* ``copy_segments`` / ``SegmentPlan``: copy many (src, dst) byte ranges at
  once. On CPU the extension splits the bytes over threads with the GIL
  released; on CUDA it copies all segments with one kernel launch on the
  current stream (``flashrt._C.copy_segments_cuda``; the segment table is
  passed in the kernel parameters, up to 1024 segments per launch).
* ``xxh64``: the standard XXH64 checksum, identical with or without the
  extension (the fallback is the pure-Python ``_xxh64_py``).
* ``hash_blocks`` / ``read_blocks_hashed``: the capsule file checksum, an
  XXH64 per fixed-size block of a byte stream given as spans of a buffer;
  blocks are hashed on all cores, and a reader hashes each block right after
  reading it, while it is still in cache (capsule load walks the payload once).

Without the extension every function still works through torch copies and
pure Python, after a single warning naming the import error.
"""
from __future__ import annotations

import functools
import os
import struct
import warnings
from typing import Sequence, Tuple

import numpy as np
import torch

try:
    from . import _C
    _IMPORT_ERROR: ImportError | None = None
except ImportError as _e:  # not built, or built for another Python/platform
    _C = None
    _IMPORT_ERROR = _e

HAVE_EXT: bool = _C is not None
HAVE_CUDA_EXT: bool = HAVE_EXT and bool(_C.has_cuda())

__all__ = ["HAVE_EXT", "HAVE_CUDA_EXT", "ext_status", "SegmentPlan", "copy_segments", "xxh64",
           "hash_blocks", "read_blocks_hashed"]

Pair = Tuple[torch.Tensor, torch.Tensor]


def ext_status() -> str:
    """One line saying which native paths are in use (for logs and bug reports)."""
    if not HAVE_EXT:
        return (f"flashrt._C unavailable ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}); "
                "using torch copies and pure-Python xxh64")
    cuda = "CUDA segmented copy" if _C.has_cuda() else "no CUDA kernel (built without CUDA)"
    return f"flashrt._C {_C.version}: CPU segmented copy, xxh64, block checksums, {cuda}"


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
      * all CPU   -> ``_C.copy_segments_cpu`` (threads split the bytes; GIL released);
        or, from 512 KiB with num_threads None/0 when the segments coalesce into at
        most 8 equally spaced runs, one torch copy per run as 2-D strided views
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
            # Large copies that coalesce into a few strided views run as torch copies, on
            # torch's own intra-op threads: right after a model step those threads are still
            # spinning on the cores, and a second pool of copy threads competes with them
            # for the cores (measured 2-3x slower than one torch copy at 4-16 MiB on 2 cores).
            if self.num_threads == 0 and sum(sizes) >= _TORCH_MIN_BYTES:
                runs = _strided_runs(self.pairs, src, dst, sizes)
                if len(runs) <= _TORCH_MAX_RUNS:
                    self.mode, self.pairs = "strided", runs
        elif self.device.type == "cuda":
            self.mode = "cuda" if HAVE_CUDA_EXT else "torch"
        else:
            self.mode = "torch"
        if self.mode == "torch" and not HAVE_EXT:
            _warn_fallback()

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    def run(self) -> None:
        if self.mode == "cpu":
            _C.copy_segments_cpu(self.src, self.dst, self.nbytes, self.num_threads)
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


def _spans(buf: torch.Tensor, offsets, nbytes, block: int, who: str):
    if buf.device.type != "cpu" or buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"{who}: the buffer must be a contiguous 1-D uint8 CPU tensor")
    return np.ascontiguousarray(offsets, dtype=np.int64), np.ascontiguousarray(nbytes, dtype=np.int64)


def _blocks_py(buf: torch.Tensor, offsets, nbytes, block: int) -> bytes:
    """Fallback: the block digests, one pure-Python XXH64 per block."""
    mv = memoryview(buf.numpy())
    stream = b"".join(mv[o:o + n] for o, n in zip(offsets.tolist(), nbytes.tolist()))
    return b"".join(struct.pack("<Q", _xxh64_py(stream[i:i + block]))
                    for i in range(0, len(stream), block))


def hash_blocks(buf: torch.Tensor, offsets, nbytes, block: int) -> bytes:
    """Block digests of the stream formed by spans (offsets[i], nbytes[i]) of the uint8 CPU
    tensor `buf`, in order: for each `block`-byte block of the stream (the last may be shorter)
    its XXH64 (seed 0), as little-endian u64 bytes. Independent of the thread count."""
    offsets, nbytes = _spans(buf, offsets, nbytes, block, "hash_blocks")
    if HAVE_EXT:
        return _C.hash_blocks(buf.data_ptr(), buf.numel(), offsets, nbytes, block)
    _warn_fallback()
    if block <= 0 or (offsets < 0).any() or (nbytes < 0).any() or (offsets + nbytes > buf.numel()).any():
        raise ValueError("hash_blocks: bad block size or a span outside the buffer")
    return _blocks_py(buf, offsets, nbytes, block)


def read_blocks_hashed(f, file_offset: int, buf: torch.Tensor, offsets, nbytes,
                       block: int) -> bytes | None:
    """Read the stream from the binary file `f` at byte `file_offset` (positioned reads: the
    file position is untouched) into the spans of `buf`; return ``hash_blocks`` of them, or
    None when the file ends first. Each block is hashed right after it is read."""
    offsets, nbytes = _spans(buf, offsets, nbytes, block, "read_blocks_hashed")
    if HAVE_EXT:
        return _C.read_blocks_hashed(f.fileno(), file_offset, buf.data_ptr(), buf.numel(),
                                     offsets, nbytes, block)
    _warn_fallback()
    if block <= 0 or (offsets < 0).any() or (nbytes < 0).any() or (offsets + nbytes > buf.numel()).any():
        raise ValueError("read_blocks_hashed: bad block size or a span outside the buffer")
    mv, pos = memoryview(buf.numpy()), file_offset
    for o, n in zip(offsets.tolist(), nbytes.tolist()):
        got = os.preadv(f.fileno(), [mv[o:o + n]], pos) if n else 0
        while got < n:
            more = os.preadv(f.fileno(), [mv[o + got:o + n]], pos + got)
            if not more:
                return None
            got += more
        pos += n
    return _blocks_py(buf, offsets, nbytes, block)

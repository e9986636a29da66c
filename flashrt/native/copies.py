"""Segmented copies: many (src, dst) byte ranges at once, on CPU threads or one CUDA kernel."""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
import torch

from . import _ext as ext

Pair = Tuple[torch.Tensor, torch.Tensor]

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
      * all CPU   -> ``ext.C.copy_segments_cpu`` (threads split the bytes; GIL released;
        one OpenMP region on torch's own threads when ``ext.COPIES_ON_TORCH_THREADS``);
        without that, from 512 KiB with num_threads None/0 when the segments coalesce
        into at most 8 equally spaced runs, one torch copy per run as 2-D strided views
        (torch's intra-op threads do it: see ``_strided_runs``).
      * all on one CUDA device -> ``ext.C.copy_segments_cuda``: one kernel on the
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
            self.mode = "cpu" if ext.HAVE_EXT else "torch"
            # Without torch's own OpenMP threads, large copies run as a few strided torch copies:
            # a second pool would fight torch's still-spinning threads (see bench/README.md).
            if self.num_threads == 0 and sum(sizes) >= _TORCH_MIN_BYTES and not (
                    ext.HAVE_EXT and ext.COPIES_ON_TORCH_THREADS):
                runs = _strided_runs(self.pairs, src, dst, sizes)
                if len(runs) <= _TORCH_MAX_RUNS:
                    self.mode, self.pairs = "strided", runs
        elif self.device.type == "cuda":
            self.mode = "cuda" if ext.HAVE_CUDA_EXT else "torch"
        else:
            self.mode = "torch"
        if self.mode == "torch" and not ext.HAVE_EXT:
            ext.warn_fallback()
        # the table goes to the extension once: run() converts no arrays
        self._cpu = ext.C.CpuCopyPlan(self.src, self.dst, self.nbytes) if self.mode == "cpu" else None

    @classmethod
    def from_table(cls, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                   device: torch.device, keep: tuple = ()) -> "SegmentPlan | None":
        """A plan over raw addresses (int64 arrays, validated by whoever made them: e.g. a
        checked plan's table moved onto another buffer of the same layout, which builds no
        views). `keep` holds the buffers behind the addresses alive. None where a plan from
        views would copy through torch (no extension; large CPU copies off torch's threads):
        build that one from views."""
        if not ext.HAVE_EXT:
            return None
        if device.type == "cpu":
            if not ext.COPIES_ON_TORCH_THREADS and int(nbytes.sum()) >= _TORCH_MIN_BYTES:
                return None
            mode = "cpu"
        elif device.type == "cuda" and ext.HAVE_CUDA_EXT:
            mode = "cuda"
        else:
            return None
        self = cls.__new__(cls)
        self.num_threads, self.pairs, self.device, self.mode = 0, [], device, mode
        self.src, self.dst, self.nbytes, self._keep, self._sync = src, dst, nbytes, keep, False
        self._cpu = ext.C.CpuCopyPlan(src, dst, nbytes) if mode == "cpu" else None
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
                ext.C.copy_segments_cuda(self.src, self.dst, self.nbytes,
                                      torch.cuda.current_stream().cuda_stream)
        elif self.mode == "strided":
            for src, dst in self.pairs:
                dst.copy_(src)
        elif self.mode == "torch":
            for src, dst in self.pairs:
                dst.copy_(src, non_blocking=True)
            if self._sync:
                torch.cuda.current_stream().synchronize()



def copy_segments(pairs: Sequence[Pair], num_threads: int | None = None) -> None:
    """Copy every (src, dst) pair of contiguous 1-D uint8 tensors; see SegmentPlan.

    Raises ValueError naming the first bad segment (dtype, shape, layout or
    length mismatch). Zero-length segments are skipped.
    """
    SegmentPlan(pairs, num_threads).run()


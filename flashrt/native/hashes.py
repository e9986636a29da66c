"""Checksums: XXH64, XXH3-64 and the capsule file's per-block XXH3 over spans of a buffer,
with pure-Python fallbacks that give the same values."""
from __future__ import annotations

import os
import struct

import numpy as np
import torch

from . import _ext as ext
from .hash_fallback import xxh3_py, xxh64_py

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
        if ext.HAVE_EXT:
            return ext.C.xxh64(t.data_ptr(), t.numel() * t.element_size(), seed)
        ext.warn_fallback()
        return xxh64_py(t.reshape(-1).view(torch.uint8).numpy(), seed)
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("xxh64: buffer must be C-contiguous")
    mv = mv.cast("B")
    if ext.HAVE_EXT:
        arr = np.frombuffer(mv, dtype=np.uint8)  # zero-copy; exposes the address
        return ext.C.xxh64(arr.ctypes.data if arr.size else 0, arr.size, seed)
    ext.warn_fallback()
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
    if ext.HAVE_EXT:
        return ext.C.xxh3_parts(list(parts))
    ext.warn_fallback()
    return xxh3_py(b"".join(bytes(memoryview(p).cast("B")) for p in parts))



def _spans(buf: torch.Tensor, offsets, nbytes, block: int, who: str):
    """The spans as int64 arrays; the extension checks them itself, the fallbacks here."""
    if buf.device.type != "cpu" or buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"{who}: the buffer must be a contiguous 1-D uint8 CPU tensor")
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    nbytes = np.ascontiguousarray(nbytes, dtype=np.int64)
    if not ext.HAVE_EXT and (block <= 0 or (offsets < 0).any() or (nbytes < 0).any()
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
    if ext.HAVE_EXT:
        return ext.C.hash_blocks(buf.data_ptr(), buf.numel(), offsets, nbytes, block)
    ext.warn_fallback()
    return _blocks_py(buf, offsets, nbytes, block)


def read_blocks_hashed(f, file_offset: int, buf: torch.Tensor, offsets, nbytes,
                       block: int) -> bytes | None:
    """Read the stream from the binary file `f` (a file object or descriptor) at byte
    `file_offset` (positioned reads: the file position is untouched) into the spans of `buf`;
    return ``hash_blocks`` of them, or None when the file ends first. Each block is hashed
    right after it is read."""
    offsets, nbytes = _spans(buf, offsets, nbytes, block, "read_blocks_hashed")
    fd = f if isinstance(f, int) else f.fileno()
    if ext.HAVE_EXT:
        return ext.C.read_blocks_hashed(fd, file_offset, buf.data_ptr(), buf.numel(),
                                     offsets, nbytes, block)
    ext.warn_fallback()
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


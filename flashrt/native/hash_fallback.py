"""XXH64 and XXH3-64 in pure Python/numpy: the same digests as the extension's vendored
xxhash, for installs without it (tested against it at every length class). Slow; correct."""
from __future__ import annotations

import struct

import numpy as np

_M64 = 0xFFFFFFFFFFFFFFFF
_P1 = 0x9E3779B185EBCA87
_P2 = 0xC2B2AE3D27D4EB4F
_P3 = 0x165667B19E3779F9
_P4 = 0x85EBCA77C2B2AE63
_P5 = 0x27D4EB2F165667C5


def xxh64_py(data, seed: int = 0) -> int:
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


def xxh3_py(data) -> int:
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

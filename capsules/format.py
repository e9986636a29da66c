"""On-disk capsule format, version 1: one safetensors file any safetensors reader can open.

    [u64 LE header length][JSON header, space-padded to a multiple of 8][entry bytes, in entry order]

The header is {"__metadata__": {...}, <buffer name>: {dtype, shape, data_offsets}, ...}; the
metadata keeps what safetensors cannot (capsule offsets, kinds, seq flags, CapsuleMeta) so load
rebuilds the exact in-memory layout. The checksum chains XXH64 over the header bytes as written
(checksum value blanked) and then every entry's bytes, so no flipped byte anywhere goes
unnoticed.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import struct

import torch

from flashrt.errors import CapsuleCorruptError, CapsuleMismatchError
from flashrt.native import read_hashed, xxh64

from .capsule import Capsule, CapsuleMeta, Entry

MAGIC, VERSION = "flashrt.capsule", "1"
_MAX_HEADER = 100_000_000   # safetensors' own limit; anything larger is a corrupt length field
_ALIGN = 64                 # capsule buffer size granularity (matches capsule.plan_entries)
_SLACK = 4096               # most padding one entry may leave before it (arena ALIGN is 256)
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64",
              "int32": "I32", "uint8": "U8", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_META_KEYS = ("format", "version", "position", "fingerprint", "provenance", "kinds", "tokens",
              "parent", "single_use", "extra", "entries", "checksum")


def _js(x) -> str:
    return json.dumps(x, separators=(",", ":"), sort_keys=True, ensure_ascii=True)


def _header(entries, meta: CapsuleMeta, tokens: list, checksum: str) -> bytes:
    """The canonical header (length prefix included), as save writes it."""
    md = {"format": MAGIC, "version": VERSION, "position": str(meta.position),
          "fingerprint": _js(meta.fingerprint), "provenance": _js(meta.provenance),
          "kinds": _js(sorted({e.kind for e in entries})), "tokens": _js(tokens),
          "parent": _js(meta.parent), "single_use": _js(meta.single_use), "extra": _js(meta.extra),
          "entries": _js([[e.name, e.kind, e.dtype, list(e.shape), e.offset, e.seq, e.row0]
                         for e in entries]),
          "checksum": checksum}
    hdr, pos = {"__metadata__": md}, 0
    for e in entries:   # file order = entry order, tiling the data region as safetensors requires
        hdr[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    b = json.dumps(hdr, separators=(",", ":"), ensure_ascii=True).encode()
    b += b" " * (-len(b) % 8)
    return struct.pack("<Q", len(b)) + b


def _blank(head: bytes, checksum: str) -> bytes:
    """The header as hashed (checksum value ""), derived from the bytes read without re-serialising:
    `"checksum":"` occurs once unescaped (inside the metadata strings quotes are escaped)."""
    body = head.rstrip(b" ").replace(f'"checksum":"{checksum}"'.encode(), b'"checksum":""', 1)
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _tokens(cap: Capsule) -> list:
    return cap.tokens if any(e.name == "meta.tokens" for e in cap.entries) else []


def _checksum(head_blank: bytes, data: torch.Tensor, entries) -> str:
    h = xxh64(head_blank, 0)
    for e in entries:
        h = xxh64(data[e.offset: e.offset + e.nbytes], h)
    return f"{h:016x}"


def _write_all(f, mv: memoryview) -> None:
    """Unbuffered writes straight from the tensor's memory (a module function so tests can fail it)."""
    while mv.nbytes:
        mv = mv[f.write(mv):]


def save_capsule(cap: Capsule, path) -> None:
    """Write `cap` to `path` atomically: a crash leaves the old file or the new one, never a mix."""
    path = os.path.abspath(os.fspath(path))
    if cap.device.type != "cpu":
        cap = cap.to("cpu")
    for e in cap.entries:
        if e.name == "__metadata__" or e.offset < 0 or e.offset + e.nbytes > cap.data.numel():
            raise ValueError(f"save_capsule: entry {e.name!r} is reserved or outside the capsule data")
    tokens = _tokens(cap)
    blank = _header(cap.entries, cap.meta, tokens, "")
    header = _header(cap.entries, cap.meta, tokens, _checksum(blank, cap.data, cap.entries))
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        # buffering=0: bytes go from the tensor to the kernel with no Python-side copy, so there
        # is nothing to flush; fsync before the rename so the rename never exposes a partial file.
        with open(tmp, "xb", buffering=0) as f:
            _write_all(f, memoryview(header))
            for e in cap.entries:
                _write_all(f, memoryview(cap.raw(e).numpy()))
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fd = os.open(folder, os.O_RDONLY)   # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_exact(f, mv: memoryview, path, what) -> None:
    while mv.nbytes:
        n = f.readinto(mv)
        if not n:
            raise CapsuleCorruptError(f"{path}: truncated while reading {what}")
        mv = mv[n:]


def _int(x, what) -> int:
    if type(x) is not int or x < 0:   # bool is an int subclass; JSON true is no offset
        raise ValueError(f"{what} is {x!r}, not a non-negative integer")
    return x


def _entry(row) -> Entry:
    name, kind, dtype, shape, offset, seq, row0 = row
    if not (isinstance(name, str) and isinstance(kind, str) and type(seq) is bool
            and isinstance(shape, list) and dtype in _ST_DTYPES):
        raise ValueError(f"bad entry {row!r}")
    return Entry(name, kind, dtype, tuple(_int(s, f"{name} shape") for s in shape),
                 _int(offset, f"{name} offset"), seq, _int(row0, f"{name} row0"))


def _parse(path, head: bytes, data_bytes: int):
    hdr = json.loads(head.decode("ascii"))
    md = hdr.get("__metadata__") if isinstance(hdr, dict) else None
    if not isinstance(md, dict):
        raise CapsuleCorruptError(f"{path}: no __metadata__ table: not a FlashRT capsule")
    if md.get("format") != MAGIC:
        raise CapsuleCorruptError(f"{path}: not a FlashRT capsule: format is {md.get('format')!r}, "
                                  f"expected {MAGIC!r}")
    if md.get("version") != VERSION:
        raise CapsuleCorruptError(f"{path}: unsupported capsule format version "
                                  f"{md.get('version')!r} (this build reads {VERSION!r})")
    if sorted(md) != sorted(_META_KEYS):
        raise CapsuleCorruptError(f"{path}: metadata keys {sorted(md)} != {sorted(_META_KEYS)}")
    entries = [_entry(r) for r in json.loads(md["entries"])]
    meta = CapsuleMeta(int(md["position"]), json.loads(md["fingerprint"]),
                       json.loads(md["provenance"]), json.loads(md["parent"]),
                       json.loads(md["single_use"]), json.loads(md["extra"]))
    tokens = json.loads(md["tokens"])
    # The safetensors table must describe exactly these entries, contiguous and in order.
    table, pos = [k for k in hdr if k != "__metadata__"], 0
    if table != [e.name for e in entries]:
        raise CapsuleCorruptError(f"{path}: tensor table {table} disagrees with the entry list")
    for e in entries:
        want = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        if hdr[e.name] != want:
            raise CapsuleCorruptError(f"{path}: tensor {e.name!r} is {hdr[e.name]}, entries say {want}")
        pos += e.nbytes
    if pos != data_bytes:
        raise CapsuleCorruptError(f"{path}: entries hold {pos} B but the file's data region is "
                                  f"{data_bytes} B (truncated or trailing bytes)")
    return entries, meta, tokens, md["checksum"]


def load_capsule(path, device="cpu", into: Capsule | None = None) -> Capsule:
    """Read a capsule file; any damage raises CapsuleCorruptError naming the file and the problem.

    into: a CPU capsule whose buffer is reused (no fresh allocation, like snapshot(into=)); it is
    returned holding the file's capsule. A file refused once its bytes started landing leaves it
    holding no capsule (no entries, an empty fingerprint), so it is never restored half-written;
    one refused earlier (header) leaves it untouched."""
    if into is not None and into.device.type != "cpu":
        raise ValueError(f"load(into=): the target capsule must be in host memory, not {into.device}")
    with open(path, "rb", buffering=0) as f:       # a missing file stays FileNotFoundError
        try:
            cap = _load(f, path, into)
        except (struct.error, ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
            # json and Unicode decode errors are ValueErrors
            raise CapsuleCorruptError(f"{path}: malformed capsule header "
                                      f"({type(e).__name__}: {e})") from e
    return cap.to(device)


def _load(f, path, into: Capsule | None = None) -> Capsule:
    size = os.fstat(f.fileno()).st_size
    pre = bytearray(8)
    _read_exact(f, memoryview(pre), path, "the header length")
    (n,) = struct.unpack("<Q", pre)
    if n > min(_MAX_HEADER, size - 8):
        raise CapsuleCorruptError(f"{path}: header length {n} exceeds the file ({size} B) or the "
                                  f"{_MAX_HEADER} B limit")
    head = bytearray(n)
    _read_exact(f, memoryview(head), path, "the header")
    entries, meta, tokens, stored = _parse(path, bytes(head), size - 8 - n)
    # The checksum covers the header's own bytes (with the checksum value blanked), so no flipped
    # byte goes unnoticed without re-serialising the header to a canonical form; the length
    # prefix is checked by the parse (entries must tile the data region exactly).
    blank = _blank(bytes(head), stored)
    # Offsets are trusted only after the checksum; bound the buffer so a damaged offset cannot
    # request a huge allocation, and refuse overlaps so no entry's bytes land on another's.
    spans = sorted((e.offset, e.offset + e.nbytes) for e in entries)
    cap_size = -(-max((b for _, b in spans), default=0) // _ALIGN) * _ALIGN
    if cap_size > size + _SLACK * (len(entries) + 1) or any(
            b0 > a1 for (_, b0), (a1, _) in zip(spans, spans[1:])):
        raise CapsuleCorruptError(f"{path}: entry offsets overlap or exceed the file's contents")
    if into is not None:
        if into.data.numel() < cap_size:
            raise CapsuleMismatchError(f"load(into=): capsule buffer holds {into.data.numel()} B, "
                                       f"{path} needs {cap_size} B")
        # emptied before any byte lands: a refused load leaves no restorable half-capsule
        into.entries, into.meta = (), CapsuleMeta(0, {}, {})
        data = into.data
    else:
        data = torch.empty(cap_size, dtype=torch.uint8)
    buf, prev = memoryview(data.numpy()), 0
    for a, b in spans + [(cap_size, cap_size)]:   # zero the alignment gaps: bytes match the snapshot
        if a > prev:
            buf[prev:a] = bytes(a - prev)
        prev = b
    # file order; each entry's bytes land directly at its capsule offset and are hashed on the
    # way in (chained: each entry's digest seeds the next, as _checksum computes it)
    h = xxh64(blank, 0)
    for e in entries:
        h = read_hashed(f, data[e.offset: e.offset + e.nbytes], h)
        if h is None:
            raise CapsuleCorruptError(f"{path}: truncated while reading entry {e.name!r}")
    if f.read(1):
        raise CapsuleCorruptError(f"{path}: trailing bytes after the last entry")
    if f"{h:016x}" != stored:
        raise CapsuleCorruptError(f"{path}: checksum mismatch (stored {stored})")
    if into is not None:
        cap = into
        cap.entries, cap.meta = entries, meta
        cap._consumed, cap.parent_capsule = False, None
        cap.generation += 1
    else:
        cap = Capsule(data, entries, meta)
    if _tokens(cap) != tokens:
        raise CapsuleCorruptError(f"{path}: token history in metadata disagrees with meta.tokens")
    return cap

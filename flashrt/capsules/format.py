"""On-disk capsule format, version 4: one safetensors file any safetensors reader can open.

    [u64 LE header length][JSON header, space-padded][entry bytes, in entry order]

The padding (a multiple of 8, under 4 KiB) puts most entry bytes at their capsule page offset
in the file, so a load copies page-cache pages onto buffer pages one to one.

The header is {"__metadata__": {...}, <buffer name>: {dtype, shape, data_offsets}, ...}; the
metadata keeps what safetensors cannot (capsule offsets, kinds, seq flags, CapsuleMeta) so load
rebuilds the exact in-memory layout.

Checksum (metadata "hash" = "xxh3/262144"): the entry bytes in file order form one stream, cut
into 256 KiB blocks; each block has its XXH3-64 (seed 0), and the checksum is the XXH3-64 of the
header as written (length prefix included) with the 16 hex digits of the checksum value read as
"0000000000000000", followed by the block digests as little-endian u64s. No flipped byte
anywhere goes unnoticed, and the blocks are independent: save hashes them on every core, and
load hashes each one right after reading it, while it is in cache.

Reading: a load(into=) of a file whose entry table the target already holds runs in one native
call (csrc/capsule_file.cpp: header, metadata, payload, checksums); every other file, and any
header not in the exact form save writes, goes through the Python reader below, which accepts
whatever json does and names what is wrong.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import struct
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from flashrt.errors import CapsuleCorruptError, CapsuleMismatchError
from flashrt.native import (hash_blocks, load_known_table, read_blocks_hashed, xxh3_parts,
                            zero_spans)

from .types import ALIGN, Capsule, CapsuleMeta, Entry, ReadOnlyDict

# version 3: one sha256-based weights digest whatever the build (2: build-dependent); version 4:
# page-aligning header padding (3 differs only in it; refused by version, not as non-canonical)
MAGIC, VERSION = "flashrt.capsule", "4"
_BLOCK = 1 << 18                            # checksum block: fits L2, 4 blocks per MiB to share out
HASH = f"xxh3/{_BLOCK}"
_MAX_HEADER = 100_000_000   # safetensors' own limit; anything larger is a corrupt length field
_SLACK = 4096               # most padding one entry may leave before it (arena ALIGN is 256)
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64",
              "int32": "I32", "uint8": "U8", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_FIRST_READ = 64 << 10     # first read: the length prefix and the header of most capsules
_IOV_MAX = 1024            # buffers per writev (Linux IOV_MAX)
_MD_PREFIX = '{"__metadata__":'   # save writes the metadata first
_DECODER = json.JSONDecoder()
_META_KEYS = ("format", "version", "hash", "position", "fingerprint", "provenance", "kinds", "tokens",
              "parent", "single_use", "extra", "entries", "checksum")
_META_KEY_SET = frozenset(_META_KEYS)
_FIXED = (("format", MAGIC), ("version", VERSION), ("hash", HASH))   # what _check requires


def _js(x) -> str:
    return json.dumps(x, separators=(",", ":"), sort_keys=True, ensure_ascii=True)


def _entry_parts(entries) -> tuple:
    """What the header says about an entry table alone: (kinds JSON, entries JSON, the
    safetensors tensor table as JSON members). Save caches it per table on the capsule."""
    dumps = functools.partial(json.dumps, separators=(",", ":"), ensure_ascii=True)
    table, pos = [], 0
    for e in entries:   # file order = entry order, tiling the data region as safetensors requires
        table.append(f',{dumps(e.name)}:' + dumps({"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape),
                                                   "data_offsets": [pos, pos + e.nbytes]}))
        pos += e.nbytes
    return (_js(sorted({e.kind for e in entries})),
            _js([[e.name, e.kind, e.dtype, list(e.shape), e.offset, e.seq, e.row0] for e in entries]),
            "".join(table))


def _header(entries, meta: CapsuleMeta, tokens: list, checksum: str, parts=None) -> bytes:
    """The canonical header (length prefix included), as save writes it: the metadata first,
    then the tensor table (the JSON of {"__metadata__": md, name: {...}, ...})."""
    kinds, table_entries, table = parts or _entry_parts(entries)
    md = {"format": MAGIC, "version": VERSION, "hash": HASH, "position": str(meta.position),
          "fingerprint": _js(meta.fingerprint), "provenance": _js(meta.provenance),
          "kinds": kinds, "tokens": _js(tokens), "parent": _js(meta.parent),
          "single_use": _js(meta.single_use), "extra": _js(meta.extra), "entries": table_entries,
          "checksum": checksum}
    b = (_MD_PREFIX + json.dumps(md, separators=(",", ":"), ensure_ascii=True) + table + "}").encode()
    b += b" " * _padding(entries, len(b))
    return struct.pack("<Q", len(b)) + b


_PAGE = 4096


def _padding(entries, n: int) -> int:
    """Spaces after an n-byte header so the data region starts at the file offset (mod a page,
    and a multiple of 8) that puts the most entry bytes at their capsule page offset."""
    by, pos = {}, 0
    for e in entries:              # entry i lands at data start + pos: aligned when start = r
        r = (e.offset - pos) % _PAGE
        if r % 8 == 0:
            by[r] = by.get(r, 0) + e.nbytes
        pos += e.nbytes
    r = max(by, key=by.get) if by else 0
    return (r - 8 - n) % _PAGE


_PLACEHOLDER = "0" * 16     # the checksum value as hashed: fixed width, so the header keeps its size


def _value_at(header, checksum: str) -> int:
    """Offset of the checksum value in the header bytes; -1 if absent. `"checksum":"` occurs once
    unescaped: inside the metadata strings every quote is escaped."""
    i = header.find(f'"checksum":"{checksum}"'.encode())
    return -1 if i < 0 else i + len('"checksum":"')


def _spans(entries):
    """(capsule offsets, byte counts) of the entries in file order, as int64 arrays."""
    return (np.fromiter((e.offset for e in entries), np.int64, len(entries)),
            np.fromiter((e.nbytes for e in entries), np.int64, len(entries)))


def _checksum(header, at: int, digests: bytes) -> str:
    """The checksum of a file whose header (length prefix included) holds its value at `at`."""
    mv = memoryview(header)
    return f"{xxh3_parts([mv[:at], _PLACEHOLDER.encode(), mv[at + 16:], digests]):016x}"


def _write_all(fd: int, views: list) -> None:
    """Unbuffered gathered writes straight from the tensor's memory (a module function so tests
    can fail it). Regular files take every byte in one call; the loop covers the rest."""
    while views:
        n = os.writev(fd, views[:_IOV_MAX])
        if n == 0:
            raise OSError(f"writev wrote nothing with {sum(v.nbytes for v in views)} B left")
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        if n:
            views = [views[0][n:]] + views[1:]


def file_size(cap: Capsule) -> int:
    """Exact size of cap's file: the header with a 16-hex-digit checksum, then entry bytes."""
    return len(_header(cap.entries, cap.meta, cap.history, _PLACEHOLDER)) + cap.nbytes


def _file_views(cap: Capsule, cached) -> list:
    """The file's bytes as [header, entry views...] (no copy of the entries)."""
    parts, (offsets, nbytes) = cached[1], cached[2]
    header = _header(cap.entries, cap.meta, cap.history, _PLACEHOLDER, parts)
    at = _value_at(header, _PLACEHOLDER)
    checksum = _checksum(header, at, hash_blocks(cap.data, offsets, nbytes, _BLOCK))
    header = header[:at] + checksum.encode() + header[at + 16:]
    mv = memoryview(cap.data.numpy())
    return [memoryview(header)] + [mv[o:o + n] for o, n in zip(offsets.tolist(), nbytes.tolist())]


def _prepared(cap: Capsule, who: str):
    """(cap on the CPU, its cached (entries, header parts, spans)), entries checked."""
    if cap.device.type != "cpu":
        cap = cap.to("cpu")
    for e in cap.entries:
        if e.name == "__metadata__" or e.offset < 0 or e.offset + e.nbytes > cap.data.numel():
            raise ValueError(f"{who}: entry {e.name!r} is reserved or outside the capsule data")
    cached = cap.plans.get(("file", "header"))
    if cached is None or cached[0] is not cap.entries:
        cached = cap.plans[("file", "header")] = (cap.entries, _entry_parts(cap.entries), _spans(cap.entries))
    return cap, cached


def to_bytes(cap: Capsule) -> bytes:
    """The exact bytes save() would write for `cap` (for stores that hold values, not files)."""
    return b"".join(_file_views(*_prepared(cap, "to_bytes")))


def from_bytes(buf, name: str = "<bytes>") -> Capsule:
    """The capsule in `buf` (bytes-like, the file format); every byte is checksummed before
    it is used, and any damage raises CapsuleCorruptError naming `name` and the problem."""
    try:
        return _from_bytes(memoryview(buf).cast("B"), name)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        raise CapsuleCorruptError(f"{name}: malformed capsule header ({type(e).__name__}: {e})") from e


def _from_bytes(mv: memoryview, name) -> Capsule:
    size = len(mv)
    if size < 8:
        raise CapsuleCorruptError(f"{name}: truncated while reading the header length")
    (n,) = struct.unpack_from("<Q", mv)
    if n > min(_MAX_HEADER, size - 8):
        raise CapsuleCorruptError(f"{name}: header length {n} exceeds the value ({size} B)")
    header = bytes(mv[:8 + n])
    table, meta, _, stored = _parse(name, header[8:], size - 8 - n)
    at = _value_at(header, stored) if type(stored) is str and len(stored) == 16 else -1
    if at < 0:
        raise CapsuleCorruptError(f"{name}: the checksum value {stored!r} is not 16 hex digits")
    if table.cap_size > size + _SLACK * (len(table.entries) + 1):
        raise CapsuleCorruptError(f"{name}: entry offsets exceed the value's contents")
    # the data region is the block stream itself: check it in place, before any byte is copied
    with warnings.catch_warnings():      # read-only bytes: src is only ever read
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(mv, dtype=torch.uint8)
    digests = hash_blocks(src, np.array([8 + n], np.int64), np.array([size - 8 - n], np.int64), _BLOCK)
    if _checksum(header, at, digests) != stored:
        raise CapsuleCorruptError(f"{name}: checksum mismatch (stored {stored})")
    data = torch.empty(table.cap_size, dtype=torch.uint8)
    zero_spans(data, table.gap_offsets, table.gap_nbytes)
    pos = 8 + n
    for o, k in zip(table.offsets.tolist(), table.nbytes.tolist()):
        data[o:o + k].copy_(src[pos:pos + k])
        pos += k
    return _filled(None, data, table, meta)


def save(cap: Capsule, path) -> None:
    """Write `cap` to `path` atomically: a crash leaves the old file or the new one, never a mix."""
    path = os.path.abspath(os.fspath(path))
    cap, cached = _prepared(cap, "save_capsule")
    views = _file_views(cap, cached)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        # O_EXCL: a fresh file; bytes go from the tensor to the kernel with no Python-side copy.
        # fsync before the rename so the rename never exposes a partial file.
        # 0600: a capsule holds a conversation; only its owner reads it
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            _write_all(fd, views)
            os.fsync(fd)
        finally:
            os.close(fd)
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


@dataclass(frozen=True)
class _Table:
    """An entry table parsed from a file header, with what load derives from it."""
    text: str                 # the metadata's "entries" JSON it was parsed from
    entries: tuple
    offsets: np.ndarray       # capsule offsets in file order
    nbytes: np.ndarray
    data_bytes: int           # sum of nbytes: the file's data region
    cap_size: int             # capsule buffer bytes (end of the last entry, aligned)
    gap_offsets: np.ndarray   # capsule byte ranges no entry covers: zeroed on load
    gap_nbytes: np.ndarray


class _Overlap(ValueError):
    """Entry offsets overlap (raised by the memoized parse, which knows no path)."""


def _table(path, text: str, known: "_Table | None") -> _Table:
    if known is not None and known.text == text:
        return known          # same table as the last file loaded into this capsule
    try:
        return _parse_table(text)
    except _Overlap:
        raise CapsuleCorruptError(f"{path}: entry offsets overlap") from None


# A pure function of the entries text, memoized: a process loading capsules of one model sees
# a few tables (one per position), and parsing ~60 entries costs ~0.8 ms, more than reading
# a 1 MiB payload. The result is immutable (frozen entries, read-only arrays).
@functools.lru_cache(maxsize=64)
def _parse_table(text: str) -> _Table:
    entries = tuple(_entry(r) for r in json.loads(text))
    offsets, nbytes = _spans(entries)
    spans = sorted(zip(offsets.tolist(), nbytes.tolist()))
    # Offsets are trusted only after the checksum; refuse overlaps so no entry's bytes land on
    # another's (the buffer is bounded against the file size by the caller).
    if any(a0 + n0 > a1 for (a0, n0), (a1, _) in zip(spans, spans[1:])):
        raise _Overlap("entry offsets overlap")
    cap_size = -(-max((a + n for a, n in spans), default=0) // ALIGN) * ALIGN
    gaps, prev = [], 0
    for a, n in spans + [(cap_size, 0)]:
        if a > prev:
            gaps.append((prev, a))
        prev = max(prev, a + n)
    arrays = (offsets, nbytes, np.array([a for a, _ in gaps], np.int64),
              np.array([b - a for a, b in gaps], np.int64))
    for arr in arrays:
        arr.flags.writeable = False
    return _Table(text, entries, arrays[0], arrays[1], int(nbytes.sum()), cap_size, *arrays[2:])


def _check(path, md) -> None:
    """The metadata's format, version, keys and checksum scheme are the ones this build reads."""
    if md.get("format") != MAGIC:
        raise CapsuleCorruptError(f"{path}: not a FlashRT capsule: format is {md.get('format')!r}, "
                                  f"expected {MAGIC!r}")
    if md.get("version") != VERSION:
        raise CapsuleCorruptError(f"{path}: unsupported capsule format version "
                                  f"{md.get('version')!r} (this build reads {VERSION!r})")
    if md.keys() != _META_KEY_SET:
        raise CapsuleCorruptError(f"{path}: metadata keys {sorted(md)} != {sorted(_META_KEYS)}")
    if md["hash"] != HASH:
        raise CapsuleCorruptError(f"{path}: unsupported checksum scheme {md['hash']!r} "
                                  f"(this build reads {HASH!r})")


def _json(s: str):
    """json.loads for what save wrote (compact, no surrounding space), minus its wrapper's
    whitespace regexes: five per load."""
    obj, end = _DECODER.raw_decode(s)
    if end != len(s):
        raise ValueError(f"extra data after JSON value at {end}")
    return obj


def _meta(md) -> CapsuleMeta:
    fingerprint = ReadOnlyDict(_json(md["fingerprint"]))     # as a snapshot's: not edited in place
    return CapsuleMeta(int(md["position"]), fingerprint, _json(md["provenance"]),
                       _json(md["parent"]), _json(md["single_use"]), _json(md["extra"]))


def _parse(path, head: bytes, data_bytes: int, known: _Table | None = None):
    """(table, meta, tokens JSON, stored checksum) from a header. Only the metadata is parsed: the
    safetensors tensor table after it restates the entries for other readers, and is covered
    by the checksum like every other header byte."""
    text = head.decode("ascii")
    if not text.startswith(_MD_PREFIX):
        raise CapsuleCorruptError(f"{path}: no leading __metadata__ table: not a FlashRT capsule")
    md, _ = _DECODER.raw_decode(text, len(_MD_PREFIX))
    if not isinstance(md, dict):
        raise CapsuleCorruptError(f"{path}: __metadata__ is not a table: not a FlashRT capsule")
    _check(path, md)
    table = _table(path, md["entries"], known)
    if table.data_bytes != data_bytes:
        raise CapsuleCorruptError(f"{path}: entries hold {table.data_bytes} B but the file's data "
                                  f"region is {data_bytes} B (truncated or trailing bytes)")
    return table, _meta(md), md["tokens"], md["checksum"]


def load(path, device="cpu", into: Capsule | None = None, follow_symlinks: bool = True) -> Capsule:
    """Read a capsule file; any damage raises CapsuleCorruptError naming the file and the problem.

    follow_symlinks=False: a symbolic link at `path` is refused (OSError, ELOOP): a store's
    directory holds only the files it wrote.

    into: a CPU capsule whose buffer is reused (no fresh allocation, like snapshot(into=)); it is
    returned holding the file's capsule. A file refused once its bytes started landing leaves it
    holding no capsule (no entries, an empty fingerprint), so it is never restored half-written;
    one refused earlier (header) leaves it untouched."""
    if into is not None and not into.data.is_cpu:
        raise ValueError(f"load(into=): the target capsule must be in host memory, not {into.device}")
    flags = _O_READ if follow_symlinks else _O_READ | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)   # missing: FileNotFoundError
    try:
        cap = _load(fd, path, into)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        # json and Unicode decode errors are ValueErrors
        raise CapsuleCorruptError(f"{path}: malformed capsule header "
                                  f"({type(e).__name__}: {e})") from e
    finally:
        os.close(fd)
    return cap if device == "cpu" else cap.to(device)


def _load(fd: int, path, into: Capsule | None = None) -> Capsule:
    known = into.plans.get(("file", "table")) if into is not None else None
    if known is not None:
        cap = _load_known(fd, path, into, known)
        if cap is not None:
            return cap
    size = os.fstat(fd).st_size
    first = os.pread(fd, _FIRST_READ, 0)      # the length prefix and, usually, the whole header
    if len(first) < 8:
        raise CapsuleCorruptError(f"{path}: truncated while reading the header length")
    (n,) = struct.unpack_from("<Q", first)
    if n > min(_MAX_HEADER, size - 8):
        raise CapsuleCorruptError(f"{path}: header length {n} exceeds the file ({size} B) or the "
                                  f"{_MAX_HEADER} B limit")
    head = first[8:8 + n]
    while len(head) < n:
        more = os.pread(fd, n - len(head), 8 + len(head))
        if not more:
            raise CapsuleCorruptError(f"{path}: truncated while reading the header")
        head += more
    table, meta, _, stored = _parse(path, head, size - 8 - n, known)
    header = first[:8 + n] if len(first) >= 8 + n else first[:8] + head
    at = _value_at(header, stored) if type(stored) is str and len(stored) == 16 else -1
    if at < 0:
        raise CapsuleCorruptError(f"{path}: the checksum value {stored!r} is not 16 hex digits")
    # bound the buffer so a damaged offset cannot request a huge allocation
    if table.cap_size > size + _SLACK * (len(table.entries) + 1):
        raise CapsuleCorruptError(f"{path}: entry offsets exceed the file's contents")
    if into is not None:
        if into.data.numel() < table.cap_size:
            raise CapsuleMismatchError(f"load(into=): capsule buffer holds {into.data.numel()} B, "
                                       f"{path} needs {table.cap_size} B")
        # emptied before any byte lands: a refused load leaves no restorable half-capsule
        into.emptied()
        data = into.data
    else:
        data = torch.empty(table.cap_size, dtype=torch.uint8)
    zero_spans(data, table.gap_offsets, table.gap_nbytes)   # alignment gaps: bytes match the snapshot
    # each entry's bytes land directly at its capsule offset; blocks are hashed as they arrive
    digests = read_blocks_hashed(fd, 8 + n, data, table.offsets, table.nbytes, _BLOCK)
    if digests is None:
        raise CapsuleCorruptError(f"{path}: truncated while reading the entries")
    if _checksum(header, at, digests) != stored:
        raise CapsuleCorruptError(f"{path}: checksum mismatch (stored {stored})")
    return _filled(into, data, table, meta)


def _filled(into: Capsule | None, data, table: _Table, meta: CapsuleMeta) -> Capsule:
    if into is None:
        cap = Capsule(data, table.entries, meta)
    else:
        cap = into
        cap.refill(table.entries, meta)
    cap.plans[("file", "table")] = table
    return cap


def _load_known(fd: int, path, into: Capsule, table: _Table) -> Capsule | None:
    """A file with the table `into` last loaded (a session reloading its capsules), in one
    native call: at 1-4 MiB the per-file Python work cost as much as reading the bytes. None:
    the file is for the general reader (no extension, a header not as save writes it, another
    table or format); `into` is then as before."""
    span = into.plans.get(("file", "span"))
    if span is None:      # the buffer never moves: checked and kept once
        d = into.data
        if d.dtype != torch.uint8 or d.dim() != 1 or not d.is_contiguous():
            raise ValueError("load(into=): the capsule buffer is not a contiguous 1-D uint8 tensor")
        span = into.plans[("file", "span")] = (d.data_ptr(), d.numel())
    saved = into.entries, into.meta
    into.emptied()                         # before any byte lands
    res = load_known_table(fd, _META_KEYS, (*_FIXED, ("entries", table.text)), *span,
                           table.offsets, table.nbytes, table.gap_offsets, table.gap_nbytes, _BLOCK)
    if res is None or res[0] == "not_fast":
        into.entries, into.meta = saved
        return None
    status, md = res
    if status == "short":
        raise CapsuleCorruptError(f"{path}: truncated while reading the entries")
    if status == "mismatch":
        raise CapsuleCorruptError(f"{path}: checksum mismatch (stored {md['checksum']})")
    return _filled(into, into.data, table, _meta(md))


def read_header(path):
    """(entries, meta, tokens, file size) of a capsule file, checking its header only."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        pre = f.read(8)
        if len(pre) < 8:
            raise CapsuleCorruptError(f"{path}: truncated while reading the header length")
        (n,) = struct.unpack("<Q", pre)
        if n > min(_MAX_HEADER, size - 8):
            raise CapsuleCorruptError(f"{path}: header length {n} exceeds the file ({size} B)")
        head = f.read(n)
    if len(head) < n:
        raise CapsuleCorruptError(f"{path}: truncated while reading the header")
    try:
        table, meta, tokens, stored = _parse(path, head, size - 8 - n)
        entries, tokens = list(table.entries), json.loads(tokens)
        canonical = _header(entries, meta, tokens, stored) == pre + head
    except (struct.error, ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
        raise CapsuleCorruptError(f"{path}: malformed capsule header ({type(e).__name__}: {e})") from e
    if not canonical:
        raise CapsuleCorruptError(f"{path}: header is not in canonical form (damaged)")
    return entries, meta, tokens, size

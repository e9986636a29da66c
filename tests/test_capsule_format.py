"""Capsule files (flashrt/capsules/format.py): round trip, safetensors compatibility, damage detection,
atomic replacement. Capsules are built by hand so no model is needed (one test uses qwen3 tiny)."""
import json
import os
import random
import struct

import pytest
import safetensors
import safetensors.torch
import torch

import flashrt
import flashrt.capsules.format as fmt
import flashrt.native as fmt_native
from flashrt.core.arena import CAPSULE_KINDS
from flashrt.capsules.types import Capsule, CapsuleMeta, Entry, dtype_from_name
from flashrt.errors import CapsuleCorruptError, CapsuleMismatchError


def make_capsule(position=5, seed=0, single_use=False, parent=None) -> Capsule:
    """Odd sizes and a gap in the fixed block, so file offsets and capsule offsets differ and
    some file offsets are unaligned for their dtype."""
    g = torch.Generator().manual_seed(seed)
    specs = [("sampler.rng", "rng", "int64", (2,), False),
             ("state.flag", "meta", "uint8", (7,), False),                # 7 B: misaligns what follows
             ("meta.logits", "meta", "float32", (13,), False),
             ("meta.tokens", "meta", "int64", (position,), True),
             ("layers.0.attn.k", "kv", "bfloat16", (position, 3, 5), True),
             ("layers.0.conv", "conv", "float16", (position, 3), True),
             ("layers.1.rec", "recurrent", "int32", (3,), False)]
    entries, off = [], 0
    for i, (name, kind, dt, shape, seq) in enumerate(specs):
        e = Entry(name, kind, dt, shape, off, seq)
        entries.append(e)
        off = (off + e.nbytes + (255 if i < 2 else 63)) // 64 * 64   # arena-like padding
    data = torch.zeros(off, dtype=torch.uint8)     # exact size, as snapshot allocates
    cap = Capsule(data, entries, CapsuleMeta(
        position, {"model_type": "fake", "config": "c" * 16, "weights": "w" * 16, "dtype": "float32",
                   "layout": "l" * 16}, {"device": "cpu", "threads": 2, "note": "ünïcode"},
        parent=parent, single_use=single_use, extra={"k": [1, 2.5, None], "history": "meta.tokens"}))
    for e in entries:
        v = cap.view(e.name)
        if e.name == "meta.tokens":
            v.copy_(torch.arange(100, 100 + position))
        elif v.dtype.is_floating_point:
            v.copy_(torch.randn(v.shape, generator=g))
        else:
            cap.raw(e).copy_(torch.randint(0, 256, (e.nbytes,), generator=g, dtype=torch.uint8))
    return cap


def assert_same(a: Capsule, b: Capsule):
    assert a.entries == b.entries
    assert a.meta == b.meta
    for e in a.entries:
        assert torch.equal(a.raw(e), b.raw(e)), e.name


@pytest.fixture
def saved(tmp_path):
    cap = make_capsule()
    path = tmp_path / "c.capsule"
    flashrt.save_capsule(cap, path)
    return cap, path


def test_round_trip(saved):
    cap, path = saved
    back = flashrt.load_capsule(path)
    assert_same(cap, back)
    assert torch.equal(cap.data, back.data)     # gaps are zero in both
    assert back.history == list(range(100, 105))
    assert back.device.type == "cpu"


@pytest.mark.parametrize("position", [0, 1, 37])
def test_round_trip_positions_and_meta(tmp_path, position):
    cap = make_capsule(position, seed=position, single_use=True, parent="abc")
    flashrt.save_capsule(cap, tmp_path / "c")
    back = fmt.load(tmp_path / "c")
    assert_same(cap, back)
    assert back.meta.single_use and back.meta.parent == "abc"


def test_readable_by_safetensors(saved):
    cap, path = saved
    with safetensors.safe_open(str(path), "pt") as f:
        assert list(f.keys()) == sorted(e.name for e in cap.entries)
        md = f.metadata()
        for e in cap.entries:
            t = f.get_tensor(e.name)
            assert t.dtype == dtype_from_name(e.dtype) and tuple(t.shape) == e.shape
    assert md["format"] == "flashrt.capsule" and md["version"] == fmt.VERSION == "4"
    assert md["hash"] == "xxh3/262144"
    assert md["tokens"] == "[100,101,102,103,104]"
    loaded = safetensors.torch.load_file(str(path))
    assert set(loaded) == {e.name for e in cap.entries}
    for name, t in loaded.items():
        assert t.dtype == cap.view(name).dtype and torch.equal(t, cap.view(name)), name


def test_header_is_padded_and_entries_contiguous(saved):
    cap, path = saved
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8 + n - 1:8 + n] in (b" ", b"}")
    assert len(raw) == 8 + n + cap.nbytes
    assert raw[8 + n:] == b"".join(cap.raw(e).numpy().tobytes() for e in cap.entries)

    def aligned(start):   # entry bytes at their capsule page offset when the data starts there
        pos, out = start, 0
        for e in cap.entries:
            out += e.nbytes if pos % 4096 == e.offset % 4096 else 0
            pos += e.nbytes
        return out
    assert aligned(8 + n) == max(aligned(s) for s in range(0, 4096, 8)) > 0


def _expect_corrupt(path, data: bytes, *, match=None):
    path.write_bytes(data)
    with pytest.raises(CapsuleCorruptError, match=match):
        fmt.load(path)


def test_every_flipped_byte_is_detected(saved, tmp_path):
    cap, path = saved
    raw = path.read_bytes()
    hlen = 8 + struct.unpack("<Q", raw[:8])[0]
    rng = random.Random(1)
    bad = tmp_path / "bad"
    bad.write_bytes(raw)
    fd = os.open(bad, os.O_RDWR)      # patch one byte in place: rewriting the file is ~50x slower
    positions = [(i, 0xFF) for i in range(hlen)]                      # every header byte, inverted
    positions += [(i, 1 << rng.randrange(8)) for i in range(hlen)]    # and with one bit flipped
    positions += [(rng.randrange(hlen, len(raw)), rng.randrange(1, 256)) for _ in range(200)]
    try:
        for i, mask in positions:
            os.pwrite(fd, bytes([raw[i] ^ mask]), i)
            try:
                fmt.load(bad)
            except CapsuleCorruptError:
                pass
            except Exception as e:    # noqa: BLE001 - the point is naming the wrong type
                pytest.fail(f"byte {i} ^ {mask:#x}: {type(e).__name__}: {e}")
            else:
                pytest.fail(f"byte {i} ^ {mask:#x}: loaded without error")
            os.pwrite(fd, raw[i:i + 1], i)
    finally:
        os.close(fd)
    assert_same(cap, fmt.load(bad))    # the restored file is intact again


def test_truncation(saved, tmp_path):
    cap, path = saved
    raw = path.read_bytes()
    hlen = 8 + struct.unpack("<Q", raw[:8])[0]
    bad = tmp_path / "bad"
    for n in sorted({0, 1, 4, 7, 8, 9, hlen // 2, hlen - 1, hlen, hlen + 1,
                     (hlen + len(raw)) // 2, len(raw) - 1}):
        _expect_corrupt(bad, raw[:n], match="bad")


def test_appended_garbage(saved, tmp_path):
    cap, path = saved
    raw = path.read_bytes()
    for tail in (b"\0", b"x" * 8, raw):
        _expect_corrupt(tmp_path / "bad", raw + tail, match="trailing|data region")


def test_wrong_magic_and_version(tmp_path, monkeypatch):
    cap = make_capsule()
    with monkeypatch.context() as m:          # a consistent file that differs only in these fields
        m.setattr(fmt, "MAGIC", "someone.else")
        flashrt.save_capsule(cap, tmp_path / "magic")
    for v in ("1", "2", "3"):   # 2: build-dependent weight digests; 3: other header padding
        with monkeypatch.context() as m:
            m.setattr(fmt, "VERSION", v)
            flashrt.save_capsule(cap, tmp_path / f"version{v}")
    with monkeypatch.context() as m:
        m.setattr(fmt, "HASH", "xxh64/65536")
        flashrt.save_capsule(cap, tmp_path / "hash")
    with pytest.raises(CapsuleCorruptError, match="not a FlashRT capsule.*someone.else"):
        fmt.load(tmp_path / "magic")
    for v in ("1", "2", "3"):
        with pytest.raises(CapsuleCorruptError, match=f"version '{v}' \\(this build reads '4'\\)"):
            fmt.load(tmp_path / f"version{v}")
    with pytest.raises(CapsuleCorruptError, match="checksum scheme 'xxh64/65536'"):
        fmt.load(tmp_path / "hash")


def test_plain_safetensors_and_missing_file(tmp_path):
    safetensors.torch.save_file({"x": torch.ones(3)}, str(tmp_path / "plain"))
    with pytest.raises(CapsuleCorruptError, match="not a FlashRT capsule"):
        fmt.load(tmp_path / "plain")
    with pytest.raises(FileNotFoundError):
        fmt.load(tmp_path / "nope")


def test_atomic_save_failure_keeps_old_file(saved, monkeypatch):
    cap, path = saved
    before = path.read_bytes()
    real = fmt._write_all

    def failing(fd, views):      # the header and 1000 B go through, then the disk fills up
        os.write(fd, b"".join(bytes(v) for v in views)[:1000])
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(fmt, "_write_all", failing)
    with pytest.raises(OSError, match="simulated"):
        flashrt.save_capsule(make_capsule(position=9, seed=3), path)
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == [path.name]       # no temp file left behind
    assert_same(cap, fmt.load(path))
    monkeypatch.setattr(fmt, "_write_all", real)
    new = make_capsule(position=9, seed=3)
    flashrt.save_capsule(new, path)                                       # and a good save replaces it
    assert_same(new, fmt.load(path))
    assert os.listdir(path.parent) == [path.name]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_capsule(tmp_path):
    cap = make_capsule().to("cuda")
    flashrt.save_capsule(cap, tmp_path / "c")
    back = fmt.load(tmp_path / "c", device="cuda")
    assert back.device.type == "cuda"
    assert_same(cap.to("cpu"), back.to("cpu"))


def _capsule_state(rt):
    """Arena bytes a restore decides: the fixed range (padding included) and live KV rows."""
    a = rt.arena
    parts = [a.data[a.fixed_begin:a.fixed_end]]
    parts += [a.bytes_of(s.name, rt.position) for s in a.slots
              if s.spec.kind in CAPSULE_KINDS and s.spec.seq_dim is not None]
    return torch.cat(parts).clone()


def test_real_runtime_save_load_restore(runtime, tmp_path):
    rt = runtime("qwen3")
    rt.prefill([3, 1, 4, 1, 5, 9, 2, 6])
    cap = rt.snapshot()
    flashrt.save_capsule(cap, tmp_path / "rt.capsule")
    rt.generate(max_new_tokens=4)
    rt.restore(cap)
    want = _capsule_state(rt)
    want_next = rt.generate(max_new_tokens=4)
    loaded = flashrt.load_capsule(tmp_path / "rt.capsule")
    assert_same(cap, loaded)
    rt.restore(loaded)
    assert torch.equal(_capsule_state(rt), want)
    assert rt.generate(max_new_tokens=4) == want_next


def test_load_into_preallocated(saved, tmp_path):
    """load(into=) reuses the buffer and equals a fresh load; a refused load leaves the target
    holding no capsule, never a half-written one."""
    cap, path = saved
    target = Capsule(torch.full((cap.data.numel() + 256,), 7, dtype=torch.uint8), [],
                     CapsuleMeta(0, {}, {}))
    ptr = target.data.data_ptr()
    got = flashrt.load_capsule(path, into=target)
    assert got is target and target.data.data_ptr() == ptr
    assert_same(cap, target)
    assert torch.equal(target.data[: cap.data.numel()], cap.data)    # gaps zeroed as well
    small = Capsule(torch.empty(cap.data.numel() // 2, dtype=torch.uint8), [], CapsuleMeta(0, {}, {}))
    with pytest.raises(fmt.CapsuleMismatchError, match="needs"):
        flashrt.load_capsule(path, into=small)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40                                                  # payload damage
    bad = tmp_path / "bad.capsule"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CapsuleCorruptError, match="checksum"):
        flashrt.load_capsule(bad, into=target)
    assert target.entries == () and target.meta.fingerprint == {}
    with pytest.raises(CapsuleCorruptError, match="truncated"):
        (tmp_path / "short.capsule").write_bytes(path.read_bytes()[:-9])
        flashrt.load_capsule(tmp_path / "short.capsule", into=target)
    assert flashrt.load_capsule(path, into=target) is target                 # reusable after a refusal
    assert_same(cap, target)
    # one target, files with other tables and with the same table in turn: the table parsed
    # for the previous file is reused only when the file's is the same
    other, same_table = make_capsule(position=3, seed=5), make_capsule(seed=9)
    flashrt.save_capsule(other, tmp_path / "other.capsule")
    flashrt.save_capsule(same_table, tmp_path / "same.capsule")
    for want, p in [(other, "other"), (cap, "c"), (same_table, "same"), (other, "other")]:
        got = flashrt.load_capsule(tmp_path / f"{p}.capsule", into=target)
        assert_same(want, got)
        assert got.nbytes == want.nbytes and got.kinds == want.kinds


def test_real_runtime_load_into(runtime, ckpt, tmp_path):
    rt = runtime("qwen3")
    rt.prefill([3, 1, 4, 1, 5, 9, 2, 6])
    cap = rt.snapshot()
    flashrt.save_capsule(cap, tmp_path / "rt.capsule")
    want = rt.generate(max_new_tokens=4)
    target = rt.empty_capsule()
    rt.restore(flashrt.load_capsule(tmp_path / "rt.capsule", into=target))
    assert rt.generate(max_new_tokens=4) == want
    # a refused load empties the target; the session can still snapshot into it
    raw = (tmp_path / "rt.capsule").read_bytes()
    (tmp_path / "bad.capsule").write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(CapsuleCorruptError):
        flashrt.load_capsule(tmp_path / "bad.capsule", into=target)
    assert not target.entries
    assert rt.snapshot(into=target) is target and target.position == rt.position
    other = flashrt.load(ckpt("qwen3", seed=1), dtype="float32", max_seq_len=64)   # other weights
    with pytest.raises(CapsuleMismatchError, match="another model"):
        other.snapshot(into=target)                # holds qwen3 state now: refused elsewhere


def test_save_after_snapshot_into_at_another_position(runtime, tmp_path):
    """save caches the header parts of a capsule's entry table: a capsule rewritten in place at
    another position must not be saved with the previous table."""
    rt = runtime("qwen3")
    target = rt.empty_capsule()
    rt.prefill([3, 1, 4, 1, 5, 9, 2, 6])
    flashrt.save_capsule(rt.snapshot(into=target), tmp_path / "a.capsule")
    first = flashrt.load_capsule(tmp_path / "a.capsule")
    rt.prefill([5, 3, 5])
    fresh = rt.snapshot()
    flashrt.save_capsule(rt.snapshot(into=target), tmp_path / "b.capsule")
    loaded = flashrt.load_capsule(tmp_path / "b.capsule")
    assert_same(target, loaded)
    assert loaded.entries == fresh.entries and torch.equal(_capsule_state_of(fresh), _capsule_state_of(loaded))
    assert first.position == 8 and fresh.position == 11


def _capsule_state_of(cap):
    return torch.cat([cap.raw(e) for e in cap.entries])


# ---- load(into=) of a file with the target's table: one native call ------------------------------
needs_ext = pytest.mark.skipif(not fmt_native.HAVE_EXT, reason="the one-call load is native only")


@pytest.fixture
def fast_statuses(monkeypatch):
    """Statuses the native one-call load returned, in order."""
    seen, real = [], fmt.load_known_table

    def spy(*a):
        r = real(*a)
        seen.append(None if r is None else r[0])
        return r
    monkeypatch.setattr(fmt, "load_known_table", spy)
    return seen


def ascii_capsule(position=5, seed=0, extra=None) -> Capsule:
    """make_capsule with metadata the native reader takes (no \\u escapes in the header)."""
    cap = make_capsule(position, seed)
    cap.meta = CapsuleMeta(position, dict(cap.meta.fingerprint), {"device": "cpu", "threads": 2},
                           extra=extra if extra is not None else {"k": [1, 2.5, None], "history": "meta.tokens"})
    return cap


def _target(cap) -> Capsule:
    return Capsule(torch.full((cap.data.numel() + 512,), 7, dtype=torch.uint8), [], CapsuleMeta(0, {}, {}))


def _holding_target(tmp_path):
    """(capsule, its file, a target that loaded the file once and so holds its table)."""
    cap = ascii_capsule()
    path = tmp_path / "c.capsule"
    flashrt.save_capsule(cap, path)
    target = _target(cap)
    flashrt.load_capsule(path, into=target)
    return cap, path, target


@needs_ext
def test_load_into_same_table_takes_the_native_path(tmp_path, fast_statuses):
    """The second load into a target goes through the native reader and gives what the general
    reader gives, escapes in the metadata included; a header in a form save never writes goes
    back to the general reader."""
    tricky = {"s": 'quote " backslash \\ slash / \n\t\r\b\f \x01 end', "k": [1, 2.5, None]}
    caps = [ascii_capsule(), ascii_capsule(seed=3, extra=tricky), ascii_capsule(seed=4)]
    for i, c in enumerate(caps):
        flashrt.save_capsule(c, tmp_path / f"{i}.capsule")
    target = _target(caps[0])
    for i, c in enumerate(caps):
        got = flashrt.load_capsule(tmp_path / f"{i}.capsule", into=target)
        assert got is target
        assert_same(c, got)
        assert_same(flashrt.load_capsule(tmp_path / f"{i}.capsule"), got)      # the general reader agrees
        assert torch.equal(got.data[: c.data.numel()], c.data)          # gaps zeroed
    assert fast_statuses == ["loaded", "loaded"]    # the first load parsed the table in Python
    # The same file with an escape save never writes: valid JSON, and a valid checksum, that the
    # native reader leaves to the general one
    raw = _with_header_replaced((tmp_path / "1.capsule").read_bytes(), b'"hash":"xxh3/',
                                b'"hash":"\\u0078xh3/')
    (tmp_path / "escaped.capsule").write_bytes(raw)
    assert_same(caps[1], flashrt.load_capsule(tmp_path / "escaped.capsule", into=target))
    assert fast_statuses[-1] == "not_fast"
    assert_same(caps[2], flashrt.load_capsule(tmp_path / "2.capsule", into=target))
    assert fast_statuses[-1] == "loaded"


def _with_header_replaced(raw: bytes, old: bytes, new: bytes) -> bytes:
    """A capsule file with `old` replaced by `new` in its header and the checksum recomputed."""
    n = struct.unpack("<Q", raw[:8])[0]
    body, payload = raw[8:8 + n].rstrip(b" "), raw[8 + n:]
    stored = json.loads(body)["__metadata__"]["checksum"]
    assert body.count(old) == 1
    body = body.replace(f'"checksum":"{stored}"'.encode(), b'"checksum":"' + b"0" * 16 + b'"')
    body = body.replace(old, new)
    body += b" " * (-len(body) % 8)
    header = struct.pack("<Q", len(body)) + body
    at = fmt._value_at(header, "0" * 16)
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    digests = fmt_native.hash_blocks(buf, [0], [len(payload)], fmt._BLOCK)
    return header[:at] + fmt._checksum(header, at, digests).encode() + header[at + 16:] + payload


def test_overlapping_entries_are_refused_with_a_valid_checksum(tmp_path):
    """Entry offsets come from the (checksummed) header; a file whose checksum was recomputed
    over overlapping entries is still refused, so no entry's bytes land on another's. Parsed
    tables are memoized per entries text; the memo shares, and never changes, a table."""
    cap = ascii_capsule()
    path = tmp_path / "c.cap"
    flashrt.save_capsule(cap, path)
    e0, e1 = cap.entries[0], cap.entries[1]

    def row(e, offset):   # the entry's row as it sits in the header (a JSON string in JSON)
        r = json.dumps([e.name, e.kind, e.dtype, list(e.shape), offset, e.seq, e.row0],
                       separators=(",", ":"))
        return json.dumps(r)[1:-1].encode()

    good = flashrt.load_capsule(path)
    assert flashrt.load_capsule(path).entries is good.entries               # one parsed table
    with pytest.raises(ValueError):
        good.plans[("file", "table")].offsets[0] = 1                              # shared: read-only
    path.write_bytes(_with_header_replaced(path.read_bytes(), row(e1, e1.offset), row(e1, e0.offset)))
    with pytest.raises(CapsuleCorruptError, match="c.cap: entry offsets overlap"):
        flashrt.load_capsule(path)


@needs_ext
def test_native_path_detects_every_flipped_byte(tmp_path, fast_statuses):
    """Damage anywhere is refused when the target already holds the file's table, and a refusal
    leaves it either untouched (header refused before any byte landed) or holding no capsule."""
    cap, path, target = _holding_target(tmp_path)
    raw = path.read_bytes()
    hlen = 8 + struct.unpack("<Q", raw[:8])[0]
    rng = random.Random(2)
    fd = os.open(path, os.O_RDWR)
    positions = [(i, 1 << rng.randrange(8)) for i in range(hlen)]
    positions += [(rng.randrange(hlen, len(raw)), rng.randrange(1, 256)) for _ in range(200)]
    try:
        for i, mask in positions:
            os.pwrite(fd, bytes([raw[i] ^ mask]), i)
            with pytest.raises(CapsuleCorruptError):
                flashrt.load_capsule(path, into=target)
            assert target.entries in ((), cap.entries), i
            if target.entries:
                assert_same(cap, target)
            os.pwrite(fd, raw[i:i + 1], i)
            if not target.entries:
                flashrt.load_capsule(path, into=target)      # holds the file again for the next flip
    finally:
        os.close(fd)
    assert {"mismatch", "not_fast"} <= set(fast_statuses)   # both refusal routes were taken
    assert_same(cap, flashrt.load_capsule(path, into=target))
    assert fast_statuses[-1] == "loaded"


@needs_ext
def test_native_path_refusals_name_the_problem(tmp_path, monkeypatch, fast_statuses):
    cap, path, target = _holding_target(tmp_path)
    raw = path.read_bytes()
    bad = tmp_path / "bad.capsule"
    hlen = 8 + struct.unpack("<Q", raw[:8])[0]
    for data, match in [(raw[:-1], "data region"), (raw + b"x", "data region"),
                        (raw[:-3] + bytes([raw[-3] ^ 4]) + raw[-2:], "checksum mismatch"),
                        (raw[:4], "header length"), (raw[:hlen - 1], "header length"),
                        (raw[:hlen], "data region"), (b"", "header length")]:
        bad.write_bytes(data)
        with pytest.raises(CapsuleCorruptError, match=match):
            flashrt.load_capsule(bad, into=target)
    with monkeypatch.context() as m:      # consistent files that differ in format fields only
        m.setattr(fmt, "VERSION", "5")
        flashrt.save_capsule(cap, tmp_path / "v5")
    target = _target(cap)
    flashrt.load_capsule(path, into=target)
    with pytest.raises(CapsuleCorruptError, match="version '5'"):
        flashrt.load_capsule(tmp_path / "v5", into=target)
    assert_same(cap, target)              # refused on its header: untouched
    assert fast_statuses[-1] == "not_fast"


@needs_ext
def test_native_path_reads_a_header_longer_than_its_first_read(tmp_path, fast_statuses):
    cap = ascii_capsule(position=5000)    # the token history alone is ~25 KB of header
    path = tmp_path / "long.capsule"
    flashrt.save_capsule(cap, path)
    assert struct.unpack("<Q", path.read_bytes()[:8])[0] > 16 << 10
    target = _target(cap)
    flashrt.load_capsule(path, into=target)
    assert_same(cap, flashrt.load_capsule(path, into=target))
    assert fast_statuses == ["loaded"]


def test_to_bytes_is_the_file_and_from_bytes_checks_every_byte(tmp_path):
    cap = make_capsule(position=9, seed=3)
    fmt.save(cap, tmp_path / "c.capsule")
    b = fmt.to_bytes(cap)
    assert b == (tmp_path / "c.capsule").read_bytes()
    assert_same(cap, fmt.from_bytes(b))
    rng = random.Random(0)
    for i in [rng.randrange(8, len(b)) for _ in range(20)]:   # header and payload bytes alike
        bad = bytearray(b)
        bad[i] ^= 1 << rng.randrange(8)
        with pytest.raises(CapsuleCorruptError):
            fmt.from_bytes(bytes(bad), "value")
    for n in (0, 7, 100, len(b) - 1):
        with pytest.raises(CapsuleCorruptError):
            fmt.from_bytes(b[:n])
    with pytest.raises(CapsuleCorruptError, match="trailing"):
        fmt.from_bytes(b + b"\0")

"""Capsule snapshot / restore / save / load latency against state bytes, per tier, each next to a
plain copy of the same bytes on the same device measured in the same run.

Tiers:
  device  arena -> capsule in the same memory (rt.snapshot(into=cap), rt.restore(cap));
          plain copy = one dst.copy_(src) between preallocated buffers of the same total size.
          Also rt.snapshot() into a fresh allocation, next to torch.empty + copy_ (allocation cost).
  host    CUDA only: device arena -> host capsule (snapshot + Capsule.to("cpu")) and back;
          plain copy = one copy_ into / out of preallocated pinned host memory. On a CPU device the
          arena already lives in host memory, so this tier is the device tier.
  disk    Capsule.save (write + fsync, atomic rename) and flashrt.load_capsule(into=) (read with a warm
          page cache, checksum verified, into a capsule allocated once; fresh load() shown too);
          plain = write + fsync of the same bytes (and the atomic-replace floor), and a read of
          them into a preallocated buffer.

Long prefixes are not prefilled (slow on CPU): copy cost depends only on bytes, so the arena is
filled with random bytes and the session position is set directly. This is said in the output.

    python bench/capsules.py                  # qwen3 and qwen3_5 at their real shapes, 1-256 MiB
    python bench/capsules.py --quick          # small shapes, 1 and 4 MiB, 2 repeats
"""
from __future__ import annotations

import flashrt

import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

TARGET_RATIO = 1.5
SYNTH_NOTE = ("state synthesized: arena filled with random bytes and the session position set "
              "directly (no prefill); copy cost depends only on the bytes moved")


def parse(argv):
    p = C.base_parser("bench/capsules.py", "Capsule snapshot/restore/save/load vs plain copies")
    p.add_argument("--arch", default=None,
                   help="comma list of qwen3, qwen3_5, lfm2 or all (default qwen3,qwen3_5)")
    p.add_argument("--size", default=None, help="tiny, small or real (default real; small in --quick)")
    p.add_argument("--mib", type=float, nargs="+", default=None,
                   help="target capsule sizes in MiB (default 1 4 16 64 256, on CUDA 1 16 256 1024; "
                   "1 4 in --quick)")
    p.add_argument("--tokens", type=int, nargs="+", default=[],
                   help="also capsules of exactly these positions (e.g. 16384: a 16k-token state)")
    p.add_argument("--tmpdir", default=None, help="directory for the disk tier (default: system temp)")
    p.add_argument("--no-disk", action="store_true", help="skip the disk tier")
    a = p.parse_args(argv)
    C.setup(a)
    a.size = a.size or ("small" if a.quick else "real")
    big = [1, 16, 256, 1024] if a.device.startswith("cuda") else [1, 4, 16, 64, 256]
    a.mib = a.mib or ([1, 4] if a.quick else big)
    a.repeats = a.repeats or (2 if a.quick else 5)
    a.warmup = 1 if a.warmup is None else a.warmup
    arch = a.arch or "qwen3,qwen3_5"
    a.archs = list(C.ARCHS) if arch == "all" else arch.split(",")
    return a


def positions_for(fixed: int, per_token: int, targets_mib) -> list:
    out = []
    for t in targets_mib:
        p = max(1, -(-(int(t * 2**20) - fixed) // per_token))
        if p not in out:
            out.append(p)
    return sorted(out)


def synthesize(rt, position: int) -> None:
    """Random bytes everywhere, valid token ids, position set directly (no compute)."""
    import torch
    a = rt.arena
    a.data.random_(0, 256)
    g = torch.Generator().manual_seed(position)
    a["meta.tokens"].copy_(torch.randint(0, rt.net.vocab_size, a["meta.tokens"].shape, generator=g))
    rt.session.adopt(position)


def same_bytes(rt, cap) -> bool:
    import torch
    for e in cap.entries:
        if not torch.equal(rt.arena.bytes_of(e.name, e.shape[0] if e.seq else None).cpu(),
                           cap.raw(e).cpu()):
            return False
    return True


def same_bytes_as(rt, before, cap) -> bool:
    """The arena's bytes under cap's entries equal those of `before` (an earlier arena copy)."""
    import torch
    base = rt.arena.data.data_ptr()
    for e in cap.entries:
        v = rt.arena.bytes_of(e.name, e.shape[0] if e.seq else None)
        off = v.data_ptr() - base
        if not torch.equal(v.cpu(), before[off: off + v.numel()].cpu()):
            return False
    return True


def plain_write(buf, path) -> None:
    with open(path, "wb", buffering=0) as f:
        mv = memoryview(buf.numpy())
        while mv.nbytes:
            mv = mv[f.write(mv):]
        os.fsync(f.fileno())


def plain_atomic_write(buf, path) -> None:
    """What any crash-safe replace costs: temp file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(path.name + ".tmp")
    plain_write(buf, tmp)
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_read(buf, path) -> None:
    with open(path, "rb", buffering=0) as f:
        mv = memoryview(buf.numpy())
        while mv.nbytes:
            n = f.readinto(mv)
            if not n:
                raise IOError(f"{path}: short read")
            mv = mv[n:]


def bench_arch(arch, a, tmp, tables, quick_note, on_size=None):
    import torch
    path = C.checkpoint(arch, a.size)
    lab = C.label(arch, a.size)
    # a session of length 1 reads the layout sizes; the measured one shares its weights. No
    # CUDA graphs: this bench never steps the model, and only copies are timed.
    probe = C.load_flashrt(path, a, max_seq_len=1, cuda_graphs=False)
    fixed, per_tok = probe.arena.fixed_state_bytes, probe.arena.per_token_bytes
    pos_list = sorted(set(positions_for(fixed, per_tok, a.mib)) | set(a.tokens))
    rt = type(probe)(probe.model, dataclasses.replace(probe.options, max_seq_len=max(pos_list)))
    del probe
    C.free_memory()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    pre = rt.empty_capsule(max(pos_list))                 # preallocated capsule, reused
    max_bytes = rt.arena.capsule_bytes(max(pos_list))
    src = torch.empty(max_bytes, dtype=torch.uint8, device=dev).random_(0, 256)
    dst = torch.empty_like(src).zero_()
    host = None
    if cuda:
        host = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True).zero_()
    cpu_buf = torch.empty(max_bytes, dtype=torch.uint8).zero_()     # disk plain read/write buffer
    evict = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)     # > any last-level cache

    def flush():
        evict.add_(1)
        C.sync(a.device)

    mem = C.Table(f"{lab}: device tier ({a.device}, {a.dtype}; {C.fmt_bytes(fixed)} fixed + "
                  f"{C.fmt_bytes(per_tok)}/token)",
                  ["state", "tokens", "plain copy ms", "snapshot(into) ms", "ratio", "restore ms",
                   "ratio", "snapshot() fresh ms", "ratio", "empty+copy ms", "plain GB/s"])
    hst = C.Table(f"{lab}: host tier (device arena <-> pinned host capsule)",
                  ["state", "tokens", "plain D2H ms", "snapshot+to(cpu) ms", "ratio", "plain H2D ms",
                   "to(dev)+restore ms", "ratio"])
    dsk = C.Table(f"{lab}: disk tier ({tmp}; warm page cache for reads)",
                  ["state", "tokens", "plain write+fsync ms", "atomic write ms", "save ms", "ratio",
                   "vs atomic", "plain read ms", "load(into) ms", "ratio", "load() fresh ms",
                   "save MB/s"])
    # load(into=) reads files into host memory (pinned on CUDA machines); restore copies it on
    load_target = rt.session.empty_capsule(max(pos_list), host=True) if not a.no_disk else None
    rows = []
    # registered before the sizes run: a partial write (on_size) carries the rows done so far
    tables += [mem] + ([hst] if cuda else []) + ([] if a.no_disk else [dsk])
    for P in C.progress(pos_list, desc=f"{arch} sizes"):
        synthesize(rt, P)
        probe_cap = rt.snapshot(into=pre)
        nb = probe_cap.nbytes
        s, d = src[:nb], dst[:nb]
        row = {"position": P, "state_bytes": nb}
        # Two groups: fresh allocations (and the frees behind them) disturb caches and the page
        # allocator for whatever runs next, so they are not interleaved with the copies into
        # preallocated memory.
        # sub-millisecond copies: each sample averages back-to-back calls (>= ~2 ms of plain copy).
        # Every sample starts from the same cache state (flushed): near the last-level cache size
        # whichever case ran before would otherwise leave its buffers warm for the next.
        probe = C.time_once(lambda: d.copy_(s), a.device, inner=5)[0]
        k = max(1, min(200, int(2e-3 / max(probe, 1e-6))))
        row["calls_per_sample"] = k
        # a ~2 ms sample moves with every hiccup of the machine and costs little: at least 31
        # rounds of them (~3 s), so a handful of samples does not decide the median
        reps = a.repeats if a.quick or k == 1 else max(a.repeats, 31)
        row["device_rounds"] = reps
        st = C.measure({
            "plain_copy": C.Case(lambda: d.copy_(s), setup=flush, inner=k),
            "snapshot_into": C.Case(lambda: rt.snapshot(into=pre), setup=flush, inner=k),
            "restore": C.Case(lambda: rt.restore(pre), setup=flush, inner=k),
        }, reps, a.warmup, a.device, desc=f"{arch} {C.fmt_bytes(nb)} device")
        st.update(C.measure({
            "snapshot_fresh": C.Case(lambda: rt.snapshot()),
            "empty_copy": C.Case(lambda: torch.empty(nb, dtype=torch.uint8, device=dev).copy_(s)),
        }, a.repeats, a.warmup, a.device, desc=f"{arch} {C.fmt_bytes(nb)} fresh"))
        rt.snapshot(into=pre)
        before = rt.arena.data.clone()      # the state the capsule was taken from
        rt.arena.data.bitwise_not_()       # every byte changed: the restore must write all back
        rt.restore(pre)
        # the capsule's bytes back in the arena, and they are the state it came from (a wrong
        # snapshot copy restores faithfully what it got wrong)
        row["restore_exact"] = same_bytes(rt, pre) and same_bytes_as(rt, before, pre)
        row["device"] = {k: v for k, v in st.items()}
        pc = st["plain_copy"]
        r = {k: C.ratio(st[k], pc) for k in ("snapshot_into", "restore", "snapshot_fresh")}
        row["device_ratio"] = r
        gbs = nb / pc.median / 1e9
        mem.add(C.fmt_bytes(nb), P, pc.ms(2), st["snapshot_into"].ms(2), _flag(r["snapshot_into"], nb),
                st["restore"].ms(2), _flag(r["restore"], nb), st["snapshot_fresh"].ms(2),
                C.fmt_ratio(r["snapshot_fresh"]), st["empty_copy"].ms(2), f"{gbs:.1f}")

        if cuda:
            hb = host[:nb]
            holder = {}

            def to_host():
                holder["cap"] = rt.snapshot(into=pre).to("cpu")

            def from_host():
                rt.restore(holder["cap"].to(dev))
            to_host()
            cases = {"plain_d2h": C.Case(lambda: hb.copy_(d, non_blocking=True)),
                     "snapshot_to_host": C.Case(to_host),
                     "plain_h2d": C.Case(lambda: d.copy_(hb, non_blocking=True)),
                     "host_restore": C.Case(from_host)}
            st = C.measure(cases, a.repeats, a.warmup, a.device, desc=f"{arch} {C.fmt_bytes(nb)} host")
            row["host"] = dict(st)
            r1, r2 = C.ratio(st["snapshot_to_host"], st["plain_d2h"]), C.ratio(st["host_restore"], st["plain_h2d"])
            row["host_ratio"] = {"snapshot_to_host": r1, "host_restore": r2}
            hst.add(C.fmt_bytes(nb), P, st["plain_d2h"].ms(2), st["snapshot_to_host"].ms(2), _flag(r1, nb),
                    st["plain_h2d"].ms(2), st["host_restore"].ms(2), _flag(r2, nb))

        if not a.no_disk:
            cap_file, plain_file = tmp / f"{arch}-{P}.capsule", tmp / f"{arch}-{P}.plain"
            cb = cpu_buf[:nb]
            # on CUDA save from a host copy made once: the disk tier times the file, not D2H
            disk_src = rt.snapshot(into=pre).to("cpu")
            holder = {}

            def save():
                flashrt.save_capsule(disk_src, cap_file)

            def load_into():
                holder["cap"] = flashrt.load_capsule(cap_file, into=load_target)

            def load_fresh():
                holder["fresh"] = flashrt.load_capsule(cap_file)
            save()
            plain_write(cb, plain_file)
            cases = {"plain_write": C.Case(lambda: plain_write(cb, plain_file)),
                     "plain_atomic": C.Case(lambda: plain_atomic_write(cb, plain_file)),
                     "save": C.Case(save),
                     "plain_read": C.Case(lambda: plain_read(cb, plain_file)),
                     "load": C.Case(load_into)}
            st = C.measure(cases, a.repeats, a.warmup, "cpu", desc=f"{arch} {C.fmt_bytes(nb)} disk")
            # apart, as in the device tier: a fresh buffer per call moves glibc's mmap threshold,
            # and whether the next buffers are page-faulted in then depends on the process's past
            st.update(C.measure({"load_fresh": C.Case(load_fresh)}, a.repeats, a.warmup, "cpu",
                                desc=f"{arch} {C.fmt_bytes(nb)} disk fresh"))
            row["load_exact"] = all(torch.equal(c.raw(e), pre.raw(e).cpu())
                                    for c in (holder["cap"], holder["fresh"]) for e in pre.entries)
            row["file_bytes"] = cap_file.stat().st_size
            row["disk"] = dict(st)
            r1, r2 = C.ratio(st["save"], st["plain_write"]), C.ratio(st["load"], st["plain_read"])
            r3 = C.ratio(st["save"], st["plain_atomic"])
            row["disk_ratio"] = {"save": r1, "save_vs_atomic": r3, "load": r2,
                                 "load_fresh": C.ratio(st["load_fresh"], st["plain_read"])}
            dsk.add(C.fmt_bytes(nb), P, st["plain_write"].ms(2), st["plain_atomic"].ms(2),
                    st["save"].ms(2), _flag(r1, nb), C.fmt_ratio(r3), st["plain_read"].ms(2),
                    st["load"].ms(2), _flag(r2, nb), st["load_fresh"].ms(2),
                    f"{nb / st['save'].median / 1e6:.0f}")
            del holder, disk_src
            for f in (cap_file, plain_file):
                f.unlink(missing_ok=True)
        rows.append(row)
        if on_size is not None:
            on_size({"arch": arch, "size": a.size, "rows": rows})

    exact = all(r["restore_exact"] for r in rows) and all(r.get("load_exact", True) for r in rows)
    mem.notes += [f"ratio = flashrt / plain copy of the same bytes; target <= {TARGET_RATIO}x for "
                  f"states >= 1 MiB ('!' marks a miss)",
                  "snapshot() fresh allocates its buffer each call; snapshot(into=) reuses one "
                  "preallocated with rt.empty_capsule(); empty+copy is torch.empty + copy_ "
                  "(the allocation cost any fresh copy pays)",
                  f"exact at every size: {exact} (every arena byte flipped, then a restore "
                  "gives back the capsule's bytes and the state it was taken from; a file "
                  "load(into) gives back the same bytes)", SYNTH_NOTE,
                  "plain copy, snapshot(into) and restore: each sample is the mean of back-to-back "
                  "calls (as many as make ~2 ms of plain copy; 'calls_per_sample' in the JSON), "
                  "the three cases interleaved round by round, caches flushed (128 MiB written) "
                  "before every sample; medians over max(--repeats, 31) rounds where a sample "
                  "averages several calls ('device_rounds' in the JSON)"]
    dsk.notes += ["save = block checksums (all cores) + header + one gathered write + fsync + "
                  "atomic rename + directory fsync; load(into) = into a capsule allocated once "
                  "(rt.empty_capsule()) that holds the file's entry table from an earlier load: "
                  "one native call reads the header, parses the metadata, reads the payload in "
                  "256 KiB blocks (on all cores from 12 MiB), each hashed as it lands, and checks "
                  "the file checksum; load() fresh parses the table in Python and allocates its "
                  "buffer per call",
                  "plain = write + fsync of the same bytes / readinto a preallocated buffer; "
                  "atomic write = the crash-safe floor: write a temp file + fsync + rename + "
                  "directory fsync; ratio = flashrt / plain ('!' > 1.5x at >= 1 MiB), vs atomic = "
                  "save / atomic write"]
    if cuda:
        hst.notes.append("to(cpu) allocates a fresh pinned buffer per call; plain copies use "
                         "preallocated pinned memory")
    else:
        quick_note.append(f"{lab}: host tier = device tier on a CPU device (the arena already "
                          "lives in host memory); not measured separately")
    out = {"arch": arch, "size": a.size, "checkpoint": C.short_path(path), "fixed_state_bytes": fixed,
           "per_token_bytes": per_tok, "rows": rows, "all_exact": exact}
    del rt, pre, src, dst, host, cpu_buf, load_target, evict
    C.free_memory()
    return out


def _flag(r, nbytes) -> str:
    s = C.fmt_ratio(r)
    return s + ("!" if r is not None and nbytes >= 2**20 and r > TARGET_RATIO else "")


def main(argv=None) -> int:
    a = parse(argv)
    info = C.banner("capsules", a)
    print(SYNTH_NOTE)
    if not C.have_native():
        print("WARNING: flashrt.native._C is not built: copies use torch and the capsule checksum is "
              "numpy XXH3 (~50 MB/s); build it (pip install --no-build-isolation .) or set "
              "FLASHRT_EXT_DIR. Disk tier limited to states under 2 MiB.")
        a.mib = [m for m in a.mib if m < 2] or [1]
    tmp = Path(tempfile.mkdtemp(prefix="flashrt-bench-", dir=a.tmpdir))
    tables, results, notes = [], [], []
    data = {"targets_mib": a.mib, "tokens": a.tokens, "repeats": a.repeats, "warmup": a.warmup,
            "size": a.size, "target_ratio": TARGET_RATIO, "synthesized": True}
    try:
        for arch in a.archs:
            if not C.arch_available(arch):
                print(f"{arch}: model file not present in this checkout, skipped")
                continue
            n0 = len(tables)

            def partial(out):     # a run cut short (gpu_check's time caps) keeps what it measured
                C.write_json("capsules", a, info, tables, dict(data, results=results + [out],
                                                               partial=True), argv)
            results.append(bench_arch(arch, a, tmp, tables, notes, partial))
            C.print_tables(tables[n0:])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for n in notes:
        print(n)
    if tables:
        tables[-1].notes += notes
    C.write_json("capsules", a, info, tables, dict(data, results=results), argv)
    return 0 if all(r["all_exact"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

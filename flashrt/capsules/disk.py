"""The disk tier's directory: one capsule file per key, and nothing else on disk.

Files are written by format.save (temp file, fsync, rename, fsync of the folder), so a reader
sees the old file, the new one, or none. A single-use claim is a rename to a unique name:
atomic on one filesystem, so exactly one caller wins across threads and processes.

A capsule holds a conversation: the folder is made 0700 and files 0600 (format.save), and a
symbolic link in it is never followed (skipped by scan, refused by load), so nobody who can
write the folder's parent or plant a link makes the store read another file.
"""
from __future__ import annotations

import os
import re
import secrets
import warnings

from flashrt.errors import CapsuleCorruptError

from . import format as fmt
from .types import Capsule

SUFFIX = ".capsule"
KEY = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")
_TMP = re.compile(r"^\..+\.tmp-(\d+)-[0-9a-f]+$")
_CLAIMED = re.compile(r"^.+\.claimed-(\d+)-[0-9a-f]+$")


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid < (1 << 31)
    return True


def unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def parent_id(meta, entries) -> str | None:
    """The id of the capsule holding a delta capsule's rows below row0 (None: not a delta)."""
    return (meta.parent or {}).get("id") if any(e.row0 for e in entries) else None


def make_private_dir(path) -> str:
    """`path` as an absolute folder, made (with missing parents) mode 0700 when absent."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def is_link(path) -> bool:
    try:
        return os.path.islink(path)
    except OSError:
        return False


class DiskDir:
    def __init__(self, path):
        self.dir = make_private_dir(path)

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key + SUFFIX)

    def write(self, key: str, cap: Capsule) -> None:
        fmt.save(cap, self.path(key))

    def load(self, key: str, device) -> Capsule:
        """Checksummed load; FileNotFoundError if claimed or removed by another process (or
        the name is a symbolic link: never followed)."""
        try:
            return fmt.load(self.path(key), device, follow_symlinks=False)
        except OSError as e:
            if isinstance(e, FileNotFoundError) or not is_link(self.path(key)):
                raise
            raise FileNotFoundError(f"{self.path(key)} is a symbolic link: not followed") from None

    def remove(self, key: str) -> None:
        unlink(self.path(key))

    def claim(self, key: str) -> bool:
        """Take the file away for this caller alone; False if another caller took it first."""
        claimed = f"{self.path(key)}.claimed-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(self.path(key), claimed)
        except FileNotFoundError:
            return False
        unlink(claimed)
        return True

    def scan(self, verify: bool) -> list:
        """[(key, entries, meta, tokens, file size)] of the complete capsules, oldest first.
        Deletes dead writers' temp files and corrupt files (warning); skips, with a warning,
        a repeated capsule id and a delta whose ancestry is not all here."""
        found = []
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            m = _TMP.match(name) or _CLAIMED.match(name)
            if m:
                if not pid_alive(int(m.group(1))):
                    unlink(path)          # a writer or claimer that died mid-way
                continue
            if not name.endswith(SUFFIX) or not KEY.match(name[: -len(SUFFIX)]) or is_link(path):
                continue
            try:
                if verify:
                    cap = fmt.load(path)
                    head = (list(cap.entries), cap.meta, cap.history, os.path.getsize(path))
                else:
                    head = fmt.read_header(path)
                mtime = os.stat(path).st_mtime_ns
            except FileNotFoundError:
                continue                  # claimed or removed meanwhile
            except CapsuleCorruptError as e:
                warnings.warn(f"capsule store: deleting corrupt file: {e}")
                unlink(path)
                continue
            found.append((mtime, name[: -len(SUFFIX)], *head))
        found.sort(key=lambda f: (f[0], f[1]))
        ids = {}
        for _, key, _, meta, _, _ in found:
            cid = meta.extra.get("id", "") if isinstance(meta.extra, dict) else ""
            if cid and cid in ids:
                warnings.warn(f"capsule store: {key}{SUFFIX} repeats capsule id {cid} of "
                              f"{ids[cid]}{SUFFIX}; skipped")
                continue
            ids[cid] = key
        by_key = {f[1]: f for f in found}
        out = []
        for _, key, entries, meta, tokens, size in found:
            if ids.get(meta.extra.get("id", "")) != key:
                continue
            p, ok, seen = parent_id(meta, entries), True, set()
            while p is not None:          # the whole ancestry must be here
                pk = ids.get(p)
                if pk is None or pk in seen:
                    ok = False
                    break
                seen.add(pk)
                p = parent_id(by_key[pk][3], by_key[pk][2])
            if not ok:
                warnings.warn(f"capsule store: {key}{SUFFIX} is a delta capsule whose parent "
                              f"{parent_id(meta, entries)} is not in {self.dir}; skipped")
                continue
            out.append((key, entries, meta, tokens, size))
        return out

"""NamedCapsules: capsules saved under names a client chose, in a directory, per namespace.

    named = NamedCapsules("caps/named", budget_bytes=1 << 30, per_namespace=64)
    named.save(rt.snapshot(), "alice", namespace="t1f2...")      # caps/named/t1f2.../alice.capsule
    cap = named.load("alice", namespace="t1f2...", fingerprint=rt.fingerprint)

Namespace "" is the directory itself; any other is a subfolder of it. Folders are made 0700
and files 0600 (format.save); symbolic links are never followed (a link where a file or a
namespace folder should be is refused: KeyError, as if absent). The capsule keeps its model
fingerprint: load(fingerprint=) refuses, naming the fields, a capsule another model made
(CapsuleMismatchError). A damaged file is moved aside (to "<name>.capsule.damaged-<ns>", out
of every listing and budget) and raises CapsuleCorruptError naming it: never deleted, so it
can be looked at.

Limits (NamedLimitError, its `limit` says which): `per_namespace` names in one namespace, and
`budget_bytes` for the files of all namespaces together (overwriting a name counts the new
file instead of the old one). Names are never evicted: a full budget refuses the save.
The directory is the only state (read on each save), so processes sharing it share the budget.
"""
from __future__ import annotations

import os
import re
import stat
import threading
import time

from flashrt.errors import CapsuleCorruptError, CapsuleError, CapsuleMismatchError

from . import format as fmt
from .disk import KEY, SUFFIX, is_link, make_private_dir
from .types import Capsule

NAMESPACE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# what identifies the model (dtype and layout are the runtime's: tokens stay meaningful)
MODEL_KEYS = ("model_type", "config", "weights")


class NamedLimitError(CapsuleError):
    """A save refused by a limit: limit is "count" (per namespace) or "bytes" (the budget)."""

    def __init__(self, message: str, limit: str, value: int):
        super().__init__(message)
        self.limit, self.value = limit, value


class NamedCapsules:
    def __init__(self, path, budget_bytes: int | None = None, per_namespace: int | None = None):
        self.dir = make_private_dir(path)
        self.budget, self.per_namespace = budget_bytes, per_namespace
        self._lock = threading.Lock()

    # ---- paths ----------------------------------------------------------------------------
    def _folder(self, namespace: str, make: bool = False) -> str | None:
        if not namespace:
            return make_private_dir(self.dir) if make else self.dir
        if not NAMESPACE.match(namespace):
            raise ValueError(f"bad namespace {namespace!r}")
        folder = os.path.join(self.dir, namespace)
        if is_link(folder):
            return None
        if make:
            make_private_dir(self.dir)
            make_private_dir(folder)
        return folder if os.path.isdir(folder) else None

    @staticmethod
    def _check_name(name) -> str:
        if not isinstance(name, str) or not KEY.match(name):
            raise ValueError(f"bad capsule name {name!r}: 1-200 characters of [A-Za-z0-9._-], "
                             "not starting with '.'")
        return name

    @staticmethod
    def _files(folder) -> list:
        """(name, size) of the regular capsule files of a folder (links skipped)."""
        out = []
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return out
        for e in entries:
            if not e.name.endswith(SUFFIX) or not KEY.match(e.name[: -len(SUFFIX)]):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((e.name[: -len(SUFFIX)], st.st_size))
        return out

    def used_bytes(self) -> int:
        """Bytes of every namespace's named files."""
        total = sum(size for _, size in self._files(self.dir))
        for e in os.scandir(self.dir):
            if NAMESPACE.match(e.name) and e.is_dir(follow_symlinks=False):
                total += sum(size for _, size in self._files(e.path))
        return total

    def names(self, namespace: str = "") -> list:
        folder = self._folder(namespace)
        return sorted(n for n, _ in self._files(folder)) if folder else []

    def __contains__(self, item) -> bool:
        name, namespace = item if isinstance(item, tuple) else (item, "")
        folder = self._folder(namespace)
        if folder is None:
            return False
        try:
            return stat.S_ISREG(os.lstat(os.path.join(folder, self._check_name(name) + SUFFIX)).st_mode)
        except FileNotFoundError:
            return False

    # ---- save / load ----------------------------------------------------------------------
    def save(self, cap: Capsule, name: str, namespace: str = "", overwrite: bool = False) -> int:
        """Write cap as `name` of `namespace`; returns the file's size. FileExistsError when the
        name is taken (and not overwrite); NamedLimitError past a limit."""
        name = self._check_name(name)
        with self._lock:
            folder = self._folder(namespace, make=True)
            if folder is None:
                raise ValueError(f"namespace folder {namespace!r} is a symbolic link: refused")
            files = dict(self._files(folder))
            if name in files and not overwrite:
                raise FileExistsError(name)
            if self.per_namespace is not None and name not in files and len(files) >= self.per_namespace:
                raise NamedLimitError(f"{len(files)} capsules are saved by name already: the limit "
                                      f"is {self.per_namespace}", "count", self.per_namespace)
            size = fmt.file_size(cap)
            if self.budget is not None:
                used = self.used_bytes() - files.get(name, 0)
                if used + size > self.budget:
                    raise NamedLimitError(f"saving {size} B would take named capsules to "
                                          f"{used + size} B, past their budget of {self.budget} B",
                                          "bytes", self.budget)
            fmt.save(cap, os.path.join(folder, name + SUFFIX))
            return size

    def load(self, name: str, namespace: str = "", fingerprint: dict | None = None,
             device="cpu") -> Capsule:
        """The capsule saved as `name`; KeyError when there is none (or a link is there)."""
        name = self._check_name(name)
        folder = self._folder(namespace)
        if folder is None:
            raise KeyError(name)
        path = os.path.join(folder, name + SUFFIX)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise KeyError(name)
            cap = fmt.load(path, device, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            raise KeyError(name) from None
        except OSError as e:
            if is_link(path):                     # swapped for a link after the check
                raise KeyError(name) from None
            raise CapsuleCorruptError(f"capsule {name!r} could not be read: {e}") from None
        except CapsuleCorruptError as e:
            aside = f"{path}.damaged-{time.time_ns()}"
            try:
                os.replace(path, aside)
            except OSError:
                aside = None
            raise CapsuleCorruptError(f"capsule {name!r} is damaged ({e.args[0] if e.args else e})"
                                      + (f"; moved aside to {os.path.basename(aside)}" if aside else "")) from None
        if fingerprint is not None:
            have = cap.meta.fingerprint or {}
            differ = [k for k in MODEL_KEYS if have.get(k) != fingerprint.get(k)]
            if differ:
                raise CapsuleMismatchError(f"capsule {name!r} was saved from another model: its "
                                           f"{', '.join(differ)} differ from this model's")
        return cap

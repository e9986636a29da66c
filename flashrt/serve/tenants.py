"""Tenants: who a request belongs to, and the namespace its reuse lives in.

Every API key is a tenant (--api-key, FLASHRT_API_KEY, or --api-keys FILE with one key per
line); without a key every client is the one tenant "". A tenant's id is a digest of its key
(never the key itself: ids name folders and Redis keys). A request's namespace is its tenant,
or with a `cache_salt` a digest of tenant and salt: capsules are reused, and cached_tokens
reported, only within one namespace; sessions, response ids and names only within one tenant.
"""
from __future__ import annotations

import hashlib
import os

ENV_KEY = "FLASHRT_API_KEY"


def tenant_id(key: str) -> str:
    return "t" + hashlib.sha256(b"flashrt-tenant\0" + key.encode("ascii")).hexdigest()[:20]


def namespace(tenant: str, salt: str | None) -> str:
    """The capsule namespace of a request: its tenant's, or one of tenant and salt."""
    if salt is None:
        return tenant
    return "s" + hashlib.sha256(f"flashrt-salt\0{tenant}\0{salt}".encode()).hexdigest()[:20]


def check_key(key, what: str) -> str:
    """A usable API key: 1 to 512 visible ASCII characters (a header carries it as is), else a
    ValueError naming `what` (never the key)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"{what}: the API key is empty")
    bad = next((i for i, c in enumerate(key) if not "\x21" <= c <= "\x7e"), None)
    if bad is not None:
        raise ValueError(f"{what}: the API key holds a character that is not visible ASCII "
                         f"(at index {bad}); a client could never send it in a header")
    if len(key) > 512:
        raise ValueError(f"{what}: the API key is longer than 512 characters")
    return key


def read_keys(path) -> tuple:
    """The keys of an --api-keys file: one a line; blank lines and '#' comments skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-keys {path}: cannot read it: {e}") from None
    keys = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(check_key(line, f"--api-keys {path} line {n}"))
    if not keys:
        raise ValueError(f"--api-keys {path}: no key in it")
    return tuple(keys)


def key_from_env() -> str | None:
    return os.environ.get(ENV_KEY) or None

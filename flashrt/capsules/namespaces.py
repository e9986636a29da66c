"""Store namespaces: one CapsuleStore, capsules that only their own namespace sees.

    store.put(cap, namespace="t1")          # stored in namespace "t1"
    store.match(tokens, namespace="t2")     # never finds it: another namespace
    rt.set_context(tokens, store=store.view("t1"))

A server gives each tenant (API key, and salt) a namespace, so nobody's prompt is reused for,
or reported to, another. Each namespace has a prefix index of its own; a delta capsule's parent
must be in its child's namespace; the shared (Redis) tier keeps each namespace under keys of
its own. Budgets and the LRU order stay shared by all. Keys are one space: a caller that puts
by explicit key gives each namespace keys of its own (a key taken in another namespace is a
ValueError, never replaced). view(ns) is the store as ns sees it: what
LanguageModel.set_context(store=) and the shared tier are handed.
"""
from __future__ import annotations

from .types import Capsule


class NamespaceView:
    """A CapsuleStore as one namespace sees it: what it puts lands in the namespace, and
    match, key_of, get, pin and `in` see only the namespace's capsules."""

    def __init__(self, store, namespace: str):
        self.store, self.namespace = store, namespace

    def put(self, cap: Capsule, key: str | None = None, pin: bool = False) -> str:
        return self.store.put(cap, key, pin, namespace=self.namespace)

    def match(self, tokens, fingerprint: dict | None = None):
        return self.store.match(tokens, fingerprint, namespace=self.namespace)

    def key_of(self, capsule_id: str) -> str | None:
        return self.store.key_of(capsule_id, namespace=self.namespace)

    def _mine(self, key) -> bool:
        return self.store.namespace_of(key) == self.namespace

    def get(self, key: str) -> Capsule:
        if not self._mine(key):
            raise KeyError(key)
        return self.store.get(key)

    def pin(self, key: str, pinned: bool = True) -> None:
        if not self._mine(key):
            raise KeyError(key)
        self.store.pin(key, pinned)

    def __contains__(self, key) -> bool:
        return self._mine(key)

    def __repr__(self) -> str:
        return f"NamespaceView({self.namespace!r} of {self.store!r})"

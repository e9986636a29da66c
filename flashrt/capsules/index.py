"""A radix trie over token histories: which stored keys hold which exact prefix.

Keys end at nodes; a lookup walks the query once and yields every node on its path that holds
keys, deepest last, so the caller picks the longest usable prefix.
"""
from __future__ import annotations


class _Node:
    """`edge` is the token run from the parent; `keys` end exactly here."""
    __slots__ = ("edge", "kids", "keys", "up")

    def __init__(self, edge=(), up=None):
        self.edge, self.kids, self.keys, self.up = tuple(edge), {}, set(), up


class PrefixIndex:
    def __init__(self):
        self._root = _Node()
        self._node: dict = {}          # key -> node it ends at

    def add(self, key, tokens) -> None:
        """Index `key` as holding exactly `tokens` (a non-empty sequence of ints)."""
        if not tokens:
            return
        self.remove(key)
        node, i = self._root, 0
        while i < len(tokens):
            nxt = node.kids.get(tokens[i])
            if nxt is None:
                leaf = _Node(tokens[i:], node)
                node.kids[tokens[i]] = leaf
                node = leaf
                break
            e, j = nxt.edge, 0
            while j < len(e) and i + j < len(tokens) and e[j] == tokens[i + j]:
                j += 1
            if j < len(e):                # split nxt's edge at j
                mid = _Node(e[:j], node)
                node.kids[e[0]] = mid
                nxt.edge, nxt.up = e[j:], mid
                mid.kids[e[j]] = nxt
                nxt = mid
            node, i = nxt, i + j
        node.keys.add(key)
        self._node[key] = node

    def remove(self, key) -> None:
        node = self._node.pop(key, None)
        if node is None:
            return
        node.keys.discard(key)
        while node is not self._root and not node.keys:
            up = node.up
            if not node.kids:             # empty leaf: remove it
                del up.kids[node.edge[0]]
                node = up
                continue
            if len(node.kids) == 1:       # keyless pass-through: merge the only child into it
                (child,) = node.kids.values()
                child.edge = node.edge + child.edge
                child.up = up
                up.kids[child.edge[0]] = child
            break

    def prefixes(self, tokens) -> list[tuple[int, frozenset]]:
        """[(n, keys)] for every indexed prefix tokens[:n], shortest first."""
        out, node, i = [], self._root, 0
        while i < len(tokens):
            nxt = node.kids.get(tokens[i])
            if nxt is None or tuple(tokens[i: i + len(nxt.edge)]) != nxt.edge:
                break
            node, i = nxt, i + len(nxt.edge)
            if node.keys:
                out.append((i, frozenset(node.keys)))
        return out

    def __contains__(self, key) -> bool:
        return key in self._node

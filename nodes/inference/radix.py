"""A radix (prefix) cache of KV state keyed by token ids, with a token budget and LRU eviction.

Each node holds a run of token ids and the backend's KV for exactly those tokens (an opaque
value the backend knows how to slice and concatenate; ``None`` for the sim backend). A request
whose ids extend a cached prefix gets that prefix's KV back and only computes the rest, which
is what makes a resumed (aborted, then re-posted) request cheap. The request id plays no part,
as in SGLang. Matches copy KV out of the tree, so eviction never races a running request.

Eviction walks the tree, so it runs rarely: past the budget it frees down to ``1 - SLACK`` of it
(walking and sorting the tree on every insert of a full cache made each insert many times slower:
bench/RESULTS.md, "Radix cache eviction").
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class KVOps(Protocol):
    """How the cache cuts and joins a backend's KV values (token axis)."""

    def slice(self, kv: Any, start: int, end: int) -> Any:
        """KV of tokens ``[start, end)`` of ``kv``."""

    def concat(self, parts: list[Any]) -> Any:
        """KV of the parts' tokens, in order."""


class NoKV:
    """KV ops for backends without tensors (sim): every value is ``None``."""

    def slice(self, kv: Any, start: int, end: int) -> Any:
        """No KV to slice."""
        return None

    def concat(self, parts: list[Any]) -> Any:
        """No KV to join."""
        return None


_clock = itertools.count()


@dataclass(eq=False)
class _Node:
    key: list[int]
    value: Any
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_access: int = 0


@dataclass
class Match:
    """The cached prefix of a lookup: ``length`` tokens and their KV (``None`` if length 0)."""

    length: int
    kv: Any


class RadixCache:
    """Prefix cache of at most ``max_tokens`` tokens; least recently used leaves go first."""

    SLACK = 1 / 16  # share of the budget an eviction frees beyond what the budget needs

    def __init__(self, max_tokens: int, ops: KVOps | None = None) -> None:
        self.max_tokens = max_tokens
        self.ops: KVOps = ops or NoKV()
        self._root = _Node(key=[], value=None, parent=None)
        self.total_tokens = 0
        self.hits = 0
        self.lookups = 0

    def match(self, ids: Sequence[int]) -> Match:
        """The longest cached prefix of ``ids`` and its KV; refreshes the path's LRU stamp."""
        node, pos, parts = self._root, 0, []
        now = next(_clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            k = _common_len(child.key, ids, pos)
            child.last_access = now
            parts.append(child.value if k == len(child.key) else self.ops.slice(child.value, 0, k))
            pos += k
            if k < len(child.key):
                break
            node = child
        self.lookups += 1
        self.hits += pos
        return Match(length=pos, kv=self.ops.concat(parts) if pos else None)

    def insert(self, ids: Sequence[int], kv: Any) -> int:
        """Cache ``ids`` with ``kv`` (covering all of ``ids``); returns tokens newly added."""
        node, pos = self._root, 0
        now = next(_clock)
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = _Node(
                    key=list(ids[pos:]),
                    value=self.ops.slice(kv, pos, len(ids)),
                    parent=node,
                    last_access=now,
                )
                node.children[ids[pos]] = leaf
                added = len(ids) - pos
                self.total_tokens += added
                self._evict(protect=leaf)
                return added
            k = _common_len(child.key, ids, pos)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            node, pos = child, pos + k
        return 0

    def flush(self) -> None:
        """Drop everything."""
        self._root = _Node(key=[], value=None, parent=None)
        self.total_tokens = 0

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after its first ``k`` tokens; returns the new upper half."""
        assert node.parent is not None
        upper = _Node(
            key=node.key[:k],
            value=self.ops.slice(node.value, 0, k),
            parent=node.parent,
            last_access=node.last_access,
        )
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[k:]
        node.value = self.ops.slice(node.value, k, k + len(node.key))
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def _evict(self, protect: _Node | None = None) -> None:
        """Past the budget, remove least recently used leaves down to ``1 - SLACK`` of it (a parent
        left without children becomes a leaf, at least as recent as its newest child was)."""
        if self.total_tokens <= self.max_tokens:
            return
        target = self.max_tokens - int(self.max_tokens * self.SLACK)
        heap = [(n.last_access, id(n), n) for n in self._iter_nodes() if not n.children and n is not protect]
        heapq.heapify(heap)
        while self.total_tokens > target and heap:
            leaf = heapq.heappop(heap)[2]
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.total_tokens -= len(leaf.key)
            if parent is not self._root and not parent.children and parent is not protect:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        if self.total_tokens > self.max_tokens and protect is not None:
            # a single sequence longer than the budget: cache none of it
            self._remove_leaf_chain(protect)

    def _remove_leaf_chain(self, leaf: _Node) -> None:
        parent = leaf.parent
        assert parent is not None
        del parent.children[leaf.key[0]]
        self.total_tokens -= len(leaf.key)

    def _iter_nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out


def _common_len(key: list[int], ids: Sequence[int], pos: int) -> int:
    """How many leading tokens of ``key`` equal ``ids[pos:]``."""
    n = min(len(key), len(ids) - pos)
    i = 0
    while i < n and key[i] == ids[pos + i]:
        i += 1
    return i

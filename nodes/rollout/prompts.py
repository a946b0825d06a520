"""Prompt sources a rollout actor builds in its own process from a small, msgpack-able spec.

Each source yields ``(group_id, item)``. Group ids are deterministic (``name/e<epoch>/<index>``)
so that a restarted rollout actor that replays its source re-creates the same ids, and the
buffer's idempotent ``begin``/``put`` turn the replay into no-ops for groups already accepted.
Sharding (``shard`` of ``num_shards``) splits one data set across rollout actors.

Spec kinds:
- ``{"kind": "items", "items": [...]}`` — inline items (dicts).
- ``{"kind": "jsonl", "path": "..."}`` — one JSON object per line.
- ``{"kind": "arithmetic", "n": 100, "seed": 0}`` — offline GSM8K-shaped toy problems
  ("What is 17 + 25?", answer "42") for tests and benchmarks.
- ``{"kind": "factory", "factory": "module:function", "kwargs": {...}}`` — any iterable of dicts
  (e.g. a reasoning-gym data set).
Common keys: ``name`` (default: the kind), ``epochs`` (default 1; None repeats forever).
"""

from __future__ import annotations

import importlib
import itertools
import json
import random
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = ["arithmetic_items", "prompt_source"]


def arithmetic_items(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` two-number word problems with GSM8K-style answers."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rnd.randint(2, 99), rnd.randint(2, 99)
        op = rnd.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append({"question": f"What is {a} {op} {b}?", "answer": f"#### {value}"})
    return out


def _items(spec: Mapping[str, Any]) -> Iterable[Any]:
    kind = spec.get("kind")
    if kind == "items":
        return list(spec["items"])
    if kind == "jsonl":
        lines = Path(spec["path"]).read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    if kind == "arithmetic":
        return arithmetic_items(int(spec.get("n", 100)), int(spec.get("seed", 0)))
    if kind == "factory":
        module, _, fn = str(spec["factory"]).partition(":")
        if not fn:
            raise ValueError(f"prompt source factory must be 'module:function', got {spec['factory']!r}")
        return list(getattr(importlib.import_module(module), fn)(**dict(spec.get("kwargs") or {})))
    raise ValueError(f"unknown prompt source kind {kind!r}; use items, jsonl, arithmetic or factory")


def prompt_source(spec: Mapping[str, Any], shard: int = 0, num_shards: int = 1) -> Iterator[tuple[str, Any]]:
    """Build the source described by ``spec``; yields ``(group_id, item)`` for this shard."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} outside [0, {num_shards})")
    items = list(_items(spec))
    name = spec.get("name") or spec["kind"]
    epochs = spec.get("epochs", 1)
    for epoch in itertools.count() if epochs is None else range(int(epochs)):
        for i in range(shard, len(items), num_shards):
            yield f"{name}/e{epoch}/{i}", items[i]

"""Prompt sources a rollout actor builds in its own process from a :class:`PromptSpec`.

Each source yields ``(group_id, item)``. Group ids are deterministic (``name/e<epoch>/<index>``)
so that a restarted rollout actor that replays its source re-creates the same ids: it skips the
groups the buffer already accepted (``skip``), and the buffer's idempotent ``begin``/``put`` turn
any replay that slips through (accepted after the actor asked) into no-ops.
Sharding (``shard`` of ``num_shards``) splits one data set across rollout actors.

Kinds (``PromptSpec.kind``):
- ``items`` — inline items (dicts), ``items``.
- ``jsonl`` — one JSON object per line of the file at ``path``.
- ``arithmetic`` — ``n`` offline GSM8K-shaped toy problems ("What is 17 + 25?", answer "42") from
  ``seed``, for tests and benchmarks.
- ``factory`` — any iterable of dicts returned by ``factory`` ("module:function") called with
  ``kwargs`` (e.g. a reasoning-gym data set).
Common settings: ``name`` (default: the kind), ``epochs`` (default 1; None repeats forever),
``start_epoch`` (default 0), ``shuffle`` (default false: each epoch in a fresh order drawn from
``seed``; the ids keep naming the item, so a replay re-creates the same ids in the same order).
A plain dict with these keys is taken as a spec too.

A run that checkpoints records what it trained with :func:`trained_position` and resumes with
``start_epoch`` = its ``done_epochs`` and the buffer told the ``trained`` ids (they are refused),
so every prompt is trained once per epoch across restarts.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nodes.common.plugins import resolve
from protocols.runtime.codec import register

__all__ = ["PromptSpec", "arithmetic_items", "prompt_source", "trained_position"]


@register
@dataclass
class PromptSpec:
    """What prompts a rollout actor iterates over, and in which order (see the module's docstring)."""

    kind: Literal["items", "jsonl", "arithmetic", "factory"] = "items"
    items: list[Any] = field(default_factory=list)  # kind = items
    path: str = ""  # kind = jsonl
    n: int = 100  # kind = arithmetic
    factory: str = ""  # kind = factory: "module:function"
    kwargs: dict[str, Any] = field(default_factory=dict)  # kind = factory
    name: str = ""  # group ids are name/e<epoch>/<index>; "" = the kind
    epochs: int | None = 1  # None: repeat forever
    start_epoch: int = 0
    shuffle: bool = False
    seed: int = 0


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


def _items(spec: PromptSpec) -> Iterable[Any]:
    if spec.kind == "items":
        return list(spec.items)
    if spec.kind == "jsonl":
        lines = Path(spec.path).read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    if spec.kind == "arithmetic":
        return arithmetic_items(spec.n, spec.seed)
    if spec.kind == "factory":
        return list(resolve(spec.factory, "prompt source factory")(**spec.kwargs))
    raise ValueError(f"unknown prompt source kind {spec.kind!r}; use items, jsonl, arithmetic or factory")


def prompt_source(
    spec: PromptSpec | Mapping[str, Any], shard: int = 0, num_shards: int = 1, skip: Collection[str] = ()
) -> Iterator[tuple[str, Any]]:
    """Build the source described by ``spec``; yields ``(group_id, item)`` for this shard, leaving
    out the ids in ``skip`` (groups already accepted: a restarted actor must not ask for them one by
    one). Bad specs and empty shards raise here, not at the first ``next``."""
    if not isinstance(spec, PromptSpec):
        spec = PromptSpec(**spec)
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} outside [0, {num_shards})")
    items = list(_items(spec))
    name = spec.name or spec.kind
    if len(items) <= shard:  # nothing to yield, ever: with epochs=None a consumer would spin
        raise ValueError(
            f"prompt source {name!r} has {len(items)} items: shard {shard} of {num_shards} is empty"
        )
    return _iterate(items, name, spec, shard, num_shards, frozenset(skip))


def _iterate(
    items: list[Any], name: str, spec: PromptSpec, shard: int, num_shards: int, skip: frozenset[str]
) -> Iterator[tuple[str, Any]]:
    start = spec.start_epoch
    for epoch in itertools.count(start) if spec.epochs is None else range(start, spec.epochs):
        order = list(range(len(items)))
        if spec.shuffle:
            random.Random(f"prompts/{spec.seed}/{epoch}").shuffle(order)  # str seeds hash stably
        for i in order[shard::num_shards]:
            if (gid := f"{name}/e{epoch}/{i}") not in skip:
                yield gid, items[i]


_GROUP_ID = re.compile(r"[^/].*/e(\d+)/(\d+)")


def trained_position(trained: Iterable[str], n_items: int, done_epochs: int = 0) -> dict[str, Any]:
    """What a run has trained, compactly: ``done_epochs`` (epochs ``0 .. done_epochs - 1`` are
    behind it) and the ``trained`` ids of later epochs. ``trained`` holds ids from this module's
    sources (``name/e<epoch>/<index>``); epochs before ``done_epochs`` count as done already.

    An epoch is behind once all its items are trained, or once training has reached two epochs
    later: a group that failed or was dropped as stale is not generated again within a run, so
    its epoch would otherwise never complete and the record would grow for ever."""
    by_epoch: dict[int, list[str]] = {}
    for gid in trained:
        m = _GROUP_ID.fullmatch(gid)
        if m is None:
            raise ValueError(f"group id {gid!r} is not a prompt source's (name/e<epoch>/<index>)")
        epoch = int(m.group(1))
        if epoch >= done_epochs:
            by_epoch.setdefault(epoch, []).append(gid)
    latest = max(by_epoch, default=-1)
    while n_items and (done_epochs + 2 <= latest or len(set(by_epoch.get(done_epochs, ()))) >= n_items):
        by_epoch.pop(done_epochs, None)
        done_epochs += 1
    return {"done_epochs": done_epochs, "trained": sorted(g for ids in by_epoch.values() for g in ids)}

"""The head's state: node and actor records, and the small key-value store used for rendezvous."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from rlactors.base.aio import wait_for
from rlactors.head.placement import NodeResources
from rlactors.wire.client import Connection


@dataclass
class NodeRecord:
    node_id: str
    address: str
    host: str
    resources: NodeResources
    conn: Connection
    alive: bool = True
    last_seen: float = 0.0  # when last heard from, in the head's awake time (rlactors.base.awake)
    labels: dict[str, Any] = field(default_factory=dict)

    def info(self) -> dict[str, Any]:
        """What ``list_nodes`` reports."""
        return {
            "node_id": self.node_id,
            "host": self.host,
            "address": self.address,
            "alive": self.alive,
            "total": self.resources.total,
            "used": self.resources.used,
            "labels": self.labels,
        }


@dataclass
class ActorRecord:
    actor_id: str
    name: str | None
    class_name: str
    request: dict[str, Any]
    resources: dict[str, float]
    owner: str
    detached: bool
    run: str  # the client id of the driver whose run spawned it, directly or through its actors
    max_restarts: int
    node_id: str = ""
    bundle: tuple[str, int] | None = None  # (placement group id, bundle index) it runs in
    starting: bool = False
    pending_exit: str | None = None
    gpus: list[int] = field(default_factory=list)
    state: str = "PENDING"
    address: str = ""
    pid: int = 0
    methods: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    reason: str = ""
    killed: bool = False
    # Who stopped it, when its owner asked (a run's end, a kill, a pool removing it): such an actor
    # is STOPPED in `status`; DEAD is left for deaths nobody asked for.
    stopped_by: str = ""
    died: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    since: float = field(default_factory=time.monotonic)  # when its state last changed

    def info(self) -> dict[str, Any]:
        return {
            "actor_id": self.actor_id,
            "name": self.name,
            "class_name": self.class_name,
            "address": self.address,
            "methods": self.methods,
            "state": self.state,
            "node_id": self.node_id,
            "restarts": self.restarts,
            "pid": self.pid,
            "reason": self.reason,
            "resources": self.resources,
            "gpus": self.gpus,
            "run": self.run,
            "detached": self.detached,
        }

    def event(self) -> dict[str, Any]:
        return {
            "type": "actor",
            "actor_id": self.actor_id,
            "state": self.state,
            "address": self.address,
            "reason": self.reason,
            "name": self.name,
        }


class KVStore:
    """Keys to values, with waiting for a key to appear (no polling)."""

    def __init__(self) -> None:
        self._data: dict[str, Any] = {}
        self._changed = asyncio.Event()

    def put(self, key: str, value: Any) -> None:
        self._data[key] = value
        self._changed.set()
        self._changed = asyncio.Event()

    async def get(self, key: str, wait: float = 0.0) -> Any:
        """The value at ``key``; with ``wait`` > 0, wait up to that long for it to appear (KeyError after)."""
        deadline = time.monotonic() + wait
        while key not in self._data:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KeyError(key)
            with contextlib.suppress(TimeoutError):
                await wait_for(self._changed.wait(), left)
        return self._data[key]

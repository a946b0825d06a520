"""What tests read from a running cluster."""

from __future__ import annotations

from typing import Any


async def worker_pid(cluster: Any, actor: Any) -> int:
    """The process id of ``actor``'s current worker (its running incarnation), as the head records
    it: a test kills that process to make the actor die."""
    for info in await cluster.actors():
        if info["actor_id"] == actor.actor_id:
            return int(info["pid"])
    raise LookupError(f"the cluster has no actor {actor.actor_id}")

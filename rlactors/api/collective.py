"""torch.distributed groups over actors, and rendezvous addresses for external groups.

``Cluster.collective_group(actors, backend)`` makes the actors one torch.distributed world:
ranks in the given order, the master port reserved on rank 0's host, RANK/WORLD_SIZE/
MASTER_ADDR/MASTER_PORT/LOCAL_RANK set in each worker, and ``init_process_group`` run on
each worker's sync thread (where its sync methods, e.g. training steps, also run). A member
that does not join within the timeout is named in the error.

torch is imported only inside worker processes that join a group.
"""

from __future__ import annotations

import asyncio
import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlactors.base.errors import ClusterError

SYSTEM_TARGET = "__rlactors__"


@dataclass
class CollectiveGroup:
    """A torch.distributed world made of actors (rank i = ``members[i]``)."""

    name: str
    backend: str
    master_address: str
    master_port: int
    members: list[Any]

    @property
    def world_size(self) -> int:
        return len(self.members)


def interface_for(ip: str) -> str | None:
    """The name of the network interface that has address ``ip`` (Linux), or None."""
    import fcntl
    import socket
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(
                    s.fileno(), 0x8915, struct.pack("256s", name[:15].encode())
                )  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


class WorkerSystem:
    """Runtime services inside a worker, served under the reserved target ``__rlactors__``."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        # the group this worker joined (name, backend, rank, world size, its members' ids and
        # names by rank): stacks() reports it, so a rank blocked in a collective names who is missing
        self.joined: dict[str, Any] | None = None

    def init_collective(
        self,
        rank: int,
        world_size: int,
        master_address: str,
        master_port: int,
        backend: str,
        local_rank: int,
        timeout_s: float,
        group: str = "default",
        members: list[list[Any]] | None = None,
    ) -> dict[str, Any]:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR=master_address,
            MASTER_PORT=str(master_port),
            LOCAL_RANK=str(local_rank),
        )
        # Make gloo/NCCL use the interface this node is reachable on, unless the user chose one.
        if self.host not in ("127.0.0.1", "localhost") and not (
            os.environ.get("GLOO_SOCKET_IFNAME") and os.environ.get("NCCL_SOCKET_IFNAME")
        ):
            iface = interface_for(self.host)
            if iface:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
                os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
        import torch.distributed as dist

        if dist.is_initialized():
            raise ClusterError("this actor is already in a default process group; destroy it first")
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_address}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.joined = {
            "group": group,
            "backend": backend,
            "rank": rank,
            "world_size": world_size,
            "members": members or [],  # [actor id, name] by rank
        }
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend()}

    def destroy_collective(self) -> bool:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
            self.joined = None
            return True
        return False


async def make_group(
    cluster: Any, members: Sequence[Any], backend: str, timeout: float, name: str
) -> CollectiveGroup:
    """Implementation of :meth:`Cluster.collective_group`."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', not {backend!r}")
    if not members:
        raise ValueError("a collective group needs at least one member")
    nodes = await asyncio.gather(*(cluster.node_of(m) for m in members))
    where = await cluster.reserve_port(nodes[0])
    client = cluster._client
    futs = []
    seen: dict[str, int] = {}
    roster = {"group": name, "members": [[m.actor_id, m.name] for m in members]}
    for rank, (m, node) in enumerate(zip(members, nodes, strict=True)):
        local_rank = seen.get(node, 0)
        seen[node] = local_rank + 1
        args = (rank, len(members), where["host"], where["port"], backend, local_rank, timeout)
        futs.append(
            client.call_actor(m.actor_id, m.address, "init_collective", args, roster, target=SYSTEM_TARGET)
        )
    done, pending = await asyncio.wait(futs, timeout=timeout + 5)
    problems = []
    for rank, (fut, m, node) in enumerate(zip(futs, members, nodes, strict=True)):
        who = f"rank {rank} ({m.name or m.actor_id} on node {node})"
        if fut in pending:
            fut.cancel()
            problems.append(f"{who} did not join within {timeout:.0f}s")
        elif fut.exception() is not None:
            problems.append(f"{who} failed to join: {fut.exception()}")
    if problems:
        joined = [m for f, m in zip(futs, members, strict=True) if f in done and f.exception() is None]
        await asyncio.gather(
            *(
                client.call_actor(m.actor_id, m.address, "destroy_collective", (), {}, target=SYSTEM_TARGET)
                for m in joined
            ),
            return_exceptions=True,
        )
        # Members that never joined come first: they are usually the cause, the others timed out waiting.
        problems.sort(key=lambda p: "did not join" not in p)
        raise ClusterError(
            f"collective group {name!r} ({backend}, {len(members)} members) failed: " + "; ".join(problems)
        )
    return CollectiveGroup(name, backend, where["host"], where["port"], list(members))

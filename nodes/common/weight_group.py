"""SGLang's weight-update group, formed exactly as SGLang forms it.

A trainer and its inference servers share one torch.distributed group outside the trainer's
own world: the trainer's rank 0 is rank 0 (it hosts the TCP store), server ``i`` joins as
``rank_offset + tp_rank``. SGLang's servers join through ``init_custom_process_group``
(``sglang/srt/utils/common.py``): a ``tcp://`` rendezvous, the store wrapped in
``PrefixStore(group_name)``, then torch's own group constructor, which adds ``"{group_name}/"``
and a device prefix to every key. Any other construction waits on other keys: under gloo both
sides time out, under NCCL the first broadcast hangs. So both of our sides, the trainer and the
reference server, call :func:`init_weight_update_group`, which builds the group the same way
(AReaL and slime do the same on their trainer side); ``tests/sglang`` checks it against
SGLang's own function.

Broadcasts go through :func:`broadcast` (``torch.distributed.broadcast`` on the group, source
rank 0), which is how SGLang's receiving side calls it. torch is imported lazily.
"""

from __future__ import annotations

import datetime
from typing import Any

__all__ = [
    "broadcast",
    "destroy_weight_update_group",
    "gpu_uuid",
    "init_weight_update_group",
    "tcp_init_method",
]


def gpu_uuid(device: Any) -> str | None:
    """The physical GPU behind ``device`` (its UUID, the same whatever ``CUDA_VISIBLE_DEVICES``
    calls it), or ``None`` for a CPU. NCCL refuses a group with two ranks on one GPU ("Duplicate
    GPU detected"), so a trainer compares this with each server's before it picks NCCL."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def tcp_init_method(host: str, port: int) -> str:
    """``tcp://host:port``, with an IPv6 host in brackets (as SGLang's ``NetworkAddress`` writes it)."""
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


def init_weight_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 600.0,
) -> Any:
    """Join (rank 0: host) the weight-update group ``group_name``; blocks until every rank joined.

    The construction is SGLang's: rendezvous at ``tcp://master_address:master_port`` (rank 0
    starts the store), ``PrefixStore(group_name, store)``, torch's group constructor with
    ``group_name``, and the group's ranks registered as the identity map so that
    ``broadcast(..., group_src=0)`` works whether or not this process has a default group.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not group_name:
        raise ValueError("a weight-update group needs a non-empty group_name")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        c10d.rendezvous(tcp_init_method(master_address, master_port), rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    # torch's private helper is what SGLang calls: it adds the key prefixes SGLang's side expects
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        dist.PrefixStore(group_name, store),
        group_name=c10d.GroupName(group_name),
        backend_options=None,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast(tensor: Any, group: Any) -> Any:
    """Start a broadcast of ``tensor`` from rank 0 of ``group``; returns the work to ``wait()`` on."""
    import torch.distributed as dist

    return dist.broadcast(tensor, group=group, group_src=0, async_op=True)


def destroy_weight_update_group(group: Any) -> None:
    """Leave the group and drop torch's records of it (its name can then be used again)."""
    import torch.distributed as dist

    dist.destroy_process_group(group)

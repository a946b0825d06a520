"""rlactors: an asyncio-native actor runtime over ZeroMQ and msgpack.

    async with rlactors.init() as cluster:
        counter = await cluster.spawn(Counter, 5, name="c")
        assert await counter.add(2) == 7

Importing this package does not import torch.
"""

from protocols.runtime.codec import register
from rlactors.api.actor import Actor, ActorContext, get_context
from rlactors.api.cluster import Cluster, PlacementGroup, connect
from rlactors.api.collective import CollectiveGroup
from rlactors.api.handle import ActorGroup, ActorHandle, ActorMethod, GroupMethod, drain
from rlactors.api.stacks import StacksReport
from rlactors.base.errors import (
    ActorDiedError,
    ActorNotFoundError,
    ActorUnreachableError,
    ClusterError,
    MessageTooLargeError,
    PlacementError,
    RemoteError,
    RuntimeShutdownError,
)
from rlactors.launch.local import init
from rlactors.wire.methods import backpressure, blocking

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorContext",
    "ActorDiedError",
    "ActorGroup",
    "ActorHandle",
    "ActorMethod",
    "ActorNotFoundError",
    "ActorUnreachableError",
    "Cluster",
    "ClusterError",
    "CollectiveGroup",
    "GroupMethod",
    "MessageTooLargeError",
    "PlacementError",
    "PlacementGroup",
    "RemoteError",
    "RuntimeShutdownError",
    "StacksReport",
    "__version__",
    "backpressure",
    "blocking",
    "connect",
    "drain",
    "get_context",
    "init",
    "register",
]

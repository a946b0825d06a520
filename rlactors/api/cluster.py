"""The user-facing cluster API: :class:`Cluster`, and ``connect()`` to join a running one
(``init()``, which starts an embedded one, is rlactors.launch.local's: it needs the head and a node).

Both work on the caller's running event loop: no second loop, no threads to manage.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

import structlog

from protocols.runtime import codec
from rlactors.api.collective import CollectiveGroup, make_group
from rlactors.api.handle import ActorGroup, ActorHandle
from rlactors.api.runs import read_state, resolve_connect, state_file
from rlactors.api.stacks import ActorStacks, StacksReport, build_report
from rlactors.base import logging as rlog
from rlactors.base.aio import wait_for
from rlactors.base.classpath import class_spec
from rlactors.wire.runtime import RuntimeClient, set_current
from rlactors.wire.security import Security, is_secret, load_secret

log = structlog.get_logger("rlactors.api.cluster")

__all__ = ["Cluster", "ClusterStarter", "EmbeddedCluster", "PlacementGroup", "connect"]

T = TypeVar("T")


class EmbeddedCluster(Protocol):
    """The cluster a connection started and owns (``rlactors.init()``'s head and node agent on the
    driver's loop: :class:`rlactors.launch.local.LocalCluster`); a joined one has none."""

    secret_file: str | None  # the file another process needs to connect over TCP (None over ipc)

    def record(self, folder: Path) -> object:
        """Record how to reach the cluster in ``folder``."""
        ...

    async def shutdown(self, client: RuntimeClient) -> None:
        """Stop the cluster, after this connection's client."""
        ...


class Cluster:
    """A connection to a cluster: spawn and look up actors, watch them, use the KV store."""

    def __init__(self, client: RuntimeClient, *, local: EmbeddedCluster | None = None) -> None:
        self._client = client
        self._local = local

    @property
    def address(self) -> str:
        """The head's address; pass it to :func:`connect` from another process."""
        return self._client.head_address

    @property
    def secret_file(self) -> str | None:
        """The secret file another process needs to :func:`connect` over TCP (None over ipc)."""
        return self._local.secret_file if self._local is not None else None

    def record_run(self, folder: str | os.PathLike[str]) -> str:
        """Make this run reachable from ``folder`` (its run folder) and return the ``rlactors``
        flags that reach it: for an embedded cluster, its address and a credential file (mode 600)
        are written there and removed at shutdown, and the flags are ``--run FOLDER``; a connected
        cluster is reached as it was found ('' for the one ``rlactors up`` started)."""
        if self._local is not None:
            self._local.record(Path(folder))
            return f"--run {folder}"
        if os.environ.get("RLACTORS_ADDRESS") and os.environ["RLACTORS_ADDRESS"] == self.address:
            return ""
        sf = state_file()
        up = read_state(sf).get("address") if sf.exists() else None
        return "" if up == self.address else f"--address {self.address}"

    async def spawn(
        self,
        cls: type[T],
        *args: Any,
        name: str | None = None,
        resources: dict[str, float] | None = None,
        max_concurrency: int = 1000,
        max_restarts: int = 0,
        env: dict[str, str] | None = None,
        node_id: str | None = None,
        strategy: str = "pack",
        detached: bool = False,
        get_if_exists: bool = False,
        placement: tuple[PlacementGroup, int] | None = None,
        control: bool = False,
        **kwargs: Any,
    ) -> ActorHandle[T]:
        """Start an actor of class ``cls`` in its own worker process; ``args``/``kwargs`` go to its constructor.

        ``resources`` (cpu, gpu, custom) are reserved on the chosen node; ``max_restarts``
        restarts the actor (constructor re-run) if its process dies; non-``detached``
        actors are stopped when this connection closes. ``control`` hands the actor the cluster's
        control credential, so that it can spawn actors itself (a worker otherwise holds only the
        call credential: it calls actors and cannot start processes).
        """
        _warn_shadowed_options(cls, kwargs)
        request = {
            "class": class_spec(cls),
            # encoded here and decoded only by the worker, once it trusts the actor's package: the
            # head and the agents pass them on without importing the modules of their types
            "init": [bytes(f) for f in codec.encode((list(args), kwargs))],
            "name": name,
            "resources": resources or {},
            "max_concurrency": max_concurrency,
            "max_restarts": max_restarts,
            "env": env or {},
            "node_id": node_id,
            "strategy": strategy,
            "detached": detached,
            "get_if_exists": get_if_exists,
            "owner": self._client.client_id,
            "run": self._client.run,
            "sys_path": [p for p in sys.path if p and os.path.isdir(p)],  # noqa: ASYNC240 (quick stat calls)
            "cwd": os.getcwd(),
            "placement": [placement[0].group_id, placement[1]] if placement is not None else None,
            "control": control,
        }
        info = await self._client.head_call("spawn", request)
        self._client._update(info["actor_id"], info["state"], info["address"], info.get("reason", ""))
        return ActorHandle.from_info(info)

    async def spawn_group(
        self, cls: type[T], n: int, *args: Any, name: str | None = None, **options: Any
    ) -> ActorGroup[T]:
        """Start ``n`` actors of ``cls`` (named ``name-0`` … when ``name`` is given)."""
        handles = await asyncio.gather(
            *(self.spawn(cls, *args, name=f"{name}-{i}" if name else None, **options) for i in range(n)),
            return_exceptions=True,
        )
        errors = [h for h in handles if isinstance(h, BaseException)]
        if errors:
            await asyncio.gather(
                *(self.kill(h) for h in handles if isinstance(h, ActorHandle)), return_exceptions=True
            )
            raise errors[0]
        return ActorGroup([h for h in handles if isinstance(h, ActorHandle)])

    async def get_actor(self, name: str) -> ActorHandle[Any]:
        """The live actor with this name (or id); raises ActorNotFoundError."""
        info = await self._client.head_call("get_actor", name)
        return ActorHandle.from_info(info)

    async def kill(self, actor: ActorHandle[Any] | str, *, no_restart: bool = True) -> bool:
        """Kill an actor's process (SIGKILL). With ``no_restart=False`` it may be restarted."""
        actor_id = actor.actor_id if isinstance(actor, ActorHandle) else actor
        by = self._client.client_id if no_restart else ""  # an owner's stop: STOPPED in `status`
        return bool(await self._client.head_call("kill", actor_id, no_restart, by))

    async def watch(self, actor: ActorHandle[Any] | str) -> dict[str, Any]:
        """Return when the actor (its current incarnation) dies: ``{state, reason, restarting}``."""
        actor_id = actor.actor_id if isinstance(actor, ActorHandle) else actor
        return await self._client.head_call("watch", actor_id)

    async def actors(self) -> list[dict[str, Any]]:
        return await self._client.head_call("list_actors")

    async def nodes(self) -> list[dict[str, Any]]:
        return await self._client.head_call("list_nodes")

    async def stacks(self, names: Sequence[str] | None = None, timeout_s: float = 5.0) -> StacksReport:
        """What every actor (or these, by name or id) is doing and who waits on whom, for a hung run.

        Each worker answers from its event loop, even while its actor is busy: its calls (running,
        or queued behind ``max_concurrency``) with their await chains or thread stacks, its
        outgoing calls, its threads and its loop's lag. A worker whose loop is stuck is reported
        unresponsive, with the Python stacks it dumps on a signal; a dead actor as dead. This
        process's own pending calls are included as a driver, and other drivers' as their loops last
        noted them for their heartbeats (the report says how old; a call the target no longer has
        is no chain's link, and a driver whose view is older than two notes is reported with its
        loop blocked), so ``rlactors stack`` holds a run's roots too. Returns within about
        ``timeout_s``. ``str(report)`` is readable text; ``report.cycles`` and ``report.waited_on``
        name the wait-for cycles and the actors at the ends of the longest wait chains.
        """
        t0 = time.monotonic()
        call = self._client.head_call("stacks", list(names) if names is not None else None, timeout_s)
        answers = await wait_for(call, timeout_s + 2.0)
        me = self._client.client_id  # our own calls, fresh, rather than as of our last heartbeat
        actors = [ActorStacks.from_answer(a) for a in answers if a.get("actor_id") != me]
        if "RLACTORS_ACTOR_ID" not in os.environ:  # a driver: its pending calls are the chains' roots
            outgoing = self._client.outgoing_calls()
            if outgoing:
                actors.append(ActorStacks.driver(me, outgoing))
        return build_report(actors, time.monotonic() - t0)

    async def kv_put(self, key: str, value: Any) -> None:
        """Store ``value`` at ``key`` in the head's key-value store. Keys under ``secret/`` (the
        servers' API keys) need the control credential: a worker without it gets a PermissionError."""
        await self._client.head_call("kv_put_secret" if is_secret(key) else "kv_put", key, value)

    async def kv_get(self, key: str, wait: float = 0.0) -> Any:
        """The value at ``key`` (KeyError when absent; ``wait`` > 0: wait that long for it). Keys
        under ``secret/`` need the control credential, as for :meth:`kv_put`."""
        return await self._client.head_call("kv_get_secret" if is_secret(key) else "kv_get", key, wait)

    async def reserve_port(self, node_id: str) -> dict[str, Any]:
        """A free port on ``node_id``'s host: ``{host, port}``."""
        return await self._client.head_call("reserve_port", node_id)

    async def node_of(self, actor: ActorHandle[Any]) -> str:
        """The node an actor runs on."""
        return await self._client.head_call("node_of", actor.actor_id)

    async def collective_group(
        self,
        actors: Sequence[ActorHandle[Any]],
        backend: str = "gloo",
        *,
        timeout: float = 120.0,
        name: str = "default",
    ) -> CollectiveGroup:
        """Make ``actors`` one torch.distributed world (rank i = actors[i]); ``gloo`` on CPUs, ``nccl`` on GPUs."""
        return await make_group(self, list(actors), backend, timeout, name)

    async def rendezvous(self, name: str, world_size: int, *, node_id: str | None = None) -> dict[str, Any]:
        """Reserve a master address for an *external* group (e.g. inference servers joining a trainer).

        Returns ``{group_name, master_address, master_port, world_size}``, also published in
        the KV store under ``rendezvous/<name>`` for the other members to read.
        """
        if node_id is None:
            # In an actor, its own node: its agent names it in the worker's environment (rlactors.node.agent).
            node_id = os.environ.get("RLACTORS_NODE_ID") or (await self.nodes())[0]["node_id"]
        return await self._client.head_call("rendezvous", name, world_size, node_id)

    async def reserve(self, bundles: list[dict[str, float]], *, strategy: str = "pack") -> PlacementGroup:
        """Reserve resource bundles atomically (all or nothing), like a placement group.

        Spawn into bundle i with ``spawn(..., placement=(group, i))``. Strategies: ``pack``,
        ``spread``, ``strict_spread`` (one node per bundle). Fails fast with what was asked
        and what is free.
        """
        info = await self._client.head_call("reserve_bundles", bundles, strategy)
        return PlacementGroup(info["group_id"], info["nodes"], self)

    async def close(self) -> None:
        """Disconnect. Actors this connection spawned (unless detached) are stopped; a local cluster shuts down."""
        if self._local is not None:
            await self._local.shutdown(self._client)
            return
        await self._client.leave()

    shutdown = close

    async def __aenter__(self) -> Cluster:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


SPAWN_OPTIONS = frozenset(
    (
        "name",
        "resources",
        "max_concurrency",
        "max_restarts",
        "env",
        "node_id",
        "strategy",
        "detached",
        "get_if_exists",
        "placement",
        "control",
    )
)
_warned: set[type] = set()


def _warn_shadowed_options(cls: type[Any], kwargs: dict[str, Any]) -> None:
    """spawn() keeps its own options; a constructor parameter of the same name never receives them."""
    if cls in _warned:
        return
    import inspect

    try:
        params = set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return
    shadowed = sorted(params & SPAWN_OPTIONS)
    if shadowed:
        _warned.add(cls)
        log.warning(
            "constructor parameters shadowed by spawn() options: pass them positionally",
            cls=cls.__qualname__,
            params=shadowed,
        )


class PlacementGroup:
    """Reserved resource bundles; ``nodes[i]`` is where bundle i lives."""

    def __init__(self, group_id: str, nodes: list[str], cluster: Cluster) -> None:
        self.group_id = group_id
        self.nodes = nodes
        self._cluster = cluster

    def __len__(self) -> int:
        return len(self.nodes)

    async def release(self) -> None:
        """Kill actors in the group and return its resources."""
        await self._cluster._client.head_call("release_bundles", self.group_id)

    def __repr__(self) -> str:
        return f"<PlacementGroup {self.group_id} on {self.nodes}>"


class ClusterStarter:
    """Both ``await rlactors.init()`` and ``async with rlactors.init() as cluster``."""

    def __init__(self, coro_factory: Any) -> None:
        self._factory = coro_factory
        self._cluster: Cluster | None = None

    def __await__(self) -> Generator[Any, None, Cluster]:
        return self._factory().__await__()

    async def __aenter__(self) -> Cluster:
        self._cluster = await self._factory()
        return self._cluster

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._cluster is not None:
            await self._cluster.close()


def connect(
    address: str | None = None,
    *,
    secret_file: str | None = None,
    timeout: float | None = None,
    security: str | None = None,
) -> ClusterStarter:
    """Join an existing cluster from this process's running loop.

    ``address`` defaults to ``$RLACTORS_ADDRESS`` or the cluster last started with
    ``rlactors up``; the secret to ``$RLACTORS_SECRET_FILE`` or that cluster's secret file.
    ``timeout`` (default ``$RLACTORS_CONNECT_TIMEOUT`` or 30 s) bounds the wait for the head.
    """

    async def _connect() -> Cluster:
        rlog.ensure_logging()
        addr, secret, state_mechanism = resolve_connect(address, secret_file)
        mechanism = security or os.environ.get("RLACTORS_SECURITY") or state_mechanism or "curve"
        sec = Security(load_secret(secret), mechanism) if secret else None  # tcp, or a recorded run's ipc
        client = RuntimeClient(addr, sec)
        await client.start(timeout=timeout or float(os.environ.get("RLACTORS_CONNECT_TIMEOUT", "30")))
        set_current(client)
        return Cluster(client)

    return ClusterStarter(_connect)

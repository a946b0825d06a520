"""The head: the cluster's control plane, itself served on the runtime.

It keeps the node table (with heartbeats), the actor registry (ids, names, addresses,
state, restarts), resource accounting, a small key-value store for rendezvous, and it
publishes actor-state events to every connected client, which is how calls to a dead
actor fail fast everywhere. It is never on the data path of actor calls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from rlactors.base.aio import wait_for
from rlactors.base.awake import awake_clock
from rlactors.base.errors import ActorNotFoundError, ClusterError, PlacementError
from rlactors.base.procs import exit_reason
from rlactors.head.placement import BundleTable, NodeResources, choose_node, normalise_request
from rlactors.head.registry import ActorRecord, KVStore, NodeRecord
from rlactors.head.sessions import Sessions
from rlactors.wire.client import Connection
from rlactors.wire.security import SECRET_PREFIX, Security, control_plane, is_secret
from rlactors.wire.transport import HEARTBEAT_TIMEOUT_MS

log = structlog.get_logger("rlactors.head.head")

START_TIMEOUT_S = 3600.0  # safety net; a lost node fails its calls at once
MAX_DEAD_ACTORS = 100  # records of dead actors kept (for status, and to say why a late call fails)
AGENT_CALL_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0  # a run's actors get this long for their on_stop hooks when the run ends
STATUS_TIMEOUT_S = 3.0  # an agent that does not report its workers within this: their activity is unknown


class Head:
    """Control-plane service. Methods are called remotely with target ``"head"``."""

    def __init__(
        self,
        security: Security | None = None,
        *,
        node_timeout: float = 5.0,
        client_timeout: float | None = None,
        fence_after: float | None = None,
        retain_finished: float = 0.0,
    ) -> None:
        """``retain_finished``: seconds ``status`` lists a finished run's STOPPED actors after they
        stopped (0: no time bound; :data:`MAX_DEAD_ACTORS` bounds the ended ones either way)."""
        if node_timeout <= 0 or (client_timeout is not None and client_timeout <= 0):
            raise ValueError(
                f"node_timeout and client_timeout must be > 0 seconds, got {node_timeout} and {client_timeout}"
            )
        if fence_after is not None and fence_after <= HEARTBEAT_TIMEOUT_MS / 1000:
            raise ValueError(
                f"fence_after must be more than the heartbeat timeout ({HEARTBEAT_TIMEOUT_MS / 1000:g}s), "
                f"got {fence_after:g}"
            )
        self.security = security
        self.node_timeout = node_timeout
        # A worker (with restarts left) silent this long is killed by its agent and restarted.
        self.fence_after = fence_after or node_timeout + HEARTBEAT_TIMEOUT_MS / 1000
        self.nodes: dict[str, NodeRecord] = {}
        # Nodes whose agent runs in this process, on this loop (the embedded local cluster): its
        # heartbeats late means this process is short of CPU, not a node lost, so no deadline.
        self.in_process: set[str] = set()
        self.actors: dict[str, ActorRecord] = {}
        self._dead: collections.deque[str] = collections.deque()  # ids of dead actors, oldest first
        self.names: dict[str, str] = {}
        self.kv = KVStore()
        self.client_timeout = client_timeout or max(10.0, 3 * node_timeout)
        self.retain_finished = retain_finished
        self.sessions = Sessions(self.client_timeout)
        self.clients: dict[str, dict[str, Any]] = {}  # client id -> pid, host, cmd, run (while connected)
        # a driver's pending calls as of its last heartbeat: (when received, calls), for stacks()
        self.driver_calls: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        self._client_left = asyncio.Event()
        # placement group id -> bundles: {node_id, resources, gpus, actor}
        self.bundles = BundleTable()
        self._monitor: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self.started = time.time()
        self.on_exit: Callable[[], None] | None = None  # set by a standalone head process

    def _spawn_bg(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def start(self) -> None:
        self._monitor = asyncio.get_running_loop().create_task(self._watch_nodes(), name="head-node-monitor")

    async def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        for n in self.nodes.values():
            n.conn.close()

    # --- clients ------------------------------------------------------------------------------

    async def hello(self, client_id: str, about: dict[str, Any] | None = None) -> dict[str, Any]:
        """A client connects; ``about`` (pid, host, cmd) names its run in errors and ``status``."""
        self.sessions.beat(client_id)
        self.clients[client_id] = dict(about or {})
        return {"ok": True, "nodes": len(self.nodes), "client_heartbeat": self.client_timeout / 5}

    async def client_alive(
        self, client_id: str, calls: list[dict[str, Any]] | None = None, noted_s: float = 0.0
    ) -> bool:
        """Heartbeat of a connected client; its non-detached actors outlive it only while it beats.
        ``calls``: a driver's pending calls, for ``stacks()`` asked by another process, as its loop
        noted them ``noted_s`` seconds before this beat.

        False: the client had been given up (silent past ``client_timeout``) and must follow the
        actor events again; from now on it counts as connected again.
        """
        if calls:
            self.driver_calls[client_id] = (time.monotonic() - noted_s, calls)
        else:
            self.driver_calls.pop(client_id, None)
        return self.sessions.beat(client_id)

    async def client_closed(self, client_id: str) -> int:
        """The client leaves: the actors it spawned (a driver: its whole run's) are stopped."""
        self.sessions.close(client_id)
        by = f"{self.who(client_id)}, which left"
        try:
            return await self.release_owner(client_id, by=by)
        finally:  # a head waiting for its runs to end stops only once their actors have
            self._forget_client(client_id)

    def _forget_client(self, client_id: str) -> None:
        self.clients.pop(client_id, None)
        self.driver_calls.pop(client_id, None)
        self._client_left.set()
        self._client_left = asyncio.Event()

    def drivers(self) -> list[str]:
        """The connected clients that drive a run (a driver's run is its own client id)."""
        return [cid for cid, about in self.clients.items() if about.get("run") == cid]

    async def runs_ended(self) -> None:
        """Return once no driver is connected (they leave, or fall silent past client_timeout)."""
        while self.drivers():
            await self._client_left.wait()

    async def subscribe(self, client_id: str) -> AsyncIterator[dict[str, Any]]:
        """Actor-state events: a snapshot first, then every change. Ends when the client is gone."""
        snapshot = {"type": "snapshot", "actors": [a.event() for a in self.actors.values()]}
        async for event in self.sessions.subscribe(client_id, snapshot):
            yield event

    def _publish(self, rec: ActorRecord) -> None:
        rec.since = time.monotonic()
        changed, rec.changed = rec.changed, asyncio.Event()
        changed.set()
        self.sessions.publish(rec.event())

    # --- nodes --------------------------------------------------------------------------------

    @control_plane
    async def register_node(
        self,
        node_id: str,
        address: str,
        host: str,
        resources: dict[str, float],
        labels: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        old = self.nodes.get(node_id)
        if old is not None:
            # A node that comes back: its old actors are gone (their processes were on it).
            self._node_lost(old, "node re-registered")
            old.conn.close()
        res = NodeResources(total={k: float(v) for k, v in resources.items()})
        self.nodes[node_id] = NodeRecord(
            node_id,
            address,
            host,
            res,
            Connection(address, self.security, name=f"agent:{node_id}"),
            last_seen=awake_clock().now(),
            labels=labels or {},
        )
        log.debug("node registered", node=node_id, host=host, resources=resources)
        return {
            "ok": True,
            "heartbeat_interval": max(0.2, self.node_timeout / 5),
            "fence_after": self.fence_after,
        }

    async def heartbeat(self, node_id: str) -> bool:
        """False tells the agent to register again (it was declared dead)."""
        n = self.nodes.get(node_id)
        if n is None or not n.alive:
            return False
        n.last_seen = awake_clock().now()
        return True

    async def _watch_nodes(self) -> None:
        """Declare dead the nodes (and give up the clients) silent past their timeout.

        Silence is counted in awake time (``rlactors.base.awake``): a head that was itself stopped or
        blocked heard nothing because it was not listening, so its stall extends every deadline.
        """
        clock = awake_clock()
        stalled = clock.stalled_s
        while True:
            await asyncio.sleep(min(1.0, self.node_timeout / 5))
            now = clock.now()
            if clock.stalled_s - stalled >= 1.0:
                log.warning(
                    "the head was stalled (stopped or blocked); extending every node's and client's deadline by it",
                    stalled_s=round(clock.stalled_s - stalled, 1),
                )
            stalled = clock.stalled_s
            for cid in self.sessions.expire():
                self._forget_client(cid)
                victims = self._owned_by(cid)
                if victims:
                    log.warning(
                        "client stopped answering; stopping the actors it owned",
                        client=cid,
                        actors=len(victims),
                    )
                    by = (
                        f"the head: its run's client {cid} was silent for more than "
                        f"{self.client_timeout:g}s (client_timeout)"
                    )
                    for r in victims:
                        self._spawn_bg(self.kill(r.actor_id, by=by))
            for n in list(self.nodes.values()):
                if n.alive and n.node_id not in self.in_process and now - n.last_seen > self.node_timeout:
                    log.warning(
                        "node stopped answering; declaring it dead",
                        node=n.node_id,
                        host=n.host,
                        silent_s=round(now - n.last_seen, 1),
                    )
                    self._node_lost(n, f"node {n.node_id} ({n.host}) stopped answering")

    def _node_lost(self, n: NodeRecord, reason: str) -> None:
        n.alive = False
        n.conn.fail_all(ClusterError(reason))  # e.g. a spawn waiting on that agent fails now
        for rec in list(self.actors.values()):
            if rec.node_id == n.node_id and rec.state in ("ALIVE", "PENDING", "RESTARTING"):
                self._mark_dead(rec, reason)

    def _alive_nodes(self) -> dict[str, NodeResources]:
        return {nid: n.resources for nid, n in self.nodes.items() if n.alive}

    # --- actors -------------------------------------------------------------------------------

    @control_plane
    async def spawn(self, request: dict[str, Any]) -> dict[str, Any]:
        name = request.get("name")
        if name is not None:
            existing = self.names.get(name)
            if existing is not None:
                if request.get("get_if_exists"):
                    rec = self.actors[existing]
                    if rec.state != "ALIVE":  # another caller is still starting it
                        await wait_for(self._until_alive(rec), START_TIMEOUT_S)
                    if rec.state != "ALIVE":
                        raise ActorNotFoundError(f"actor {name!r} died while starting: {rec.reason}")
                    return rec.info()
                raise ValueError(self._name_taken(self.actors[existing]))
        res = normalise_request(request.get("resources"))
        placement = request.get("placement")
        bundle: dict[str, Any] | None = None
        if placement is not None:
            bundle = self.bundles.free_bundle(placement[0], int(placement[1]), set(self._alive_nodes()))
            nid, res = bundle["node_id"], bundle["resources"]
        else:
            nid = choose_node(
                self._alive_nodes(),
                res,
                strategy=request.get("strategy", "pack"),
                node_id=request.get("node_id"),
            )
        rec = ActorRecord(
            actor_id=uuid.uuid4().hex[:12],
            name=name,
            class_name=request["class"]["qualname"],
            request=request,
            resources=res,
            owner=request.get("owner", ""),
            detached=bool(request.get("detached")),
            run=request.get("run") or request.get("owner", ""),
            max_restarts=int(request.get("max_restarts", 0)),
            node_id=nid,
        )
        if placement is not None and bundle is not None:
            rec.bundle = (placement[0], int(placement[1]))
            rec.gpus = list(bundle["gpus"])
            bundle["actor"] = rec.actor_id
        else:
            rec.gpus = self.nodes[nid].resources.acquire(res)
        self.actors[rec.actor_id] = rec
        if name is not None:
            self.names[name] = rec.actor_id
        try:
            await self._start(rec)
        except BaseException:  # any exit forgets the half-started record, then re-raises
            self._forget(rec)
            raise
        log.debug("actor started", actor=rec.actor_id, name=name, cls=rec.class_name, node=nid)
        return rec.info()

    async def _start(self, rec: ActorRecord) -> None:
        node = self.nodes[rec.node_id]
        spec = dict(
            rec.request, actor_id=rec.actor_id, gpus=rec.gpus, restarts=rec.restarts, node_id=rec.node_id
        )
        # While starting, an exit report for this actor is parked: it may overtake the reply below.
        rec.starting, rec.pending_exit = True, None
        try:
            call = node.conn.call("start_worker", (rec.actor_id, spec), {}, target="agent")
            started = await wait_for(call, START_TIMEOUT_S)
        finally:
            rec.starting = False
        if rec.state == "DEAD" or rec.killed:  # killed while (re)starting
            # best effort: the agent may be gone too, and the record is dead either way
            with contextlib.suppress(Exception):
                await wait_for(
                    node.conn.call("kill_worker", (rec.actor_id,), {}, target="agent"), AGENT_CALL_TIMEOUT_S
                )
            raise ActorNotFoundError(f"actor {rec.name or rec.actor_id} was killed while starting")
        rec.address, rec.pid, rec.methods = started["address"], started["pid"], started["methods"]
        rec.state, rec.reason = "ALIVE", ""
        self._publish(rec)
        if rec.pending_exit is not None:  # it died right after reporting ready
            self._spawn_bg(self.actor_exited(rec.actor_id, rec.pending_exit))

    def _release(self, rec: ActorRecord) -> None:
        if rec.state == "DEAD":
            return
        if rec.bundle is not None:
            self.bundles.vacate(rec.bundle[0], rec.bundle[1], rec.actor_id)
            return
        node = self.nodes.get(rec.node_id)
        if node is not None:
            node.resources.release(rec.resources, rec.gpus)

    def _forget(self, rec: ActorRecord) -> None:
        self.actors.pop(rec.actor_id, None)
        if rec.name is not None and self.names.get(rec.name) == rec.actor_id:
            del self.names[rec.name]
        self._release(rec)

    def _mark_dead(self, rec: ActorRecord, reason: str) -> None:
        self._release(rec)
        rec.state, rec.reason = "DEAD", reason
        if rec.name is not None and self.names.get(rec.name) == rec.actor_id:
            del self.names[rec.name]
        rec.died.set()
        self._publish(rec)
        self._dead.append(rec.actor_id)
        while len(self._dead) > MAX_DEAD_ACTORS:
            old = self.actors.get(self._dead.popleft())
            if old is not None and old.state == "DEAD":
                del self.actors[old.actor_id]

    async def actor_exited(self, actor_id: str, reason: str) -> None:
        """Called by a node agent the moment a worker process exits."""
        rec = self.actors.get(actor_id)
        if rec is None or rec.state == "DEAD":
            return
        if rec.starting:
            rec.pending_exit = reason
            return
        log.warning("actor process exited", actor=actor_id, name=rec.name, reason=reason)
        if rec.killed and rec.stopped_by:  # a clean exit is what was asked for: no need to say it
            clean = reason == exit_reason(0)
            reason = f"stopped by {rec.stopped_by}" + ("" if clean else f" ({reason})")
        node = self.nodes.get(rec.node_id)
        if rec.killed or rec.restarts >= rec.max_restarts or node is None or not node.alive:
            self._mark_dead(rec, reason)
            return
        rec.state, rec.reason = "RESTARTING", reason
        rec.died.set()
        rec.died = asyncio.Event()
        self._publish(rec)
        rec.restarts += 1
        try:
            await self._start(rec)
            log.info("actor restarted", actor=actor_id, name=rec.name, restarts=rec.restarts)
        except Exception as e:  # whatever stopped the restart, the actor is dead and callers must hear so
            self._mark_dead(rec, f"restart failed: {e}")

    async def get_actor(self, name: str) -> dict[str, Any]:
        aid = self.names.get(name) or (name if name in self.actors else None)
        rec = self.actors.get(aid) if aid else None
        if rec is None or rec.state == "DEAD":
            raise ActorNotFoundError(f"no live actor named {name!r}; alive: {sorted(self.names)}")
        if rec.state != "ALIVE":
            await wait_for(self._until_alive(rec), timeout=300)
        return rec.info()

    async def _until_alive(self, rec: ActorRecord) -> None:
        while rec.state not in ("ALIVE", "DEAD"):
            await rec.changed.wait()

    @control_plane(what="killing an actor")  # a worker owns no actor: it cannot spawn one
    async def kill(self, actor_id: str, no_restart: bool = True, by: str = "", grace: float = 0.0) -> bool:
        """Kill an actor's process; ``by`` (who asked) makes it STOPPED rather than DEAD. With
        ``grace`` its agent asks it to stop first (its ``on_stop`` runs) and kills it after that long."""
        rec = self.actors.get(actor_id)
        if rec is None or rec.state == "DEAD":
            return False
        rec.killed = rec.killed or no_restart
        if no_restart and by and not rec.stopped_by:
            rec.stopped_by = by
        node = self.nodes.get(rec.node_id)
        if node is not None and node.alive:
            died = rec.died
            call = node.conn.call("kill_worker", (actor_id, grace), {}, target="agent")
            if await wait_for(call, AGENT_CALL_TIMEOUT_S):
                # Return once the agent has seen the exit, so the kill is visible to everyone.
                with contextlib.suppress(TimeoutError):
                    await wait_for(died.wait(), 10 + grace)
        else:
            self._mark_dead(rec, f"stopped by {rec.stopped_by}" if rec.stopped_by else "killed")
        return True

    async def watch(self, actor_id: str) -> dict[str, Any]:
        """Return when this incarnation of the actor dies (also when it will be restarted)."""
        rec = self.actors.get(actor_id)
        if rec is None:
            return {"actor_id": actor_id, "state": "DEAD", "reason": "unknown actor"}
        if rec.state != "DEAD":
            await rec.died.wait()
        return {
            "actor_id": actor_id,
            "state": rec.state,
            "reason": rec.reason,
            "restarting": rec.state == "RESTARTING",
        }

    def _owned_by(self, client_id: str) -> list[ActorRecord]:
        """The live non-detached actors a client spawned, and, for a driver, every one of its run
        (those its actors spawned too: a pool's servers are the run's, not the pool's alone)."""
        return [
            r
            for r in self.actors.values()
            if client_id in (r.owner, r.run) and not r.detached and r.state != "DEAD"
        ]

    def who(self, client_id: str, cmd: bool = False) -> str:
        """A client as a person finds it: its id, pid and host (and command line)."""
        about = self.clients.get(client_id)
        if not about:
            return client_id
        line = f": {about.get('cmd', '')}" if cmd else ""
        return f"{client_id} (pid {about.get('pid')} on {about.get('host')}{line})"

    def run_about(self, run: str) -> str:
        """A run as a person finds it: its driver's command, pid and host, or that it has ended."""
        if run not in self.clients:
            return f"run {run} (its driver has left)"
        return f"run {self.who(run, cmd=True)}"

    def _name_taken(self, rec: ActorRecord) -> str:
        taken = f"an actor named {rec.name!r} already exists ({rec.actor_id}, {rec.state})"
        if rec.detached or rec.run not in self.clients:
            return f"{taken}; kill it first (cluster.kill) or pick another name"
        about = self.clients[rec.run]
        return (
            f"{taken}: it belongs to {self.run_about(rec.run)}, which is still running; stop that run "
            f"(kill -TERM {about.get('pid')} on {about.get('host')}) or pick another name"
        )

    async def release_owner(self, owner: str, by: str = "") -> int:
        """Kill the non-detached actors a departing client spawned (a driver: all of its run's)."""
        victims = self._owned_by(owner)
        by = by or f"{owner}, which left"
        stops = (self.kill(r.actor_id, by=by, grace=STOP_GRACE_S) for r in victims)
        await asyncio.gather(*stops, return_exceptions=True)
        return len(victims)

    # --- placement groups ----------------------------------------------------------------------

    @control_plane(what="creating a placement group")
    async def reserve_bundles(
        self, bundles: list[dict[str, float]], strategy: str = "pack"
    ) -> dict[str, Any]:
        """Reserve resource bundles atomically (all or nothing); actors then spawn into them."""
        gid, nodes = self.bundles.reserve(self._alive_nodes(), bundles, strategy)
        return {"group_id": gid, "nodes": nodes}

    @control_plane(what="removing a placement group")
    async def release_bundles(self, group_id: str) -> None:
        """Kill the group's actors and give its resources back to the nodes."""
        bundles = self.bundles.groups.get(group_id)
        if bundles is None:
            return
        await asyncio.gather(*(self.kill(b["actor"]) for b in bundles if b["actor"]), return_exceptions=True)
        del self.bundles.groups[group_id]
        for b in bundles:
            node = self.nodes.get(b["node_id"])
            if node is not None:
                node.resources.release(b["resources"], b["gpus"])

    # --- views, kv, ports -----------------------------------------------------------------------

    async def list_actors(self) -> list[dict[str, Any]]:
        return [r.info() for r in self.actors.values()]

    async def list_nodes(self) -> list[dict[str, Any]]:
        return [n.info() for n in self.nodes.values()]

    async def status(self) -> dict[str, Any]:
        """For operators (`rlactors status`): nodes and actors, live ones first, each with the
        seconds since it was last heard from and, for actors, what they are doing. A finished run's
        STOPPED actors are dropped ``retain_finished`` seconds after they stopped."""
        self._drop_finished()
        alive = [n for n in self.nodes.values() if n.alive]
        reports = await asyncio.gather(
            *(
                wait_for(n.conn.call("worker_status", (), {}, target="agent"), STATUS_TIMEOUT_S)
                for n in alive
            ),
            return_exceptions=True,
        )
        workers = {w["actor_id"]: w for r in reports if isinstance(r, list) for w in r}
        now, awake = time.monotonic(), awake_clock().now()
        nodes = [dict(n.info(), heard_s=round(awake - n.last_seen, 3)) for n in self.nodes.values()]
        actors = []
        for rec in self.actors.values():
            w = workers.get(rec.actor_id)
            if w is None or w["pid"] != rec.pid or rec.state != "ALIVE":
                w = {"heard_s": None, "activity": None}
            stopped = rec.state == "DEAD" and bool(rec.stopped_by)
            actors.append(
                dict(
                    rec.info(),
                    state="STOPPED" if stopped else rec.state,
                    stopped_by=rec.stopped_by or None,
                    state_s=round(now - rec.since, 3),
                    heard_s=w["heard_s"],
                    activity=w["activity"],
                )
            )
        order = {"ALIVE": 0, "PENDING": 1, "RESTARTING": 1, "DEAD": 2, "STOPPED": 3}
        nodes.sort(key=lambda n: (not n["alive"], n["node_id"]))
        actors.sort(key=lambda a: (order.get(a["state"], 1), a["run"]))  # the ended: by run
        runs = {d: self.who(d, cmd=True) for d in self.drivers()}  # whose the live actors are
        return {"nodes": nodes, "actors": actors, "runs": runs, "retain_finished_s": self.retain_finished}

    def _drop_finished(self) -> None:
        """Forget the STOPPED actors of runs whose driver has left, ``retain_finished`` seconds
        after they stopped. DEAD ones (deaths nobody asked for) stay, as ever, with their cause."""
        if self.retain_finished <= 0:
            return
        now = time.monotonic()
        for rec in list(self.actors.values()):
            stopped = rec.state == "DEAD" and rec.stopped_by
            if stopped and rec.run not in self.clients and now - rec.since >= self.retain_finished:
                del self.actors[rec.actor_id]
        self._dead = collections.deque(i for i in self._dead if i in self.actors)

    async def stacks(self, names: list[str] | None = None, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """For ``cluster.stacks()``: each actor (these names or ids; None: all) as its node agent
        reports it (see ``NodeAgent.worker_stacks``), or dead, or unknown. Bounded by ``timeout_s``:
        a node that does not answer in time has its actors reported as not answering."""
        if names is None:
            recs = list(self.actors.values())
            unknown: list[str] = []
        else:
            by_name = {r.name: r for r in self.actors.values() if r.name is not None}
            by_name.update({n: self.actors[a] for n, a in self.names.items()})  # live ones win
            recs = [by_name.get(n) or self.actors.get(n) for n in names]  # type: ignore[misc]
            unknown = [n for n, r in zip(names, recs, strict=True) if r is None]
            recs = [r for r in recs if r is not None]
        live: dict[str, list[str]] = {}
        for r in recs:
            node = self.nodes.get(r.node_id)
            if r.state == "ALIVE" and node is not None and node.alive:
                live.setdefault(r.node_id, []).append(r.actor_id)

        async def ask(node_id: str, ids: list[str]) -> list[dict[str, Any]]:
            call = self.nodes[node_id].conn.call("worker_stacks", (ids, timeout_s * 0.7), {}, target="agent")
            return await wait_for(call, timeout_s * 0.85)

        replies = await asyncio.gather(*(ask(n, ids) for n, ids in live.items()), return_exceptions=True)
        workers = {w["actor_id"]: w for r in replies if isinstance(r, list) for w in r}
        out = []
        for r in recs:
            entry = dict(r.info())
            entry.pop("methods", None)
            w = workers.get(r.actor_id)
            if w is not None and w["pid"] == r.pid:
                entry.update(w)
            elif r.state == "ALIVE":
                entry["responsive"] = False  # its node did not answer in time, or it just restarted
            out.append(entry)
        out.extend(
            {"name": n, "actor_id": "", "state": "UNKNOWN", "reason": "no such actor"} for n in unknown
        )
        if names is None:  # the drivers' pending calls, as their loops last noted them (aged since)
            now = time.monotonic()
            for client_id, (at, calls) in self.driver_calls.items():
                if client_id in self.clients:
                    aged = [dict(c, age_s=round(c["age_s"] + now - at, 3)) for c in calls]
                    out.append(
                        {
                            "name": client_id,
                            "actor_id": client_id,
                            "state": "DRIVER",
                            "outgoing": aged,
                            # how old that view is, and how often a loop that runs renews it
                            "noted_s": round(now - at, 3),
                            "note_interval_s": self.client_timeout / 5,
                        }
                    )
        return out

    async def kv_put(self, key: str, value: Any) -> None:
        _not_secret(key, "writing")
        self.kv.put(key, value)

    async def kv_get(self, key: str, wait: float = 0.0) -> Any:
        """The value at ``key``; with ``wait`` > 0, wait up to that long for it to appear."""
        _not_secret(key, "reading")
        return await self.kv.get(key, wait)

    @control_plane(what="writing a secret key")
    async def kv_put_secret(self, key: str, value: Any) -> None:
        """``kv_put`` for a key under ``secret/`` (the servers' API keys): control credential only."""
        self.kv.put(key, value)

    @control_plane(what="reading a secret key")
    async def kv_get_secret(self, key: str, wait: float = 0.0) -> Any:
        """``kv_get`` for a key under ``secret/``: control credential only."""
        return await self.kv.get(key, wait)

    async def reserve_port(self, node_id: str) -> dict[str, Any]:
        n = self.nodes.get(node_id)
        if n is None or not n.alive:
            raise PlacementError(f"no alive node {node_id!r}")
        port = await wait_for(n.conn.call("reserve_port", (), {}, target="agent"), AGENT_CALL_TIMEOUT_S)
        return {"host": n.host, "port": port}

    async def rendezvous(self, name: str, world_size: int, node_id: str) -> dict[str, Any]:
        """Reserve a master address for an external process group and publish it in the KV store."""
        where = await self.reserve_port(node_id)
        info = {
            "group_name": name,
            "master_address": where["host"],
            "master_port": where["port"],
            "world_size": world_size,
        }
        await self.kv_put(f"rendezvous/{name}", info)
        return info

    async def node_of(self, actor_id: str) -> str:
        rec = self.actors.get(actor_id)
        if rec is None:
            raise ActorNotFoundError(f"no actor {actor_id}")
        return rec.node_id

    @control_plane
    async def shutdown_cluster(self) -> int:
        """Stop every agent (and its workers), then the head process itself (`rlactors down`)."""
        alive = [n for n in self.nodes.values() if n.alive]
        await asyncio.gather(
            *(wait_for(n.conn.call("shutdown", (), {}, target="agent"), 10) for n in alive),
            return_exceptions=True,
        )
        for n in alive:
            self._node_lost(n, "cluster shut down")
        if self.on_exit is not None:
            asyncio.get_running_loop().call_later(0.2, self.on_exit)
        return len(alive)


def _not_secret(key: str, doing: str) -> None:
    if is_secret(key):
        raise PermissionError(
            f"{doing} the key {key!r} needs the cluster's control credential (keys under "
            f"{SECRET_PREFIX!r} are secret): use cluster.kv_get/kv_put, which ask for it"
        )

"""Publishing a policy version: the orchestration around the algorithm, out of the recipe's loop.

:class:`PolicySync` gets the trainer ranks' weights to the inference servers and the new version
to the rest of the plane: it forms the weight-update group (its store on trainer rank 0's host),
and on :meth:`PolicySync.publish` applies the inference pool's changes (nodes/inference/pool.py)
and drops servers that stopped answering (re-forming the group when its members changed: a joiner
enters here, before anything pauses), pauses rollout dispatch, pushes the weights (once more
without a server that died during the push), checks that each joiner reports the new version and
only then adds it to routing, tells the governor and the rollout actors the new version and the
live servers, resumes dispatch and then continues the servers, also when the push failed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx  # control calls, a few per server per push: client CPU per call (what chose /generate's wire) does not count
import structlog

import rlactors
from protocols.http.auth import ServerKeys
from protocols.http.sglang import ContinueGenerationRequest, request_body

if TYPE_CHECKING:
    from nodes.inference.pool import InferencePool
    from nodes.plane.governor import GovernorActor
    from nodes.rollout.actor import RolloutHandle
    from nodes.trainer.rank import TrainerRank

__all__ = ["HEALTH_TIMEOUT_S", "PolicySync"]

log = structlog.get_logger(__name__)

# SGLang 0.5.23's /health runs a one-token generation and gives up itself after 20 s
# (SGLANG_HEALTH_CHECK_TIMEOUT), answering 503; under load it can take most of that. Wait past it.
HEALTH_TIMEOUT_S = 40.0


class PolicySync:
    """Weights from ``ranks`` (an ``rlactors.ActorGroup`` of TrainerRank) to the servers at ``urls``;
    versions to ``governor`` and ``rollouts`` (set them with :meth:`attach` once they exist).
    ``live`` is the servers the rollout actors route to; ``group`` those in the weight-update
    group (``live`` and joiners). ``pool`` (the ``inference-pool`` actor, optional) says which
    servers joined and left. ``report`` gets a line for each thing a user should see (a server
    dropped or joined, a push retried); by default it is logged as a warning."""

    def __init__(
        self,
        cluster: rlactors.Cluster,
        ranks: rlactors.ActorGroup[TrainerRank],
        urls: list[str],
        report: Callable[[str], Any] | None = None,
        pool: rlactors.ActorHandle[InferencePool] | None = None,
        keys: ServerKeys | None = None,
    ) -> None:
        self.cluster, self.ranks, self.pool = cluster, ranks, pool
        self.live = list(urls)
        self.group = list(urls)
        self.planned = self.told = len(urls)  # governor's max_concurrent is for this many; told it
        self.joined = self.left = 0  # servers that joined / left routing, in all (metrics)
        self.governor: rlactors.ActorHandle[GovernorActor] | None = None
        self.rollouts: list[RolloutHandle] = []
        self.report = report or (lambda line: log.warning(line))
        # keys: the servers' (protocols.http.auth); each call carries the one its route needs
        self.keys = keys or ServerKeys()
        self.http = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S, auth=self.keys or None)

    def attach(self, governor: rlactors.ActorHandle[GovernorActor], rollouts: list[RolloutHandle]) -> None:
        """The rollout plane that :meth:`publish` pauses, resumes and tells new versions to."""
        self.governor, self.rollouts = governor, list(rollouts)

    async def connect(self) -> None:
        """Form the weight-update group with the live servers: its store on trainer rank 0's host,
        at the address that host registered with (reachable from servers on other hosts), on a
        port its agent reserved."""
        where = await self.cluster.rendezvous(
            f"weights-{uuid.uuid4().hex[:8]}",
            1 + len(self.group),
            node_id=await self.cluster.node_of(self.ranks[0]),
        )
        await self.ranks.connect_servers(self.group, where["master_address"], where["master_port"])

    async def publish(self, version: int) -> dict[str, float]:
        """Push the ranks' weights (at ``version``) to the live servers and publish ``version``.
        Returns rank 0's push statistics.

        The servers stay paused after the push until the rollout actors have re-posted what the
        pause held (a paused server holds a new request until it continues, as SGLang's tokenizer
        manager does), so each server has work the moment it continues: no idle gap between
        ``/continue_generation`` and the first re-posted request.
        """
        await self.apply_changes()
        await asyncio.gather(*(r.pause() for r in self.rollouts))
        push: dict[str, float] = {}
        joined: list[str] = []
        try:
            try:
                push = (await self.ranks.push_weights(keep_paused=True))[0]
            except Exception as e:  # a server died during the push: drop it and push again, once
                if not await self.drop_dead_servers():
                    raise
                self.report(f"weight push failed ({type(e).__name__}); retrying without the dead server")
                push = (await self.ranks.push_weights(keep_paused=True))[0]
            joined = await self._checked_joiners(version)
            self.live += joined
            # at once: a rollout actor raises its client's version to any grant's, so the order
            # between the governor and the (still paused) rollout actors does not matter
            governor = [self.governor.set_version(version)] if self.governor is not None else []
            if self.governor is not None and len(self.live) != self.told:  # its concurrency follows
                governor.append(self.governor.set_servers(len(self.live), self.planned))
                self.told = len(self.live)
            await asyncio.gather(*governor, *(r.set_version(version, self.live) for r in self.rollouts))
        finally:
            try:
                await asyncio.gather(*(r.resume() for r in self.rollouts))
            finally:  # also after a failure (a failed push continued its servers; again is harmless)
                if push.get("left_paused", 1.0):
                    await self.continue_servers()
        if self.pool is not None:
            await self.pool.settle(version, joined, self.group)
        return push

    async def apply_changes(self) -> None:
        """Take the pool's joins and leaves and drop dead servers; re-form the weight-update group
        if its members changed. Nothing is paused here: the other servers keep generating while
        the group forms (``init_weights_update_group`` runs beside generation)."""
        if self.pool is None:
            await self.drop_dead_servers()
            return
        plan = await self.pool.plan()
        for line in plan["events"]:
            self.report(line)
        want = [u for u in self.group if u in plan["live"] or u in plan["joining"]]
        want += [u for u in [*plan["live"], *plan["joining"]] if u not in want]
        healthy = set(await self.healthy(want))
        if down := [u for u in want if u not in healthy]:
            self.report(f"servers down: {down}; re-forming the weight-update group without them")
        want = [u for u in want if u in healthy]
        if not want:
            raise RuntimeError("every inference server is down")
        leaving = [u for u in self.live if u not in want or u not in plan["live"]]
        for url in leaving:
            await asyncio.gather(*(r.retire_server(url) for r in self.rollouts))
        self.left += len(leaving)
        self.live = [u for u in self.live if u not in leaving]
        if want != self.group:
            self.group = want
            await self.connect()

    async def _checked_joiners(self, version: int) -> list[str]:
        """The group's servers not yet routed to that report ``version`` now (the push gave them
        its weights); one that does not stays out of routing and is checked again next publish."""
        new = [u for u in self.group if u not in self.live]
        if not new:
            return []
        versions = await asyncio.gather(*(self._version(u) for u in new))
        ok = [u for u, v in zip(new, versions, strict=True) if v == version]
        for u, v in zip(new, versions, strict=True):
            if v != version:
                self.report(f"server {u} reports weight version {v}, not {version}: not routing to it yet")
        if ok:
            self.report(f"servers joined: {ok} (serving version {version})")
        self.joined += len(ok)
        return ok

    async def _version(self, url: str) -> int | None:
        try:
            return int((await self.http.get(f"{url}/model_info")).json().get("weight_version") or 0)
        except (httpx.HTTPError, ValueError):
            return None

    async def continue_servers(self) -> None:
        """``/continue_generation`` to every live server at once; a server that does not answer is
        left to :meth:`drop_dead_servers`."""

        body = request_body(ContinueGenerationRequest())

        async def go(url: str) -> None:
            try:
                r = await self.http.post(f"{url}/continue_generation", json=body)
                if r.status_code != 200:
                    log.warning("continue_generation_refused", server=url, status=r.status_code)
            except httpx.HTTPError as e:
                log.warning("continue_generation_failed", server=url, error=str(e))

        await asyncio.gather(*(go(u) for u in self.group))

    async def drop_dead_servers(self) -> bool:
        """Re-form the weight-update group without servers that stopped answering, and stop rollout
        from using them. True when any was dropped."""
        healthy = await self.healthy(self.group)
        if healthy == self.group:
            return False
        gone = sorted(set(self.group) - set(healthy))
        self.report(f"servers down: {gone}; re-forming the weight-update group with {len(healthy)}")
        if not healthy:
            raise RuntimeError("every inference server is down")
        for url in gone:
            await asyncio.gather(*(r.retire_server(url) for r in self.rollouts))
        self.left += len([u for u in gone if u in self.live])
        self.live = [u for u in self.live if u in healthy]
        self.group = healthy
        await self.connect()
        return True

    async def healthy(self, urls: list[str] | None = None) -> list[str]:
        """Those of ``urls`` (default: the live servers) whose ``/health`` (SGLang's recommended
        probe) answers 200."""
        urls = self.live if urls is None else urls

        async def ok(u: str) -> bool:
            try:
                return (await self.http.get(f"{u}/health")).status_code == 200
            except httpx.HTTPError:
                return False

        answers = await asyncio.gather(*(ok(u) for u in urls))
        return [u for u, good in zip(urls, answers, strict=True) if good]

    async def weight_versions(self) -> list[int]:
        """Weight versions of the live servers that answer (one may die at any moment)."""
        infos = await asyncio.gather(
            *(self.http.get(f"{u}/model_info") for u in self.live), return_exceptions=True
        )
        return [int(r.json().get("weight_version") or 0) for r in infos if isinstance(r, httpx.Response)]

    async def aclose(self) -> None:
        await self.http.aclose()

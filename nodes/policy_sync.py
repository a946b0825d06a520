"""Publishing a policy version: the orchestration around the algorithm, out of the recipe's loop.

:class:`PolicySync` gets the trainer ranks' weights to the inference servers and the new version
to the rest of the plane: it forms the weight-update group (its store on trainer rank 0's host),
and on :meth:`PolicySync.publish` drops servers that stopped answering, pauses rollout dispatch,
pushes the weights (once more without a server that died during the push), tells the governor and
the rollout actors the new version, resumes dispatch and then continues the servers, also when the
push failed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import structlog

import rlactors
from protocols.sglang import ContinueGenerationRequest, request_body

__all__ = ["HEALTH_TIMEOUT_S", "PolicySync"]

log = structlog.get_logger(__name__)

# SGLang 0.5.23's /health runs a one-token generation and gives up itself after 20 s
# (SGLANG_HEALTH_CHECK_TIMEOUT), answering 503; under load it takes 1-20 s. Wait past that.
HEALTH_TIMEOUT_S = 40.0


class PolicySync:
    """Weights from ``ranks`` (an ``rlactors.ActorGroup`` of TrainerRank) to the servers at ``urls``;
    versions to ``governor`` and ``rollouts`` (set them with :meth:`attach` once they exist).
    ``live`` is the servers still in use. ``report`` gets a line for each thing a user should
    see (a server dropped, a push retried); by default it is logged as a warning."""

    def __init__(
        self,
        cluster: rlactors.Cluster,
        ranks: Any,
        urls: list[str],
        report: Callable[[str], Any] | None = None,
    ) -> None:
        self.cluster, self.ranks = cluster, ranks
        self.live = list(urls)
        self.governor: Any = None
        self.rollouts: list[Any] = []
        self.report = report or (lambda line: log.warning(line))
        self.http = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S)

    def attach(self, governor: Any, rollouts: list[Any]) -> None:
        """The rollout plane that :meth:`publish` pauses, resumes and tells new versions to."""
        self.governor, self.rollouts = governor, list(rollouts)

    async def connect(self) -> None:
        """Form the weight-update group with the live servers: its store on trainer rank 0's host,
        at the address that host registered with (reachable from servers on other hosts), on a
        port its agent reserved."""
        where = await self.cluster.rendezvous(
            f"weights-{uuid.uuid4().hex[:8]}",
            1 + len(self.live),
            node_id=await self.cluster.node_of(self.ranks[0]),
        )
        await self.ranks.connect_servers(self.live, where["master_address"], where["master_port"])

    async def publish(self, version: int) -> dict[str, float]:
        """Push the ranks' weights (at ``version``) to the live servers and publish ``version``.
        Returns rank 0's push statistics.

        The servers stay paused after the push until the rollout actors have re-posted what the
        pause held (a paused server holds a new request until it continues, as SGLang's tokenizer
        manager does), so each server has work the moment it continues: no idle gap between
        ``/continue_generation`` and the first re-posted request.
        """
        await self.drop_dead_servers()
        await asyncio.gather(*(r.pause() for r in self.rollouts))
        push: dict[str, float] = {}
        try:
            try:
                push = (await self.ranks.push_weights(keep_paused=True))[0]
            except Exception as e:  # a server died during the push: drop it and push again, once
                if not await self.drop_dead_servers():
                    raise
                self.report(f"weight push failed ({type(e).__name__}); retrying without the dead server")
                push = (await self.ranks.push_weights(keep_paused=True))[0]
            # at once: a rollout actor raises its client's version to any grant's, so the order
            # between the governor and the (still paused) rollout actors does not matter
            governor = [self.governor.set_version(version)] if self.governor is not None else []
            await asyncio.gather(*governor, *(r.set_version(version, self.live) for r in self.rollouts))
        finally:
            try:
                await asyncio.gather(*(r.resume() for r in self.rollouts))
            finally:  # also after a failure (a failed push continued its servers; again is harmless)
                if push.get("left_paused", 1.0):
                    await self.continue_servers()
        return push

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

        await asyncio.gather(*(go(u) for u in self.live))

    async def drop_dead_servers(self) -> bool:
        """Re-form the weight-update group without servers that stopped answering, and stop rollout
        from using them. True when any was dropped."""
        healthy = await self.healthy()
        if healthy == self.live:
            return False
        gone = sorted(set(self.live) - set(healthy))
        self.report(f"servers down: {gone}; re-forming the weight-update group with {len(healthy)}")
        if not healthy:
            raise RuntimeError("every inference server is down")
        for url in gone:
            await asyncio.gather(*(r.retire_server(url) for r in self.rollouts))
        self.live = healthy
        await self.connect()
        return True

    async def healthy(self) -> list[str]:
        """The live servers whose ``/health`` (SGLang's recommended probe) answers 200."""

        async def ok(u: str) -> bool:
            try:
                return (await self.http.get(f"{u}/health")).status_code == 200
            except httpx.HTTPError:
                return False

        answers = await asyncio.gather(*(ok(u) for u in self.live))
        return [u for u, good in zip(self.live, answers, strict=True) if good]

    async def weight_versions(self) -> list[int]:
        """Weight versions of the live servers that answer (one may die at any moment)."""
        infos = await asyncio.gather(
            *(self.http.get(f"{u}/model_info") for u in self.live), return_exceptions=True
        )
        return [int(r.json().get("weight_version") or 0) for r in infos if isinstance(r, httpx.Response)]

    async def aclose(self) -> None:
        await self.http.aclose()

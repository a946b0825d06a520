"""Connections to one inference server, split over many small httpx pools ("lanes")."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from nodes.rollout.client import ClientConfig

__all__ = ["Lane", "ServerPool"]


class Lane:
    """One httpx.AsyncClient with a small pool. httpx's pool does work linear in its number of
    connections on every request; many small pools keep that cheap (10x fewer CPU us per call
    at 256 concurrent requests on this machine, see bench/RESULTS.md)."""

    __slots__ = ("http", "inflight")

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.inflight = 0


class ServerPool:
    """One server: its lanes of pooled connections, requests in flight, and when it is next tried."""

    def __init__(
        self, url: str, cfg: ClientConfig, transport: httpx.AsyncBaseTransport | None, ssl_context: Any
    ) -> None:
        self.url = url.rstrip("/")
        self._cfg = cfg
        self._transport = transport
        self._ssl = ssl_context
        self._max_lanes = max(1, cfg.max_connections_per_server // cfg.connections_per_lane)
        self.lanes: list[Lane] = []
        self.inflight = 0
        self.down_until = 0.0

    def healthy(self, now: float) -> bool:
        return now >= self.down_until

    def take_lane(self) -> Lane:
        """A lane with a free connection (a new lane if all are busy and the cap allows)."""
        per = self._cfg.connections_per_lane
        lane = next((ln for ln in self.lanes if ln.inflight < per), None)
        if lane is None:
            if len(self.lanes) < self._max_lanes:
                lane = self._new_lane()
            else:
                lane = min(self.lanes, key=lambda ln: ln.inflight)
        lane.inflight += 1
        self.inflight += 1
        return lane

    def give_lane(self, lane: Lane) -> None:
        lane.inflight -= 1
        self.inflight -= 1

    def any_lane(self) -> Lane:
        return self.lanes[0] if self.lanes else self._new_lane()

    def _new_lane(self) -> Lane:
        cfg = self._cfg
        lane = Lane(httpx.AsyncClient(
            base_url=self.url,
            transport=self._transport,
            verify=self._ssl,  # one shared context: building one loads the CA bundle (~20 ms each)
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(max_connections=cfg.connections_per_lane,
                                max_keepalive_connections=cfg.connections_per_lane),
        ))  # fmt: skip
        self.lanes.append(lane)
        return lane

    async def aclose(self) -> None:
        await asyncio.gather(*(ln.http.aclose() for ln in self.lanes))

"""PolicySync.publish's order against a live sim server: the servers stay paused after the push
until the rollout actors have re-posted, and are continued whatever failed."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from nodes.driver.policy_sync import PolicySync


async def paused(url: str) -> bool:
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        return (await c.get("/server_info")).json()["internal_states"][0]["paused"]


class Ranks:
    """Trainer ranks' push as rank 0 does it with ``keep_paused``: pause, and leave it paused."""

    def __init__(self, url: str, log: list[str], fail: bool = False) -> None:
        self.url, self.log, self.fail = url, log, fail

    async def push_weights(self, keep_paused: bool = False) -> list[dict[str, float]]:
        self.log.append(f"push keep_paused={keep_paused}")
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as c:
            await c.post("/pause_generation", json={"mode": "abort"})
            if self.fail:  # a failure that is not a dead server (e.g. non-finite weights)
                await c.post("/continue_generation", json={})  # as WeightPusher's undo does
                raise RuntimeError("push failed")
        return [{"push_time_s": 0.0, "left_paused": 1.0 if keep_paused else 0.0}]


class Plane:
    """A rollout actor's and the governor's version calls, recording the server's state."""

    def __init__(self, url: str, log: list[str]) -> None:
        self.url, self.log = url, log

    async def pause(self) -> None:
        self.log.append("rollout pause")

    async def set_version(self, version: int, servers: Any = None) -> None:
        self.log.append(f"set_version {version}")

    async def resume(self) -> None:
        self.log.append(f"rollout resume (server paused: {await paused(self.url)})")


async def test_publish_resumes_the_rollouts_while_the_servers_are_paused_then_continues_them(
    sim_server: str,
) -> None:
    log: list[str] = []
    sync = PolicySync(None, Ranks(sim_server, log), [sim_server])  # type: ignore[arg-type]
    sync.attach(Plane(sim_server, log), [Plane(sim_server, log)])
    try:
        push = await sync.publish(3)
    finally:
        await sync.aclose()
    assert push["left_paused"] == 1.0
    assert log == [
        "rollout pause",
        "push keep_paused=True",
        "set_version 3",
        "set_version 3",
        "rollout resume (server paused: True)",
    ]
    assert not await paused(sim_server)


async def test_a_failed_publish_still_resumes_the_rollouts_and_continues_the_servers(sim_server: str) -> None:
    log: list[str] = []
    sync = PolicySync(None, Ranks(sim_server, log, fail=True), [sim_server])  # type: ignore[arg-type]
    sync.attach(Plane(sim_server, log), [Plane(sim_server, log)])
    try:
        with pytest.raises(RuntimeError, match="push failed"):
            await sync.publish(3)
        assert log[-1].startswith("rollout resume") and "set_version 3" not in log
        assert not await paused(sim_server)
        # a failure after the push left the server paused (a rollout actor died at set_version):
        # publish continues it
        sync.ranks = Ranks(sim_server, log)
        sync.governor = None

        class Dies(Plane):
            async def set_version(self, version: int, servers: Any = None) -> None:
                raise ConnectionError("rollout actor died")

        sync.rollouts = [Dies(sim_server, log)]
        with pytest.raises(ConnectionError):
            await sync.publish(4)
        assert not await paused(sim_server)
    finally:
        await sync.aclose()

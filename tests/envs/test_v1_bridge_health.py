"""The v1 bridge's ``/health`` (what the env server's actor probes): it answers at once from the last
time the env server was heard, and a probe of its own runs in the background, so an env server
whose loop is slow to answer (many episodes starting their programs on a loaded machine) is not
taken for dead and replaced with every episode it holds; one silent for ``SILENT_S`` is unhealthy.
verifiers' client is replaced by a stand-in whose health answers when the test says, and the
bridge's clock by one the test moves (the bridge imports verifiers only inside its functions)."""

from __future__ import annotations

import asyncio
import socket
import sys
import types
from collections.abc import AsyncIterator

import aiohttp
import pytest

from nodes.rollout.environments import v1_bridge


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


class StandInClient:
    answers: asyncio.Queue[bool]

    def __init__(self, address: str) -> None:
        self.address = address

    async def health(self, timeout: float) -> bool:
        return await StandInClient.answers.get()  # the env server answers when the test puts one

    async def close(self) -> None:
        pass


@pytest.fixture
async def bridge(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[str, Clock]]:
    StandInClient.answers = asyncio.Queue()
    serve = types.ModuleType("verifiers.v1.serve")
    serve.EnvClient = StandInClient  # type: ignore[attr-defined]
    for name, module in (
        ("verifiers", types.ModuleType("verifiers")),
        ("verifiers.v1", types.ModuleType("verifiers.v1")),
        ("verifiers.v1.serve", serve),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    clock = Clock()
    monkeypatch.setattr(v1_bridge, "clock", clock)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    task = asyncio.create_task(v1_bridge.bridge("ipc:///nonexistent", "127.0.0.1", port))
    url = f"http://127.0.0.1:{port}/health"
    async with aiohttp.ClientSession() as http:
        while True:  # until it listens
            try:
                async with http.get(url):
                    break
            except aiohttp.ClientConnectorError:
                await asyncio.sleep(0.05)
    try:
        yield url, clock
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def status(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        return r.status, await r.json()


async def test_a_slow_env_server_is_healthy_until_silent_for_silent_s(bridge: tuple[str, Clock]) -> None:
    url, clock = bridge
    # its health probe has not answered (the stand-in holds it): heard from at the start, so healthy
    clock.now += v1_bridge.SILENT_S - 1
    assert (await status(url))[0] == 200
    clock.now += 2  # silent past SILENT_S: unhealthy, said at once (no probe is waited for)
    code, body = await status(url)
    assert code == 503 and body == {"ok": False, "silent_s": v1_bridge.SILENT_S + 1}
    StandInClient.answers.put_nowait(True)  # the held probe answers: heard from now
    for _ in range(100):
        code, body = await status(url)
        if code == 200:
            break
        await asyncio.sleep(0)
    assert code == 200 and body["silent_s"] == 0.0


async def test_an_env_server_that_says_it_is_unhealthy_is_not_heard(bridge: tuple[str, Clock]) -> None:
    url, clock = bridge
    StandInClient.answers.put_nowait(False)
    await status(url)  # starts the probe, which hears "not healthy"
    clock.now += v1_bridge.SILENT_S + 5
    assert (await status(url))[0] == 503


def test_the_env_server_runs_at_most_max_concurrent_episodes_at_once() -> None:
    """The gate reaches verifiers' server: V1ServerActor's command line carries it, and the bridge's
    ``server`` passes it to ``serve_env`` (whose EnvServer takes it: test_v1_contract checks that)."""
    from nodes.rollout.environments.verifiers_v1 import V1ServerActor

    actor = V1ServerActor("app", 10.0, sys.executable, "{}", 5)
    (server, _bridge), _ = actor.commands("127.0.0.1", 1)
    assert server[server.index("--max-concurrent") + 1] == "5"
    seen: dict[str, object] = {}
    serve = types.ModuleType("verifiers.v1.serve")
    serve.serve_env = lambda **kw: seen.update(kw)  # type: ignore[attr-defined]
    v1 = types.ModuleType("verifiers.v1")
    v1.resolve_env_config = lambda config: config  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:
        for name, module in (("verifiers", types.ModuleType("verifiers")), ("verifiers.v1", v1)):
            mp.setitem(sys.modules, name, module)
        mp.setitem(sys.modules, "verifiers.v1.serve", serve)
        v1_bridge.main(server[2:])
    assert seen["max_concurrent"] == 5 and seen["max_workers"] == 1

"""Another model's pool ([models.<name>]: a teacher, a judge) is the policy's pool class with
``pushed = False``: its servers serve as soon as they are healthy (no publish to join at), one
removed is stopped once drained, one taken at a URL is watched but never relaunched, and the
policy's pool reports every model's servers (what `rlactors pool ls` prints). Sim servers."""

from __future__ import annotations

import httpx
import pytest

import rlactors
from nodes.inference.launcher import ReferenceServerConfig
from nodes.inference.pool import POOL_NAME, InferencePool, PoolConfig, pool_name
from nodes.rollout.models import ModelClient

SIM = ReferenceServerConfig(backend="sim")


@pytest.mark.timeout(300)
async def test_a_models_pool_serves_at_once_and_reports_through_the_policys() -> None:
    async with rlactors.init() as cluster:
        cfg = PoolConfig(server=SIM, model="judge", pushed=False)
        judge = await cluster.spawn(InferencePool, cfg, name=pool_name("judge"), control=True)
        (first,) = await judge.start(1)
        (second,) = await judge.launch(1)  # live at once: nothing is ever pushed to it
        rows = {s["url"]: s for s in (await judge.status())["servers"]}
        assert [rows[u]["state"] for u in (first, second)] == ["live", "live"]
        assert [rows[u]["name"] for u in (first, second)] == ["judge-server-0", "judge-server-1"]
        assert rows[first]["version"] == -1  # no policy version: it is not the policy
        assert sorted(await judge.urls()) == sorted([first, second])

        # a model's client reaches the pool's live servers by asking the pool
        client = ModelClient("judge", judge)
        try:
            answer = await client.post(
                "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
            )
            assert answer["meta_info"]["completion_tokens"] == 2
        finally:
            await client.aclose()

        removed = await judge.remove(second)  # drained, then stopped: no publish will settle it
        assert removed["state"] == "removed" and await judge.urls() == [first]
        async with httpx.AsyncClient(timeout=5) as http:
            with pytest.raises(httpx.HTTPError):
                await http.get(f"{second}/health")

        # [models.<name>] urls = [...]: a server already running is taken, live at once, never launched
        cfg = PoolConfig(server=SIM, model="ext", pushed=False)
        ext = await cluster.spawn(InferencePool, cfg, name=pool_name("ext"), control=True)
        row = await ext.add(first)
        assert (row["state"], row["launched"]) == ("live", False) and await ext.urls() == [first]

        policy = await cluster.spawn(InferencePool, PoolConfig(server=SIM), name=POOL_NAME, control=True)
        await policy.start(1)
        await policy.attach_models({"judge": judge})
        status = await policy.status()
        assert status["model"] == "" and [s["state"] for s in status["servers"]] == ["live"]
        assert [s["url"] for s in status["models"]["judge"]["servers"]] == [first]
        assert status["models"]["judge"]["model"] == "judge"

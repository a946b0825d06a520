"""The rollout client's wire end to end against a real reference server process (sim backend)
started with API keys: a weight-update pause with abort and resume, a wrong key, hung and dead
servers, and the rollout plane on the runtime; and the ``[rollout.client] http`` setting, removed
(the client has one HTTP layer), refused with a line that says so."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from nodes.common.procs import free_port
from nodes.plane.buffer import BufferActor
from nodes.plane.governor import GovernorActor, GovernorConfig
from nodes.rollout.actor import RolloutActor
from nodes.rollout.client import ClientConfig, GenerationError, GenRequest, SGLangClient
from nodes.rollout.config import RolloutConfig
from nodes.rollout.workflows import RLVRConfig, WorkflowSpec
from protocols.http.auth import ServerKeys
from rlactors.base.aio import wait_for
from rlactors.base.tomlconf import ConfigError, load_toml
from tests.helpers.servers import hung_server, reference_server, wait_until

KEYS = ServerKeys("plain-key-1", "admin-key-2")
PROMPT = [(11 * i + 5) % 30000 + 10 for i in range(200)]
N_NEW = 80
SP = {"max_new_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    # 5 ms per decode step: an 80-token generation lasts ~0.4 s, long enough to pause mid-way
    args = ["--backend", "sim", "--sim-decode-s-base", "0.005", "--sim-eos-prob", "0.05"]
    with reference_server([*args, *KEYS.server_args()]) as url:
        yield url


@pytest.fixture
async def admin(server_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server_url, timeout=30, auth=KEYS) as c:
        yield c
        await c.post("/continue_generation", json={})


async def generated_tokens(admin: httpx.AsyncClient) -> int:
    r = await admin.get("/v1/loads")
    return sum(e["num_used_tokens"] for e in r.json()["loads"])


async def test_generation_resumes_across_an_abort_pause(server_url: str, admin: httpx.AsyncClient) -> None:
    """The trainer's side of a weight update (pause in abort mode, bump the version, continue)
    mid-generation: the request comes back aborted, is re-posted with its tokens so far, and
    ends token for token as an uninterrupted one."""
    prompt = [1, *PROMPT]
    assert (await admin.post("/update_weight_version", json={"new_version": "0"})).json()["success"]
    client = SGLangClient([server_url], ClientConfig(keys=KEYS))
    task = asyncio.create_task(client.agenerate(GenRequest(prompt, SP, rid="pause")))

    async def mid_generation() -> bool:
        return await generated_tokens(admin) >= len(prompt) + 20

    await wait_until(mid_generation, timeout_s=30, what="20 tokens generated")
    client.pause()
    assert (await admin.post("/pause_generation", json={"mode": "abort"})).status_code == 200
    assert (await admin.post("/update_weight_version", json={"new_version": "1"})).json()["success"]
    client.set_version(1)
    assert (await admin.post("/continue_generation", json={})).status_code == 200
    client.resume()
    res = await wait_for(task, 60)
    await client.aclose()

    assert res.aborts == 1 and res.posts == 2 and res.finish_reason == "length"
    r = await admin.post("/generate", json={"input_ids": prompt, "sampling_params": SP})
    assert res.output_ids == r.json()["output_ids"]
    first = res.output_versions.index(1)
    assert 20 <= first < N_NEW and res.output_versions == [0] * first + [1] * (N_NEW - first)
    prefix = len(prompt) + first
    assert 0.95 * prefix <= res.cached_tokens[1] <= prefix - 1, res.cached_tokens  # re-posted prefix cached
    assert client.counters["retries"] == 0 and client.counters["errors"] == 0


async def test_each_route_gets_the_key_it_needs_and_a_wrong_key_is_refused_at_once(server_url: str) -> None:
    good = SGLangClient([server_url], ClientConfig(keys=KEYS))
    res = await good.agenerate(GenRequest([3, *PROMPT], {**SP, "max_new_tokens": 4}))
    assert len(res.output_ids) == 4
    pool = good._servers[server_url]
    assert (await pool.post("/abort_request", b'{"rid": "none"}'))[0] == 200  # the admin key
    await good.aclose()

    # with an admin key set, the plain key no longer opens admin routes (SGLang 0.5.23)
    plain = SGLangClient([server_url], ClientConfig(keys=ServerKeys(KEYS.api_key)))
    status, body = await plain._servers[server_url].post("/abort_request", b'{"rid": "none"}')
    assert status == 401, body
    await plain.aclose()

    wrong = SGLangClient([server_url], ClientConfig(keys=ServerKeys("wrong")))
    with pytest.raises(GenerationError, match="answered 401"):
        await wrong.agenerate(GenRequest([3, *PROMPT], {**SP, "max_new_tokens": 4}))
    assert wrong.counters["posts"] == 1 and wrong.counters["retries"] == 0  # a 4xx is not retried
    await wrong.aclose()


async def test_hung_and_dead_servers_fail_over_to_a_live_one(server_url: str) -> None:
    """A timed-out read and a refused connect are both a WireError: retried, then failed over."""
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = ClientConfig(keys=KEYS, request_timeout_s=0.5, max_retries=1, backoff_base_s=0.01)
    async with hung_server() as hung:
        for bad in (hung, dead):
            client = SGLangClient([bad, server_url], cfg)
            client._servers[server_url].inflight = 1  # the bad server is the least loaded
            res = await client.agenerate(GenRequest([5, *PROMPT], {**SP, "max_new_tokens": 8}))
            assert res.server == server_url and len(res.output_ids) == 8 and res.failovers == 1
            assert client.counters["retries"] == 1 and client.counters["errors"] == 0
            await client.aclose()


async def test_the_rollout_plane_runs_over_the_client(
    cluster, server_url: str, admin: httpx.AsyncClient
) -> None:
    """Rollout actors built from a RolloutConfig with its [rollout.client] (keys): every prompt is
    trained on once, with no retry."""
    b, eta, n = 2, 1, 8
    # the server labels tokens with its weight version: it follows the trainer's, as a push would
    assert (await admin.post("/update_weight_version", json={"new_version": "0"})).json()["success"]
    gov = await cluster.spawn(GovernorActor, GovernorConfig(b, eta, 8), name="gov")
    buf = await cluster.spawn(BufferActor, "gov", name="buf")
    cfg = RolloutConfig(max_inflight=4, acquire_batch=2, client=ClientConfig(keys=KEYS))
    workflow = WorkflowSpec(config=RLVRConfig(n_samples=2, max_new_tokens=16))
    r = await cluster.spawn(
        RolloutActor, [server_url], "gov", "buf", {"kind": "arithmetic", "n": n}, workflow, cfg, name="r"
    )
    seen: list[str] = []
    for v in range(n // b):
        batch = await buf.get_batch(b, v, 60)
        batch.validate()
        seen += [g.group_id for g in batch.groups]
        pushed = await admin.post("/update_weight_version", json={"new_version": str(v + 1)})
        assert pushed.json()["success"]
        await gov.set_version(v + 1)
    assert sorted(seen) == sorted(f"arithmetic/e0/{i}" for i in range(n))
    s = await r.stats()
    assert s["client_requests"] >= 2 * n and s["client_retries"] == 0 and s["client_errors"] == 0
    await r.stop()


def test_the_removed_http_setting_is_refused_with_a_line_that_says_so(tmp_path: Path) -> None:
    toml = tmp_path / "old.toml"
    toml.write_text('[client]\nhttp = "httptools"\n')
    for source, overrides in ((None, ["client.http=aiohttp"]), (toml, [])):
        with pytest.raises(ConfigError) as e:
            load_toml(RolloutConfig, source, overrides)
        where = "command line" if source is None else str(toml)
        assert str(e.value) == (
            f"{where}: 'client.http' was removed: the client has one HTTP layer (nodes/rollout/pool.py);"
            " delete the line"
        )

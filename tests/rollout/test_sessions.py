"""Online mode's session API (nodes/rollout/sessions.py) driven by a raw httpx client and by curl, with
a scripted generation backend: groups of sessions by task_id, the key (401 creates nothing), 429 with
Retry-After when no slot is admitted or the servers are paused, the timeouts, and 200 concurrent
sessions on one endpoint; then through the rollout client in front of a sim server, a completion
paused (aborted) mid-way for a weight push and resumed."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.rollout.client import GenRequest, GenResult, SGLangClient
from nodes.rollout.sessions import OnlineConfig, OnlineError, OnlineWorkflow
from protocols.http.auth import ServerKeys
from rlactors.base.aio import wait_for
from tests.helpers.servers import wait_decoding

KEY = "sk-test-key"
ROOT = Path(__file__).resolve().parents[2]
CURL_CLIENT = ROOT / "examples" / "online" / "client.sh"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_tiny_checkpoint()), local_files_only=True)


class Backend:
    """Stands in for the rollout actor's SGLangClient: answers "ok <n>" then end of turn, versions 3;
    ``paused`` as the client's is during a weight push; holds the run's key as the client does."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok, self.calls, self.paused = tokenizer, 0, False
        self.config = type("Config", (), {"keys": ServerKeys(KEY, "admin")})()

    async def agenerate(self, request: GenRequest) -> GenResult:
        self.calls += 1
        await asyncio.sleep(0)  # other sessions' requests interleave
        ids = [*self.tok.encode(f"ok {self.calls}", add_special_tokens=False), self.tok.eos_token_id]
        return GenResult(
            request.rid or "",
            ids,
            [-0.5] * len(ids),
            [3] * len(ids),
            "stop",
            "",
            len(request.input_ids),
            [0],
            "fake",
        )


@pytest.fixture
async def online(tokenizer: Any) -> AsyncIterator[tuple[OnlineWorkflow, Backend, str]]:
    """An online workflow whose API has started (the first slot starts it); its sessions URL."""
    wf = OnlineWorkflow(tokenizer, None, OnlineConfig(n_samples=2, max_new_tokens=8))  # type: ignore[arg-type]
    backend = Backend(tokenizer)
    api = await wf.start(backend)
    try:
        yield wf, backend, f"{api.base}/rl/v1/sessions"
    finally:
        await wf.aclose()


def authed(key: str = KEY) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=20, max_keepalive_connections=20)
    return httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60, limits=limits)


async def turn(http: httpx.AsyncClient, base_url: str, text: str) -> dict[str, Any]:
    r = await http.post(
        f"{base_url}/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": text}]},
    )
    assert r.status_code == 200, r.text
    return r.json()


async def test_sessions_of_a_task_form_one_group(online: tuple[OnlineWorkflow, Backend, str]) -> None:
    wf, backend, url = online
    episode = asyncio.ensure_future(wf.arun_episode(backend, {}, "online/e0/0"))
    await asyncio.sleep(0)  # the slot is offered
    async with authed() as http:
        first = (await http.post(url, json={"task_id": "t1"})).json()
        second = (await http.post(url, json={"task_id": "t1"})).json()
        assert first["group_id"] == second["group_id"] == "online/e0/0" and first["task_id"] == "t1"
        assert first["id"] != second["id"] and first["base_url"].endswith(f"/episodes/{first['id']}/v1")
        for s, reward in ((first, 1.0), (second, 0.0)):
            await turn(http, s["base_url"], "Hi")
            r = await http.post(f"{url}/{s['id']}/reward", json={"reward": reward})
            assert r.status_code == 200 and r.json()["trajectories"] == 1, r.text
        # the session has ended: its base_url and reward are gone
        assert (await http.post(f"{url}/{first['id']}/reward", json={"reward": 1})).status_code == 404
        r = await http.post(
            f"{first['base_url']}/chat/completions",
            json={"model": "p", "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 404
    group = await wait_for(episode, 30)
    assert group.group_id == "online/e0/0"
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]
    assert {t.meta["session"] for t in group.trajectories} == {first["id"], second["id"]}
    assert all(t.meta["task_id"] == "t1" and 3 in t.versions for t in group.trajectories)
    assert wf.counters["sessions_opened"] == 2 and wf.counters["sessions_rewarded"] == 2


async def test_a_wrong_or_missing_key_gets_401_and_creates_nothing(
    online: tuple[OnlineWorkflow, Backend, str],
) -> None:
    wf, backend, url = online
    episode = asyncio.ensure_future(wf.arun_episode(backend, {}, "g"))
    await asyncio.sleep(0)
    try:
        async with authed("sk-wrong") as wrong, httpx.AsyncClient(timeout=30) as none:
            for http in (wrong, none):
                r = await http.post(url, json={"task_id": "t"})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert (await http.get(url.replace("/rl/v1/sessions", "/v1/models"))).status_code == 401
            async with authed() as http:  # the bare /v1 is no episode of online mode's
                r = await http.post(
                    url.replace("/rl/v1/sessions", "/v1/chat/completions"),
                    json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                )
                assert r.status_code == 404 and r.json()["error"]["code"] == "episode_not_found"
        assert wf.api is not None and len(wf.api.slots) == 1 and not wf.api.sessions and not wf.api.open
        assert wf.counters["sessions_opened"] == 0 and not wf.api.endpoint.episodes
    finally:
        episode.cancel()
        await asyncio.gather(episode, return_exceptions=True)


async def test_429_with_retry_after_when_nothing_is_admitted_or_the_servers_are_paused(
    online: tuple[OnlineWorkflow, Backend, str],
) -> None:
    wf, backend, url = online
    async with authed() as http:
        r = await http.post(url, json={})  # no slot admitted
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        episode = asyncio.ensure_future(wf.arun_episode(backend, {}, "g"))
        await asyncio.sleep(0)
        backend.paused = True  # a weight push
        assert (await http.post(url, json={})).status_code == 429
        backend.paused = False
        s = (await http.post(url, json={"group": 1})).json()  # a task of its own, a group of one
        assert s["task_id"] and (await http.post(url, json={})).status_code == 429  # the only slot is taken
        await turn(http, s["base_url"], "Hi")
        assert (await http.post(f"{url}/{s['id']}/reward", json={"reward": 0.5})).status_code == 200
    group = await wait_for(episode, 30)
    assert [t.reward for t in group.trajectories] == [0.5]
    assert wf.counters["sessions_refused"] == 3


async def test_bad_requests_are_400(online: tuple[OnlineWorkflow, Backend, str]) -> None:
    wf, backend, url = online
    episode = asyncio.ensure_future(wf.arun_episode(backend, {}, "g"))
    await asyncio.sleep(0)
    try:
        async with authed() as http:
            assert (await http.post(url, json={"task_id": 5})).json()["error"]["param"] == "task_id"
            assert (await http.post(url, json={"group": 0})).json()["error"]["param"] == "group"
            assert (await http.get(url)).status_code == 405
            s = (await http.post(url, json={})).json()
            r = await http.post(f"{url}/{s['id']}/reward", json={"reward": "high"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "reward"
    finally:
        episode.cancel()
        await asyncio.gather(episode, return_exceptions=True)


@pytest.mark.parametrize("partial", ["train", "drop"])
async def test_a_group_that_never_fills_is_trained_as_is_or_dropped(tokenizer: Any, partial: str) -> None:
    """The group's and a session's timers fired by hand (the next test has one fire by itself)."""
    cfg = OnlineConfig(n_samples=3, partial_groups=partial)  # type: ignore[arg-type]
    wf, backend = OnlineWorkflow(tokenizer, None, cfg), Backend(tokenizer)  # type: ignore[arg-type]
    api = await wf.start(backend)
    url = f"{api.base}/rl/v1/sessions"
    try:
        episode = asyncio.ensure_future(wf.arun_episode(backend, {}, "g"))
        await asyncio.sleep(0)
        async with authed() as http:
            rewarded = (await http.post(url, json={"task_id": "t"})).json()
            silent = (await http.post(url, json={"task_id": "t"})).json()  # never rewarded
            await turn(http, rewarded["base_url"], "Hi")
            await turn(http, silent["base_url"], "Hi")
            assert (await http.post(f"{url}/{rewarded['id']}/reward", json={"reward": 1})).status_code == 200
            group = api.open["t"]
            assert group.timer is not None and group.sessions[1].timer is not None  # both armed
            api._expire_group(group)  # group_timeout_s: two sessions of three
            assert not episode.done() or partial == "drop"
            if partial == "train":
                api._expire_session(group.sessions[1])  # session_timeout_s
                done = await wait_for(episode, 30)
                assert [t.meta["session"] for t in done.trajectories] == [rewarded["id"]]
                assert wf.counters["sessions_timed_out"] == 1
            else:
                with pytest.raises(OnlineError, match="dropped"):
                    await wait_for(episode, 30)
                assert wf.counters["groups_dropped"] == 1
            assert wf.counters["groups_partial"] == 1
            assert (await http.post(f"{url}/{silent['id']}/reward", json={"reward": 1})).status_code == 404
            assert (
                await http.post(url, json={"task_id": "t"})
            ).status_code == 429  # the task's group is gone
    finally:
        await wf.aclose()


async def test_a_session_never_rewarded_times_out(tokenizer: Any) -> None:
    cfg = OnlineConfig(session_timeout_s=0.2)
    wf, backend = OnlineWorkflow(tokenizer, None, cfg), Backend(tokenizer)  # type: ignore[arg-type]
    api = await wf.start(backend)
    try:
        episode = asyncio.ensure_future(wf.arun_episode(backend, {}, "g"))
        await asyncio.sleep(0)
        async with authed() as http:
            s = (await http.post(f"{api.base}/rl/v1/sessions", json={"group": 1})).json()
            await turn(http, s["base_url"], "Hi")
        with pytest.raises(OnlineError, match="no rewarded session"):
            await wait_for(episode, 30)
        assert wf.counters["sessions_timed_out"] == 1 and not api.sessions and not api.endpoint.episodes
    finally:
        await wf.aclose()


async def test_200_concurrent_sessions_on_one_endpoint(online: tuple[OnlineWorkflow, Backend, str]) -> None:
    """200 sessions open at once (100 tasks of two), each a turn and a reward, all interleaved."""
    wf, backend, url = online
    episodes = [asyncio.ensure_future(wf.arun_episode(backend, {}, f"g{i}")) for i in range(100)]
    await asyncio.sleep(0)
    # ten clients of 20 connections: one httpcore pool's cost grows with its queue times its connections
    clients = [authed() for _ in range(10)]
    try:

        async def create(i: int) -> dict[str, Any]:
            r = await clients[i % 10].post(url, json={"task_id": f"task-{i // 2}"})
            assert r.status_code == 200, r.text
            return r.json()

        async def finish(i: int, s: dict[str, Any]) -> None:
            await turn(clients[i % 10], s["base_url"], f"Question {i}")
            assert (
                await clients[i % 10].post(f"{url}/{s['id']}/reward", json={"reward": i})
            ).status_code == 200

        sessions = await asyncio.gather(*(create(i) for i in range(200)))
        assert wf.api is not None and len(wf.api.sessions) == 200 and not wf.api.slots  # all open at once
        await asyncio.gather(*(finish(i, s) for i, s in enumerate(sessions)))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    groups = await wait_for(asyncio.gather(*episodes), 120)
    ids = {s["id"] for s in sessions}
    by_session = {t.meta["session"]: t for g in groups for t in g.trajectories}
    assert len(ids) == 200 and set(by_session) == ids  # every session one trajectory
    assert all(len(g.trajectories) == 2 for g in groups)
    assert all(
        len({int(t.reward) // 2 for t in g.trajectories}) == 1 for g in groups
    )  # a task's two sessions
    assert wf.counters["sessions_rewarded"] == 200


@pytest.mark.skipif(not (shutil.which("curl") and shutil.which("jq")), reason="needs curl and jq")
async def test_the_curl_client_of_the_docs(online: tuple[OnlineWorkflow, Backend, str]) -> None:
    """examples/online/client.sh (the docs' shell client), twice: a task's group of two sessions."""
    wf, backend, url = online
    episode = asyncio.ensure_future(wf.arun_episode(backend, {}, "g"))
    await asyncio.sleep(0)
    env = {**os.environ, "RL_URL": url, "RL_KEY": KEY, "TASK_ID": "curl-task"}
    for _ in range(2):
        proc = await asyncio.create_subprocess_exec(
            "bash", str(CURL_CLIENT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = await wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert '"reward":0.0' in out.decode() and '"trajectories":1' in out.decode()  # "ok <n>" is never 17
    group = await wait_for(episode, 30)
    assert [t.meta["task_id"] for t in group.trajectories] == ["curl-task", "curl-task"]
    assert all(
        t.meta["turns"] == 2 and sum(t.loss_mask) > 2 for t in group.trajectories
    )  # both turns, one sequence


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["data.source=online"], "goes with rollout.workflow"),
        (["rollout.workflow=nodes.rollout.sessions:OnlineWorkflow"], "goes with rollout.workflow"),
        (
            [
                "data.source=online",
                "rollout.workflow=nodes.rollout.sessions:OnlineWorkflow",
                "rollout.workflow_args.port=8100",
                "rollout.n_actors=2",
            ],
            "set port = 0",
        ),
    ],
)
def test_the_recipe_config_refuses_online_mode_half_set(overrides: list[str], error: str) -> None:
    from recipes.gsm8k_config import ConfigError, load_config

    with pytest.raises(ConfigError, match=error):
        load_config(None, overrides)
    ok = [
        "data.source=online",
        "rollout.workflow=nodes.rollout.sessions:OnlineWorkflow",
        "rollout.workflow_args.port=8100",
    ]
    assert load_config(None, ok).rollout.workflow_args.port == 8100


async def test_a_reward_while_a_completion_runs_is_409(online: tuple[OnlineWorkflow, Backend, str]) -> None:
    """The session's token sequence is still growing: its reward waits for the answer."""
    wf, backend, url = online
    gate, reached = asyncio.Event(), asyncio.Event()
    answer = backend.agenerate

    async def held(request: GenRequest) -> GenResult:
        reached.set()
        await gate.wait()
        return await answer(request)

    backend.agenerate = held  # type: ignore[method-assign]
    episode = asyncio.ensure_future(wf.arun_episode(backend, {}, "g"))
    await asyncio.sleep(0)
    async with authed() as http:
        s = (await http.post(url, json={"group": 1})).json()
        running = asyncio.ensure_future(turn(http, s["base_url"], "Hi"))
        await wait_for(reached.wait(), 30)  # the completion is generating
        r = await http.post(f"{url}/{s['id']}/reward", json={"reward": 1})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
        gate.set()
        await running
        assert (await http.post(f"{url}/{s['id']}/reward", json={"reward": 1})).status_code == 200
    assert [t.reward for t in (await wait_for(episode, 30)).trajectories] == [1.0]


async def test_a_completion_across_a_weight_push_is_aborted_resumed_and_trained_whole(
    slow_sim: str, tokenizer: Any
) -> None:
    """Through the rollout client, as in a run: the servers pause (abort) mid-completion; meanwhile
    opening a session is 429; after the resume the completion ends whole, one sequence, trained."""
    client = SGLangClient([slow_sim])
    wf = OnlineWorkflow(tokenizer, None, OnlineConfig(n_samples=1))  # type: ignore[arg-type]
    api = await wf.start(client, api_key=KEY)
    url = f"{api.base}/rl/v1/sessions"
    episodes = [asyncio.ensure_future(wf.arun_episode(client, {}, f"g{i}")) for i in range(2)]
    await asyncio.sleep(0)
    try:
        async with authed() as http, httpx.AsyncClient(base_url=slow_sim) as server:
            s = (await http.post(url, json={})).json()
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
            running = asyncio.ensure_future(http.post(f"{s['base_url']}/chat/completions", json=body))
            await wait_decoding(server)  # a few tokens in
            client.pause()  # the weight push, as PolicySync makes it
            assert (await server.post("/pause_generation", json={"mode": "abort"})).status_code == 200
            r = await http.post(url, json={})
            assert (
                r.status_code == 429 and r.headers["retry-after"] == "1"
            )  # a slot is free: the pause refuses
            client.resume()
            await server.post("/continue_generation", json={})
            answer = (await running).json()
            assert answer["usage"]["completion_tokens"] == 40, answer
            assert (await http.post(f"{url}/{s['id']}/reward", json={"reward": 1})).json()[
                "trajectories"
            ] == 1
        (traj,) = (await wait_for(episodes[0], 60)).trajectories
        assert sum(traj.loss_mask) == 40 and traj.meta["aborts"] >= 1  # cut off, resumed, whole
    finally:
        for e in episodes:
            e.cancel()
        await asyncio.gather(*episodes, return_exceptions=True)
        await wf.aclose()
        await client.aclose()


async def test_a_session_on_the_anthropic_sdk_sends_the_key_as_x_api_key(
    online: tuple[OnlineWorkflow, Backend, str],
) -> None:
    """A client on Anthropic's SDK uses a session's base_url without its ``/v1``, the run's key as
    its ``api_key`` (sent as ``x-api-key``); a wrong key is refused in Anthropic's error shape."""
    import anthropic

    wf, backend, url = online
    episode = asyncio.ensure_future(wf.arun_episode(backend, {}, "g"))
    await asyncio.sleep(0)
    async with authed() as http:
        s = (await http.post(url, json={"group": 1})).json()
        root = s["base_url"].removesuffix("/v1")
        async with anthropic.AsyncAnthropic(base_url=root, api_key="sk-wrong", max_retries=0) as wrong:
            with pytest.raises(anthropic.AuthenticationError) as e:
                await wrong.messages.create(
                    model="policy", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
                )
        assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        async with anthropic.AsyncAnthropic(base_url=root, api_key=KEY, max_retries=0) as claude:
            m = await claude.messages.create(
                model="policy", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
            )
        assert m.content[0].text == "ok 1" and m.stop_reason == "end_turn"  # type: ignore[union-attr]
        r = await http.post(f"{url}/{s['id']}/reward", json={"reward": 1.0})
        assert r.status_code == 200 and r.json()["trajectories"] == 1
    (t,) = (await wait_for(episode, 30)).trajectories
    assert t.reward == 1.0 and 3 in t.versions

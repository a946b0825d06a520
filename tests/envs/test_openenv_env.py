"""OpenEnvWorkflow against real OpenEnv servers (tests/envs/openenv_app.py, built with openenv-core,
served by uvicorn in their own processes): an episode is reset, then model turns and steps until
done, its reward the environment's, each episode one token sequence; a server the run starts is an
actor (env-<i>) that the runtime replaces when its server dies, only the group on it dropped; one that
hangs times out; unreachable servers and apps that do not import are config errors."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import rlactors
from nodes.rollout.environments import EnvError, OpenEnvConfig, OpenEnvWorkflow
from nodes.rollout.reward import RewardRunner
from tests.rollout.test_openai_endpoint import Scripted, tokenizer  # noqa: F401 - the fixture

pytest.importorskip("openenv.core")

APP = "tests.envs.openenv_app"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """A running OpenEnv server (as a user starts one, or Docker publishes one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", f"{APP}:app", "--port", str(port), "--log-level", "warning"],
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the OpenEnv server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)  # polling a starting process's port
        yield url
    finally:
        proc.kill()
        proc.wait()


def workflow(tok: Any, **kw: Any) -> OpenEnvWorkflow:
    return OpenEnvWorkflow(tok, RewardRunner(lambda c, i: 0.0), OpenEnvConfig(**kw))


async def test_an_episode_steps_until_done_and_is_rewarded_by_the_environment(
    tokenizer: Any,  # noqa: F811
    server: str,
) -> None:
    wf = workflow(tokenizer, env_urls=[server], n_samples=2, system_prompt="Answer in one word.")
    gen = Scripted(tokenizer, ["apple", "kiwi", "banana split", "fig"])
    try:
        group = await wf.arun_episode(gen, {"question": "-", "reset": {"seed": 7}}, "g/0")
    finally:
        await wf.episodes.endpoint.aclose()
    assert len(group.trajectories) == 2  # one token sequence per episode: the turns continue
    # the environment's rewards, summed over each episode's two steps: len(message) / 40 each. The
    # two episodes run at once and the scripted answers go out in request order, so which episode
    # gets which two depends on timing: each reward is the sum of two different answers', together
    # all four (a reward of the last step alone would be one answer's)
    lengths = [len(a) for a in ("apple", "kiwi", "banana split", "fig")]
    pairs = {round((a + b) / 40, 4) for i, a in enumerate(lengths) for b in lengths[i + 1 :]}
    got = [round(t.reward, 4) for t in group.trajectories]
    assert set(got) <= pairs and sum(got) == pytest.approx(sum(lengths) / 40), got
    for t in group.trajectories:
        t.validate()
        assert t.meta["info"]["turns"] == 2.0 and t.meta["info"]["env_reward_steps"] == 2.0
    first = tokenizer.decode(gen.requests[0].input_ids)
    assert "Say a word (seed 7)." in first and "Answer in one word." in first  # reset's observation
    # each second request extends a first one: the next observation is appended, token-exact. The
    # episodes run at once, so one may send its second request before the other its first: the
    # first requests are the reset's observation alone (both episodes reset with seed 7)
    shortest = min(len(r.input_ids) for r in gen.requests)
    firsts = [r for r in gen.requests if len(r.input_ids) == shortest]
    seconds = [r for r in gen.requests if len(r.input_ids) > shortest]
    assert len(firsts) == len(seconds) == 2 and firsts[0].input_ids == firsts[1].input_ids
    assert all(s.input_ids[:shortest] == firsts[0].input_ids for s in seconds)
    assert all("Another word." in tokenizer.decode(s.input_ids[shortest:]) for s in seconds)
    assert wf.counters["history_edits"] == 0 and wf.counters["env_errors"] == 0


def servers_noted(marker: Path) -> list[dict[str, Any]]:
    """The dying app's server processes, as each noted itself (tests/envs/openenv_app.py)."""
    path = Path(f"{marker}.servers")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def all_gone(pids: list[int], timeout: float = 60.0) -> bool:
    """Whether every process in ``pids`` has ended (waited on, up to ``timeout`` s in all)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)  # readable once the process has ended
        except ProcessLookupError:
            continue
        try:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return False
        finally:
            os.close(fd)
    return True


@pytest.mark.timeout(600)  # a cluster and two server starts: seconds idle, minutes on a loaded machine
async def test_a_started_server_is_an_actor_replaced_when_it_dies_and_only_its_group_dropped(
    tokenizer: Any,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    marker = tmp_path / "died"
    monkeypatch.setenv("RLACTORS_TEST_DIE_ONCE", str(marker))  # the cluster's workers inherit it
    config = OpenEnvConfig(env_app=f"{APP}:dying_app", n_samples=1, max_replacements=1)
    wf = OpenEnvWorkflow(tokenizer, RewardRunner(lambda c, i: 0.0), config)
    async with rlactors.init() as cluster:
        try:
            await OpenEnvWorkflow.start_actors(cluster, config)  # as the run does, before its rollout actors
            first = await cluster.get_actor("env-0")
            with pytest.raises(EnvError, match="raised"):
                await wf.arun_episode(Scripted(tokenizer, []), {"question": "-"}, "g/1")
            # the next episode asks the actor again: the runtime has replaced it, with a new server
            group = await wf.arun_episode(Scripted(tokenizer, ["ok", "ok"]), {"question": "-"}, "g/2")
            assert len(group.trajectories) == 1 and group.trajectories[0].reward == pytest.approx(4 / 40)
            env0 = next(a for a in await cluster.actors() if a["name"] == "env-0")
            assert env0["class_name"].endswith("EnvServerActor") and env0["state"] == "ALIVE"
            assert env0["restarts"] == 1 and env0["actor_id"] == first.actor_id
        finally:
            await wf.episodes.endpoint.aclose()
        servers = servers_noted(marker)
        # two server processes, each started by a worker of the actor env-0: the first and its replacement
        assert len(servers) == 2 and servers[0]["pid"] == int(marker.read_text())
        assert all("rlactors.node.worker env-0" in s["parent"] for s in servers)
        assert servers[0]["parent_pid"] != servers[1]["parent_pid"]
    assert wf.counters["env_errors"] == 1
    assert all_gone([s["pid"] for s in servers])  # the cluster's end stopped the server with its actor


async def test_started_servers_are_asked_of_their_actors_outside_a_run_it_is_an_env_error(
    tokenizer: Any,  # noqa: F811
) -> None:
    wf = workflow(tokenizer, env_app=f"{APP}:app", n_samples=1)
    with pytest.raises(
        EnvError, match="started by a run; outside one, start the server and name it in env_urls"
    ):
        await wf.arun_episode(Scripted(tokenizer, []), {"question": "-"}, "g/5")
    assert wf.counters["env_errors"] == 1


async def test_a_server_that_hangs_times_out_and_the_group_is_dropped(
    tokenizer: Any,  # noqa: F811
    server: str,
) -> None:
    wf = workflow(tokenizer, env_urls=[server], n_samples=2, episode_timeout_s=3.0)
    try:
        with pytest.raises(EnvError, match=r"ran past 3\.0s"):
            await wf.arun_episode(
                Scripted(tokenizer, []), {"question": "-", "reset": {"kind": "hang"}}, "g/3"
            )
        assert not wf.episodes.endpoint.episodes
        # the same server still serves the next group
        group = await wf.arun_episode(Scripted(tokenizer, []), {"question": "-"}, "g/4")
        assert len(group.trajectories) == 2
    finally:
        await wf.episodes.endpoint.aclose()
    assert wf.counters["env_timeouts"] == 1


def test_unreachable_servers_and_apps_that_do_not_import_are_config_errors() -> None:
    from recipes.gsm8k_config import ConfigError, load_config

    base = ["rollout.workflow=nodes.rollout.environments:OpenEnvWorkflow"]
    with pytest.raises(ConfigError, match=r"'rollout\.workflow_args\.env_urls' or 'env_app'"):
        load_config(None, base)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConfigError, match=rf"workflow_args\.env_urls' entry '{dead}' does not answer"):
        load_config(None, [*base, f'rollout.workflow_args.env_urls=["{dead}"]'])
    with pytest.raises(ConfigError, match=r"'rollout\.workflow_args\.env_app' = 'no_such_module:app'"):
        load_config(None, [*base, "rollout.workflow_args.env_app=no_such_module:app"])

"""OpenEnvWorkflow against real OpenEnv servers (tests/envs/openenv_app.py, built with openenv-core,
served by uvicorn in their own processes): an episode is reset, then model turns and steps until
done, its reward the environment's, each episode one token sequence; a server that dies is replaced
and its group dropped, one that hangs times out; unreachable servers and apps that do not import
are config errors."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

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
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", f"{APP}:app", "--port", str(port),
                             "--log-level", "warning"], stderr=subprocess.DEVNULL)  # fmt: skip
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
    # the environment's rewards, summed over the two steps: len(message) / 40 each
    got = sorted(round(t.reward, 4) for t in group.trajectories)
    assert got == sorted([round((5 + 12) / 40, 4), round((4 + 3) / 40, 4)])
    for t in group.trajectories:
        t.validate()
        assert t.meta["info"]["turns"] == 2.0 and t.meta["info"]["env_reward_steps"] == 2.0
    first = tokenizer.decode(gen.requests[0].input_ids)
    assert "Say a word (seed 7)." in first and "Answer in one word." in first  # reset's observation
    # each second request extends a first one: the next observation is appended, token-exact
    firsts, seconds = gen.requests[:2], gen.requests[2:]
    assert all(any(s.input_ids[: len(f.input_ids)] == f.input_ids for f in firsts) for s in seconds)
    assert "Another word." in tokenizer.decode(seconds[0].input_ids)
    assert wf.counters["history_edits"] == 0 and wf.counters["env_errors"] == 0


async def test_a_server_that_dies_is_replaced_and_only_its_group_dropped(
    tokenizer: Any,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RLACTORS_TEST_DIE_ONCE", str(tmp_path / "died"))
    wf = workflow(tokenizer, env_app=f"{APP}:dying_app", n_samples=1)
    try:
        with pytest.raises(EnvError, match="raised"):
            await wf.arun_episode(Scripted(tokenizer, []), {"question": "-"}, "g/1")
        first = wf.servers.procs[0]
        assert first is not None and await first.wait() == 1  # the server process died
        group = await wf.arun_episode(Scripted(tokenizer, ["ok", "ok"]), {"question": "-"}, "g/2")
        assert len(group.trajectories) == 1 and group.trajectories[0].reward == pytest.approx(4 / 40)
        assert wf.servers.replaced == 1 and wf.servers.procs[0] is not first
    finally:
        await wf.servers.aclose()
        await wf.episodes.endpoint.aclose()
    assert wf.counters["env_errors"] == 1
    assert all(p is not None and p.returncode is not None for p in wf.servers.procs)  # nothing left behind


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

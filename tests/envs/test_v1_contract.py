"""The wire between rlactors and the pinned verifiers (``VerifiersV1Config.verifiers``'s default): it
fails loudly when a verifiers release changes what the bridge uses. Then verifiers' own env server
and the bridge, real processes in the taskset's Python environment, driving episodes on the
rollout endpoint with a scripted generator: the trained tokens are the generator's, joined by the
X-Session-ID verifiers sends; the ``@vf.reward`` is the reward; an episode that errors, a server
that dies and a generator that hangs past ``episode_timeout_s`` each drop the group, counted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodes.common.procs import free_port
from nodes.rollout.environments import EnvError, VerifiersV1Config, VerifiersV1Workflow
from nodes.rollout.environments.verifiers_v1 import BRIDGE, process_env
from tests.rollout.test_openai_endpoint import Scripted, tokenizer  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(600)
PACKAGE = str(Path(__file__).with_name("v1_sums"))


@pytest.fixture(scope="module")
def config() -> VerifiersV1Config:
    """The taskset's config (its environment made, or found made), every other task failing."""
    return VerifiersV1Config(
        taskset="rlactors-v1-sums",
        packages=[PACKAGE],
        n_samples=2,
        env_config={"taskset": {"fail_odd": True}},
    )


def test_the_pinned_verifiers_speaks_the_bridges_wire(config: VerifiersV1Config) -> None:
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(BRIDGE).parent)!r}); "
        "from v1_bridge import wire_problems; print(json.dumps(wire_problems()))"
    )
    done = subprocess.run([str(config.python()), "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [], f"verifiers {config.verifiers}'s wire changed: {done.stdout}"
    described = config.described()
    assert described["verifiers"] == config.verifiers and described["harnesses"] == {"agent": "null"}
    assert [t["answer"] for t in described["tasks"]][:2] == [14, 6]


@pytest.fixture
def bridge(config: VerifiersV1Config) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """verifiers' env server and the bridge, as V1ServerActor runs them; the bridge's URL once healthy."""
    python, host = str(config.python()), "127.0.0.1"
    address, port = f"tcp://{host}:{free_port(host)}", free_port(host)
    cfg = json.dumps(config.full_env_config())
    procs = [
        subprocess.Popen(
            cmd,
            env=process_env(config.python()),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for cmd in (
            [python, BRIDGE, "server", "--config", cfg, "--address", address],
            [
                python,
                BRIDGE,
                "bridge",
                "--address",
                address,
                "--host",
                host,
                "--port",
                str(port),
                "--silent-s",
                "2",
            ],
        )
    ]
    url = f"http://{host}:{port}"
    try:
        for _ in range(600):  # polling starting processes: nothing to wait on but the port
            if any(p.poll() is not None for p in procs):
                raise AssertionError(f"a process exited: {[p.returncode for p in procs]}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            subprocess.run(["sleep", "0.2"], check=True)
        yield url, procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def workflow(config: VerifiersV1Config, tok: Any, url: str) -> VerifiersV1Workflow:
    wf = VerifiersV1Workflow(tok, None, config)  # type: ignore[arg-type]

    async def pick() -> str:
        return url

    wf.servers.pick = pick  # type: ignore[method-assign]  # the bridge above, not a run's actors
    return wf


def item(config: VerifiersV1Config, i: int) -> dict[str, Any]:
    return {"id": f"sum-{i}", "task": config.described()["tasks"][i]}


async def test_episodes_train_the_endpoints_tokens_with_the_tasks_reward(
    config: VerifiersV1Config,
    tokenizer: Any,  # noqa: F811
    bridge: tuple[str, list[Any]],
) -> None:
    wf = workflow(config, tokenizer, bridge[0])
    gen = Scripted(tokenizer, ["The answer is 14", "It is 15"])  # task 0: 7 + 7
    group = await wf.arun_episode(gen, item(config, 0), "g0")
    assert len(group.trajectories) == 2 and len(gen.requests) == 2
    # each trajectory is the task's prompt and exactly the ids the generator made for one request
    prompt = list(gen.requests[0].input_ids)
    assert all(list(r.input_ids) == prompt for r in gen.requests)  # both episodes: the task's prompt
    made = sorted(
        [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        for text in ["The answer is 14", "It is 15"]
    )
    assert all(list(t.input_ids)[: len(prompt)] == prompt for t in group.trajectories)
    assert sorted([int(i) for i in t.input_ids[len(prompt) :]] for t in group.trajectories) == made
    for t in group.trajectories:
        assert t.meta["info"]["correct"] == t.reward and t.meta["info"]["correct/weight"] == 1.0
    assert sorted(t.reward for t in group.trajectories) == [0.0, 1.0]  # @vf.reward: only 14 is right
    # task 1's scoring raises: the group is dropped and counted
    with pytest.raises(EnvError, match="fails, as configured"):
        await wf.arun_episode(Scripted(tokenizer, []), item(config, 1), "g1")
    assert wf.counters["env_errors"] == 1


async def test_a_server_that_dies_or_hangs_drops_the_group(
    config: VerifiersV1Config,
    tokenizer: Any,  # noqa: F811
    bridge: tuple[str, list[Any]],
) -> None:
    url, procs = bridge

    class Hangs(Scripted):
        async def agenerate(self, request: Any) -> Any:
            await asyncio.Event().wait()

    wf = workflow(config, tokenizer, url)
    wf.config.episode_timeout_s = 3.0
    with pytest.raises(EnvError, match="ran past"):
        await wf.arun_episode(Hangs(tokenizer, []), item(config, 0), "g-hang")
    assert wf.counters["env_timeouts"] == 1
    os.killpg(procs[0].pid, signal.SIGKILL)  # verifiers' env server
    procs[0].wait()
    # what V1ServerActor watches beside the processes (it then ends, and the runtime replaces it):
    # health fails end to end once the env server has been silent for the bridge's --silent-s (2 s here, 30 s in a run)
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(240):
            if (await http.get(f"{url}/health")).status_code == 503:
                break
            await asyncio.sleep(0.25)
        assert (await http.get(f"{url}/health")).status_code == 503
    with pytest.raises(EnvError):  # until then an episode on it does not finish: dropped, counted
        await wf.arun_episode(Scripted(tokenizer, []), item(config, 0), "g-dead")
    assert wf.counters["env_timeouts"] == 2

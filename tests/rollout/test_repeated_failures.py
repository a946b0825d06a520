"""Failures that repeat stop the run, occasional ones do not (nodes/rollout/failures.py): the watch's
two rules, and the Rollout core with a sim server: a reward that raises on every sample and a
workflow that fails every episode end the trainer's wait for a batch with one line naming them;
a reward that fails now and then leaves the run training."""

from __future__ import annotations

import asyncio

import pytest

from nodes.plane.buffer import BufferConfig, RepeatedFailureError, TrajectoryBuffer
from nodes.plane.governor import GovernorConfig, StalenessGovernor
from nodes.rollout.actor import Rollout
from nodes.rollout.client import SGLangClient
from nodes.rollout.config import RolloutConfig
from nodes.rollout.failures import MIN_FIRST, FailureWatch
from nodes.rollout.reward import RewardConfig
from nodes.rollout.workflows import RLVRConfig, WorkflowSpec, build_workflow
from rlactors.base.aio import wait_for

B = 2


def always_raises(completion: str, item: dict) -> float:
    return float(item["no_such_column"])  # a reward reading a column the data does not have


def every_third_raises(completion: str, item: dict) -> float:
    if int(item["id"].rsplit("/", 1)[-1]) % 3 == 0:
        raise ValueError("a checker's rare bug")
    return 1.0


def make(url: str, reward: str, n_prompts: int = 64):
    gov = StalenessGovernor(GovernorConfig(B, 1, max_concurrent=16))
    buf = TrajectoryBuffer(BufferConfig(max_staleness=1, drop_no_signal=False), governor=gov)
    client = SGLangClient([url])
    spec = WorkflowSpec(config=RLVRConfig(n_samples=2, max_new_tokens=8), reward=RewardConfig(fn=reward))
    items = [
        {"id": f"row/{i}", "question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(n_prompts)
    ]
    rollout = Rollout(
        "h0",
        client,
        build_workflow(spec),
        iter((it["id"], it) for it in items),
        gov,
        buf,
        RolloutConfig(max_inflight=4, acquire_batch=4),
        name="workflow RLVR",
        first_batch=B,
    )
    return gov, buf, client, rollout


def test_every_episode_of_the_first_batch_failing_is_the_line_with_what_how_many_and_the_item() -> None:
    w = FailureWatch(first=MIN_FIRST, window=64, max_share=0.9)
    lines = [
        w.failure("reward function m:f", KeyError("answer2"), {"id": f"data-train-{i}"}, "g")
        for i in range(MIN_FIRST)
    ]
    assert lines[:-1] == [None] * (MIN_FIRST - 1)  # a few failures alone are not a verdict
    line = lines[-1]
    assert line is not None and "reward function m:f failed on 8 of 8 episodes" in line
    assert "KeyError: 'answer2'" in line and "first failing item: data-train-0" in line and "\n" not in line


def test_occasional_failures_do_not_stop_and_a_share_over_the_window_does() -> None:
    w = FailureWatch(first=MIN_FIRST, window=10, max_share=0.9)
    assert w.ok() is None
    for i in range(100):  # one in three fails: occasional
        assert (w.failure("workflow W", RuntimeError("x"), {}, f"g{i}") if i % 3 == 0 else w.ok()) is None
    assert w.n == 101 and w.failed == 34
    lines = [w.failure("workflow W", RuntimeError("x"), {}, f"h{i}") for i in range(8)]
    assert lines[:7] == [None] * 7  # 8 of the last 10 failed (the 99th of before among them): under 0.9
    assert (
        lines[7] is not None
        and "failed on 9 of 10 episodes (rollout.max_failure_share = 0.9 of the last 10)" in lines[7]
    )


def test_the_share_is_checked_in_the_config() -> None:
    from recipes.gsm8k_config import load_config
    from rlactors.base.tomlconf import ConfigError

    with pytest.raises(ConfigError, match=r"'rollout.max_failure_share' must be in \(0, 1\], got 0.0"):
        load_config(None, ["rollout.max_failure_share=0.0"])


async def test_a_reward_that_raises_on_every_sample_ends_the_wait_for_a_batch(sim_server: str) -> None:
    _gov, buf, client, rollout = make(sim_server, "tests.rollout.test_repeated_failures:always_raises")
    run = asyncio.create_task(rollout.run())
    with pytest.raises(RepeatedFailureError) as e:
        await buf.get_batch(B, 0, timeout=300)  # raised when the watch says so, not at the timeout
    await wait_for(run, 60)  # dispatch ended by itself
    await client.aclose()
    line = str(e.value)
    assert line.startswith("reward function tests.rollout.test_repeated_failures:always_raises failed on")
    assert "KeyError: 'no_such_column'" in line and "first failing item: row/" in line
    assert rollout.stop_line == line and buf.ready == 0  # none of its zeros was trained on
    assert rollout.stats()["episodes_failed"] >= MIN_FIRST


async def test_a_workflow_that_fails_every_episode_ends_the_wait_for_a_batch(sim_server: str) -> None:
    gov, buf, client, rollout = make(sim_server, "nodes.rollout.reward:final_number_reward")

    class Broken:
        async def arun_episode(self, client, item, group_id=None):
            raise ConnectionError("environment server refused")

    rollout.workflow = Broken()
    run = asyncio.create_task(rollout.run())
    with pytest.raises(
        RepeatedFailureError,
        match=r"^workflow RLVR failed on (\d+) of \1 episodes .*"
        r"ConnectionError: environment server refused; first failing item: row/",
    ):
        await buf.get_batch(B, 0, timeout=300)
    await wait_for(run, 60)
    await client.aclose()
    assert gov.running == 0 and buf.in_flight == 0  # every lease went back


async def test_a_reward_that_fails_now_and_then_keeps_the_run_training(sim_server: str) -> None:
    gov, buf, client, rollout = make(
        sim_server, "tests.rollout.test_repeated_failures:every_third_raises", 24
    )
    run = asyncio.create_task(rollout.run())
    for v in range(4):  # four steps of training: the failures were counted, not fatal
        batch = await buf.get_batch(B, v, timeout=300)
        assert len(batch.groups) == B
        gov.set_version(v + 1)
        rollout.set_version(v + 1)
    rollout.stop_line is None or pytest.fail(rollout.stop_line)
    await rollout.stop()
    await wait_for(run, 60)
    await client.aclose()

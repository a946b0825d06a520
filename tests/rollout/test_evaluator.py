"""The evaluator with nothing held out (online mode) evaluates nothing and reports nothing, instead of
an accuracy of 0 over 0 items; the run's first evaluation holds the first push until it ends (it
measures the weights the run started with), and no later one does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nodes.driver import evaluator as evaluator_module
from nodes.driver.evaluator import Evaluator


async def test_no_items_no_evaluation() -> None:
    evaluator = Evaluator(spec=None, items=[])  # type: ignore[arg-type]  # never built: nothing to run
    await evaluator.start(["http://127.0.0.1:9"], 0)
    assert evaluator.poll() is None
    assert await evaluator.finish(["http://127.0.0.1:9"], 3) == {}
    assert evaluator.summary() is None and evaluator.workflow is None


async def test_the_first_evaluation_holds_the_first_push_and_no_later_one_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release: dict[int, asyncio.Event] = {0: asyncio.Event(), 3: asyncio.Event()}
    began: dict[int, asyncio.Event] = {0: asyncio.Event(), 3: asyncio.Event()}

    async def evaluate(
        workflow: Any, urls: list[str], items: list[Any], version: int, *a: Any, **k: Any
    ) -> dict:
        began[version].set()
        await release[version].wait()  # the servers answer when the test says
        return {"eval/accuracy": 0.5, "eval/version": version}

    monkeypatch.setattr(evaluator_module, "evaluate", evaluate)
    ev = Evaluator(spec=None, items=[{"question": "q"}])  # type: ignore[arg-type]  # evaluate is replaced
    ev.workflow = object()  # type: ignore[assignment]  # built: nothing to load
    await ev.start(["http://127.0.0.1:9"], 0)
    held = asyncio.create_task(ev.baseline())
    await began[0].wait()
    for _ in range(20):  # the push waits for as long as the first evaluation runs
        await asyncio.sleep(0)
    assert not held.done()
    release[0].set()
    assert await held > 0.0
    assert ev.poll() == {"eval/accuracy": 0.5, "eval/version": 0}  # handed over at the same step
    await ev.start(["http://127.0.0.1:9"], 3)  # a later evaluation, still running: nothing waits for it
    assert await ev.baseline() == 0.0 and ev.poll() is None
    release[3].set()
    assert (await ev.finish(["http://127.0.0.1:9"], 3))["eval/version"] == 3


async def test_a_first_evaluation_already_done_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    async def evaluate(*a: Any, **k: Any) -> dict:
        return {"eval/accuracy": 0.5, "eval/version": 0}

    monkeypatch.setattr(evaluator_module, "evaluate", evaluate)
    ev = Evaluator(spec=None, items=[{"question": "q"}])  # type: ignore[arg-type]  # evaluate is replaced
    ev.workflow = object()  # type: ignore[assignment]  # built: nothing to load
    await ev.start(["http://127.0.0.1:9"], 0)
    assert ev._task is not None
    await asyncio.wait([ev._task])  # it ended before the push, its result not yet handed over
    assert await ev.baseline() == 0.0  # nothing to wait for: no phase of its own in the step line
    assert ev.poll() == {"eval/accuracy": 0.5, "eval/version": 0}


async def test_an_item_that_fails_is_counted_and_left_out_not_the_whole_evaluation() -> None:
    from nodes.driver.evaluator import evaluate
    from protocols.rl import Trajectory, TrajectoryGroup

    class Workflow:
        async def arun_episode(self, client: Any, item: dict, gid: str) -> TrajectoryGroup:
            if item["id"] == "b":
                raise RuntimeError("the environment's server went away")
            reward = 1.0 if item["id"] == "a" else 0.0
            t = Trajectory([1, 2], [0, 1], [0.0, 0.0], [0, 0], reward=reward, group_id=gid, prompt_len=1)
            return TrajectoryGroup(gid, [t])

    items = [{"id": i, "question": i, "answer": "1"} for i in ("a", "b", "c")]
    records: list[dict] = []
    out = await evaluate(Workflow(), ["http://127.0.0.1:9"], items, 2, records=records)  # type: ignore[arg-type]
    assert out["eval/n"] == 2 and out["eval/failed"] == 1 and out["eval/accuracy"] == 0.5
    assert [r["id"] for r in records] == ["a", "c", "b"]
    assert records[-1]["error"] == "RuntimeError: the environment's server went away"
    with pytest.raises(asyncio.CancelledError):  # a cancelled evaluation is not an item's failure
        task = asyncio.create_task(evaluate(Workflow(), ["http://127.0.0.1:9"], items[:1], 2))
        await asyncio.sleep(0)
        task.cancel()
        await task

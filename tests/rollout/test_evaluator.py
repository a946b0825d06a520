"""The evaluator with nothing held out (online mode) evaluates nothing and reports nothing, instead of
an accuracy of 0 over 0 items."""

from __future__ import annotations

from nodes.driver.evaluator import Evaluator


async def test_no_items_no_evaluation() -> None:
    evaluator = Evaluator(spec=None, items=[])  # type: ignore[arg-type]  # never built: nothing to run
    await evaluator.start(["http://127.0.0.1:9"], 0)
    assert evaluator.poll() is None
    assert await evaluator.finish(["http://127.0.0.1:9"], 3) == {}
    assert evaluator.summary() is None and evaluator.workflow is None

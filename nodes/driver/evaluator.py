"""Held-out evaluation beside training: one sample per test prompt through the servers, as a
background task that never stops training, and the run's result in one line.

:class:`Evaluator` runs at most one evaluation at a time: :meth:`Evaluator.start` begins one at a
policy version (unless one is still running), :meth:`Evaluator.poll` hands over a finished one,
:meth:`Evaluator.finish` waits for the running one and evaluates the final policy. Every result it
produced is kept in ``results``, and :meth:`Evaluator.summary` compares the first with the last.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog

from nodes.common.trace import TRACE
from nodes.driver.metrics import accuracy_interval, interval_text
from nodes.rollout.workflows import Workflow, WorkflowSpec, build_workflow
from protocols.http.auth import ServerKeys
from protocols.rl import TrajectoryGroup

__all__ = ["Evaluator", "eval_summary", "evaluate"]

log = structlog.get_logger(__name__)


async def evaluate(
    workflow: Workflow,
    urls: list[str],
    items: list[dict[str, Any]],
    version: int,
    keys: ServerKeys | None = None,
    records: list[dict[str, Any]] | None = None,
    progress: Callable[[], object] | None = None,
    lora: str = "",
) -> dict[str, float]:
    """Accuracy over ``items``: the mean over items of the mean reward of each item's samples (one
    sample each unless the workflow's ``n_samples`` says more), with its 95% Wilson interval over the
    items and the policy version the evaluation started at (weights may move on while it runs). A
    failure is logged and reported as a NaN accuracy: evaluation is a side job.

    ``keys``: the servers' keys. ``records``: when given, one dict per item is appended (its id,
    question, answer, the mean reward, and each sample's reward and completion text), in ``items``'
    order. ``progress``: called as each item finishes. ``lora``: the servers' adapter name under
    adapter pushes (:class:`~nodes.rollout.config.ClientConfig`'s ``lora``).
    """
    from nodes.rollout.client import ClientConfig, SGLangClient

    client = SGLangClient(urls, ClientConfig(keys=keys or ServerKeys(), lora=lora), version=version)
    started = time.time()

    async def one(i: int, item: dict[str, Any]) -> TrajectoryGroup:
        group = await workflow.arun_episode(client, item, f"eval/v{version}/{i}")
        if progress is not None:
            progress()
        return group

    try:
        results = await asyncio.gather(*(one(i, it) for i, it in enumerate(items)), return_exceptions=True)
    finally:
        await client.aclose()
        TRACE.span("eval", started, time.time(), thread="eval", version=version)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r  # cancelled, interrupted: not an item's failure
    failed = [(item, r) for item, r in zip(items, results, strict=True) if isinstance(r, Exception)]
    done = [(item, r) for item, r in zip(items, results, strict=True) if isinstance(r, TrajectoryGroup)]
    if failed:  # evaluation must never stop training: an item that failed is counted, not scored
        e = failed[0][1]
        log.warning(
            "eval_items_failed",
            version=version,
            failed=len(failed),
            of=len(items),
            first=f"{type(e).__name__}: {e}",
            note="left out of the accuracy; counted in eval/failed",
        )
    if not done:
        return {"eval/accuracy": float("nan"), "eval/failed": len(failed), "eval/version": version}
    groups = [g for _, g in done]
    scores = [sum(t.reward for t in g.trajectories) / len(g.trajectories) for g in groups]
    if records is not None:
        records.extend(
            _record(workflow, item, g, score) for (item, g), score in zip(done, scores, strict=True)
        )
        records.extend({**_item_fields(item), "error": f"{type(e).__name__}: {e}"} for item, e in failed)
    correct = sum(scores)
    low, high = accuracy_interval(correct, len(groups))
    out = {
        "eval/accuracy": correct / max(1, len(groups)),
        "eval/ci_low": low,
        "eval/ci_high": high,
        "eval/n": len(groups),
        "eval/failed": len(failed),
        "eval/version": version,
    }
    if any("tool_calls" in g.trajectories[0].meta for g in groups):  # an agent's episodes
        calling = sum(1 for g in groups if g.trajectories[0].meta.get("tool_calls"))
        low, high = accuracy_interval(calling, len(groups))
        out.update(
            {
                "eval/tool_call_rate": calling / max(1, len(groups)),
                "eval/tool_call_ci_low": low,
                "eval/tool_call_ci_high": high,
            }
        )
    return out


def _record(workflow: Workflow, item: dict[str, Any], group: TrajectoryGroup, score: float) -> dict[str, Any]:
    """One item's result: what it was, its score, and each sample's completion as the model wrote it."""
    decode = getattr(getattr(workflow, "tokenizer", None), "decode", None)
    samples = []
    for t in group.trajectories:
        generated = [i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if m]
        text = decode(generated, skip_special_tokens=True) if decode is not None else None
        samples.append({"reward": t.reward, "completion": text, "tokens": len(generated)})
    return {**_item_fields(item), "reward": score, "samples": samples}


def _item_fields(item: dict[str, Any]) -> dict[str, Any]:
    return {"id": item.get("id"), "question": item.get("question"), "answer": item.get("answer")}


def eval_summary(first: dict[str, float], last: dict[str, float]) -> str:
    """``eval accuracy 0.23 (±0.07) at version 0 → 0.45 (±0.09) at version 10: higher, ...``."""
    a, b = first["eval/accuracy"], last["eval/accuracy"]
    if b > first["eval/ci_high"] and a < last["eval/ci_low"]:
        verdict = "higher, outside both intervals"
    elif b < first["eval/ci_low"] and a > last["eval/ci_high"]:
        verdict = "LOWER, outside both intervals"
    else:
        verdict = "no clear change: the intervals overlap"
    return (
        f"eval accuracy {a:.2f} ({interval_text(first)}) at version {first['eval/version']:.0f} → "
        f"{b:.2f} ({interval_text(last)}) at version {last['eval/version']:.0f}: {verdict} "
        f"({last['eval/n']:.0f} held-out problems, 95% intervals)"
    )


class Evaluator:
    """Evaluations of ``items`` with the workflow ``spec`` names, one at a time, in the background.
    With no items (online mode holds nothing out) it evaluates nothing and reports nothing."""

    def __init__(
        self, spec: WorkflowSpec, items: list[dict[str, Any]], keys: ServerKeys | None = None, lora: str = ""
    ) -> None:
        """``keys``: the servers' keys (:class:`protocols.http.auth.ServerKeys`), if they take any;
        ``lora``: the adapter name the policy is served under (adapter pushes), if any."""
        self.spec, self.items, self.keys, self.lora = spec, items, keys, lora
        self.workflow: Workflow | None = None
        self.results: list[dict[str, float]] = []
        self._task: asyncio.Task[dict[str, float]] | None = None

    async def start(self, urls: list[str], version: int) -> None:
        """Begin evaluating ``version`` on ``urls``, unless an evaluation is still running."""
        if self._task is not None or not self.items:
            return
        if self.workflow is None:  # may load a tokenizer
            self.workflow = await asyncio.to_thread(build_workflow, self.spec)
        self._task = asyncio.create_task(
            evaluate(self.workflow, urls, self.items, version, self.keys, lora=self.lora), name="eval"
        )

    async def baseline(self) -> float:
        """Wait for the run's first evaluation if it is still running; the seconds waited. It
        measures the weights the run started with, the "before" of every comparison: the first
        publish must not move them under it (a later evaluation is labelled with the version it
        started at, and may finish on newer weights)."""
        if self.results or self._task is None or self._task.done():
            return 0.0
        started = time.monotonic()
        await asyncio.wait([self._task])
        return time.monotonic() - started

    def poll(self) -> dict[str, float] | None:
        """The result of an evaluation that finished since the last call, else None."""
        if self._task is None or not self._task.done():
            return None
        result, self._task = self._task.result(), None
        self.results.append(result)
        return result

    async def finish(self, urls: list[str], version: int) -> dict[str, float]:
        """Wait for a running evaluation, then evaluate ``version``; the final result ({} with no items)."""
        if not self.items:
            return {}
        if self._task is not None:
            await asyncio.wait([self._task])
            self.poll()
        await self.start(urls, version)
        assert self._task is not None
        await asyncio.wait([self._task])
        result = self.poll()
        assert result is not None
        return result

    def summary(self) -> str | None:
        """:func:`eval_summary` of the first and last evaluation that did not fail, if two did."""
        done = [r for r in self.results if r["eval/accuracy"] == r["eval/accuracy"]]  # not NaN
        return eval_summary(done[0], done[-1]) if len(done) >= 2 else None

    def cancel(self) -> None:
        """Stop a running evaluation (the run is ending)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

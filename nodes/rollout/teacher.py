"""On-policy distillation's rollout half: the teacher's log-probs of exactly the sampled tokens.

For each finished group, every trajectory goes to the teacher's servers as one prefill call: its
whole token ids (prompt and completion), ``max_new_tokens = 0``, ``return_logprob`` with
``logprob_start_len`` one before its first generated token, at the temperature it was sampled at
(so the teacher's log-probs are of the same distribution the policy's are). SGLang and the
reference server answer ``meta_info.input_token_logprobs`` from that position on, the first entry
``None`` (its position is not predicted); the rest are the teacher's ``log p(token_t | tokens_<t)``.
They are stored in ``Trajectory.teacher_logprobs`` (0 where the loss mask is 0), beside the
policy's behaviour log-probs, and the trainer turns them into the distillation advantage
(nodes/trainer/loss.py, :func:`~nodes.trainer.loss.distill_advantages`).

The calls run in the episode's task, after generation and before the group goes to the buffer:
other episodes keep generating meanwhile, and the trainer only ever sees finished groups.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from nodes.rollout.models import ModelCallError, ModelClient
from protocols.rl import LOGPROBS_DTYPE, Trajectory, TrajectoryGroup

__all__ = ["TeacherScorer", "prefill_body", "teacher_logprobs"]


def prefill_body(traj: Trajectory) -> tuple[dict[str, Any], int]:
    """The ``/generate`` body that scores ``traj``'s generated tokens, and the position its
    log-probs start at (``logprob_start_len``; the answer's entry 0 is that position's ``None``)."""
    ids, mask, _, _ = traj.arrays()
    generated = np.flatnonzero(mask)
    start = max(int(generated[0]) - 1, 0) if generated.size else max(len(ids) - 1, 0)
    body = {
        "input_ids": ids.tolist(),
        "sampling_params": {"max_new_tokens": 0, "temperature": traj.temperature or 1.0},
        "return_logprob": True,
        "logprob_start_len": start,
    }
    return body, start


def teacher_logprobs(traj: Trajectory, answer: dict[str, Any], start: int) -> np.ndarray:
    """The per-token teacher log-probs of ``traj`` from the prefill's ``answer``: float32, one per
    token, 0 where the loss mask is 0. A ValueError when the answer does not cover the tokens."""
    ids, mask, _, _ = traj.arrays()
    rows = answer.get("meta_info", {}).get("input_token_logprobs") or []
    if len(rows) != len(ids) - start:
        raise ValueError(
            f"the teacher answered {len(rows)} input log-probs from position {start} for "
            f"{len(ids)} tokens (want {len(ids) - start}): it does not support logprob_start_len"
        )
    out = np.zeros(len(ids), dtype=LOGPROBS_DTYPE)
    for k, row in enumerate(rows):
        p = start + k
        if mask[p]:
            lp, token = row[0], row[1]
            if lp is None or int(token) != int(ids[p]):
                raise ValueError(f"the teacher's log-prob at position {p} is {row!r}, for token {ids[p]}")
            out[p] = lp
    return out


class TeacherScorer:
    """Adds the teacher's log-probs to every trajectory of a group (see the module docstring).
    ``seconds`` and ``calls`` count the time spent and the calls made."""

    def __init__(self, client: ModelClient, timeout_s: float = 600.0) -> None:
        self.client, self.timeout_s = client, timeout_s
        self.seconds = 0.0
        self.calls = 0

    async def _one(self, traj: Trajectory) -> float:
        body, start = prefill_body(traj)
        t0 = time.monotonic()
        answer = await self.client.post("/generate", body, self.timeout_s)
        try:
            traj.teacher_logprobs = teacher_logprobs(traj, answer, start)
        except ValueError as e:
            raise ModelCallError(f"model '{self.client.name}': {e}") from None
        return time.monotonic() - t0

    async def score(self, group: TrajectoryGroup) -> float:
        """Score the group's trajectories (concurrently); the seconds it took. Each trajectory's
        ``meta["teacher_time_s"]`` is its call's time."""
        t0 = time.monotonic()
        times = await asyncio.gather(*(self._one(t) for t in group.trajectories))
        for t, s in zip(group.trajectories, times, strict=True):
            t.meta["teacher_time_s"] = s
        elapsed = time.monotonic() - t0
        self.seconds += elapsed
        self.calls += len(times)
        return elapsed

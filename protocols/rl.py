"""RL batch schema: what rollout hands to the buffer and the buffer hands to the trainer.

These dataclasses cross process boundaries (rollout actor -> buffer actor -> trainer ranks),
so they are registered with the runtime codec and hold only msgpack-friendly fields.
No I/O and no heavy imports here.

Conventions (shared with nodes/trainer):
- ``input_ids`` is prompt + generated tokens (multi-turn: turns interleaved).
- ``loss_mask`` is 1 on tokens the policy generated and the trainer learns from, else 0.
- ``logprobs`` are the behaviour policy's log-probs, 0.0 where ``loss_mask`` is 0.
- ``versions`` is the policy version that produced each token, -1 where ``loss_mask`` is 0.
- ``temperature`` is what the tokens were sampled at: the trainer's log-probs use the same.
- ``Batch.advantages`` holds one advantage per trajectory, set on the driver before training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocols.codec import register

__all__ = ["Batch", "Trajectory", "TrajectoryError", "TrajectoryGroup"]


class TrajectoryError(ValueError):
    """A trajectory, group or batch breaks the schema's invariants (say which and why)."""


@register
@dataclass
class Trajectory:
    """One sampled sequence with everything the trainer needs to compute a PPO loss on it."""

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    group_id: str
    prompt_len: int
    meta: dict[str, Any] = field(default_factory=dict)
    temperature: float = 1.0  # sampling temperature (0 = greedy, scored at 1)

    @property
    def num_tokens(self) -> int:
        """Total tokens (prompt + generated), the unit the trainer packs micro-batches by."""
        return len(self.input_ids)

    @property
    def num_generated(self) -> int:
        """Tokens the loss is computed on."""
        return sum(self.loss_mask)

    @property
    def loss_tokens(self) -> int:
        """Tokens the loss is computed on: generated tokens with a token before them to predict
        them from (the first token of a sequence has none)."""
        return sum(self.loss_mask[1:])

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among generated tokens, or -1 when nothing was generated."""
        gen = [v for v, m in zip(self.versions, self.loss_mask, strict=False) if m]
        return min(gen) if gen else -1

    @property
    def newest_version(self) -> int:
        """The newest policy version among generated tokens, or -1 when nothing was generated."""
        return max((v for v, m in zip(self.versions, self.loss_mask, strict=False) if m), default=-1)

    def validate(self) -> None:
        """Raise TrajectoryError unless the per-token lists line up and masks are consistent."""
        n = len(self.input_ids)
        lens = {
            "loss_mask": len(self.loss_mask),
            "logprobs": len(self.logprobs),
            "versions": len(self.versions),
        }
        bad = {k: v for k, v in lens.items() if v != n}
        if bad:
            raise TrajectoryError(f"trajectory {self.group_id!r}: len(input_ids)={n} but {bad}")
        if not 0 <= self.prompt_len <= n:
            raise TrajectoryError(
                f"trajectory {self.group_id!r}: prompt_len={self.prompt_len} outside [0, {n}]"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise TrajectoryError(f"trajectory {self.group_id!r}: loss_mask must hold only 0/1")
        if any(self.loss_mask[: self.prompt_len]):
            raise TrajectoryError(f"trajectory {self.group_id!r}: loss_mask is 1 inside the prompt")
        for i, (m, v) in enumerate(zip(self.loss_mask, self.versions, strict=True)):
            if m and v < 0:
                raise TrajectoryError(f"trajectory {self.group_id!r}: generated token {i} has no version")
            if not m and v != -1:
                raise TrajectoryError(
                    f"trajectory {self.group_id!r}: masked token {i} has version {v}, want -1"
                )


@register
@dataclass
class TrajectoryGroup:
    """The n samples of one prompt; GRPO normalises rewards within a group, so it travels whole."""

    group_id: str
    trajectories: list[Trajectory]

    @property
    def num_tokens(self) -> int:
        """Total tokens over the group's trajectories."""
        return sum(t.num_tokens for t in self.trajectories)

    @property
    def oldest_version(self) -> int:
        """Oldest generated-token version in the group (-1 if none generated)."""
        vs = [t.oldest_version for t in self.trajectories if t.num_generated]
        return min(vs) if vs else -1

    @property
    def rewards(self) -> list[float]:
        """Rewards of the group's trajectories, in order."""
        return [t.reward for t in self.trajectories]

    def validate(self) -> None:
        """Raise TrajectoryError unless non-empty, every member valid and of this group."""
        if not self.trajectories:
            raise TrajectoryError(f"group {self.group_id!r} has no trajectories")
        for t in self.trajectories:
            if t.group_id != self.group_id:
                raise TrajectoryError(f"group {self.group_id!r} holds a trajectory of group {t.group_id!r}")
            t.validate()


@register
@dataclass
class Batch:
    """What the trainer consumes in one step: whole groups, the version it trains at, and (once
    the driver has computed them) one advantage per trajectory, in ``trajectories`` order."""

    groups: list[TrajectoryGroup]
    version: int
    advantages: list[float] = field(default_factory=list)

    @property
    def trajectories(self) -> list[Trajectory]:
        """All trajectories, group by group."""
        return [t for g in self.groups for t in g.trajectories]

    @property
    def num_tokens(self) -> int:
        """Total tokens in the batch."""
        return sum(g.num_tokens for g in self.groups)

    @property
    def oldest_version(self) -> int:
        """Oldest generated-token version in the batch (-1 if none generated)."""
        vs = [g.oldest_version for g in self.groups if g.oldest_version >= 0]
        return min(vs) if vs else -1

    @property
    def max_staleness(self) -> int:
        """How many versions the oldest token lags the version trained at (0 when none generated)."""
        oldest = self.oldest_version
        return self.version - oldest if oldest >= 0 else 0

    def validate(self) -> None:
        """Raise TrajectoryError unless every group is valid and group ids are unique."""
        ids = [g.group_id for g in self.groups]
        if len(set(ids)) != len(ids):
            raise TrajectoryError(f"batch at version {self.version} repeats a group id")
        for g in self.groups:
            g.validate()

"""RL batch schema: what rollout hands to the buffer and the buffer hands to the trainer.

These dataclasses cross process boundaries (rollout actor -> buffer actor -> trainer ranks),
so they are registered with the runtime codec and hold only wire types; a trajectory's per-token
fields travel as raw numpy arrays (see :class:`Trajectory` for which type comes out).
No I/O and no heavy imports here (numpy only).

Conventions (shared with nodes/trainer):
- ``input_ids`` is prompt + generated tokens (multi-turn: turns interleaved).
- ``loss_mask`` is 1 on tokens the policy generated and the trainer learns from, else 0.
- ``logprobs`` are the behaviour policy's log-probs, 0.0 where ``loss_mask`` is 0.
- ``versions`` is the policy version that produced each token, -1 where ``loss_mask`` is 0.
- ``temperature`` is what the tokens were sampled at: the trainer's log-probs use the same.
- ``teacher_logprobs`` (on-policy distillation only, else None) are a teacher model's log-probs of
  the same tokens at the same temperature, 0.0 where ``loss_mask`` is 0.
- ``Batch.advantages`` holds one advantage per trajectory, set on the driver before training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocols.runtime.codec import array_metadata, register

__all__ = ["Batch", "Trajectory", "TrajectoryError", "TrajectoryGroup"]


class TrajectoryError(ValueError):
    """A trajectory, group or batch breaks the schema's invariants (say which and why)."""


# The per-token fields' dtypes on the wire and after it: token ids and versions fit in 32 bits, the
# mask is 0/1 (int8 rather than bool, so a bad value still fails validate() after a conversion),
# and the trainer computes log-probs in float32.
IDS_DTYPE, MASK_DTYPE, LOGPROBS_DTYPE, VERSIONS_DTYPE = "int32", "int8", "float32", "int32"


@register
@dataclass(eq=False)
class Trajectory:
    """One sampled sequence with everything the trainer needs to compute a PPO loss on it.

    The per-token fields (``input_ids``, ``loss_mask``, ``logprobs``, ``versions``) accept lists
    or numpy arrays. A trajectory keeps what it was built with in its own process (a workflow or
    agent may build lists and edit them); it travels as raw arrays (converted once, when sent),
    so every trajectory the buffer, the driver and the trainer ranks receive holds numpy arrays:
    int32 ids, int8 mask, float32 log-probs, int32 versions (views of the received message,
    read-only; copy one to change it). Code that reads these
    fields should treat them as sequences (``len``, indexing, ``numpy.asarray``), not as lists.
    """

    # raw arrays on the wire (codec.array_field), declared with field() so a checker sees no default
    input_ids: Sequence[int] = field(metadata=array_metadata(IDS_DTYPE))
    loss_mask: Sequence[int] = field(metadata=array_metadata(MASK_DTYPE))
    logprobs: Sequence[float] = field(metadata=array_metadata(LOGPROBS_DTYPE))
    versions: Sequence[int] = field(metadata=array_metadata(VERSIONS_DTYPE))
    reward: float
    group_id: str
    prompt_len: int
    meta: dict[str, Any] = field(default_factory=dict)
    temperature: float = 1.0  # sampling temperature (0 = greedy, scored at 1)
    # distillation: the teacher's log-probs of these tokens (float32 array, 0 off the loss mask); else None
    teacher_logprobs: Any = None

    def __eq__(self, other: object) -> bool:
        if type(other) is not Trajectory:
            return NotImplemented
        return (
            (self.reward, self.group_id, self.prompt_len, self.meta, self.temperature)
            == (
                other.reward,
                other.group_id,
                other.prompt_len,
                other.meta,
                other.temperature,
            )
            and all(np.array_equal(getattr(self, f), getattr(other, f)) for f in _PER_TOKEN)
            and (
                (self.teacher_logprobs is None) == (other.teacher_logprobs is None)
                and (
                    self.teacher_logprobs is None
                    or np.array_equal(self.teacher_logprobs, other.teacher_logprobs)
                )
            )
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, like any dataclass with eq

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The per-token fields as numpy arrays of their wire dtypes (no copy when they are)."""
        return (
            _array(self.input_ids, IDS_DTYPE),
            _array(self.loss_mask, MASK_DTYPE),
            _array(self.logprobs, LOGPROBS_DTYPE),
            _array(self.versions, VERSIONS_DTYPE),
        )

    @property
    def num_tokens(self) -> int:
        """Total tokens (prompt + generated), the unit the trainer packs micro-batches by."""
        return len(self.input_ids)

    @property
    def num_generated(self) -> int:
        """Tokens the loss is computed on."""
        return int(np.count_nonzero(_array(self.loss_mask, MASK_DTYPE)))

    @property
    def loss_tokens(self) -> int:
        """Tokens the loss is computed on: generated tokens with a token before them to predict
        them from (the first token of a sequence has none)."""
        return int(np.count_nonzero(_array(self.loss_mask, MASK_DTYPE)[1:]))

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among generated tokens, or -1 when nothing was generated."""
        gen = self._generated_versions()
        return int(_min(gen)) if gen.size else -1

    @property
    def newest_version(self) -> int:
        """The newest policy version among generated tokens, or -1 when nothing was generated."""
        gen = self._generated_versions()
        return int(_max(gen)) if gen.size else -1

    def _generated_versions(self) -> np.ndarray:
        mask, versions = _array(self.loss_mask, MASK_DTYPE), _array(self.versions, VERSIONS_DTYPE)
        n = min(len(mask), len(versions))
        return versions[:n][mask[:n] != 0]

    def validate(self) -> None:
        """Raise TrajectoryError unless the per-token fields line up and masks are consistent."""
        n = len(self.input_ids)
        lens = {
            "loss_mask": len(self.loss_mask),
            "logprobs": len(self.logprobs),
            "versions": len(self.versions),
        }
        if self.teacher_logprobs is not None:
            lens["teacher_logprobs"] = len(self.teacher_logprobs)
        bad = {k: v for k, v in lens.items() if v != n}
        if bad:
            raise TrajectoryError(f"trajectory {self.group_id!r}: len(input_ids)={n} but {bad}")
        if not 0 <= self.prompt_len <= n:
            raise TrajectoryError(
                f"trajectory {self.group_id!r}: prompt_len={self.prompt_len} outside [0, {n}]"
            )
        try:
            mask = np.asarray(self.loss_mask)
            if mask.dtype == bool:
                mask = mask.view(np.int8)
            versions = _array(self.versions, VERSIONS_DTYPE)
        except (TypeError, ValueError, OverflowError) as e:
            raise TrajectoryError(
                f"trajectory {self.group_id!r}: per-token fields must be numbers: {e}"
            ) from e
        # the common case in a few C-level passes (this runs on every group the buffer takes): each
        # generated token (mask 1) has a version >= 0, each masked one (mask 0) exactly -1
        if (
            _all(np.minimum(versions, 0) == mask - 1)
            and not _any(mask[: self.prompt_len])
            and not _any(mask < 0)
        ):
            return
        gen = mask == 1
        if not _all(gen | (mask == 0)):
            raise TrajectoryError(f"trajectory {self.group_id!r}: loss_mask must hold only 0/1")
        if _any(gen[: self.prompt_len]):
            raise TrajectoryError(f"trajectory {self.group_id!r}: loss_mask is 1 inside the prompt")
        unversioned = np.flatnonzero(gen & (versions < 0))
        if unversioned.size:
            raise TrajectoryError(
                f"trajectory {self.group_id!r}: generated token {unversioned[0]} has no version"
            )
        i = int(np.flatnonzero(~gen & (versions != -1))[0])
        raise TrajectoryError(
            f"trajectory {self.group_id!r}: masked token {i} has version {versions[i]}, want -1"
        )


# ndarray.all()/any()/min() go through Python wrappers; the ufuncs' reductions do not
_all, _any = np.logical_and.reduce, np.logical_or.reduce
_min, _max = np.minimum.reduce, np.maximum.reduce
_PER_TOKEN = ("input_ids", "loss_mask", "logprobs", "versions")


def _array(values: Sequence[Any], dtype: str) -> np.ndarray:
    """``values`` as an array of ``dtype``; an array that is one already is returned as it is."""
    if type(values) is np.ndarray and values.dtype == dtype:
        return values
    return np.asarray(values, dtype=dtype)


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

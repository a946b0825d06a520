"""The rollout plane's configuration: how many rollout actors, how many episodes each runs at once,
and what an episode is (the workflow, by import path, with its own settings).

Torch-free and registered with the codec: the recipe's ``[rollout]`` table is this class, and the
same object travels to every rollout actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocols.codec import register

__all__ = ["RolloutConfig"]


@register
@dataclass
class RolloutConfig:
    n_actors: int = 1  # rollout actors (processes); each takes every n-th prompt
    max_inflight: int = 64  # episodes one rollout actor runs at once
    acquire_batch: int = 64  # grants asked for per governor call
    acquire_timeout_s: float = 5.0  # a wait for capacity returns empty after this, to re-check pause/stop
    put_retries: int = 3  # put is idempotent, so retrying a failed call is safe
    n_samples: int = 8  # completions per prompt (one GRPO group)
    max_new_tokens: int = 96  # truncated rambling scores 0
    temperature: float = 1.0  # sampling temperature; the loss uses the same
    # the episode: a class with arun_episode(client, item, group_id) -> TrajectoryGroup
    workflow: str = "nodes.rollout.workflows:RLVRWorkflow"  # or ...:MultiTurnWorkflow, or yours
    # the workflow's own settings (fields of its config_class), e.g. {max_turns = 3} for MultiTurnWorkflow
    workflow_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, lo in (("n_actors", 1), ("max_inflight", 1), ("acquire_batch", 1), ("n_samples", 1),
                        ("max_new_tokens", 1), ("put_retries", 0), ("temperature", 0)):  # fmt: skip
            if getattr(self, key) < lo:
                raise ValueError(f"'{key}' must be >= {lo}, got {getattr(self, key)!r}")
        if not self.acquire_timeout_s > 0:
            raise ValueError(f"'acquire_timeout_s' must be > 0, got {self.acquire_timeout_s!r}")
        if ":" not in self.workflow:
            raise ValueError(f"'workflow' must be an import path 'module:Class', got {self.workflow!r}")

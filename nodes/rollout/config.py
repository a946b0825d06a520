"""The rollout plane's configuration: how many rollout actors, how many episodes each runs at once,
what an episode is (the workflow, by import path, with its own settings), and how the actors'
SGLang client times out, retries and pools connections (``[rollout.client]``).

Torch-free and registered with the codec: the recipe's ``[rollout]`` table is this class, and the
same object travels to every rollout actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocols.codec import register

__all__ = ["ClientConfig", "RolloutConfig"]


@register
@dataclass
class ClientConfig:
    """Timeouts, retry and pool settings of :class:`~nodes.rollout.client.SGLangClient` (``[rollout.client]``)."""

    request_timeout_s: float = 3600.0  # one /generate; a hung server is detected by this
    # the TCP connect alone. It is a timer on the client's loop, so a loop turn longer than it fails
    # connects that had completed: rollout actors at 10k requests in flight on 2 busy cores had turns
    # of up to 4.9 s (stats loop_lag_max_s) and retried ~130 connects at 5 s (bench/RESULTS.md).
    connect_timeout_s: float = 30.0
    max_retries: int = 3  # per server per post, on transport errors and 5xx
    backoff_base_s: float = 0.05
    backoff_max_s: float = 2.0
    down_cooldown_s: float = 10.0  # a failed server is skipped this long before being tried again
    max_connections_per_server: int = 1024  # keep-alive connections; more requests queue for one
    pause_timeout_s: float = 3600.0  # a resumed request waits at most this long for resume()
    max_idle_aborts: int = 64  # consecutive aborts that returned no tokens before giving up
    sticky_entries: int = 65536  # rid -> server entries kept (LRU) for multi-turn episodes

    def __post_init__(self) -> None:
        for key in ("request_timeout_s", "connect_timeout_s", "pause_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"'{key}' must be > 0, got {getattr(self, key)!r}")
        for key, lo in (("max_retries", 0), ("backoff_base_s", 0), ("backoff_max_s", 0), ("down_cooldown_s", 0),
                        ("max_connections_per_server", 1), ("max_idle_aborts", 1), ("sticky_entries", 1)):  # fmt: skip
            if getattr(self, key) < lo:
                raise ValueError(f"'{key}' must be >= {lo}, got {getattr(self, key)!r}")


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
    client: ClientConfig = field(default_factory=ClientConfig)  # [rollout.client]

    def __post_init__(self) -> None:
        for key, lo in (("n_actors", 1), ("max_inflight", 1), ("acquire_batch", 1), ("n_samples", 1),
                        ("max_new_tokens", 1), ("put_retries", 0), ("temperature", 0)):  # fmt: skip
            if getattr(self, key) < lo:
                raise ValueError(f"'{key}' must be >= {lo}, got {getattr(self, key)!r}")
        if not self.acquire_timeout_s > 0:
            raise ValueError(f"'acquire_timeout_s' must be > 0, got {self.acquire_timeout_s!r}")
        if ":" not in self.workflow:
            raise ValueError(f"'workflow' must be an import path 'module:Class', got {self.workflow!r}")

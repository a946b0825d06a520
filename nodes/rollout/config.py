"""The rollout plane's configuration: how many rollout actors, how many episodes each runs at once,
what an episode is (the workflow, by import path, with its own settings: ``[rollout.workflow_args]``
is the workflow's ``config_class``, samples per prompt and sampling temperature included), and how
the actors' SGLang client times out, retries and pools connections (``[rollout.client]``).

Torch-free and registered with the codec: the recipe's ``[rollout]`` table is this class, and the
same object travels to every rollout actor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from nodes.common.plugins import resolve
from protocols.http.auth import ServerKeys
from protocols.runtime.codec import register
from rlactors.base.tomlconf import above, at_least, check_ranges, import_path

__all__ = ["ClientConfig", "RolloutConfig", "workflow_settings"]


@register
@dataclass
class ClientConfig:
    """Timeouts, retry and pool settings of :class:`~nodes.rollout.client.SGLangClient` (``[rollout.client]``)."""

    REMOVED_KEYS: ClassVar[dict[str, str]] = {
        "http": "the client has one HTTP layer (nodes/rollout/pool.py); delete the line",
    }

    # one /generate; a hung server is detected by this
    request_timeout_s: float = field(default=3600.0, metadata=above(0))
    # the TCP connect alone; keep it well above the loop's longest turn. It is a timer on the client's loop, so a loop turn longer than it fails
    # connects that had completed: a rollout actor with thousands of requests in flight on busy cores
    # has turns of seconds (its stats' loop_lag_max_s), and a 5 s timeout retried connects
    # (bench/RESULTS.md, "Rollout").
    connect_timeout_s: float = field(default=30.0, metadata=above(0))
    # retries of a /generate post to one server, on transport errors and 5xx; then the next server
    max_retries: int = field(default=3, metadata=at_least(0))
    # the first retry's delay, doubled on each next one (jittered); also between aborts without progress
    backoff_base_s: float = field(default=0.05, metadata=at_least(0))
    backoff_max_s: float = field(default=2.0, metadata=at_least(0))  # the longest delay between retries
    # a failed server is skipped this long before being tried again
    down_cooldown_s: float = field(default=10.0, metadata=at_least(0))
    # keep-alive connections; more requests queue for one
    max_connections_per_server: int = field(default=1024, metadata=at_least(1))
    # a resumed request waits at most this long for resume()
    pause_timeout_s: float = field(default=3600.0, metadata=above(0))
    # consecutive aborts that returned no tokens before giving up
    max_idle_aborts: int = field(default=64, metadata=at_least(1))
    # rid -> server entries kept (LRU) for multi-turn episodes
    sticky_entries: int = field(default=65536, metadata=at_least(1))
    # the servers' --api-key/--admin-api-key, sent as each route needs (the recipe fills it in
    # with its servers' keys; set it for servers started elsewhere)
    keys: ServerKeys = field(default_factory=ServerKeys, repr=False)
    # LoRA adapter pushes ([trainer.lora] push = "adapter"; the recipe fills it in): each post names
    # the adapter "<lora>-v<version>" of the version the client knows, which labels its tokens
    lora: str = ""

    def __post_init__(self) -> None:
        check_ranges(self)


def workflow_settings(path: str) -> type:
    """The settings class (``config_class``) of the workflow class at import path ``path``."""
    cls = resolve(path, "rollout.workflow")
    settings = getattr(cls, "config_class", None)
    if not isinstance(settings, type):
        raise ValueError(
            f"workflow {path!r} has no config_class (the dataclass of its settings; see "
            "nodes/rollout/workflows.py)"
        )
    return settings


DEFAULT_WORKFLOW = "nodes.rollout.workflows:RLVRWorkflow"


def _default_settings() -> Any:
    """The default workflow's settings, found as any workflow's are (by its import path): this
    module configures workflows and does not depend on one."""
    return workflow_settings(DEFAULT_WORKFLOW)()


@register
@dataclass
class RolloutConfig:
    # rollout actors (processes); each takes every n-th prompt
    n_actors: int = field(default=1, metadata=at_least(1))
    max_inflight: int = field(default=64, metadata=at_least(1))  # episodes one rollout actor runs at once
    # admission grants a rollout actor asks the governor for in one call
    acquire_batch: int = field(default=64, metadata=at_least(1))
    # a wait for capacity returns empty after this, to re-check pause/stop
    acquire_timeout_s: float = field(default=5.0, metadata=above(0))
    # retries of handing a finished group to the buffer (put is idempotent, so retrying is safe)
    put_retries: int = field(default=3, metadata=at_least(0))
    # the episode: a class with arun_episode(client, item, group_id) -> TrajectoryGroup
    workflow: str = field(default=DEFAULT_WORKFLOW, metadata=import_path())
    # the workflow's settings: an instance of its config_class, from [rollout.workflow_args]
    # (RLVRWorkflow: n_samples, max_new_tokens, temperature, system_prompt, ...)
    workflow_args: Any = field(
        default_factory=_default_settings, metadata={"settings_of": ("workflow", workflow_settings)}
    )
    # the rollout actors' SGLang client: timeouts, retries, connection pools
    client: ClientConfig = field(default_factory=ClientConfig)
    # failures that repeat stop the run (exit 2, one line naming what failed): every episode of the
    # first batch failing (its workflow, environment or agent raised, or its reward function raised on
    # every sample), or this share of a rollout actor's last failure_window episodes (1: all of them)
    max_failure_share: float = field(default=0.9, metadata={"check": (lambda v: 0 < v <= 1, "in (0, 1]")})
    failure_window: int = field(
        default=64, metadata=at_least(1)
    )  # the episodes max_failure_share is judged over

    def __post_init__(self) -> None:
        check_ranges(self)

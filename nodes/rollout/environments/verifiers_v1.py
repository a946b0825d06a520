"""Training verifiers v1 environments unchanged (verifiers 0.4: tasksets and harnesses; the
Environments Hub's current kind), each in a Python environment of its own.

``[rollout] workflow = "nodes.rollout.environments:VerifiersV1Workflow"`` with
``[rollout.workflow_args]`` ``taskset = "<taskset id>"`` (as ``vf.resolve_env_config`` takes it),
``packages = [...]`` (requirement specs or local paths: the taskset's package among them),
``verifiers = "0.4.0"``, ``harness = "null"`` and ``env_config = {...}`` (the rest of verifiers' env
config); ``[data] source = "env"`` trains on the taskset's tasks.

Before anything starts, the run makes the environment's Python environment (uv, cached by its
requirement set: pyenvs.py), and in it resolves the env config, checks that verifiers' wire is the
one the bridge speaks, installs what the harness's program needs and lists the tasks
(v1_bridge.py ``describe``); any failure is one line and exit 2. Then ``n_envs`` actors ``env-<i>``
(:class:`V1ServerActor`, placed, health-checked and replaced as OpenEnv's servers are:
env_servers.py) each own verifiers' env server (``serve_env``) and the bridge in front of it, both
in that environment. An item's ``n_samples`` episodes are ``POST /run`` to a bridge, which runs
verifiers' own ``EnvClient``; every model call of an episode goes to the rollout actor's
OpenAI-compatible endpoint, under a base_url that makes one token sequence per ``X-Session-ID``
(the trace id verifiers sends: :meth:`~nodes.rollout.environments.episodes.EnvEpisodes.sessions`),
so each trace's tokens are exactly what the endpoint generated. A trace's reward is its rewards'
``score * weight`` summed (verifiers' ``Trace.reward``); each reward reaches ``metrics.jsonl`` as
``episode/<name>`` (and ``episode/<name>/weight``), each metric as ``episode/<name>``; a trace
whose agent is not trainable is not trained. An episode that errors, a server that dies, or a group
past ``episode_timeout_s`` drops the group (``rollout/env_errors``, ``rollout/env_timeouts``).

Local only: the agents' runtime is verifiers' local subprocess runtime and their client is the
episode's base_url, whatever verifiers' defaults (Prime's hosted sandboxes and inference).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx  # the bridges' client, as the OpenEnv servers' (env_servers.py)

import rlactors
from nodes.rollout.environments.env_servers import EnvServerActor, EnvServers, start_env_servers
from nodes.rollout.environments.episodes import EnvEpisodes, EnvError, EpisodeSettings, finite_reward
from nodes.rollout.environments.pyenvs import ensure_pyenv, hold_pyenv, pip_source_flags, uv_source_env
from nodes.rollout.reward import RewardRunner
from nodes.rollout.workflows import all_or_none
from protocols.rl import TrajectoryGroup
from protocols.runtime.codec import register
from rlactors.base.tomlconf import above, at_least

__all__ = ["V1ServerActor", "VerifiersV1Config", "VerifiersV1Workflow"]

BRIDGE = str(Path(__file__).with_name("v1_bridge.py"))
DEFAULT_VERIFIERS = "0.4.0"  # the release tests/envs/ test (test_v1_contract.py checks its wire)


@register
@dataclass
class VerifiersV1Config(EpisodeSettings):
    """A verifiers v1 taskset, the Python environment it runs in, and how its episodes run."""

    taskset: str = ""  # the taskset's id (an installed package exporting a vf.Taskset), e.g. "my-sums"
    packages: list[str] = field(default_factory=list)  # its environment's requirements: specs or local paths
    verifiers: str = DEFAULT_VERIFIERS  # the verifiers release installed there (0.4.x)
    harness: str = "null"  # the agent's harness, as verifiers names them (null: the model alone)
    env_config: dict[str, Any] = field(default_factory=dict)  # the rest of verifiers' env config, deep-merged
    # added to every episode's sampling (over temperature and max_new_tokens), e.g. top_p
    sampling_args: dict[str, Any] = field(default_factory=dict)
    n_envs: int = field(default=1, metadata=at_least(1))  # env servers the run starts: env-<i>
    # episodes one env server runs at once (verifiers' own gate; more wait their turn): each starts
    # its harness's program, and too many at once stall the server's loop past its health checks
    max_concurrent: int = field(default=16, metadata=at_least(1))
    max_replacements: int = field(default=3, metadata=at_least(0))  # a server's, when it dies
    start_timeout_s: float = field(default=120.0, metadata=above(0))  # a server's first health
    install_timeout_s: float = field(default=900.0, metadata=above(0))  # making its Python environment

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.taskset:
            raise ValueError("'taskset' must name a verifiers v1 taskset (its id; its package in 'packages')")
        self.described()  # a taskset that does not resolve stops the run before it starts

    @property
    def env_app(self) -> str:
        """How servers and errors name this environment (env_servers.ServerSettings)."""
        return f"{self.taskset} (verifiers {self.verifiers})"

    @property
    def env_urls(self) -> list[str]:
        """None: the run starts its servers (env_servers.ServerSettings)."""
        return []

    def full_env_config(self) -> dict[str, Any]:
        """verifiers' env config: the taskset, the harness on the local subprocess runtime, then
        ``env_config`` deep-merged over them."""
        base = {
            "taskset": {"id": self.taskset},
            "agent": {"harness": {"id": self.harness}, "runtime": {"type": "subprocess"}},
        }
        return _merged(base, self.env_config)

    def requirements(self) -> list[str]:
        """What its Python environment holds: verifiers, uv (the harness programs' installer), the packages."""
        return [f"verifiers=={self.verifiers}", "uv", *self.packages]

    def python(self) -> Path:
        """Its Python environment's interpreter, made now unless it was before; ``ValueError`` (one line)."""
        try:
            return ensure_pyenv(self.requirements(), self.install_timeout_s)
        except ValueError as e:
            raise ValueError(f"'packages': {e}") from None

    def described(self) -> dict[str, Any]:
        """The bridge's ``describe`` of this environment (its tasks), once per environment and
        config (kept beside the environment); ``ValueError`` naming ``'taskset'`` (one line)."""
        python = self.python()
        config = json.dumps(self.full_env_config(), sort_keys=True)
        kept = python.parent.parent / f"described-{hashlib.sha256(config.encode()).hexdigest()[:16]}.json"
        if kept.exists():
            return dict(json.loads(kept.read_text()))
        try:
            done = subprocess.run(
                [str(python), BRIDGE, "describe", "--config", config],
                capture_output=True,
                text=True,
                timeout=self.install_timeout_s,
                env=process_env(python),
            )
        except subprocess.TimeoutExpired:
            raise ValueError(
                f"'taskset' = {self.taskset!r}: describing it ran past {self.install_timeout_s}s"
            ) from None
        try:
            out = json.loads(done.stdout)
        except json.JSONDecodeError:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
            raise ValueError(f"'taskset' = {self.taskset!r}: the bridge failed: {tail}") from None
        if "error" in out:
            raise ValueError(f"'taskset' = {self.taskset!r}: {out['error']}")
        kept.write_text(done.stdout)
        return dict(out)

    def env_data(self, data: Any) -> tuple[list[Any], list[Any], str, str]:
        """``[data] source = "env"``: the taskset's tasks; ``data.eval_from_train`` of them (else a
        fifth, at most ``data.eval_size``) held out for evaluation, never trained on."""
        import random

        name = self.taskset
        tasks = self.described()["tasks"]
        items = [
            {"id": t.get("id") or f"{name}-{i}", "question": _prompt_text(t.get("prompt")), "task": t}
            for i, t in enumerate(tasks)
        ]
        n = data.eval_from_train or min(data.eval_size, len(items) // 5)
        order = list(range(len(items)))
        random.Random(data.seed).shuffle(order)
        out = set(order[:n])
        held = [t for i, t in enumerate(items) if i in out]
        train = [t for i, t in enumerate(items) if i not in out]
        if data.train_limit:
            train = train[: data.train_limit]
        if not train:
            raise ValueError(f"taskset {name} has no tasks to train on")
        held_about = (
            f"{len(held)} tasks of {name} held out, never trained on (data.eval_from_train sets how many)"
        )
        return train, held, f"{len(train)} tasks of verifiers v1 taskset {name}", held_about


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = (
            _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
        )
    return out


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt or [] if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1].get("content", "")) if users else ""


def process_env(python: Path) -> dict[str, str]:
    """The environment of processes in ``python``'s Python environment: its ``bin`` first on PATH
    (its uv prepares harness programs), pip's package sources as uv's."""
    bin_dir = str(python.parent)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(python.parent.parent),
        **uv_source_env(pip_source_flags()),
    }


class V1ServerActor(EnvServerActor):
    """verifiers' env server (``serve_env``) of one taskset and the bridge in front of it, both in the
    taskset's Python environment; health-checked, and replaced when either dies, as an OpenEnv server."""

    label = "verifiers v1 env server"

    def __init__(
        self, app: str, start_timeout_s: float, python: str, env_config: str, max_concurrent: int = 16
    ) -> None:
        super().__init__(app, start_timeout_s)
        self.python, self.env_config, self.max_concurrent = python, env_config, max_concurrent
        hold_pyenv(Path(python).parent.parent, made=True)  # in use while this actor lives: never pruned

    def commands(self, host: str, port: int) -> tuple[list[list[str]], dict[str, str]]:
        from nodes.common.procs import free_port

        address = f"tcp://{host}:{free_port(host)}"
        env = process_env(Path(self.python))
        gate = ["--max-concurrent", str(self.max_concurrent)]
        return [
            [self.python, BRIDGE, "server", "--config", self.env_config, "--address", address, *gate],
            [self.python, BRIDGE, "bridge", "--address", address, "--host", host, "--port", str(port)],
        ], env


class VerifiersV1Workflow:
    """Runs a verifiers v1 taskset's episodes ``n_samples`` times per task through its env servers'
    bridges; the traces' rewards, the endpoint's tokens."""

    config_class: ClassVar[type] = VerifiersV1Config

    @staticmethod
    async def start_actors(cluster: rlactors.Cluster, config: VerifiersV1Config) -> None:
        """Before the rollout actors: the run's env servers (``env-<i>``)."""
        env_config = json.dumps(config.full_env_config(), sort_keys=True)
        await start_env_servers(
            cluster, config, V1ServerActor, str(config.python()), env_config, config.max_concurrent
        )

    def __init__(self, tokenizer: Any, reward: RewardRunner, config: VerifiersV1Config | None = None) -> None:
        if config is None:
            raise ValueError(
                "VerifiersV1Workflow needs its config: rollout.workflow_args.taskset and packages"
            )
        self.config = c = config
        self.servers = EnvServers(c)
        self.episodes = EnvEpisodes(tokenizer, c, c.taskset)
        self.counters = self.episodes.counters
        self._http: httpx.AsyncClient | None = None

    async def arun_episode(self, client: Any, item: Any, group_id: str | None = None) -> TrajectoryGroup:
        """``n_samples`` episodes of the item's task; one group of their trainable traces."""
        gid = group_id or uuid.uuid4().hex
        trajs = await self.episodes.guard(
            all_or_none(self._episode(client, item, gid) for _ in range(self.config.n_samples)), gid
        )
        trajs = [t for ts in trajs for t in ts]
        if not trajs:
            raise EnvError(f"environment {self.config.taskset}: no trainable completion in group {gid}")
        return TrajectoryGroup(gid, trajs)

    async def _episode(self, client: Any, item: dict[str, Any], gid: str) -> list[Any]:
        c = self.config
        if self._http is None:  # on the episodes' loop
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        server = await self.servers.pick()
        sampling = {"temperature": c.temperature, "max_tokens": c.max_new_tokens, **c.sampling_args}
        async with self.episodes.sessions(client) as (sessions, url):
            try:
                r = await self._http.post(
                    f"{server}/run",
                    json={"task": item["task"], "base_url": url, "model": c.model_name, "sampling": sampling},
                )
                r.raise_for_status()
                summary = r.json()
            except httpx.HTTPError as e:
                self.servers.failed(server)  # replaced, perhaps: ask its actor again next time
                raise EnvError(
                    f"environment {c.taskset}'s server {server} failed: {type(e).__name__}: {e}"
                ) from None
            if "error" in summary:
                self.servers.failed(server)
                raise EnvError(f"environment {c.taskset}'s episode failed: {summary['error']}")
            return self._trajectories(summary, sessions, gid)

    def _trajectories(self, summary: dict[str, Any], sessions: dict[str, Any], gid: str) -> list[Any]:
        """Each trainable trace's token sequences (its X-Session-ID's episode), with its reward."""
        name = self.config.taskset
        errors = summary["errors"] + [e for t in summary["traces"] for e in t["errors"]]
        if errors or not summary["ok"]:
            raise EnvError(f"environment {name}'s episode failed: {errors[0] if errors else 'not ok'}")
        out = []
        for trace in summary["traces"]:
            if not trace["trainable"] or trace["id"] not in sessions:
                continue  # another model's agent, or one that made no model call here
            info: dict[str, float] = {}
            reward = 0.0
            for key, r in trace["rewards"].items():
                if r is None:
                    raise EnvError(f"environment {name}: reward {key} was not scored")
                score = finite_reward(r["score"], f"environment {name}'s reward {key}")
                weight = finite_reward(r["weight"], f"environment {name}'s weight of {key}")
                reward += score * weight
                info[key], info[f"{key}/weight"] = score, weight
            for key, value in trace["metrics"].items():
                if value is not None:
                    info[key] = finite_reward(value, f"environment {name}'s metric {key}")
            out += self.episodes.trajectories(sessions[trace["id"]], reward, gid, info)
        return out

"""The plane the GSM8K GRPO loop drives, built from its config: the model checkpoint, the trainer
ranks, the inference servers, the weight-update group (PolicySync), the governor, the buffer and
the rollout actors; and the loop's two questions to it: the next batch, and the step's metrics.

Each component gets its own section of the config as it is; the run fills in only what it decides
itself (the model folder it resolved, the schedule's length, where the disk push writes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import rlactors
from nodes.common.trace import TRACE, TraceWriter
from nodes.driver.policy_sync import PolicySync
from nodes.driver.run_state import RunState
from nodes.plane.buffer import BufferActor
from nodes.plane.governor import GovernorActor
from nodes.rollout.actor import RolloutActor, RolloutHandle
from nodes.rollout.prompts import PromptSpec
from nodes.rollout.workflows import WorkflowSpec
from nodes.trainer.config import TrainConfig
from nodes.trainer.rank import TrainerRank
from protocols.http.auth import ServerKeys
from protocols.rl import Batch
from recipes.gsm8k_config import ConfigError, ModelConfig, RecipeConfig, ServersConfig

if TYPE_CHECKING:
    from nodes.inference.pool import InferencePool, PoolConfig

__all__ = [
    "Plane",
    "check_teacher_tokenizer",
    "eval_spec",
    "pool_config",
    "resolve_model",
    "served_tokenizer",
    "start_model_pools",
    "start_plane",
    "start_pool",
    "start_workflow_actors",
    "with_keys",
    "with_lora",
    "workflow_actors",
]

# A rollout actor holds nothing that cannot be re-created: when it dies the runtime restarts it and the
# buffer re-queues its episodes. Past this many deaths the run stops (ActorDiedError).
ROLLOUT_MAX_RESTARTS = 3


def resolve_model(cfg: ModelConfig) -> Path:
    """The model folder: ``model.path``, a tiny random model, or SmolLM2-135M-Instruct."""
    from nodes.inference.models import ensure_smollm2_checkpoint, ensure_tiny_checkpoint

    if cfg.path:
        p = Path(cfg.path).expanduser()
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model.path={p} is not a Hugging Face model folder (no config.json)")
        return p
    if cfg.tiny:
        return ensure_tiny_checkpoint()
    return ensure_smollm2_checkpoint()


def check_teacher_tokenizer(cfg: RecipeConfig, model: Path) -> str | None:
    """``[distill] teacher``'s tokenizer is the policy's, or a ConfigError (one line): the teacher
    scores the policy's token ids, which mean the same text only under the same tokenizer. A
    teacher at ``urls`` (servers already running) is asked for its tokenizer's folder
    (``/model_info``, as SGLang and the reference server answer it) and checked the same way when
    that folder is on this machine; when it is not, the line returned says it was not checked."""
    teacher = cfg.models.get(cfg.distill.teacher) if cfg.distill.teacher else None
    if teacher is None:
        return None
    where = f"models.{cfg.distill.teacher}.path"
    if teacher.urls:
        where = f"models.{cfg.distill.teacher}.urls"
        reported = served_tokenizer(teacher.urls, where)
        if not (Path(reported) / "tokenizer_config.json").exists():
            return (
                f"distill: the teacher's tokenizer ({reported}, as its /model_info says) is not on this "
                "machine: not checked against the policy's; the two must be the same"
            )
        path = Path(reported)
    else:
        path = Path(teacher.path).expanduser()
    from transformers import AutoTokenizer

    try:
        ours, theirs = AutoTokenizer.from_pretrained(str(model)), AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: {str(path)!r}: no tokenizer to load ({e})") from None
    a, b = ours.get_vocab(), theirs.get_vocab()
    if a != b or ours.eos_token_id != theirs.eos_token_id:
        differ = len(set(a.items()) ^ set(b.items())) // 2 or "none"
        raise ConfigError(
            f"distill.teacher = {cfg.distill.teacher!r}: its tokenizer ({path}) is not the policy's ({model}): "
            f"{len(b)} tokens against {len(a)}, {differ} ids mapped differently, eos {theirs.eos_token_id} against "
            f"{ours.eos_token_id}; the teacher scores the policy's token ids, so it needs the same tokenizer"
        )
    return None


def served_tokenizer(urls: list[str], where: str) -> str:
    """The tokenizer folder the first of ``urls`` to answer ``GET /model_info`` reports, or a
    ConfigError (one line) when none answers: servers named by ``urls`` run before the run does."""
    import httpx

    last = ""
    for url in urls:
        try:
            r = httpx.get(f"{url.rstrip('/')}/model_info", timeout=10.0)
            info = r.json() if r.status_code == 200 else {}
            if path := info.get("tokenizer_path") or info.get("model_path"):
                return str(path)
            last = f"{url}/model_info answered {r.status_code}: {r.text[:120]!r}"
        except (httpx.HTTPError, ValueError) as e:
            last = f"{url}/model_info: {type(e).__name__}: {e}"
    raise ConfigError(f"{where}: no server told its tokenizer ({last}); are they running?")


def train_config(cfg: RecipeConfig, model: Path, out: Path) -> TrainConfig:
    """``[trainer]`` with what the run decides: the model, the schedule's length, and where the
    disk push writes."""
    t = cfg.trainer
    return dataclasses.replace(
        t,
        model_path=str(model),
        # run.steps = 0 (until stopped): the decaying schedules' length is trainer.total_steps
        total_steps=max(1, cfg.run.steps * t.n_minibatches or t.total_steps),
        push=dataclasses.replace(t.push, disk_dir=t.push.disk_dir or str(out / "weights")),
        distill=cfg.distill,  # the loss's distillation weights
    )


def eval_spec(cfg: RecipeConfig, model: Path) -> WorkflowSpec:
    """Evaluation: the training workflow (or the one it names as its ``eval_workflow``) with its
    settings, one sample per prompt at ``run.eval_temperature``."""
    from nodes.common.plugins import resolve

    workflow = getattr(
        resolve(cfg.rollout.workflow, "rollout.workflow"), "eval_workflow", cfg.rollout.workflow
    )
    settings = cfg.rollout.workflow_args
    names = {f.name for f in dataclasses.fields(settings)}
    one = {"n_samples": 1, "temperature": cfg.run.eval_temperature}
    settings = dataclasses.replace(settings, **{k: v for k, v in one.items() if k in names})
    return WorkflowSpec(workflow, str(model), cfg.reward, settings)


def pool_config(s: ServersConfig, model_path: str, out: Path, model: str = "") -> PoolConfig:
    """How a pool launches and watches its servers, from ``[servers]`` (the policy's) or a
    ``[models.<name>]`` table (``model``: its name; never pushed weights)."""
    from nodes.inference.pool import PoolConfig

    server = s.reference if s.kind == "reference" else s.sglang
    return PoolConfig(
        server=dataclasses.replace(server, model_path=model_path) if model_path else server,
        env={"OMP_NUM_THREADS": str(s.threads)} if s.gpus_per_server == 0 else {},
        gpus_per_server=s.gpus_per_server,
        startup_timeout_s=s.startup_timeout_s,
        log_dir=str(out / "servers"),
        replace_dead=s.replace_dead,
        max_replacements=s.max_replacements,
        model=model,
        pushed=not model,
    )


async def start_pool(
    cluster: rlactors.Cluster, cfg: RecipeConfig, model: Path, out: Path
) -> tuple[rlactors.ActorHandle[InferencePool], list[str]]:
    """The ``inference-pool`` actor and its first servers, each healthy; each server writes its log
    to ``<out>/servers/server-<i>.log`` on its host. Servers join, leave and are replaced through
    the pool during the run (``rlactors pool``)."""
    from nodes.inference.pool import POOL_NAME, InferencePool

    pool = await cluster.spawn(
        InferencePool,
        pool_config(cfg.servers, str(model), out),
        name=POOL_NAME,
        control=True,  # the pool spawns its servers' actors: it needs the control credential
    )
    return pool, await pool.start(cfg.servers.n)


async def start_model_pools(
    cluster: rlactors.Cluster, cfg: RecipeConfig, out: Path
) -> dict[str, rlactors.ActorHandle[InferencePool]]:
    """A pool per ``[models.<name>]`` (``inference-pool-<name>``), its servers healthy: launched
    from its ``path`` (logs ``<out>/servers/<name>-server-<i>.log``) or taken at its ``urls``."""
    from nodes.inference.pool import InferencePool, pool_name
    from nodes.rollout.models import bind_model

    pools = {}
    for name, m in cfg.models.items():
        pool = await cluster.spawn(
            InferencePool, pool_config(m, m.path, out, model=name), name=pool_name(name), control=True
        )
        if m.path:
            await pool.start(m.n)
        for url in m.urls:
            await pool.add(url)
        pools[name] = pool
        bind_model(name, pool)  # this process (the driver) evaluates with them too: a judge's reward
    return pools


def workflow_actors(cfg: RecipeConfig) -> Any:
    """The workflow's ``start_actors(cluster, workflow_args)``, if it has actors of its own (e.g.
    OpenEnvWorkflow's environment servers ``env-0``, ...), else None."""
    from nodes.common.plugins import resolve

    return getattr(resolve(cfg.rollout.workflow, "rollout.workflow"), "start_actors", None)


async def start_workflow_actors(cluster: rlactors.Cluster, cfg: RecipeConfig) -> None:
    """Start the workflow's own actors, before anything that runs its episodes (the rollout
    actors, an evaluation)."""
    if start_actors := workflow_actors(cfg):
        await start_actors(cluster, cfg.rollout.workflow_args)


def with_keys(cfg: RecipeConfig, keys: ServerKeys) -> RecipeConfig:
    """``cfg`` with the servers' keys where its clients read them: the weight push's and the
    rollout client's."""
    t, r = cfg.trainer, cfg.rollout
    return dataclasses.replace(
        cfg,
        trainer=dataclasses.replace(t, push=dataclasses.replace(t.push, keys=keys)),
        rollout=dataclasses.replace(r, client=dataclasses.replace(r.client, keys=keys)),
    )


def with_lora(cfg: RecipeConfig) -> RecipeConfig:
    """``cfg`` ready for LoRA adapter pushes (``[trainer.lora] push = "adapter"``): the servers
    launched with LoRA enabled for adapters of its rank and modules, the rollout client naming the
    adapter; otherwise ``cfg`` unchanged."""
    lora, s, r = cfg.trainer.lora, cfg.servers, cfg.rollout
    if not (lora.enabled and lora.push == "adapter"):
        return cfg
    modules = ["all"] if lora.target_modules == "all-linear" else list(lora.target_modules)
    flags = ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *modules]
    servers = dataclasses.replace(
        s,
        reference=dataclasses.replace(s.reference, enable_lora=True, max_lora_rank=lora.rank),
        sglang=dataclasses.replace(s.sglang, extra_args=[*s.sglang.extra_args, *flags]),
    )
    client = dataclasses.replace(r.client, lora=lora.name)
    return dataclasses.replace(cfg, servers=servers, rollout=dataclasses.replace(r, client=client))


@dataclass
class Plane:
    """Everything the loop drives. ``sync.live`` is the servers in use (the ``inference-pool``
    actor changes them at each publish)."""

    cluster: rlactors.Cluster
    ranks: rlactors.ActorGroup[TrainerRank]
    sync: PolicySync
    governor: rlactors.ActorHandle[GovernorActor]
    buffer: rlactors.ActorHandle[BufferActor]
    rollouts: list[RolloutHandle]
    tracer: TraceWriter | None = None  # the run's timeline (run.trace)
    restarts: int = 0  # rollout-actor restarts reported so far
    servers_seen: tuple[int, int] = (0, 0)  # sync.joined, sync.left at the last step

    async def get_batch(self, size: int, version: int, timeout: float, idle: bool = False) -> Batch:
        """The next batch; if none comes in time, say why (a rollout actor's dispatch may have failed).
        ``idle`` (online mode, a service): no batch in time is a quiet period, logged every ``timeout``
        s while the wait goes on; still an error once a rollout actor has failed."""
        waited = 0.0
        while True:
            try:
                return await self.buffer.get_batch(size, version, timeout)
            except TimeoutError:
                stats = await asyncio.gather(*(r.stats() for r in self.rollouts))
                failures = [s["failure"] for s in stats if s.get("failure")]
                if idle and not failures:
                    waited += timeout
                    print(
                        f"online: waiting for sessions: no batch of {size} groups for {waited:.0f}s "
                        f"at version {version}",
                        flush=True,
                    )
                    continue
                why = f"rollout failed: {failures}" if failures else f"buffer: {await self.buffer.stats()}"
                raise RuntimeError(
                    f"no batch of {size} groups within {timeout:.0f}s at version {version}; {why}"
                ) from None

    async def step_metrics(
        self, batch: Any, train: dict[str, Any], push: dict[str, Any], times: dict[str, float], bound: int
    ) -> dict[str, Any]:
        """The step's metrics (metrics.jsonl, the step line): the batch, the trainer's and the push's
        statistics, the rollout actors' counters, the servers' weight versions, the phases' times."""
        trajs = batch.trajectories
        roll = await asyncio.gather(*(r.stats() for r in self.rollouts))
        if (n := sum(r["restarts"] for r in roll)) > self.restarts:
            print(f"rollout actors restarted after dying: {n} so far (their episodes re-queued)")
            self.restarts = n
        return {
            "version": train["version"],
            "reward/mean": sum(t.reward for t in trajs) / len(trajs),
            "staleness/max": batch.max_staleness,
            "staleness/mean": train.get("staleness_mean", 0.0),
            "staleness/bound": bound,
            "servers/min_weight_version": min(await self.sync.weight_versions(), default=-1),
            **self.server_changes(),
            "throughput/samples_per_s": len(trajs) / sum(times.values()),
            "throughput/tokens_per_s": sum(r["tokens_per_s"] for r in roll),
            **{f"time/{k}_s": v for k, v in times.items()},
            "rollout/aborts": sum(r.get("client_aborts", 0) for r in roll),
            "rollout/cached_tokens": sum(r.get("client_cached_tokens", 0) for r in roll),
            "rollout/failovers": sum(r.get("client_failovers", 0) for r in roll),  # since the start
            "rollout/restarts": self.restarts,
            "buffer/dropped_no_signal": (await self.buffer.stats())[
                "dropped_no_signal"
            ],  # [buffer] drop_no_signal
            **_workflow_counters(roll),
            **_episode_info(trajs),
            **_model_metrics(trajs, train, roll),
            **{f"train/{k}": float(v) for k, v in train.items() if isinstance(v, (int, float))},
            **{f"push/{k}": float(v) for k, v in push.items() if isinstance(v, (int, float))},
            "data/groups": ",".join(g.group_id for g in batch.groups),
        }

    def server_changes(self) -> dict[str, float]:
        """``servers/live`` and how many joined and left routing since the last step."""
        joined, left = self.sync.joined - self.servers_seen[0], self.sync.left - self.servers_seen[1]
        self.servers_seen = (self.sync.joined, self.sync.left)
        return {
            "servers/live": float(len(self.sync.live)),
            "servers/joined": float(joined),
            "servers/left": float(left),
        }

    async def record_step(self, step: int, started: float, times: dict[str, float]) -> None:
        """Append the step to the run's timeline (``tracer``; nothing without one): its phases on
        the driver's track, then every actor's events since the last step."""
        if self.tracer is None:
            return
        t = started
        for name, seconds in times.items():
            TRACE.span(name, t, t + seconds)
            t += seconds
        TRACE.span("step", started, t, step=step)
        begun = time.time()
        self.tracer.write(await self.trace_events())
        TRACE.span("trace", begun, time.time())  # what this costs the loop (bench/trace_overhead.py)

    async def trace_events(self) -> list[dict[str, Any]]:
        """Every actor's timeline events since the last call (their recording starts with the
        first), and counters of the governor's admission and the buffer's size."""
        rollouts = await asyncio.gather(*(r.drain_trace() for r in self.rollouts))
        ranks = await self.ranks.drain_trace()
        gov, buf = await asyncio.gather(self.governor.stats(), self.buffer.stats())
        TRACE.counter("governor", capacity=gov["capacity"], running=gov["running"])
        TRACE.counter("buffer", ready=buf["ready"], in_flight=buf["in_flight"])
        return [e for events in (*rollouts, *ranks) for e in events] + TRACE.drain()

    async def stop(self) -> None:
        """Stop the rollout actors and close the weight-update client and the timeline (the
        cluster stops the rest)."""
        await asyncio.gather(*(r.stop() for r in self.rollouts), return_exceptions=True)
        await self.sync.aclose()
        if self.tracer is not None:
            self.tracer.close()


async def start_plane(
    cluster: rlactors.Cluster,
    cfg: RecipeConfig,
    model: Path,
    state: RunState,
    train_items: list[dict[str, Any]],
) -> Plane:
    """Trainer ranks (one torch.distributed world: gloo on CPU, nccl on GPU), servers, the
    weight-update group, governor, buffer and rollout actors; on resume, from the checkpoint
    ``state`` names (its weights pushed to the servers, its trained prompts refused by the buffer)."""
    from nodes.inference.launcher import cluster_keys

    t0 = time.monotonic()
    # The cluster's key pair, made before any server starts: every server that takes keys (beyond
    # loopback, or with servers.<kind>.auth = "on") takes it, every client of the servers holds it.
    keys = await cluster_keys(cluster)
    cfg = with_lora(with_keys(cfg, keys))
    tcfg = train_config(cfg, model, state.out)
    gpu = 1 if tcfg.device == "cuda" else 0
    ranks = await cluster.spawn_group(
        TrainerRank,
        tcfg.n_ranks,
        tcfg,
        name="trainer",
        env={"OMP_NUM_THREADS": str(tcfg.threads)} if not gpu else {},
        resources={"gpu": gpu},
    )
    await cluster.collective_group(list(ranks), backend="nccl" if gpu else "gloo")
    pool, urls = await start_pool(cluster, cfg, model, state.out)
    models = await start_model_pools(cluster, cfg, state.out)  # teachers, judges: never pushed to
    await pool.attach_models(models)  # `rlactors pool ls` shows theirs too
    await ranks.setup()
    if state.resume_from is not None:
        print(await state.load(ranks))
    sync = PolicySync(cluster, ranks, urls, report=print, pool=pool, keys=keys)
    await sync.connect()
    if state.version:
        await ranks.push_weights()  # servers start from the base model
    print(f"cluster ready in {time.monotonic() - t0:.0f}s: {len(urls)} servers, {len(ranks)} trainer ranks")

    governor = await cluster.spawn(GovernorActor, cfg.async_, state.version, name="governor")
    if state.resume_from is not None:
        await governor.recover(state.version)
    # On resume the buffer refuses prompts trained before the checkpoint; groups admitted but not
    # trained by then are generated again.
    buffer = await cluster.spawn(BufferActor, governor, cfg.buffer, sorted(state.trained), name="buffer")
    prompts = PromptSpec(
        kind="items",
        items=train_items,
        epochs=None,
        start_epoch=state.done_epochs,
        shuffle=True,
        seed=cfg.data.seed,
        name="gsm8k",
    )
    workflow = WorkflowSpec(cfg.rollout.workflow, str(model), cfg.reward, cfg.rollout.workflow_args)
    await start_workflow_actors(cluster, cfg)
    n = cfg.rollout.n_actors
    rollouts = [
        RolloutHandle(  # its calls survive a restart: they wait for the new incarnation
            await cluster.spawn(
                RolloutActor,
                urls,
                governor,
                buffer,
                prompts,
                workflow,
                config=cfg.rollout,
                shard=i,
                num_shards=n,
                version=state.version,
                first_batch=-(-cfg.async_.batch_size // n),  # this actor's share of the first batch
                teacher=cfg.distill.teacher,  # on-policy distillation: the teacher scores each group
                name=f"rollout-{i}",
                max_restarts=ROLLOUT_MAX_RESTARTS,
            ),
            ROLLOUT_MAX_RESTARTS,
        )
        for i in range(n)
    ]
    sync.attach(governor, rollouts)
    await pool.attach([r.handle for r in rollouts])
    plane = Plane(cluster, ranks, sync, governor, buffer, rollouts)
    if cfg.run.trace:
        TRACE.track = "driver"
        plane.tracer = TraceWriter(state.out / "trace.json")
        plane.tracer.write(await plane.trace_events())  # every process records from now on
    return plane


def _workflow_counters(roll: list[dict[str, Any]]) -> dict[str, float]:
    """The workflows' own counters (``workflow_<name>`` in the rollout actors' stats), summed."""
    keys = {k for r in roll for k in r if k.startswith("workflow_")}
    return {f"rollout/{k[len('workflow_') :]}": float(sum(r.get(k, 0) for r in roll)) for k in sorted(keys)}


def _model_metrics(trajs: list[Any], train: dict[str, Any], roll: list[dict[str, Any]]) -> dict[str, float]:
    """Other models' metrics, when they are used: ``distill/reverse_kl`` (the trainer's, per loss
    token) and ``distill/teacher_time_s`` (mean seconds of a trajectory's teacher call, this batch);
    ``reward/judge_errors``, ``reward/judge_calls``, ``reward/judge_cache_hits`` (a judge's or a
    reward model's, since the start) and ``reward/judge_time_s`` (the mean seconds of a judgement)."""
    out: dict[str, float] = {}
    if "distill_reverse_kl" in train:
        times = [t.meta["teacher_time_s"] for t in trajs if "teacher_time_s" in t.meta]
        out |= {
            "distill/reverse_kl": float(train["distill_reverse_kl"]),
            "distill/teacher_time_s": sum(times) / len(times) if times else 0.0,
        }
    if any("reward_judge_calls" in r for r in roll):
        out |= {
            "reward/judge_errors": float(sum(r.get("reward_judge_errors", 0) for r in roll)),
            "reward/judge_calls": float(sum(r.get("reward_judge_calls", 0) for r in roll)),
            "reward/judge_cache_hits": float(sum(r.get("reward_judge_cache_hits", 0) for r in roll)),
        }
        judged = sum(r.get("reward_judged", 0) for r in roll)
        if judged:
            out |= {"reward/judge_time_s": sum(r.get("reward_judge_time_s", 0.0) for r in roll) / judged}
    return out


def _episode_info(trajs: list[Any]) -> dict[str, float]:
    """Means of the numbers workflows put in a trajectory's ``meta["info"]`` (an agent's extra
    return values, e.g. turns), as ``episode/<name>``."""
    sums: dict[str, list[float]] = {}
    for t in trajs:
        for k, v in (t.meta.get("info") or {}).items():
            sums.setdefault(k, []).append(float(v))
    return {f"episode/{k}": sum(v) / len(v) for k, v in sorted(sums.items())}

"""TrainerRank: one FSDP2 trainer rank as an rlactors actor (a thin wrapper; the logic lives in
fsdp.py, weights.py and checkpoint.py).

The driver spawns N of them, makes them one collective group (``cluster.collective_group``,
which sets RANK/WORLD_SIZE/MASTER_* and initialises the default group), then calls the same
method on every rank at once; every method here is collective. Methods are sync, so they run in
order on the worker's sync thread while its event loop keeps answering heartbeats.

Configuration travels as a plain dict (msgpack-friendly) mirroring :class:`TrainConfig`, with
nested ``loss``, ``adv`` and ``push`` tables; an unknown key is an error that names it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import structlog

import rlactors
from protocols.rl import Batch  # imported here so this worker can decode the batches it is sent

__all__ = ["TrainerRank", "config_from_dict"]

log = structlog.get_logger(__name__)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown trainer config key(s) {[f'{where}{k}' for k in unknown]}; "
            f"valid under {where or 'top level'}: {sorted(fields)}"
        )
    return cls(**data)


def config_from_dict(data: dict[str, Any] | None) -> tuple[Any, Any]:
    """``(TrainConfig, PushConfig)`` from a dict like ``{"model_path": ..., "loss": {...},
    "adv": {...}, "push": {...}}``."""
    from nodes.trainer.fsdp import TrainConfig
    from nodes.trainer.loss import AdvantageConfig, LossConfig
    from nodes.trainer.weights import PushConfig

    data = dict(data or {})
    loss = _build(LossConfig, dict(data.pop("loss", {}) or {}), "loss.")
    adv = _build(AdvantageConfig, dict(data.pop("adv", {}) or {}), "adv.")
    push = _build(PushConfig, dict(data.pop("push", {}) or {}), "push.")
    if "betas" in data:
        data["betas"] = tuple(data["betas"])
    train = _build(TrainConfig, data, "")
    train.loss, train.adv = loss, adv
    return train, push


class TrainerRank(rlactors.Actor):
    """One trainer rank. Call ``setup`` on every rank (after the collective group exists), then
    ``train_step`` / ``push_weights`` / ``save`` / ``load`` on all ranks together."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = config
        self.trainer: Any = None
        self.pusher: Any = None

    def setup(self, config: dict[str, Any] | None = None, num_threads: int = 0) -> dict[str, Any]:
        """Join the default process group from the environment if not yet joined, build the model
        shard and optimizer. Returns ``{rank, world_size, version}``."""
        import torch
        import torch.distributed as dist

        from nodes.trainer.fsdp import FSDPTrainer

        if num_threads:
            torch.set_num_threads(num_threads)
        train_cfg, push_cfg = config_from_dict(config if config is not None else self.config)
        if not dist.is_initialized():
            backend = "nccl" if train_cfg.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method="env://")
        if train_cfg.device == "cuda":
            # the node agent may narrow CUDA_VISIBLE_DEVICES to this actor's GPU(s)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        self.trainer = FSDPTrainer(train_cfg)
        self.push_cfg = push_cfg
        log.info("trainer_rank_ready", rank=dist.get_rank(), world_size=dist.get_world_size())
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "version": self.trainer.version}

    def _need(self) -> Any:
        if self.trainer is None:
            raise RuntimeError("TrainerRank.setup() must run first")
        return self.trainer

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One GRPO step on ``batch`` (every rank gets the whole batch)."""
        return self._need().train_step(batch)

    def connect_servers(
        self, urls: list[str], master_address: str | None = None, master_port: int | None = None
    ) -> bool:
        """Form the weight-update group with these inference servers (``master_*`` from
        ``cluster.rendezvous`` when the servers are on other hosts)."""
        from nodes.trainer.weights import WeightPusher

        trainer = self._need()
        if self.pusher is None:
            self.pusher = WeightPusher(trainer.model, self.push_cfg, model_config_dir=trainer.cfg.model_path)
        self.pusher.connect(urls, master_address, master_port)
        return True

    def push_weights(self, pause_mode: str | None = "", method: str = "") -> dict[str, float]:
        """Send the current weights to the connected servers with ``weight_version`` = the trainer's
        version. ``pause_mode``/``method`` override the configured ones for this push ("" keeps).
        Weights holding inf or nan are never pushed: NonFiniteError on every rank."""
        from nodes.trainer.fsdp import NonFiniteError, name_list

        if self.pusher is None:
            raise RuntimeError("connect_servers() must run before push_weights()")
        trainer = self._need()
        if bad := trainer.nonfinite():  # servers given inf weights fail every request
            raise NonFiniteError(
                f"not pushing weights of policy version {trainer.version}: non-finite values in "
                f"{name_list(bad)}; the servers keep the previous version"
            )
        cfg = self.pusher.cfg
        saved = cfg.pause_mode, cfg.method
        if pause_mode != "":
            cfg.pause_mode = pause_mode
        if method:
            cfg.method = method
        try:
            return self.pusher.push(trainer.version)
        finally:
            cfg.pause_mode, cfg.method = saved

    def save(self, path: str, data_position: Any = None) -> str:
        """Checkpoint model, optimizer, RNG, step and ``data_position`` to ``path``."""
        from nodes.trainer import checkpoint

        return str(checkpoint.save(self._need(), path, data_position))

    def load(self, path: str) -> dict[str, Any]:
        """Resume from ``path``; returns ``{version, optim_steps, data_position, world_size}``."""
        from nodes.trainer import checkpoint

        return dataclasses.asdict(checkpoint.load(self._need(), path))

    def version(self) -> int:
        """The policy version the weights are at."""
        return self._need().version

    def close(self) -> bool:
        """Leave the weight-update group and the default process group."""
        import torch.distributed as dist

        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None
        if dist.is_initialized():
            dist.destroy_process_group()
        return True

"""TrainerRank: one FSDP2 trainer rank as an rlactors actor (a thin wrapper; the logic lives in
fsdp.py, weights.py and checkpoint.py).

The driver spawns N of them with one :class:`~nodes.trainer.config.TrainConfig` (it travels as
it is), makes them one collective group (``cluster.collective_group``, which sets RANK/WORLD_SIZE/
MASTER_* and initialises the default group), then calls the same method on all of them at once
through an ``rlactors.ActorGroup``; every method here is collective. Methods are sync, so they
run in order on the worker's sync thread while its event loop keeps answering heartbeats.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import structlog

import rlactors
from nodes.common.trace import TRACE
from nodes.trainer.config import TrainConfig
from protocols.rl import Batch  # imported here so this worker can decode the batches it is sent

# What a rank imports as it starts, imported once by its node's fork server (rlactors.node.forkserver).
FORK_PRELOAD = (
    "nodes.trainer.fsdp",
    "nodes.trainer.weights",
    "nodes.trainer.checkpoint",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
)

__all__ = ["TrainerRank"]

log = structlog.get_logger(__name__)


class TrainerRank(rlactors.Actor):
    """One trainer rank. Call ``setup`` on every rank (after the collective group exists), then
    ``train_step`` / ``push_weights`` / ``save`` / ``load`` on all ranks together."""

    def __init__(self, config: TrainConfig | None = None) -> None:
        self.config = config or TrainConfig()
        self.trainer: Any = None
        self.pusher: Any = None

    def setup(self) -> dict[str, Any]:
        """Join the default process group from the environment if not yet joined, build the model
        shard and optimizer. Returns ``{rank, world_size, version}``."""
        import torch
        import torch.distributed as dist

        from nodes.trainer.fsdp import FSDPTrainer

        train_cfg = self.config
        if train_cfg.device == "cpu":
            torch.set_num_threads(train_cfg.threads)
        device = None
        if train_cfg.device == "cuda":
            # the node agent may narrow CUDA_VISIBLE_DEVICES to this actor's GPU(s)
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
            torch.cuda.set_device(device)
        if not dist.is_initialized():  # NCCL told its device: it need not guess it from the rank
            backend = "nccl" if train_cfg.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method="env://", device_id=device)
        self.trainer = FSDPTrainer(train_cfg)
        TRACE.track = f"trainer-{dist.get_rank()}"
        log.info("trainer_rank_ready", rank=dist.get_rank(), world_size=dist.get_world_size())
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "version": self.trainer.version}

    def _need(self) -> Any:
        if self.trainer is None:
            raise RuntimeError("TrainerRank.setup() must run first")
        return self.trainer

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One policy update on ``batch`` (every rank gets the whole batch; ``batch.advantages``
        set). The statistics include ``version``: the policy version the weights are now at."""
        return self._need().train_step(batch)

    def connect_servers(
        self, urls: list[str], master_address: str | None = None, master_port: int | None = None
    ) -> bool:
        """Form the weight-update group with these inference servers (``master_*`` from
        ``cluster.rendezvous`` when the servers are on other hosts)."""
        from nodes.trainer.weights import WeightPusher

        trainer = self._need()
        if self.pusher is None:
            self.pusher = WeightPusher(
                trainer.model, self.config.push, trainer.cfg.model_path, lora=self.config.lora
            )
        self.pusher.connect(urls, master_address, master_port)
        return True

    def push_weights(
        self, pause_mode: str | None = "", method: str = "", keep_paused: bool = False
    ) -> dict[str, float]:
        """Send the current weights to the connected servers with ``weight_version`` = the trainer's
        version. ``pause_mode``/``method`` override the configured ones for this push ("" keeps);
        ``keep_paused`` leaves the servers paused after a push that succeeded (WeightPusher.push).
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
            return self.pusher.push(trainer.version, keep_paused)
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

    def drain_trace(self) -> list[dict[str, Any]]:
        """This rank's timeline events since the last call (nodes/common/trace.py); recording starts with
        the first call. Not collective."""
        return TRACE.drain()

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

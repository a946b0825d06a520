"""Trainer checkpoints: sharded model and optimizer through torch.distributed.checkpoint (DCP),
plus what a resume needs to continue the same run: policy version, optimizer step and LR
schedule, every rank's RNG state, and the data position.

Layout of a checkpoint folder::

    model+optim shards (DCP: .metadata, __<rank>_0.distcp); under LoRA the adapters only
    trainer_state.json   version, optim_steps, data_position, world_size, the base model path and
                         the LoRA settings (rank 0; what `rlactors export` needs)
    rank<r>.pt           RNG states and LR-scheduler state of rank r
    manifest.json        sha256 and size of every file above, written last (manifest.py)

Every rank writes into the same folder, so the ranks' hosts must share the filesystem it is on:
before any shard is written, rank 0 checks that it sees a marker from every rank (manifest.py) and
otherwise the save fails on every rank with an error naming the path and the hosts.

A checkpoint is written to ``<path>.tmp`` and renamed into place once every rank has finished,
so a crash mid-save never leaves a checkpoint that looks complete. Weights or optimizer state
holding inf/nan are refused at save, and files that do not match the manifest at load. DCP
reshards on load, so a run may resume on a different number of ranks (RNG states then come
from rank ``r % saved``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from nodes.trainer.fsdp import NonFiniteError, name_list
from nodes.trainer.manifest import (
    STATE_FILE,
    CheckpointError,
    hash_files,
    mark_visible,
    unmark,
    verify,
    visibility_error,
    write_manifest,
)

__all__ = ["CheckpointError", "TrainerState", "load", "save"]

log = structlog.get_logger(__name__)


@dataclass
class TrainerState:
    """The non-tensor part of a checkpoint. ``model_path`` (the base model's Hugging Face folder) and
    ``lora`` (:class:`~nodes.trainer.config.LoraConfig`'s fields, or None) say how to rebuild the model
    outside the trainer (nodes/trainer/export.py); checkpoints from before they were recorded lack them."""

    version: int
    optim_steps: int
    data_position: Any
    world_size: int
    model_path: str = ""
    lora: dict[str, Any] | None = None


def _trained_state(trainer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state of the parameters that train: all of them, or under LoRA the
    adapters (the frozen base comes from the model path on every start). Names, not torch's
    ``ignore_frozen_params``: that keeps a frozen weight's tied alias (SmolLM2's ``lm_head``)."""
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    named = trainer.model.named_parameters(remove_duplicate=False)
    frozen = {n for n, p in named if not p.requires_grad}
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _host() -> str:
    """Where this rank runs, for errors: the rlactors node and the machine's name."""
    node = os.environ.get("RLACTORS_NODE_ID")
    return f"node {node} ({socket.gethostname()})" if node else socket.gethostname()


def _check_shared(tmp: Path, path: Path, rank: int, world: int) -> None:
    """Collective, after rank 0 made ``tmp``: raise CheckpointError on every rank, before anything is
    saved, if rank 0 does not see the marker each rank leaves there (hosts without a shared disk)."""
    nonce = [uuid.uuid4().hex if rank == 0 else ""]
    dist.broadcast_object_list(nonce, src=0)
    wrote = mark_visible(tmp, rank, nonce[0])
    where: list[Any] = [None] * world
    dist.all_gather_object(where, (_host(), wrote))  # once it returns, every marker is written
    hosts, failed = [h for h, _ in where], [w for _, w in where]
    verdict = [visibility_error(tmp, path, nonce[0], hosts, failed) if rank == 0 else ""]
    dist.broadcast_object_list(verdict, src=0)
    unmark(tmp, rank)
    if verdict[0]:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(verdict[0])


def save(trainer: Any, path: str | Path, data_position: Any = None) -> Path:
    """Write a checkpoint of ``trainer`` (an FSDPTrainer) to ``path``; collective, all ranks call it.

    ``data_position`` is any JSON value that tells the data source where to continue (an index,
    a dict of counters). Raises :class:`~nodes.trainer.fsdp.NonFiniteError` on every rank, and
    writes nothing, when weights or optimizer state hold inf or nan; :class:`CheckpointError`, and
    writes nothing, when rank 0 does not see the files other ranks write to ``path``.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank, world = dist.get_rank(), dist.get_world_size()
    if bad := trainer.nonfinite(optimizer=True):
        raise NonFiniteError(
            f"not saving checkpoint {path}: non-finite values at policy version {trainer.version} in "
            f"{name_list(bad)}; the last good checkpoint is kept"
        )
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _check_shared(tmp, path, rank, world)
    model_sd, optim_sd = _trained_state(trainer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save({"rng": _rng_state(), "scheduler": trainer.scheduler.state_dict()}, tmp / f"rank{rank}.pt")
    if rank == 0:
        lora = asdict(trainer.cfg.lora) if trainer.cfg.lora.enabled else None
        base = trainer.cfg.model_path  # a folder: absolute, so an export from anywhere finds it
        base = str(Path(base).resolve()) if Path(base).is_dir() else base
        state = TrainerState(trainer.version, trainer.optim_steps, data_position, world, base, lora)
        (tmp / STATE_FILE).write_text(json.dumps(state.__dict__))
    dist.barrier()
    hashes: list[Any] = [None] * world  # each rank hashes a share of the files
    dist.all_gather_object(hashes, hash_files(tmp, (rank, world)))
    if rank == 0:
        write_manifest(tmp, {k: v for h in hashes for k, v in h.items()})
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    dist.barrier()
    log.info("checkpoint_saved", path=str(path), version=trainer.version, rank=rank)
    return path


def load(trainer: Any, path: str | Path) -> TrainerState:
    """Restore ``trainer`` from a checkpoint written by :func:`save`; collective. Returns its state.

    The files are checked against the manifest first (each rank hashes a share of them), and the
    loaded weights and optimizer state must be finite; else :class:`CheckpointError` on every rank.
    """
    path = Path(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        verify(path, (rank, world))
        error = ""
    except CheckpointError as e:
        error = str(e)
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)  # every rank raises, none waits in a collective
    if first := next((e for e in errors if e), None):
        raise CheckpointError(first)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete trainer checkpoint (no {STATE_FILE})")
    state = TrainerState(**json.loads(state_file.read_text()))
    model_sd, optim_sd = _trained_state(trainer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(  # not strict: the frozen parameters are not in it (DCP refused missing keys)
        trainer.model,
        trainer.optimizer,
        model_state_dict=sd["model"],
        optim_state_dict=sd["optim"],
        options=StateDictOptions(strict=False),
    )
    if bad := trainer.nonfinite(optimizer=True):
        raise CheckpointError(f"checkpoint {path} holds non-finite values in {name_list(bad)}")
    extra = torch.load(path / f"rank{rank % state.world_size}.pt", weights_only=True)
    trainer.scheduler.load_state_dict(extra["scheduler"])
    _set_rng_state(extra["rng"])
    trainer.version = state.version
    trainer.optim_steps = state.optim_steps
    log.info("checkpoint_loaded", path=str(path), version=state.version, rank=rank)
    return state

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
so a crash mid-save never leaves a checkpoint that looks complete. Its size is estimated from
every rank's shards and compared with the free space before anything is written; a write that
still fails for space on any rank removes the partial folder and raises
:class:`~nodes.common.disk.DiskFullError` on every rank (one line: folder, bytes needed and free),
the checkpoints before it untouched. Weights or optimizer state
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

from nodes.common.disk import DiskFullError, free_bytes, full_line, is_disk_full
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

__all__ = ["CheckpointError", "DiskFullError", "TrainerState", "load", "save"]

# Beyond the tensors' bytes: a rank's RNG and scheduler file, DCP's metadata, the manifest
OVERHEAD_BYTES = 1 << 20

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


def _local_bytes(tree: Any) -> int:
    """Bytes of this rank's part of the tensors in a (nested) state dict: a DTensor's local shard."""
    if isinstance(tree, dict):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_local_bytes(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return local.numel() * local.element_size()
    return 0


def _agree(error: BaseException | None, tmp: Path, world: int) -> None:
    """Collective: when any rank's write failed, remove the partial folder (on every rank: once
    each has stopped writing) and raise on every rank, :class:`DiskFullError` when a disk was full."""
    mine: tuple[str, bool, int] = ("", False, -1)  # (what failed, a full disk, the failing rank)
    if error is not None:
        at, text = _reason(error)
        mine = (text, is_disk_full(error, tmp), at)
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, mine)
    failed = [(r if at < 0 else at, text, full) for r, (text, full, at) in enumerate(seen) if text]
    if not failed:
        return
    shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    shutil.rmtree(tmp, ignore_errors=True)  # a rank's late view of the shared folder
    rank, text, _ = next((f for f in failed if f[2]), failed[0])
    if any(full for _, _, full in failed):
        raise DiskFullError(
            f"{_space_line(tmp)}; rank {rank}: {text}; the partial {tmp.name} was removed, the checkpoints "
            "before it are as they were"
        ) from error
    raise CheckpointError(
        f"checkpoint {tmp.with_suffix('')}: rank {rank} failed to write it: {text}; "
        f"the partial {tmp.name} was removed"
    ) from error


def _reason(e: BaseException) -> tuple[int, str]:
    """The rank whose write failed (-1: this one) and one line for ``e``: the innermost exception's
    (a DCP CheckpointException, raised on every rank, carries the failing ranks' own)."""
    at = -1
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        at, (e, _) = next(iter(failures.items()))
    while e.__cause__ is not None:
        e = e.__cause__
    return at, " ".join(f"{type(e).__name__}: {e}".split())


_need: dict[str, int] = {}  # the estimate of the checkpoint being written, per folder, for its line


def _space_line(tmp: Path) -> str:
    return full_line(f"checkpoint {tmp.with_suffix('')}", tmp.parent, _need.get(str(tmp), 0))


def _attempt(fn: Any) -> BaseException | None:
    """Run ``fn``; the exception it raised (torch's CheckpointException is a BaseException), or None."""
    try:
        fn()
    except (Exception, dcp.api.CheckpointException) as e:
        return e
    return None


def save(trainer: Any, path: str | Path, data_position: Any = None) -> Path:
    """Write a checkpoint of ``trainer`` (an FSDPTrainer) to ``path``; collective, all ranks call it.

    ``data_position`` is any JSON value that tells the data source where to continue (an index,
    a dict of counters). Raises :class:`~nodes.trainer.fsdp.NonFiniteError` on every rank, and
    writes nothing, when weights or optimizer state hold inf or nan; :class:`CheckpointError`, and
    writes nothing, when rank 0 does not see the files other ranks write to ``path``;
    :class:`DiskFullError` when the checkpoint does not fit (estimated before writing, or a write
    failing for space on any rank): the partial folder removed, the checkpoints before it untouched.
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
    needs: list[Any] = [None] * world  # every rank's shards: the checkpoint's size, before writing
    dist.all_gather_object(needs, _local_bytes(model_sd) + _local_bytes(optim_sd) + OVERHEAD_BYTES)
    _need[str(tmp)] = need = sum(needs)
    verdict = [
        full_line(f"checkpoint {path}", path.parent, need, free) + "; nothing was written"
        if rank == 0 and (free := free_bytes(tmp)) < need
        else ""
    ]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise DiskFullError(verdict[0])

    def rank_files() -> None:
        torch.save({"rng": _rng_state(), "scheduler": trainer.scheduler.state_dict()}, tmp / f"rank{rank}.pt")
        if rank == 0:
            lora = asdict(trainer.cfg.lora) if trainer.cfg.lora.enabled else None
            base = trainer.cfg.model_path  # a folder: absolute, so an export from anywhere finds it
            base = str(Path(base).resolve()) if Path(base).is_dir() else base
            state = TrainerState(trainer.version, trainer.optim_steps, data_position, world, base, lora)
            (tmp / STATE_FILE).write_text(json.dumps(state.__dict__))

    # DCP's save is collective and raises on every rank when one rank's writer fails
    error = _attempt(lambda: dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp)))
    _agree(error or _attempt(rank_files), tmp, world)
    hashes: list[Any] = [None] * world  # each rank hashes a share of the files
    dist.all_gather_object(hashes, hash_files(tmp, (rank, world)))
    if rank == 0:
        error = _attempt(lambda: write_manifest(tmp, {k: v for h in hashes for k, v in h.items()}))
    _agree(error if rank == 0 else None, tmp, world)
    if rank == 0:
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    _need.pop(str(tmp), None)
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

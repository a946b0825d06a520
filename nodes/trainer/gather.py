"""Full parameters of an FSDP2 model, assembled on rank 0 bucket by bucket for the weight push.

Only rank 0 needs the full tensors, and an ``all_gather`` of the shards or FSDP's ``unshard``
moves every rank's rows to every rank: several times the time of sending them to rank 0 alone
(bench/RESULTS.md, "Numbers that were in code comments"). So each rank puts its dim-0 shard rows
of every parameter straight into their place in rank 0's bucket buffer (FSDP2 shards dim 0 in
``torch.chunk`` pieces; rows are contiguous in memory). Rank 0 copies only its own rows; the
bucket buffer is then broadcast as is (flattened bucket) or as per-tensor views.

How the rows travel: ranks on rank 0's host map rank 0's bucket buffers from a file in
``/dev/shm`` and copy their rows in with one ``memcpy`` each (gloo has no shared-memory
transport: a loopback TCP send costs two copies and the kernel's time on both sides). Ranks that
cannot open the file (another host, another container's ``/dev/shm``, no space) send their rows
point to point. The file is unlinked as soon as every rank has mapped it (or setup failed), so
once a gatherer exists nothing of it outlives the processes, however they end; only a kill in the
milliseconds between creating and unlinking the file could leave it behind.

Two reusable buffers alternate between buckets: one can be on the wire while the next fills.
Under LoRA the buckets hold the merged weights under the base model's names: each rank merges its
own rows on the way into the buffer (nodes/trainer/lora.py).
"""

from __future__ import annotations

import math
import mmap
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from nodes.trainer.lora import served_parameters

__all__ = ["ParamGatherer", "Spec"]

log = structlog.get_logger(__name__)
SHM_DIR = "/dev/shm"


@dataclass
class Spec:
    """One parameter's place in its bucket buffer."""

    name: str
    param: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0  # bytes into the bucket buffer
    # turns rows of ``param`` (this rank's, or all with True) into what is sent: LoRA's merge
    adjust: Callable[[torch.Tensor, bool], torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _is_dim0_sharded(p: torch.Tensor, world: int, rank: int) -> bool:
    if not isinstance(p, DTensor):
        return False
    if len(p.placements) != 1 or p.placements[0] != Shard(0):
        return False
    d0 = p.shape[0]
    chunk = math.ceil(d0 / world) if d0 else 0
    rows = max(0, min(chunk, d0 - rank * chunk))
    return p.to_local().shape[0] == rows


class ParamGatherer:
    """Plans buckets over a model's parameters and gathers them onto rank 0 (collective)."""

    def __init__(
        self,
        model: torch.nn.Module,
        bucket_bytes: int,
        dtype: torch.dtype | None = None,
        shared_memory: bool = True,
        shm_dir: str = SHM_DIR,
    ):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.specs = [
            Spec(n, p, tuple(p.shape), dtype or p.dtype, adjust=fn) for n, p, fn in served_parameters(model)
        ]
        sharded = [isinstance(s.param, DTensor) for s in self.specs]
        ok = all(
            _is_dim0_sharded(s.param, self.world, self.rank)
            for s in self.specs
            if isinstance(s.param, DTensor)
        )
        if any(sharded) and self.world > 1:
            flag = torch.tensor([int(ok)], dtype=torch.int32)
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = bool(flag.item())
        self.p2p = ok  # else fall back to DTensor.full_tensor (an all-gather per parameter)
        self.buckets: list[list[Spec]] = []
        size = 0
        for s in self.specs:
            if not self.buckets or s.dtype != self.buckets[-1][0].dtype or size + s.nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            s.offset = size
            self.buckets[-1].append(s)
            size += s.nbytes
        self._capacity = max((sum(s.nbytes for s in b) for b in self.buckets), default=0)
        self._buffers: list[torch.Tensor | None] = [None, None]
        # ranks (other than 0) that write their rows into rank 0's buffers through shared memory
        self.shared_ranks: frozenset[int] = frozenset()
        self._mmap: mmap.mmap | None = None
        if self.p2p and self.world > 1 and self._capacity and self._device().type == "cpu":
            self._map_shared(shared_memory, shm_dir)  # collective

    def _map_shared(self, enabled: bool, shm_dir: str) -> None:
        """Rank 0 creates its two bucket buffers in a ``shm_dir`` file; every rank that can map it
        (same host, same ``/dev/shm``) writes there. Collective; falls back to sends per rank.
        Every rank learns the same set of sharing ranks (the barriers in :meth:`gather` depend
        on it), including ranks that could not map the file themselves."""
        n_buffers = min(2, len(self.buckets))
        stride = -(-self._capacity // 64) * 64  # buffer 1 starts aligned for any dtype
        size = n_buffers * stride
        mm, path = None, ""
        if self.rank == 0 and enabled:
            path = os.path.join(shm_dir, f"rlactors-weights-{uuid.uuid4().hex}")
            try:
                mm = _map_file(path, size, create=True)
            except OSError as e:  # no /dev/shm, or not enough room in it: point to point
                log.warning(
                    "weight_gather_shm_unavailable",
                    path=path,
                    mib=size >> 20,
                    error=str(e),
                    hint="shards go by point-to-point sends instead (slower); in a container, "
                    "enlarge /dev/shm (docker run --shm-size)",
                )
                path = ""
        try:
            shared = [path]
            dist.broadcast_object_list(shared, src=0)
            if self.rank != 0 and enabled and shared[0]:
                try:
                    mm = _map_file(shared[0], size, create=False)
                except OSError:  # another host (or another container's /dev/shm)
                    mm = None
            flags = [torch.zeros(1, dtype=torch.int32) for _ in range(self.world)]
            dist.all_gather(flags, torch.tensor([int(mm is not None)], dtype=torch.int32))
        finally:
            if self.rank == 0 and path:  # mapped by all who could (or setup failed): the memory
                os.unlink(path)  # lives until the last unmap, the name goes now
        ranks = frozenset(r for r in range(1, self.world) if flags[r].item())
        if not flags[0].item() or not ranks:
            return  # nobody shares rank 0's buffers: ordinary memory and point-to-point sends
        self.shared_ranks = ranks
        if mm is None:
            return  # this rank sends its rows; the others still meet it at the barriers
        self._mmap = mm
        whole = torch.frombuffer(mm, dtype=torch.uint8)
        cap = self._capacity
        self._buffers = [whole[i * stride : i * stride + cap] for i in range(n_buffers)] + [None] * (
            2 - n_buffers
        )
        if self.rank == 0:
            log.info("weight_gather_shm", ranks=sorted(ranks), mib=size >> 20)

    def _device(self) -> torch.device:
        p = self.specs[0].param
        return p.to_local().device if isinstance(p, DTensor) else p.device

    def _buffer(self, k: int) -> torch.Tensor:
        buf = self._buffers[k % 2]
        if buf is None:
            buf = self._buffers[k % 2] = torch.empty(self._capacity, dtype=torch.uint8, device=self._device())
        return buf

    @staticmethod
    def _view(buf: torch.Tensor | None, s: Spec) -> torch.Tensor:
        assert buf is not None, "a rank with no buffer (not rank 0, not sharing its memory) views none"
        return buf[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)

    def flat(self, k: int) -> torch.Tensor:
        """Bucket ``k``'s buffer as one 1-D tensor of its dtype (rank 0, after :meth:`gather`)."""
        b = self.buckets[k]
        end = b[-1].offset + b[-1].nbytes
        return self._buffer(k)[:end].view(b[0].dtype)

    def views(self, k: int, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Bucket ``k``'s tensors as views into ``buf``, a copy of its buffer's bytes."""
        return [(s.name, self._view(buf, s)) for s in self.buckets[k]]

    def gather(self, k: int) -> list[tuple[str, torch.Tensor]]:
        """Fill bucket ``k`` on rank 0 (every rank must call it); returns ``(name, tensor)`` views
        on rank 0, ``[]`` elsewhere. The views stay valid until bucket ``k + 2`` is gathered."""
        bucket = self.buckets[k]
        if not self.p2p:
            whole = [(s, s.param.full_tensor() if isinstance(s.param, DTensor) else s.param) for s in bucket]
            whole = [(s, s.adjust(t, True) if s.adjust else t) for s, t in whole]
            if self.rank != 0:
                return []
            dst = self._buffer(k)
            for s, t in whole:
                self._view(dst, s).copy_(t.detach())
            return [(s.name, self._view(dst, s)) for s in bucket]
        shared = self.shared_ranks
        if shared:  # rank 0 arrives once bucket k - 2 is off the wire: its buffer may be rewritten
            dist.barrier()
        ops, keep = [], []
        buf = self._buffer(k) if self.rank == 0 or self.rank in shared else None
        for i, s in enumerate(bucket):
            local = s.param.to_local() if isinstance(s.param, DTensor) else s.param
            local = local.detach()
            if s.adjust is not None:  # on every rank, in the same order: it may be collective
                local = s.adjust(local, not isinstance(s.param, DTensor))
            if not isinstance(s.param, DTensor):  # replicated: rank 0 has it all
                if self.rank == 0:
                    self._view(buf, s).copy_(local)
                continue
            d0 = s.shape[0]
            chunk = math.ceil(d0 / self.world)
            if self.rank == 0:
                full = self._view(buf, s)
                full[: local.shape[0]].copy_(local)
                for r in range(1, self.world):
                    lo, hi = r * chunk, min(d0, (r + 1) * chunk)
                    if hi > lo and r not in shared:
                        ops.append(dist.P2POp(dist.irecv, full[lo:hi], r, tag=i))
            elif local.shape[0] == 0:
                continue
            elif self.rank in shared:  # straight into rank 0's buffer (casting if asked)
                lo = self.rank * chunk
                self._view(buf, s)[lo : lo + local.shape[0]].copy_(local)
            else:
                keep.append(local.to(s.dtype).contiguous())
                ops.append(dist.P2POp(dist.isend, keep[-1], 0, tag=i))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        if shared:  # every shared rank's rows are in place
            dist.barrier()
        if self.rank != 0:
            return []
        return [(s.name, self._view(buf, s)) for s in bucket]


def _map_file(path: str, size: int, create: bool) -> mmap.mmap:
    """Map ``size`` bytes of ``path`` shared. Creating reserves the pages up front, so running out
    of room is an ``OSError`` here, not a SIGBUS on first touch."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)
        elif os.fstat(fd).st_size != size:
            raise OSError(f"{path} has {os.fstat(fd).st_size} bytes, expected {size}")
        return mmap.mmap(fd, size)
    except BaseException:  # any exit unlinks what this call created, then re-raises
        if create:
            os.unlink(path)
        raise
    finally:
        os.close(fd)

"""Receiving weights: from a safetensors folder, or by broadcast over a weight-update group.

The group is joined the way SGLang's ``init_custom_process_group`` does it: a ``TCPStore``
client at the trainer's address wrapped in ``PrefixStore(group_name, ...)``, then a
``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) built directly on it. The trainer is
rank 0; this server is ``rank_offset`` (tensor-parallel rank 0). Everything here blocks, so the
server calls it from a worker thread. torch is imported lazily.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass
class UpdateGroup:
    """A joined weight-update group."""

    name: str
    pg: Any
    rank: int
    world_size: int
    backend: str
    staging: Any = None  # the flattened-bucket receive buffer, reused (grown as needed)


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 300.0,
) -> UpdateGroup:
    """Connect to the trainer's store (prefixed by ``group_name``) and build the process group."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "nccl":
        import torch

        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        torch.cuda.synchronize()
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    log.info("weight_group_joined", group=group_name, rank=rank, world_size=world_size, backend=backend)
    return UpdateGroup(name=group_name, pg=pg, rank=rank, world_size=world_size, backend=backend)


def _dtype(name: str) -> Any:
    import torch

    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


class PackedParams:
    """A model's parameters laid out back to back in one buffer, in ``named_parameters()`` order.

    A trainer's flattened bucket is the same parameters in the same order (it walks the same
    model class), so a bucket of consecutive parameters is one slice of this buffer and can be
    received straight into the live model: no staging buffer and no second copy. Packing needs
    the model's memory twice while it runs, so servers do it on CPU, where that copy is what the
    push costs; on GPUs copying out of a staging buffer is cheap.
    """

    def __init__(self, model: Any):
        import torch

        params = list(model.named_parameters())  # tied parameters once
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"parameters of several dtypes cannot share one buffer: {sorted(map(str, dtypes))}"
            )
        self.flat = torch.empty(
            sum(p.numel() for _, p in params), dtype=params[0][1].dtype, device=params[0][1].device
        )
        self.slots: dict[str, tuple[int, Any]] = {}  # name -> (offset, parameter)
        off = 0
        with torch.no_grad():
            for name, p in params:
                n = p.numel()
                view = self.flat[off : off + n]
                view.copy_(p.data.reshape(-1))
                p.data = view.view(p.shape)  # the module keeps its Parameter; only the storage moves
                self.slots[name] = (off, p)
                off += n

    def bucket(self, names: list[str], dtype: Any, shapes: list[list[int]]) -> Any:
        """The slice that holds exactly these parameters back to back (same names, shapes and
        dtype, and still stored in the buffer), or ``None``."""
        if not names or dtype != self.flat.dtype:
            return None
        if names[0] not in self.slots:
            return None
        start = end = self.slots[names[0]][0]
        base, size = self.flat.data_ptr(), self.flat.element_size()
        for name, shape in zip(names, shapes, strict=True):
            off, p = self.slots.get(name, (-1, None))
            if p is None or off != end or tuple(p.shape) != tuple(shape) or p.data_ptr() != base + off * size:
                return None  # not next, another shape, or the model's storage moved since packing
            end += p.numel()
        return self.flat[start:end]


def receive_tensors(
    group: UpdateGroup,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    device: str,
    flattened_bucket: bool = False,
    target: Callable[[str, Any, tuple[int, ...]], Any] | None = None,
    bucket_target: Callable[[list[str], Any, list[list[int]]], Any] | None = None,
) -> list[tuple[str, Any]]:
    """Receive one broadcast per tensor from rank 0 (or one flat bucket); return them named.

    ``target(name, dtype, shape)`` may return the live tensor to receive straight into (no
    staging buffer, no second copy); tensors received that way are not returned. Likewise
    ``bucket_target(names, dtype, shapes)`` for a whole flattened bucket. As SGLang does,
    every receive is posted before any is waited on, so they follow each other on the wire
    without a round trip in between. A flattened bucket lands in a buffer the group keeps: the
    views returned are valid until the next flattened bucket arrives.
    """
    import torch

    if flattened_bucket:
        dt = _dtype(dtypes[0])
        if any(_dtype(d) != dt for d in dtypes):
            raise ValueError("a flattened bucket must hold tensors of one dtype")
        live = bucket_target(names, dt, shapes) if bucket_target is not None else None
        if live is not None:
            group.pg.broadcast(live, 0).wait()
            return []
        sizes = [math.prod(s) for s in shapes]
        nbytes = sum(sizes) * dt.itemsize
        st = group.staging
        if st is None or st.numel() < nbytes:  # a server keeps one device
            st = group.staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat = st[:nbytes].view(dt)
        group.pg.broadcast(flat, 0).wait()
        out, off = [], 0
        for name, shape, n in zip(names, shapes, sizes, strict=True):
            out.append((name, flat[off : off + n].view(*shape)))
            off += n
        return out
    out, works = [], []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dt = _dtype(dtype)
        live = target(name, dt, tuple(shape)) if target is not None else None
        if live is None:
            live = torch.empty(*shape, dtype=dt, device=device)
            out.append((name, live))
        works.append(group.pg.broadcast(live, 0))
    for w in works:
        w.wait()
    return out


def destroy_group(group: UpdateGroup) -> None:
    """Release the group's resources (best effort: gloo has no explicit shutdown)."""
    shutdown = getattr(group.pg, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # already broken; nothing to release
            log.warning("weight_group_shutdown_failed", group=group.name)


def read_safetensors_folder(path: str | Path) -> dict[str, Any]:
    """All tensors of a safetensors checkpoint folder (single file or shards); raises if none."""
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a directory")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_into_model(model: Any, named: list[tuple[str, Any]] | dict[str, Any], strict: bool) -> None:
    """Copy tensors into ``model``'s parameters in place (so tied weights stay tied).

    With ``strict`` every parameter must be covered (a tied ``lm_head.weight`` may be absent) and
    all names and shapes are checked before anything is written, so a bad checkpoint leaves the
    model unchanged.
    """
    import torch

    items = list(named.items()) if isinstance(named, dict) else list(named)
    params = dict(model.named_parameters(remove_duplicate=False))  # tied names too (lm_head.weight)
    for name, t in items:
        if name not in params:
            raise KeyError(f"unknown parameter {name!r}")
        if tuple(params[name].shape) != tuple(t.shape):
            raise ValueError(f"shape mismatch for {name}: {tuple(t.shape)} vs {tuple(params[name].shape)}")
    if strict:
        given = {n for n, _ in items}
        tied = getattr(model.config, "tie_word_embeddings", False)
        missing = [
            n for n, _ in model.named_parameters() if n not in given and not (tied and n == "lm_head.weight")
        ]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, t in items:
            params[name].copy_(t.to(dtype=params[name].dtype, device=params[name].device))

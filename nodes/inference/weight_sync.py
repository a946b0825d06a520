"""Receiving weights: from a safetensors folder, or by broadcast over a weight-update group.

The group is joined the way SGLang's ``init_custom_process_group`` joins it
(:mod:`nodes.common.weight_group`). The trainer is rank 0; this server is ``rank_offset``
(tensor-parallel rank 0). A flattened bucket arrives as SGLang's ``FlattenedTensorBucket``
sends it: the tensors' bytes back to back in one uint8 tensor, dtypes may differ. Everything
here blocks, so the server calls it from a worker thread. torch is imported lazily.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from nodes.common.weight_group import broadcast, destroy_weight_update_group, init_weight_update_group

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
    """Join the trainer's weight-update group as SGLang does (see nodes/common/weight_group.py)."""
    pg = init_weight_update_group(
        backend=backend,
        master_address=master_address,
        master_port=master_port,
        rank=rank,
        world_size=world_size,
        group_name=group_name,
        timeout_s=timeout_s,
    )
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
        dts = [_dtype(d) for d in dtypes]
        live = (
            bucket_target(names, dts[0], shapes) if bucket_target is not None and len(set(dts)) == 1 else None
        )
        if live is not None:
            broadcast(live.view(torch.uint8), group.pg).wait()
            return []
        spans, nbytes = [], 0  # byte offsets, as SGLang lays the bucket out
        for name, dt, shape in zip(names, dts, shapes, strict=True):
            if nbytes % dt.itemsize:
                raise ValueError(f"unaligned tensor {name} in flattened bucket: byte offset {nbytes}, {dt}")
            size = math.prod(shape) * dt.itemsize
            spans.append((nbytes, size))
            nbytes += size
        st = group.staging
        if st is None or st.numel() < nbytes:  # a server keeps one device
            st = group.staging = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat = st[:nbytes]
        broadcast(flat, group.pg).wait()
        return [
            (name, flat[off : off + size].view(dt).view(*shape))
            for name, dt, shape, (off, size) in zip(names, dts, shapes, spans, strict=True)
        ]
    out, works = [], []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dt = _dtype(dtype)
        live = target(name, dt, tuple(shape)) if target is not None else None
        if live is None:
            live = torch.empty(*shape, dtype=dt, device=device)
            out.append((name, live))
        works.append(broadcast(live, group.pg))
    for w in works:
        w.wait()
    return out


def destroy_group(group: UpdateGroup) -> None:
    """Leave the group (best effort: a broken group has nothing left to release)."""
    try:
        destroy_weight_update_group(group.pg)
    except Exception as e:  # best effort: a broken group has nothing left to release
        log.warning("weight_group_destroy_failed", group=group.name, error=str(e))


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

"""LoRA through ``peft``: wrap the policy's linear layers with low-rank adapters, and serve merged
weights under the base model's parameter names.

The trainer optimises and checkpoints the adapters only (``lora_A``, ``lora_B``); the base weights
stay frozen and come from the model path on every start. The servers never see an adapter: the
push sends each wrapped layer's weight as ``W + scale * B @ A`` (the weight ``merge_and_unload``
would give) under the name the base model had, so the reference server and SGLang load it as a
full fine-tune's update. The trained model is never modified to merge: each merged tensor is
computed into the push's buffer and dropped.

Under FSDP2 every parameter is sharded in rows (dim 0): the rows of ``W`` a rank holds and the rows
of ``B`` it holds are the same output rows, so a rank computes its rows of the merged weight from
its own shards and the whole of ``A`` (``rank x in``, small, all-gathered). ``peft`` is imported
only when LoRA is enabled; the rest of this module needs torch only, and recognises peft's layers
by their attributes.

With ``[trainer.lora] push = "adapter"`` a push sends the adapter alone instead
(:func:`adapter_state`, :func:`write_adapter`): rank 0 writes it as a PEFT folder
(``adapter_config.json``, ``adapter_model.safetensors``) and each server loads it with SGLang's
``/load_lora_adapter`` (nodes/trainer/weights.py). A folder on disk, not tensors handed over with
SGLang 0.5.23's ``/load_lora_adapter_from_tensors``: that route takes the same
``MultiprocessingSerializer`` payloads as ``/update_weights_from_tensor`` (CUDA IPC handles, or
shared-memory file descriptors for CPU tensors), which reach only servers on rank 0's host, while a
folder reaches every server that shares the disk (the cluster's shared file system, or the one host
of the CPU recipe) and every SGLang version with LoRA reads it. The adapter is small (a few percent
of the model), so writing and reading it costs little next to the merged weights it replaces; the
folder is also a usable PEFT artifact of that version.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from nodes.trainer.config import LoraConfig

__all__ = [
    "LoraConfig",
    "adapter_state",
    "apply_lora",
    "is_lora",
    "merge_state_dict",
    "served_parameters",
    "write_adapter",
]

PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's names
# a rank's rows (False) or the full tensor (True) of a parameter -> the same rows of what is served
Adjust = Callable[[torch.Tensor, bool], torch.Tensor]


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``cfg.target_modules`` (a ``peft`` model); only the adapter
    parameters require gradients. Call before sharding."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, peft_cfg)
    for name, layer in lora_layers(wrapped):
        base = layer.base_layer
        if not isinstance(base, torch.nn.Linear) or getattr(layer, "fan_in_fan_out", False):
            raise ValueError(
                f"trainer.lora.target_modules: {name} is a {type(base).__name__}; only linear layers "
                "(nn.Linear) can be merged for the servers. Name linear modules (e.g. q_proj, v_proj) "
                "or use 'all-linear'"
            )
    return wrapped


def lora_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(name, layer)`` of every peft LoRA layer in ``model``, names as ``named_modules`` gives them."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if hasattr(m, "base_layer") and hasattr(m, "lora_A") and hasattr(m, "scaling")
    ]


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters."""
    return bool(lora_layers(model))


def base_name(name: str) -> str:
    """The base model's name of a peft parameter name (``...q_proj.base_layer.weight`` ->
    ``...q_proj.weight``)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _adapter(layer: Any) -> tuple[torch.Tensor, torch.Tensor, float]:
    (key,) = layer.active_adapters  # one adapter: the trained one
    return layer.lora_A[key].weight, layer.lora_B[key].weight, float(layer.scaling[key])


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _merge(layer: Any) -> Adjust:
    """The adjustment that turns rows of ``layer``'s base weight into rows of its merged weight.
    Collective when the adapter is sharded (it all-gathers ``A``): every rank calls it."""

    @torch.no_grad()
    def adjust(rows: torch.Tensor, full: bool) -> torch.Tensor:
        a, b, scale = _adapter(layer)
        b_rows = _full(b) if full else (b.to_local() if isinstance(b, DTensor) else b)
        a_all = _full(a).to(rows.device)
        return rows + (b_rows.to(rows.device) @ a_all) * scale

    return adjust


def served_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, Adjust | None]]:
    """What the servers receive, in ``named_parameters`` order: ``(name, parameter, adjust)``.

    For a plain model, every parameter under its own name and no adjustment. For a LoRA model, the
    base model's parameters under the base model's names; a wrapped layer's weight comes with the
    adjustment that merges its adapter in; the adapters themselves are not sent.
    """
    layers = lora_layers(model)
    if not layers:
        return [(n, p, None) for n, p in model.named_parameters()]
    merges = {f"{n}.base_layer.weight": _merge(m) for n, m in layers}
    return [
        (base_name(n), p, merges.get(n))
        for n, p in model.named_parameters()
        if ".lora_A." not in n and ".lora_B." not in n
    ]


def merge_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict of ``model`` (``get_model_state_dict`` with ``full_state_dict``) as the
    servers load it: for a LoRA model, each wrapped weight merged (``W + scale * B @ A``) under the
    base model's names, adapters dropped; a plain model's, unchanged. Not collective: it reads only
    ``sd`` and the layers' scales."""
    layers = lora_layers(model)
    if not layers:
        return sd
    out = {base_name(k): v for k, v in sd.items() if ".lora_A." not in k and ".lora_B." not in k}
    for name, layer in layers:
        (key,) = layer.active_adapters
        a, b = sd[f"{name}.lora_A.{key}.weight"], sd[f"{name}.lora_B.{key}.weight"]
        target = base_name(f"{name}.base_layer.weight")
        out[target] = out[target] + (b @ a) * float(layer.scaling[key])
    return out


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's full tensors on CPU under PEFT's saved names (``...q_proj.lora_A.weight``, the
    adapter's own name dropped), in ``named_parameters`` order. Collective under FSDP2: every rank
    calls it and gets the same tensors. Row-sharded tensors (FSDP2's ``Shard(0)``) travel in one
    collective, each rank's shards together, not one all-gather per tensor (hundreds of small
    collectives, each a round trip: most of an adapter push's time)."""
    named = []
    for name, p in model.named_parameters():
        if ".lora_A." not in name and ".lora_B." not in name:
            continue
        key = name
        for part in (".lora_A.", ".lora_B."):
            head, sep, tail = name.partition(part)
            if sep:  # drop the adapter's own name: "lora_A.default.weight" -> "lora_A.weight"
                key = head + sep + tail.partition(".")[2]
        named.append((key, p.detach()))
    rows = [
        k
        for k, p in named
        if isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),) and p.device_mesh.ndim == 1
    ]
    out = {k: _full(p).cpu() for k, p in named if k not in set(rows)}
    if rows:
        params = {k: p for k, p in named if isinstance(p, DTensor)}  # rows are DTensors' names
        group = params[rows[0]].device_mesh.get_group()
        mine = [params[k].to_local().cpu() for k in rows]
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        for i, k in enumerate(rows):  # Shard(0): rank r holds the r-th block of rows
            out[k] = torch.cat([g[i] for g in gathered], dim=0)
    return {k: out[k] for k, _ in named}


def write_adapter(
    folder: Path, model: torch.nn.Module, tensors: dict[str, torch.Tensor], base_model: str | None
) -> int:
    """Write ``tensors`` (:func:`adapter_state`) and ``model``'s LoRA settings to ``folder`` as a
    PEFT adapter folder, atomically (a folder that exists is complete); returns the bytes written."""
    from peft import PeftModel
    from safetensors.torch import save_file

    config = model.peft_config["default"] if isinstance(model, PeftModel) else None
    if config is None:
        raise ValueError("write_adapter: the model has no peft LoRA config")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    saved = config.base_model_name_or_path
    config.base_model_name_or_path = base_model or saved
    try:
        config.save_pretrained(str(tmp))
    finally:
        config.base_model_name_or_path = saved
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return sum(t.numel() * t.element_size() for t in tensors.values())

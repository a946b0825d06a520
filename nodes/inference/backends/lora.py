"""LoRA adapters at inference on the ``hf`` backend: PEFT adapter folders, applied per batch row.

An :class:`Adapter` is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``, what
``PeftModel.save_pretrained`` writes and SGLang's ``/load_lora_adapter`` reads) read into ``A``
(``rank x in``) and ``B`` (``out x rank``) per targeted linear layer, with peft's scale
(``lora_alpha / r``, or ``/ sqrt(r)`` under rsLoRA). :class:`LoraHooks` puts a forward hook on
every linear layer of the served model that adds ``scale * (x @ A.T) @ B.T`` to the rows of the
batch whose request names that adapter, so one decode step serves requests with different adapters
and requests with none (SGLang's multi-LoRA batching). Hooks, not peft's wrappers, because the base
model keeps its parameter names: full weight updates, ``/get_weights_by_name`` and the packed
receive buffer work unchanged on a server with LoRA enabled. A request holds its :class:`Adapter`
object from admission to its end, as SGLang's requests hold their adapter's id, so unloading a
name never changes what a running request computes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["Adapter", "LoraHooks", "read_adapter"]

PEFT_PREFIX = "base_model.model."  # what peft puts before the base model's module names


@dataclass(eq=False)
class Adapter:
    """One loaded adapter: per module name of the base model, ``(A, B, scale)``."""

    name: str
    path: str
    rank: int
    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)


def read_adapter(
    name: str,
    path: str,
    model: torch.nn.Module,
    max_rank: int | None = None,
    targets: list[str] | None = None,
) -> Adapter:
    """The PEFT adapter folder ``path`` as an :class:`Adapter` for ``model``; ``ValueError`` naming
    what does not fit (no such folder, a rank over ``max_rank``, a module outside ``targets`` (unless
    it holds SGLang's ``all``), a
    tensor that is not a linear layer's adapter of the right shape)."""
    from safetensors.torch import load_file

    folder = Path(path)
    config_file, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise ValueError(
            f"{path} is not a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)"
        )
    config = json.loads(config_file.read_text())
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if max_rank is not None and rank > max_rank:
        raise ValueError(f"LoRA adapter {name} has rank {rank}, over --max-lora-rank {max_rank}")
    if config.get("fan_in_fan_out") or config.get("modules_to_save") or config.get("bias", "none") != "none":
        raise ValueError(
            f"LoRA adapter {name}: only plain LoRA on linear layers is served (no bias, no modules_to_save)"
        )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    modules = dict(model.named_modules())
    param = next(model.parameters())
    tensors = load_file(str(weights))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            raise ValueError(f"LoRA adapter {name}: unexpected tensor {key}")
        pairs.setdefault(module, {})[kind[0]] = t
    adapter = Adapter(name, str(path), rank)
    for module, ab in pairs.items():
        layer = modules.get(module)
        if not isinstance(layer, torch.nn.Linear) or set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name}: {module} is not a linear layer of the served model")
        if targets and "all" not in targets and module.rpartition(".")[2] not in targets:
            raise ValueError(f"LoRA adapter {name} targets {module}, outside --lora-target-modules {targets}")
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
            raise ValueError(f"LoRA adapter {name}: {module} has A {tuple(a.shape)}, B {tuple(b.shape)}")
        adapter.layers[module] = (a.to(param), b.to(param), scale)
    return adapter


class LoraHooks:
    """Forward hooks on ``model``'s linear layers applying each batch row's adapter; set
    :attr:`rows` (one adapter or ``None`` per batch row) before every forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.rows: list[Adapter | None] = []
        self.handles = [
            m.register_forward_hook(self._hook(name))
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)
        ]

    def _hook(self, name: str) -> Any:
        def hook(
            module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor
        ) -> torch.Tensor:
            rows = self.rows
            if not any(rows):
                return out
            x = inputs[0]
            for adapter in {a for a in rows if a is not None}:
                weights = adapter.layers.get(name)
                if weights is None:
                    continue
                a, b, scale = weights
                picked = [i for i, r in enumerate(rows) if r is adapter]
                if len(picked) == len(rows):
                    out = out + (x @ a.T) @ b.T * scale
                else:
                    idx = torch.tensor(picked, device=x.device)
                    out = out.index_add(0, idx, (x[idx] @ a.T) @ b.T * scale)
            return out

        return hook

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self.handles:
            h.remove()

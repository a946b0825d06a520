"""Weight versions on disk for ``/update_weights_from_disk``: one folder per version, written
under a temporary name and renamed into place (a server never reads a half-written version),
old versions pruned."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

__all__ = ["prune_versions", "write_version"]


def write_version(root: Path, version: int, tensors: dict[str, torch.Tensor], config_dir: str | None) -> Path:
    """``root/v<version>`` holding ``model.safetensors`` and the model's config files."""
    from safetensors.torch import save_file

    folder, tmp = root / f"v{version}", root / f".v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if config_dir:
        for name in ("config.json", "generation_config.json"):
            src = Path(config_dir) / name
            if src.is_file():
                shutil.copy(src, tmp / name)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def prune_versions(root: Path, version: int, keep: int) -> None:
    """Delete version folders older than ``version``, keeping ``keep`` versions in all."""
    old = sorted(
        (p for p in root.glob("v*") if p.name[1:].isdigit() and int(p.name[1:]) < version),
        key=lambda p: int(p.name[1:]),
    )
    for p in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)

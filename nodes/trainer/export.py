"""``rlactors export``: a trainer checkpoint out as a Hugging Face model folder that servers load.

A checkpoint (nodes/trainer/checkpoint.py) holds DCP shards of what trained: every weight of a full
fine-tune, or under LoRA the adapters alone, the frozen base coming from the model folder the run
trained from (recorded in ``trainer_state.json``). Export rebuilds that model in one plain process
(no torch.distributed: DCP reads the shards of any number of ranks into whole tensors), reads only
the ``model`` part of the shards (never the optimizer state), and writes::

    config.json, generation_config.json      dtype as asked (bf16 or fp32)
    model.safetensors (or model-0000k-of-0000n.safetensors + model.safetensors.index.json)
    tokenizer files and chat template         copied from the base model folder
    README.md                                 the run, step, policy version, base model, run config

Under LoRA, ``merge`` (the default) writes merged full weights under the base model's names, as
peft's ``merge_and_unload`` gives them; ``adapter`` writes a PEFT adapter folder
(``adapter_config.json``, ``adapter_model.safetensors``) for ``PeftModel.from_pretrained`` on the
base model, with the tokenizer and README. The checkpoint is checked against its manifest first,
and the folder is written to ``<out>.tmp`` and renamed, so a failed export leaves nothing that
looks complete; one that would not fit on its disk is refused before writing (one line: folder,
bytes needed and free), and one that fails for space midway is removed and says the same. This module imports torch only when it exports: the ``rlactors`` command loads it
for its ``--help``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import structlog

from nodes.common.disk import DiskFullError, check_room, full_line, is_disk_full
from nodes.trainer.manifest import MANIFEST, STATE_FILE, CheckpointError, verify

__all__ = ["ExportError", "add_command", "export_checkpoint", "main"]

log = structlog.get_logger(__name__)

Dtype = Literal["bf16", "fp32"]
LoraMode = Literal["merge", "adapter"]
DTYPES = ("bf16", "fp32")
LORA_MODES = ("merge", "adapter")
# what a model folder's tokenizer and chat template are made of (copied as they are)
TOKENIZER_FILES = re.compile(
    r"(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt"
    r"|chat_template\.(jinja|json)|.*\.model)$"
)


class ExportError(Exception):
    """A checkpoint that cannot be exported as asked; the message says what and what to do."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read {path} ({type(e).__name__}: {e})") from None


def _run_config(ckpt: Path) -> tuple[Path, Any]:
    """The run folder (``<run.out_dir>``, two levels above a step folder) and its resolved recipe
    config (``config.json``), or None where the checkpoint is not inside a run's folder."""
    run = ckpt.parent.parent
    path = run / "config.json"
    return run, (_read_json(path) if ckpt.parent.name == "checkpoints" and path.is_file() else None)


def _model_keys(ckpt: Path) -> dict[str, Any]:
    """``{name: TensorStorageMetadata}`` of the model weights in the checkpoint's DCP metadata."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {k.removeprefix("model."): m for k, m in meta.items() if k.startswith("model.")}


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _base_folder(base_model: str | Path | None, recorded: str, ckpt: Path) -> Path:
    if base_model is not None:
        path, source = Path(base_model), "--base-model"
    elif recorded:
        path, source = Path(recorded), f"the base model recorded in {ckpt / STATE_FILE}"
    else:
        raise ExportError(
            f"{ckpt / STATE_FILE} does not record the base model (a checkpoint from an older version): "
            "pass --base-model PATH, the Hugging Face folder the run trained from"
        )
    if not (path / "config.json").is_file():
        raise ExportError(
            f"{source} {path} is not a Hugging Face model folder (no config.json): "
            "pass --base-model PATH, the folder the run trained from"
        )
    return path.resolve()


def _name_dtype(config: Path) -> None:
    """Add ``torch_dtype`` beside transformers 5's ``dtype`` in ``config``: the name that readers
    built on transformers 4 (servers among them) look for."""
    cfg = json.loads(config.read_text())
    cfg.setdefault("torch_dtype", cfg.get("dtype"))
    config.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _readme(
    ckpt: Path, state: dict[str, Any], base: Path, what: str, dtype: str, run: Path, config: Any
) -> str:
    step = ckpt.name.removeprefix("step-") if ckpt.name.startswith("step-") else "?"
    rows = [
        ("run", f"`{run}`" if config is not None else "(not inside a run folder)"),
        ("checkpoint", f"`{ckpt}`"),
        ("step", step),
        ("policy version", str(state.get("version", "?"))),
        ("optimizer steps", str(state.get("optim_steps", "?"))),
        ("base model", f"`{base}`"),
        ("weights", what),
        ("dtype", dtype),
    ]
    lines = [
        f"# {run.name if config is not None else ckpt.name}, step {step}",
        "",
        "Exported with `rlactors export` from an rlactors trainer checkpoint.",
        "",
        "| | |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in rows),
        "",
    ]
    if state.get("lora"):
        lines += ["LoRA settings:", "", "```json", json.dumps(state["lora"], indent=2), "```", ""]
    if config is not None:
        lines += ["## The run's config", "", "```json", json.dumps(config, indent=2), "```", ""]
    return "\n".join(lines)


def export_checkpoint(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    dtype: Dtype = "bf16",
    lora: LoraMode | None = None,
    base_model: str | Path | None = None,
    force: bool = False,
    max_shard_size: str | int = "5GB",
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write checkpoint ``checkpoint_dir`` (a ``step-N`` folder) as a Hugging Face folder ``out_dir``.

    ``lora`` applies to LoRA checkpoints only: ``merge`` (default) or ``adapter``. ``base_model``
    overrides the base folder the checkpoint records (a moved folder). ``force`` replaces a
    non-empty ``out_dir``. ``progress`` gets one line per stage. Returns ``out_dir``; raises
    :class:`ExportError` for anything missing or inconsistent, before writing anything.
    """
    say = progress or (lambda line: log.info("export", progress=line))
    ckpt, out = Path(checkpoint_dir).resolve(), Path(out_dir).resolve()
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if lora is not None and lora not in LORA_MODES:
        raise ExportError(f"lora {lora!r} is not one of {', '.join(LORA_MODES)}")
    if not ckpt.is_dir() or not (ckpt / STATE_FILE).is_file() or not (ckpt / ".metadata").is_file():
        raise ExportError(
            f"{ckpt} is not a trainer checkpoint folder (no {STATE_FILE} and .metadata): "
            "pass a <run.out_dir>/checkpoints/step-N folder"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"output folder {out} exists and is a file: choose another --out")
    if out.exists() and any(out.iterdir()) and not force:
        raise ExportError(
            f"output folder {out} exists and is not empty: choose another --out, or pass --force"
        )
    if out == ckpt or ckpt in out.parents:
        raise ExportError(f"output folder {out} is inside the checkpoint {ckpt}: choose another --out")
    say(f"verifying {ckpt} against its {MANIFEST}")
    try:
        verify(ckpt)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    state = _read_json(ckpt / STATE_FILE)
    run, config = _run_config(ckpt)
    base = _base_folder(base_model, state.get("model_path", ""), ckpt)
    # whether it is a LoRA checkpoint: recorded by the trainer; an older checkpoint's shards say it
    not_lora = f"--lora {lora} is for LoRA checkpoints, and {ckpt} is a full fine-tune's: drop --lora"
    if lora is not None and "lora" in state and not state["lora"]:
        raise ExportError(not_lora)
    keys = _model_keys(ckpt)
    if not keys:
        raise ExportError(f"checkpoint {ckpt} holds no model weights (no 'model' entries in its .metadata)")
    is_lora = any(_is_adapter(k) for k in keys)
    if lora is not None and not is_lora:
        raise ExportError(not_lora)
    if is_lora and not state.get("lora"):
        raise ExportError(
            f"{ckpt} holds LoRA adapters but {STATE_FILE} does not record their settings (a checkpoint "
            "from an older version): it cannot be exported"
        )
    mode = (lora or "merge") if is_lora else None

    import torch

    say(f"loading base model {base} and the weights of {ckpt.name} (policy version {state.get('version')})")
    model = _load(ckpt, base, keys, state.get("lora"))
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    what = {
        None: "full fine-tune",
        "merge": "LoRA adapters merged into the base weights",
        "adapter": "LoRA adapter (load onto the base model with peft)",
    }[mode]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # what it will write: the weights at dtype (the adapters alone for "adapter"), the tokenizer, a MiB
    params = [p for n, p in model.named_parameters() if mode != "adapter" or "lora_" in n]
    need = sum(p.numel() for p in params) * (2 if dtype == "bf16" else 4) + (1 << 20)
    need += sum(f.stat().st_size for f in base.iterdir() if f.is_file() and TOKENIZER_FILES.fullmatch(f.name))
    try:
        check_room(f"export {out}", out.parent, need)
    except DiskFullError as e:
        raise ExportError(str(e)) from None
    tmp.mkdir(parents=True)
    try:
        say(f"writing {tmp} ({what}, {dtype})")
        if mode == "adapter":
            model.peft_config["default"].base_model_name_or_path = str(base)
            model.to(torch_dtype).save_pretrained(str(tmp))
        else:
            model = model.merge_and_unload() if mode == "merge" else model
            model.config.use_cache = True  # the trainer switched it off; servers want it
            model.to(torch_dtype).save_pretrained(str(tmp), max_shard_size=max_shard_size)
            _name_dtype(tmp / "config.json")
            if (base / "generation_config.json").is_file():  # as the base model ships it, exactly
                shutil.copy(base / "generation_config.json", tmp / "generation_config.json")
            elif not (tmp / "generation_config.json").is_file():
                model.generation_config.save_pretrained(str(tmp))
        for f in base.iterdir():
            if f.is_file() and TOKENIZER_FILES.fullmatch(f.name):
                shutil.copy(f, tmp / f.name)
        readme = _readme(ckpt, state, base, what, dtype, run, config)
        (tmp / "README.md").write_text(readme)
        if out.exists():
            old = out.with_name(out.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException as e:  # any exit removes the partial folder, then re-raises
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and is_disk_full(e, out.parent):
            raise ExportError(
                full_line(f"export {out}", out.parent, need) + f"; the partial {tmp.name} was removed"
            ) from e
        raise
    say(f"done: {out} ({_folder_bytes(out) / 2**20:.1f} MiB)")
    return out


def _load(ckpt: Path, base: Path, keys: dict[str, Any], lora: dict[str, Any] | None) -> Any:
    """The base model (fp32; with LoRA adapters as the run had them) with the checkpoint's weights
    read into it: the ``model`` entries of the DCP shards only, in one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if lora is not None:
        from nodes.trainer.config import LoraConfig
        from nodes.trainer.lora import apply_lora

        with warnings.catch_warnings():  # peft calls a transformers API deprecated in 5.x
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            model = apply_lora(model, LoraConfig(**lora))
    sd = model.state_dict()
    unknown = sorted(k for k in keys if k not in sd)
    wrong = sorted(k for k in keys if k in sd and tuple(keys[k].size) != tuple(sd[k].shape))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    absent = sorted(trained - set(keys))
    for problem, names in (
        ("holds weights the model built from it lacks", unknown),
        ("holds weights of other shapes than the model built from it", wrong),
        ("lacks weights that the model built from it trains", absent),
    ):
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ExportError(
                f"checkpoint {ckpt} {problem} (base {base}"
                f"{', LoRA ' + json.dumps(lora) if lora else ''}): {shown}. It was trained from "
                "another model: pass --base-model PATH, the folder the run trained from"
            )
    target = {k: sd[k] for k in keys}  # views of the parameters: DCP copies into them in place
    with warnings.catch_warnings():  # DCP says it loads in one process, as asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({"model": target}, checkpoint_id=str(ckpt), no_dist=True)
    bad = sorted(k for k, t in target.items() if not torch.isfinite(t).all())
    if bad:
        raise ExportError(f"checkpoint {ckpt} holds non-finite values in {', '.join(bad[:3])}")
    return model.eval()


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a <run.out_dir>/checkpoints/step-N folder")
    p.add_argument("--out", required=True, metavar="HF_DIR", help="the Hugging Face folder to write")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="weights' dtype (default bf16)")
    p.add_argument(
        "--lora",
        choices=LORA_MODES,
        default=None,
        help="LoRA checkpoints: merge the adapters into full weights (default) or write a PEFT adapter folder",
    )
    p.add_argument(
        "--base-model", metavar="PATH", help="the base model folder, where the recorded one has moved"
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace HF_DIR if it exists and is not empty")


def run(args: argparse.Namespace) -> int:
    """Run an export from parsed arguments; a bad input is one line on stderr and exit code 2."""

    def progress(line: str) -> None:
        sys.stderr.write(f"export: {line}\n")
        sys.stderr.flush()

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our progress lines say the same, one per stage

    try:
        export_checkpoint(
            args.checkpoint,
            args.out,
            dtype=args.dtype,
            lora=args.lora,
            base_model=args.base_model,
            force=args.force,
            max_shard_size=args.max_shard_size,
            progress=progress,
        )
    except ExportError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    return 0


HELP = "write a trainer checkpoint as a Hugging Face model folder"
DESCRIPTION = "Write a trainer checkpoint as a Hugging Face model folder (safetensors, config, tokenizer)."


def add_command(sub: Any) -> None:
    """Add ``export`` to the ``rlactors`` command's subparsers (the ``rlactors.commands`` entry point)."""
    p = sub.add_parser("export", help=HELP, description=DESCRIPTION)
    _arguments(p)
    p.set_defaults(handler=run)


def main(argv: list[str] | None = None) -> None:
    """``python -m nodes.trainer.export``: the same command as ``rlactors export``."""
    p = argparse.ArgumentParser(prog="python -m nodes.trainer.export", description=DESCRIPTION)
    _arguments(p)
    sys.exit(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()

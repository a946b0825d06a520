"""Evaluate a model with the run's own evaluator: accuracy with its 95% interval, and every item's result.

    python -m recipes.gsm8k_eval --model runs/gsm8k_grpo/checkpoints/step-10     # a checkpoint: exported first
    python -m recipes.gsm8k_eval --model my-export --data test.jsonl data.prompt_field=q data.answer_field=a
    python -m recipes.gsm8k_eval --model my-export --server-url http://127.0.0.1:30000   # a running SGLang
    python -m recipes.gsm8k_eval --model my-export --n 4 --temperature 0.7            # 4 samples per item

``--model`` is a Hugging Face folder (``rlactors export``'s, or any) or a trainer checkpoint
(``<run>/checkpoints/step-N``, exported into the output folder first). The config (``--config`` and
``section.key=value`` overrides, as the recipe takes them) decides the workflow, its prompt, the reward
and the servers; the items are ``--data`` (every row of a file, or the eval split of a folder, saved
dataset or hub id, read with the config's ``[data]`` field names), else the config's held-out items.
Without ``--server-url`` the config's servers are started on an embedded cluster, as the run starts
them, and stopped at the end.

Writes ``<out>/results.jsonl`` (per item: id, question, answer, mean reward, each sample's reward and
completion; an item whose episode failed: its error instead, and it is left out of the accuracy) and
``<out>/summary.json``; prints one line with the accuracy and its interval. A bad input is one line
and exit 2; an evaluation whose every item fails, exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from nodes.driver.data import DataError, load_data, load_eval_items
from nodes.driver.evaluator import evaluate
from protocols.http.auth import ServerKeys
from recipes.gsm8k_config import ConfigError, RecipeConfig, load_config
from recipes.gsm8k_plane import eval_spec, start_pool, start_workflow_actors, with_keys, workflow_actors

__all__ = ["main", "run_evaluation"]


class EvaluationError(Exception):
    """An input the evaluation cannot use (the message is one line)."""


def resolve_model(model: str, out: Path, say: Any) -> Path:
    """An HF folder as it is; a trainer checkpoint exported (fp32) into ``out/model`` first."""
    path = Path(model).expanduser().resolve()
    if (path / "trainer_state.json").is_file():
        from nodes.trainer.export import ExportError, export_checkpoint

        try:
            return export_checkpoint(path, out / "model", dtype="fp32", force=True, progress=say)
        except ExportError as e:
            raise EvaluationError(str(e)) from None
    if not (path / "config.json").is_file():
        raise EvaluationError(
            f"--model {model}: not a Hugging Face model folder (no config.json) nor a trainer checkpoint "
            "(no trainer_state.json)"
        )
    return path


def items_of(cfg: RecipeConfig, data: str | None, limit: int) -> tuple[list[dict[str, Any]], str]:
    """``--data``'s rows, else the config's held-out items; the first ``limit`` (0 = all)."""
    if data:
        return load_eval_items(cfg.data, data, limit)
    held = load_data(cfg.data, cfg.rollout.workflow_args)
    items = held.eval[:limit] if limit else held.eval
    return items, f"{len(items)} held-out items of the config's data: {held.eval_about}"


def spec_for(cfg: RecipeConfig, model: Path, n: int, temperature: float | None) -> Any:
    """The run's evaluation workflow (:func:`recipes.gsm8k_plane.eval_spec`) at ``temperature`` (None:
    the config's ``run.eval_temperature``) with ``n`` samples per item."""
    if temperature is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, eval_temperature=temperature))
    spec = eval_spec(cfg, model)
    if n != 1:
        if "n_samples" not in {f.name for f in dataclasses.fields(spec.config)}:
            raise EvaluationError(
                f"--n {n}: the workflow {spec.workflow} takes one sample per item (no n_samples)"
            )
        spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, n_samples=n))
    return spec


async def run_evaluation(args: argparse.Namespace, cfg: RecipeConfig, out: Path) -> dict[str, Any]:
    """Serve the model (or use ``--server-url``), evaluate every item, write the results."""
    from tqdm import tqdm

    from nodes.rollout.workflows import build_workflow

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    items, about = await asyncio.to_thread(items_of, cfg, args.data, args.limit)
    model = await asyncio.to_thread(resolve_model, args.model, out, say)
    spec = spec_for(cfg, model, args.n, args.temperature)
    say(f"data: {about}\nmodel: {model}")
    workflow = await asyncio.to_thread(build_workflow, spec)
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    cluster = None
    try:
        if not args.server_url or workflow_actors(cfg):  # servers to start, or the workflow's actors
            import rlactors

            cluster = await rlactors.init()
            await start_workflow_actors(cluster, cfg)  # e.g. an OpenEnv env_app's servers (env-0, ...)
        if args.server_url:
            urls, keys = list(args.server_url), ServerKeys(args.api_key or "")
        else:
            from nodes.inference.launcher import cluster_keys

            assert cluster is not None
            keys = await cluster_keys(cluster)
            say(f"starting {cfg.servers.n} {cfg.servers.kind} server(s) (logs in {out / 'servers'})")
            _, urls = await start_pool(cluster, with_keys(cfg, keys), model, out)
        with tqdm(total=len(items), desc="evaluating", unit="item", file=sys.stderr) as bar:
            result = await evaluate(workflow, urls, items, 0, keys, records, bar.update)
    finally:
        if cluster is not None:
            await cluster.close()
    if result["eval/accuracy"] != result["eval/accuracy"]:  # NaN: the evaluator logged why
        raise RuntimeError(f"the evaluation failed on {urls} (see the log above)")
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {
        "model": str(model),
        "data": about,
        "items": len(items),
        "samples_per_item": args.n,
        "temperature": spec.config.temperature if hasattr(spec.config, "temperature") else None,
        "failed": result["eval/failed"],  # items whose episode failed: left out of the accuracy
        "accuracy": result["eval/accuracy"],
        "ci_low": result["eval/ci_low"],
        "ci_high": result["eval/ci_high"],
        "servers": urls,
        "seconds": round(time.monotonic() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def eval_config(args: argparse.Namespace) -> RecipeConfig:
    """The recipe config the evaluation runs with: ``--config`` and the overrides; with ``--data``,
    that data is your data (``[data]``'s field keys read, no math prompt unless set)."""
    given = ["data.source=local", f"data.path={args.data}"] if args.data else []
    return load_config(args.config, [*given, *args.overrides])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m recipes.gsm8k_eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--model", required=True, help="a Hugging Face model folder or a trainer checkpoint folder"
    )
    ap.add_argument("--config", help="the run's TOML config (default: the recipe's defaults)")
    ap.add_argument("--data", help="evaluate on this data (file, folder, saved dataset or hub id) instead")
    ap.add_argument("--server-url", action="append", help="a running SGLang-protocol server (repeatable)")
    ap.add_argument("--api-key", help="the --server-url servers' API key, if they take one")
    ap.add_argument("--n", type=int, default=1, help="samples per item (default 1)")
    ap.add_argument(
        "--temperature", type=float, help="sampling temperature (default: run.eval_temperature, 0)"
    )
    ap.add_argument("--limit", type=int, default=0, help="evaluate the first N items only (default: all)")
    ap.add_argument("--out", default="runs/evaluate", help="where results.jsonl and summary.json go")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = ap.parse_intermixed_args(argv)  # overrides before and after flags, as `--resume run.steps=9`
    if args.n < 1 or args.limit < 0 or (args.temperature is not None and args.temperature < 0):
        print("error: --n must be >= 1, --limit >= 0 and --temperature >= 0", file=sys.stderr)
        return 2
    try:
        cfg = eval_config(args)
        out = Path(args.out).expanduser().resolve()
        out.mkdir(parents=True, exist_ok=True)
        s = asyncio.run(run_evaluation(args, cfg, out))
    except (ConfigError, DataError, EvaluationError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    half = (s["ci_high"] - s["ci_low"]) / 2
    print(
        f"accuracy {s['accuracy']:.3f} (95% interval {s['ci_low']:.3f}-{s['ci_high']:.3f}, ±{half:.3f}) over "
        f"{s['items'] - s['failed']} items x {s['samples_per_item']} sample(s) at temperature {s['temperature']}; "
        + (f"{s['failed']} item(s) failed, left out (their errors in results.jsonl); " if s["failed"] else "")
        + f"per-item results: {out / 'results.jsonl'}"
    )
    return 0


if __name__ == "__main__":
    import os

    os.environ.setdefault("RLACTORS_LOG_LEVEL", "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

"""docs/reference/metrics.md names every metric the code can write to metrics.jsonl, and only those.

The names are found where the code makes them: dict keys ``"prefix/name"`` (and ``f"prefix/{k}"``
families) in nodes/ and recipes/; the members of each family from their sources: the default
loss's statistics (computed, with every correction on), the trainer engine's and the weight push's
statistics, the workflows' counters and the loop's phases (read from the code's dict literals).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"^[a-z_]+/[A-Za-z0-9_{}]*$")
PER_LINE = {"step", "time", "version"}  # MetricsLogger's own, and the loop's policy version


def _glossary() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gen_metrics", ROOT / "scripts" / "gen-metrics-reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shape(name: str) -> str:
    """A family's shape: ``train/<stat>`` and ``train/{}`` are both ``train/<>``."""
    return re.sub(r"<[^>]*>|\{\}", "<>", name)


def _text(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _tree(rel: str) -> ast.AST:
    return ast.parse((ROOT / rel).read_text())


def emitted_names() -> set[str]:
    """Every ``prefix/name`` dict key (families with ``{}``) in nodes/ and recipes/."""
    out = set()
    for path in [*(ROOT / "nodes").rglob("*.py"), *(ROOT / "recipes").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            keys = (
                node.keys
                if isinstance(node, ast.Dict)
                else [node.key]
                if isinstance(node, ast.DictComp)
                else []
            )
            out |= {t for k in keys if (t := _text(k)) and METRIC.match(t)}
    return out


def _dict_keys(node: ast.AST) -> set[str]:
    return {t for k in getattr(node, "keys", []) if (t := _text(k))}


def engine_stats() -> set[str]:
    """The FSDP2 engine's step statistics: ``stats[...] =``, ``stats.update({...})`` in its train
    step and the phase that sums the step up, and its staleness dict."""
    out = set()
    for node in ast.walk(_tree("nodes/trainer/fsdp.py")):
        if isinstance(node, ast.FunctionDef) and node.name in ("train_step", "_step_stats", "_staleness"):
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Subscript)
                    and isinstance(sub.ctx, ast.Store)
                    and ast.unparse(sub.value) == "stats"
                ):
                    out.add(_text(sub.slice) or "")
                elif isinstance(sub, ast.Call) and ast.unparse(sub.func) == "stats.update":
                    out |= _dict_keys(sub.args[0])
                elif isinstance(sub, ast.Return) and node.name == "_staleness":
                    out |= _dict_keys(sub.value)
    return out - {""}


def loss_stats() -> set[str]:
    """The default loss's statistics with every correction on (GSPO's with and without)."""
    import torch

    from nodes.trainer.config import LossConfig, MismatchCorrections
    from nodes.trainer.loss import decoupled_ppo_loss

    out = set()
    for seq_ratio in (False, True):
        corr = MismatchCorrections(
            tis_cap=2.0, mis_low=0.5, mis_high=5.0, geo_low=0.5, geo_high=2.0, seq_ratio=seq_ratio
        )
        cfg = LossConfig(fn_args=corr, kl_coef=0.1, c_clip=3.0)
        logp = torch.log(torch.full((2, 3), 0.5))
        sums = decoupled_ppo_loss(
            logp=logp,
            prox_logp=logp,
            behave_logp=logp - 0.1,
            advantages=torch.ones(2, 3),
            loss_mask=torch.ones(2, 3),
            cfg=cfg,
            entropy=torch.ones(2, 3),
            ref_logp=logp,
        )
        out |= set(sums.sums) | set(sums.maxes) | set(sums.mins)
    return out


def push_stats() -> set[str]:
    """The weight push's statistics: its result dict (the one with ``push_time_s``) and its timings."""
    out = set()
    for node in ast.walk(_tree("nodes/trainer/weights.py")):
        if isinstance(node, ast.Dict) and "push_time_s" in _dict_keys(node):
            out |= _dict_keys(node)
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "self._timing":
            out |= _dict_keys(node.value)
    return out


def workflow_counters() -> set[str]:
    """The shipped workflows' ``self.counters`` (``rollout/<counter>``): the workflows' modules and
    the environments' episodes. Not the rollout actor's, the client's, an endpoint episode's or the
    reward runner's own counters, which reach metrics under other names or not at all."""
    rollout = ROOT / "nodes" / "rollout"
    files = [
        rollout / "workflows.py",
        rollout / "agents.py",
        rollout / "sessions.py",
        *(rollout / "environments").rglob("*.py"),
    ]
    out = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "self.counters":
                value = node.value
                if isinstance(value, ast.Call) and ast.unparse(value.func) == "dict.fromkeys":
                    out |= {t for e in getattr(value.args[0], "elts", []) if (t := _text(e))}
                out |= _dict_keys(value)
    return out


def loop_phases() -> set[str]:
    """The loop's ``times`` dict (``time/<phase>_s``): its literal keys, and those it is given."""
    out = set()
    for node in ast.walk(_tree("recipes/gsm8k_grpo.py")):
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if target is not None and ast.unparse(target) == "times":
            out |= _dict_keys(node.value)
        elif isinstance(target, ast.Subscript) and ast.unparse(target.value) == "times":
            out.add(ast.literal_eval(target.slice))
    return out


def members() -> set[str]:
    return (
        {f"train/{k}" for k in engine_stats() | loss_stats()}
        | {f"push/{k}" for k in push_stats()}
        | {f"rollout/{k}" for k in workflow_counters()}
        | {f"time/{k}_s" for k in loop_phases()}
    )


def test_every_metric_the_code_writes_is_in_the_glossary() -> None:
    glossary = _glossary().names()
    shapes = {_shape(n) for n in glossary}
    static = emitted_names()
    missing = sorted(n for n in static if _shape(n) not in shapes) + sorted(members() - glossary)
    assert not missing, f"not in scripts/gen-metrics-reference.py's GLOSSARY: {missing}"


def test_the_glossary_names_no_metric_the_code_does_not_write() -> None:
    glossary = {n for n in _glossary().names() if "<" not in n}
    written = {n for n in emitted_names() if "{" not in n} | members() | PER_LINE
    assert not glossary - written, f"in the glossary, never written: {sorted(glossary - written)}"


def test_the_sources_are_found() -> None:
    """Each source the glossary is checked against still yields names (a rename would hide them)."""
    assert {"grad_norm", "lr", "loss", "staleness_mean"} <= engine_stats()
    assert {"clip_frac", "tis_truncated_frac", "seq_ratio_max", "geo_ratio_min", "ref_kl"} <= loss_stats()
    assert {"push_time_s", "gather_s"} <= push_stats()
    assert {"agent_errors", "env_errors"} <= workflow_counters()
    assert loop_phases() == {"wait", "train", "eval", "push"}
    assert {"reward/mean", "eval/accuracy", "train/{}", "episode/{}"} <= emitted_names()

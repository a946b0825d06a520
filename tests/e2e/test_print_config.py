"""A config you can read: every key of every section (the settings classes behind import paths
included) has a meaning, ``--print-config`` shows it with its value and what it allows, the printed
TOML loads back to the same config, the run folder keeps it as config.toml, and the generated
reference (docs/reference/config.md) is current."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest

from recipes.gsm8k_config import RecipeConfig, load_config, render_config
from rlactors.base.tomlconf import field_docs, render_markdown, render_toml
from tests.helpers import forked

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "gsm8k_grpo.py"
GEN = ROOT / "scripts" / "gen-config-reference.py"
MULTI_TURN = "rollout.workflow=nodes.rollout.workflows:MultiTurnWorkflow"

# every shipped config, and the shipped workflows' settings classes beside the default's
CONFIGS = [
    pytest.param(None, [], id="defaults"),
    *(pytest.param(str(p), [], id=p.name) for p in sorted((ROOT / "recipes" / "configs").glob("*.toml"))),
    pytest.param(None, [MULTI_TURN], id="multi-turn"),
]


def tables_of(cfg: Any, path: str = "") -> list[tuple[str, Any]]:
    """``(TOML path, dataclass instance)`` of ``cfg`` and every table below it."""
    out = [(path, cfg)]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        name = "async" if f.name == "async_" else f.name
        if dataclasses.is_dataclass(value):
            out += tables_of(value, f"{path}.{name}" if path else name)
        elif _named_tables(value):  # [models.<name>]: a table per name
            for k, v in value.items():
                out += tables_of(v, f"{path}.{name}.{k}" if path else f"{name}.{k}")
    return out


def _named_tables(value: Any) -> bool:
    return (
        isinstance(value, dict) and bool(value) and all(dataclasses.is_dataclass(v) for v in value.values())
    )


def comment_above(lines: list[str], pattern: str) -> str:
    """The comment line right above the one line that matches ``pattern``, without its ``#``."""
    hits = [i for i, line in enumerate(lines) if re.fullmatch(pattern, line)]
    assert len(hits) == 1, f"{pattern!r}: {len(hits)} lines"
    above = lines[hits[0] - 1]
    assert above.startswith("# ") and not re.match(r"# \w+ = \((unset|set;)", above), (
        f"{pattern!r} has no meaning above"
    )
    return above[2:].strip()


def table_lines(text: str, path: str) -> list[str]:
    """The lines of table ``[path]``: from the comment block above its header to the next table's."""
    lines = text.splitlines()
    start = lines.index(f"[{path}]") if path else 0
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    end = next(
        (
            i
            for i in range(lines.index(f"[{path}]") + 1 if path else 0, len(lines))
            if lines[i].startswith("[")
        ),
        len(lines),
    )
    return lines[start:end]


@pytest.mark.parametrize(("config", "overrides"), CONFIGS)
def test_every_key_is_printed_with_its_meaning(config: str | None, overrides: list[str]) -> None:
    cfg = load_config(config, overrides)
    text = render_config(cfg)
    tomllib.loads(text)  # valid TOML
    lines = text.splitlines()
    for path, table in tables_of(cfg):
        docs = field_docs(type(table))
        own = table_lines(text, path)
        for f in dataclasses.fields(table):
            key = f"{path}.{f.name}" if path else ("async" if f.name == "async_" else f.name)
            assert docs[f.name], f"{type(table).__qualname__}.{f.name} ({key}) has no meaning"
            value = getattr(table, f.name)
            if dataclasses.is_dataclass(value):
                assert comment_above(lines, re.escape(f"[{key}]"))
            elif _named_tables(value):
                for name in value:
                    assert comment_above(lines, re.escape(f"[{key}.{name}]"))
            elif value is None:
                assert comment_above(own, rf"# {f.name} = \(unset\)(  # .*)?")
            else:
                assert comment_above(own, rf"{f.name} = .*")


def test_the_walk_reaches_every_settings_class() -> None:
    """The classes the test above checks include those behind every shipped import path."""
    seen = {
        type(t).__name__
        for config, overrides in [(None, []), (None, [MULTI_TURN])]
        + [(str(p), []) for p in (ROOT / "recipes" / "configs").glob("*.toml")]
        for _, t in tables_of(load_config(config, overrides))
    }
    assert {
        "RLVRConfig",  # the default workflow's settings
        "MultiTurnConfig",
        "AgentConfig",  # configs/agent_cpu.toml
        "MismatchCorrections",  # the default loss's settings
        "NoSettings",  # the default reward's and estimator's (none)
        "ClientConfig",
        "ServerKeys",
        "ShapingConfig",
        "GovernorConfig",
        "BufferConfig",
        "TrainConfig",
        "LossConfig",
        "PushConfig",
        "LoraConfig",
        "ReferenceServerConfig",
        "SGLangServerConfig",
        "DataConfig",
        "RunConfig",
        "MetricsConfig",
    } <= seen


@pytest.mark.parametrize(("config", "overrides"), CONFIGS)
def test_the_printed_config_loads_back_equal(
    config: str | None, overrides: list[str], tmp_path: Path
) -> None:
    cfg = load_config(config, overrides)
    printed = tmp_path / "printed.toml"
    printed.write_text(render_config(cfg))
    back = load_config(str(printed), [])
    assert back == cfg and dataclasses.asdict(back) == dataclasses.asdict(cfg)


def test_changed_and_unset_values_survive_the_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "async.max_staleness=0",
            "buffer.max_staleness=1",  # an optional key set
            "trainer.loss.fn_args.tis_cap=2.0",
            "trainer.betas=[0.8, 0.95]",
            "trainer.lora.enabled=true",  # its keys are read only then
            "trainer.lora.target_modules=['q_proj', 'v_proj']",
            'rollout.workflow_args.prompt_suffix="\\n\\t\\"quoted\\" \\\\ \\u007f é"',
            "rollout.workflow_args.sampling_params={top_p = 0.9, stop = ['\\n\\n']}",
            "metrics.wandb={project = 'x', 'a key' = 1}",
        ],
    )
    text = render_config(cfg)
    assert "[async]\n" in text and "async_" not in text
    assert "max_staleness = 1  # >= 0, or unset" in text
    assert "# eps_clip_higher = (unset)" in text  # no null in TOML: unset keys are commented out
    printed = tmp_path / "printed.toml"
    printed.write_text(text)
    assert load_config(str(printed), []) == cfg


def test_a_secret_is_not_printed() -> None:
    cfg = load_config(None, ["rollout.client.keys.api_key=s3cret"])
    text = render_config(cfg)
    assert "s3cret" not in text
    assert "# api_key = (set; a secret, not shown)" in text
    assert 'admin_api_key = ""' in text  # an empty one is shown: it says the server takes none


def test_print_config_prints_the_resolved_config_and_starts_nothing(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    res = run_recipe(
        [
            "--print-config",
            "--config",
            str(ROOT / "recipes/configs/gpu.toml"),
            "run.steps=3",
            f"run.out_dir={out_dir}",
        ]
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == render_config(
        load_config(str(ROOT / "recipes/configs/gpu.toml"), ["run.steps=3", f"run.out_dir={out_dir}"])
    )
    assert "\n[run]\n" in res.stdout and "\nsteps = 3  # >= 0\n" in res.stdout
    assert not out_dir.exists()  # nothing started, nothing written


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.lrr=1", "unknown key 'trainer.lrr' (did you mean 'lr'?)"),
        ("run.steps=-1", "command line: 'run.steps' must be >= 0, got -1"),
    ],
)
def test_print_config_with_a_bad_override_is_a_one_line_error(override: str, message: str) -> None:
    res = run_recipe(["--print-config", override])
    assert res.returncode == 2
    assert res.stdout == ""
    assert res.stderr.startswith("error: ") and message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_the_run_folder_keeps_the_config_as_toml_beside_the_json(tmp_path: Path) -> None:
    """``prepare`` (what a run decides before any process starts) writes both."""
    recipe = recipe_module()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a model folder; nothing loads it here
    out = tmp_path / "run"
    cfg = load_config(None, [f"model.path={model}", "data.source=easy", "data.eval_size=4"])
    recipe.prepare(cfg, out, False)
    assert (out / "config.json").exists()
    assert (out / "config.toml").read_text() == render_config(cfg)
    assert load_config(str(out / "config.toml"), []) == cfg


def test_the_committed_reference_is_current(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(GEN), "--check"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert res.returncode == 0, f"{res.stderr}\nrun: python scripts/gen-config-reference.py"
    stale = tmp_path / "config.md"
    stale.write_text(
        (ROOT / "docs" / "reference" / "config.md").read_text().replace("| `lr` |", "| `lr_old` |")
    )
    res = subprocess.run(
        [sys.executable, str(GEN), "--check", "--path", str(stale)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 1 and "stale" in res.stderr


def test_the_reference_lists_every_key_with_its_meaning() -> None:
    text = (ROOT / "docs" / "reference" / "config.md").read_text()
    sections = dict(re.findall(r"^## `\[([\w.]+)\]`\n(.*?)(?=^#)", text, re.M | re.S))
    for path, table in tables_of(RecipeConfig()):
        docs = field_docs(type(table))
        for f in dataclasses.fields(table):
            if _named_tables_field(type(table), f.name):  # [models.<name>]: its keys' own section
                continue
            if not dataclasses.is_dataclass(getattr(table, f.name)):
                meaning = docs[f.name].replace("|", "\\|").replace("<", "&lt;")
                assert re.search(rf"^\| `{f.name}` \|.*\| {re.escape(meaning)} \|$", sections[path], re.M), (
                    f"{path}.{f.name}"
                )
    assert '### `[rollout] workflow = "nodes.rollout.agents:AgentWorkflow"`' in text
    named = text.split("## `[models.<name>]`\n", 1)[1].split("\n## ", 1)[0]  # a teacher's, a judge's
    assert re.search(r"^\| `path` \| str \|", named, re.M) and re.search(r"^\| `urls` \|", named, re.M)
    assert '### `[reward] fn = "nodes.rollout.judge:judge"`' in text


def _named_tables_field(cls: type, name: str) -> bool:
    """Field ``name`` of ``cls`` is a ``dict[str, <dataclass>]``: a table per name."""
    tp = typing.get_type_hints(cls)[name]
    return typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1])


# -- the generic parts (rlactors/base/tomlconf.py) on a class of their own ---------------------------


@dataclasses.dataclass
class _Inner:
    depth: int = 1  # how deep


@dataclasses.dataclass
class _Example:
    # a meaning above,
    # on two lines
    above: int = 0
    beside: str = "x"  # a meaning beside
    wrapped: float = dataclasses.field(
        default=1.5, metadata={"check": (lambda v: v > 0, "> 0")}
    )  # a meaning after a wrapped call
    ignored: bool = True  # type: ignore[assignment]
    optional: int | None = None  # unset by default
    inner: _Inner = dataclasses.field(default_factory=_Inner)  # a nested table


@dataclasses.dataclass
class _Child(_Example):
    extra: list[str] = dataclasses.field(default_factory=list)  # the child's own


def test_field_docs_read_the_comments_of_each_field() -> None:
    assert field_docs(_Child) == {
        "above": "a meaning above, on two lines",
        "beside": "a meaning beside",
        "wrapped": "a meaning after a wrapped call",
        "ignored": "",  # a linter directive is no meaning
        "optional": "unset by default",
        "inner": "a nested table",
        "extra": "the child's own",
    }


def test_render_toml_and_markdown_of_a_plain_dataclass() -> None:
    text = render_toml(_Child(extra=["a"]))
    assert text == (
        '# a meaning above, on two lines\nabove = 0\n# a meaning beside\nbeside = "x"\n'
        "# a meaning after a wrapped call\nwrapped = 1.5  # > 0\nignored = true\n"
        '# unset by default\n# optional = (unset)\n# the child\'s own\nextra = ["a"]\n\n'
        "# a nested table\n[inner]\n# how deep\ndepth = 1\n"
    )
    md = render_markdown(_Child, prefix="x")
    assert "| `wrapped` | float | `1.5` | > 0 | a meaning after a wrapped call |" in md
    assert "| `optional` | int (optional) | unset |  | unset by default |" in md
    assert "## `[x.inner]`\n\na nested table\n" in md


def run_recipe(args: list[str]) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, str(RECIPE), *args], preload=forked.DRIVER, timeout=120, cwd=ROOT)


def recipe_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gsm8k_grpo_print_config", RECIPE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_cpu_toml_names_the_tables_it_leaves_out() -> None:
    """Its header says which tables it leaves to their defaults: that list stays true."""
    text = (ROOT / "recipes" / "configs" / "cpu.toml").read_text()
    header = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    said = set(re.findall(r"\[([\w.]+)\]", header.split("Tables left out entirely:")[1].split(";")[0]))
    data = tomllib.loads(text)

    def present(path: str) -> bool:
        node: Any = data
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    left_out = {path for path, _ in tables_of(load_config(None, [])) if path and not present(path)}
    assert said == {p for p in left_out if present(p.rpartition(".")[0]) or "." not in p}


def test_overrides_go_before_and_after_the_flags() -> None:
    """`... --resume run.steps=9` as well as `... run.steps=9 --resume`: argparse's plain parse
    refuses positionals on both sides of a flag ("unrecognized arguments")."""
    res = run_recipe(["run.steps=3", "--print-config", "trainer.lr=2e-05"])
    assert res.returncode == 0, res.stderr
    assert res.stdout == render_config(load_config(None, ["run.steps=3", "trainer.lr=2e-05"]))
    evaluate = forked.run(
        [
            sys.executable,
            "-m",
            "recipes.gsm8k_eval",
            "--model",
            "m",
            "run.steps=2",
            "--limit",
            "1",
            "trainer.lrr=1",
        ],
        preload=forked.DRIVER,
        timeout=120,
        cwd=ROOT,
    )
    assert evaluate.returncode == 2
    assert evaluate.stderr.startswith("error: ") and "unknown key 'trainer.lrr'" in evaluate.stderr, (
        evaluate.stderr
    )

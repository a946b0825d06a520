"""Every code block of the Get started and Tutorials pages runs, in order, in a fresh folder.

A page is read as a user reads it, from the repository's root: ``recipes/``, ``scripts/`` and
``examples/`` are linked into the folder, and each block runs there.

- ``<!-- file: NAME -->`` before a block: the block is saved as NAME (a module, a config) for the
  blocks after it.
- ``python``: run (``exec``); a fragment with a top-level ``await`` is compiled only.
- ``toml``: parsed; a table of the recipe's config is loaded as the recipe loads it.
- ``bash``: each command runs, or, where running it means training, serving or a cluster, is
  checked as far as it goes without that: the recipe's and ``recipes.gsm8k_eval``'s command lines
  are parsed by their own parsers and their config loaded (with ``data.source = "local"`` its data
  read too), ``rlactors``, the server's and the endpoint's command lines parsed.
  ``python -c``, ``python FILE.py`` and ``cat`` run. Anything else fails the test.
- ``<!-- illustration: why -->`` before a block: not run (a GPU, a Slurm cluster, the network);
  used sparingly, and the reason is required.
- Blocks of output (``text``, no language) are not code.

The recipe runs themselves are the e2e tests' (``tests/e2e/test_smoke_config.py``,
``test_your_data.py``, ``test_custom_algorithm.py``); this keeps the pages' commands and code
true to the code at the cost of a few seconds.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from rlactors.base.tomlconf import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "get-started").glob("*.md")) + sorted(
    (ROOT / "docs" / "tutorials").glob("*.md")
)
BLOCK = re.compile(
    r"^(?:<!-- (?P<marker>[^\n]*?) -->\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.S | re.M
)
SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::[0-9:]*)?"\s*$', re.M)
OUTPUT_LANGS = {"", "text", "console", "output"}
RECIPE_SECTIONS = {
    "model", "servers", "data", "run", "metrics", "async", "rollout", "reward", "advantage", "buffer", "trainer",
}  # fmt: skip


def _load_script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CLI = _load_script("gen-cli-reference")  # its capture(): the parser a command's main builds


def parser_of(module: str) -> argparse.ArgumentParser:
    calls = {
        "rlactors.launch.cli": lambda m: m.main([]),
        "recipes.gsm8k_grpo": lambda m: m.main([]),
        "recipes.gsm8k_eval": lambda m: m.main([]),
        "nodes.inference.server": lambda m: m.parser(),
        "nodes.rollout.openai_endpoint": lambda m: m.parse_args([]),
    }
    return CLI.capture(module, calls[module])


def blocks(page: Path) -> list[tuple[str, str, str, int]]:
    """(marker, language, body, line) of each fenced block at the page's top level, snippets expanded."""
    text = page.read_text()
    out = []
    for m in BLOCK.finditer(text):
        body = SNIPPET.sub(lambda s: (ROOT / s.group(1)).read_text(), m.group("body"))
        out.append((m.group("marker") or "", m.group("lang"), body, text.count("\n", 0, m.start()) + 1))
    return out


def commands(script: str) -> list[list[str]]:
    """The commands of a bash block: continuations joined, comments dropped, split as the shell does."""
    lines = script.replace("\\\n", " ").splitlines()
    return [argv for line in lines if (argv := shlex.split(line, comments=True))]


def load_recipe_config(config: str | None, overrides: list[str]) -> Any:
    from nodes.driver.data import load_data
    from recipes.gsm8k_config import load_config

    cfg = load_config(config, overrides)
    if cfg.data.source == "local":
        load_data(cfg.data)  # the page's data must be readable with its field names
    return cfg


def _flatten(table: dict[str, Any], prefix: str = "") -> list[str]:
    """A TOML table as the recipe's ``section.key=value`` overrides."""
    out = []
    for key, value in table.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def check_toml(body: str, where: str, page_config: list[str]) -> None:
    """A block of the recipe's config loads as the recipe loads it, with the page's earlier
    blocks (``page_config``, extended): a page may build its config a table at a time."""
    tables = tomllib.loads(body)
    if tables and set(tables) <= RECIPE_SECTIONS:
        page_config += _flatten(tables)
        try:
            load_recipe_config(None, page_config)
        except ConfigError as e:
            pytest.fail(
                f"{where}: {e}\n(a TOML block must load as the recipe's config, with the page's "
                "earlier TOML blocks; or be saved with <!-- file: NAME --> and loaded by a command, "
                "or marked <!-- illustration: why -->)"
            )


def check_python(body: str, where: str) -> None:
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    code = compile(body, where, "exec", flags=flags)
    if code.co_flags & 0x80:  # CO_COROUTINE: a fragment of an async function, compiled only
        return
    exec(compile(body, where, "exec"), {"__name__": "__page__"})


def check_command(argv: list[str], where: str, folder: Path) -> None:
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    assert set(env) <= {"PYTHONPATH", "CUDA_VISIBLE_DEVICES"}, f"{where}: environment {sorted(env)}"
    prog, args = argv[0], argv[1:]
    if prog in (".venv/bin/python", "python"):
        if args[:1] == ["recipes/gsm8k_grpo.py"]:
            ns = parser_of("recipes.gsm8k_grpo").parse_args(args[1:])
            load_recipe_config(ns.config, ns.overrides)
        elif args[:2] == ["-m", "recipes.gsm8k_eval"]:
            ns = parser_of("recipes.gsm8k_eval").parse_args(args[2:])
            importlib.import_module("recipes.gsm8k_eval").eval_config(ns)
        elif args[:2] in (["-m", "nodes.inference.server"], ["-m", "nodes.rollout.openai_endpoint"]):
            parser_of(args[1]).parse_args(args[2:])
        elif args[:1] == ["-c"] or args[0].endswith(".py"):
            run_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
            done = subprocess.run(
                [sys.executable, *args], cwd=folder, env=run_env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, f"{where}: {shlex.join(argv)}\n{done.stdout}\n{done.stderr}"
        else:
            pytest.fail(
                f"{where}: no rule runs {shlex.join(argv)}: add one, or mark the block an illustration"
            )
    elif prog in ("rlactors", ".venv/bin/rlactors"):
        parser_of("rlactors.launch.cli").parse_args(args)
    elif prog == "cat":
        assert all((folder / a).is_file() for a in args), f"{where}: {shlex.join(argv)}: no such file"
    else:
        pytest.fail(f"{where}: no rule runs {shlex.join(argv)}: add one, or mark the block an illustration")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT / "docs").as_posix() for p in PAGES])
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("recipes", "scripts", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    ran, page_config = 0, []
    for marker, lang, body, line in blocks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        if marker.startswith("illustration"):
            assert marker.partition(":")[2].strip(), f"{where}: say why it is an illustration"
            continue
        if marker.startswith("file:"):
            (tmp_path / marker.partition(":")[2].strip()).write_text(body)
            ran += 1
            continue
        if lang in OUTPUT_LANGS:
            continue
        if lang == "python":
            check_python(body, where)
        elif lang == "toml":
            check_toml(body, where, page_config)
        elif lang in ("bash", "sh", "shell"):
            for argv in commands(body):
                check_command(argv, where, tmp_path)
        else:
            pytest.fail(f"{where}: a {lang!r} block: add a rule for it, or mark it an illustration")
        ran += 1
    assert ran, f"{page.relative_to(ROOT)}: no block ran"


def test_an_unknown_command_fails_the_page(tmp_path: Path) -> None:
    """The test's own guard: a command it has no rule for is a failure, not a pass."""
    with pytest.raises(pytest.fail.Exception, match="no rule runs"):
        check_command(["make", "install"], "page.md:1", tmp_path)
    with pytest.raises(SystemExit):  # a flag the recipe does not take fails its parser
        check_command([".venv/bin/python", "recipes/gsm8k_grpo.py", "--no-such-flag"], "page.md:2", tmp_path)


def test_a_misspelt_config_key_fails_the_page() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"unknown key 'trainer\.learning_rate'"):
        check_toml("[trainer]\nlearning_rate = 1e-5\n", "page.md:1", [])


def test_a_page_builds_its_config_block_by_block() -> None:
    """A later block adds to the earlier ones: the workflow first, more of its settings after."""
    page: list[str] = []
    first = '[rollout]\nworkflow = "nodes.rollout.agents:AgentWorkflow"\n[rollout.workflow_args]\nagent = "recipes.sdk_agents.python_tool:run"\n'
    check_toml(first, "page.md:1", page)
    check_toml("[rollout.workflow_args]\nepisode_timeout_s = 60.0\n", "page.md:5", page)  # an agent's setting
    with pytest.raises(pytest.fail.Exception, match="n_samples"):
        check_toml("[rollout.workflow_args]\nn_samples = 0\n", "page.md:9", page)

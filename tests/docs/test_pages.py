"""The documentation names only what exists and reads the same on GitHub as on the site.

- Every config key a page names (``trainer.lr``, ``[trainer.lora]``, an override ``run.steps=2``) is
  in the config reference (docs/reference/config.md, generated from the config classes).
- Every extra a page names (``.[all,envs]``, "the `envs` extra") is in pyproject.toml, and the
  install page's table lists them all.
- Every page is in mkdocs.yml's nav and linked from the home page.
- No page uses what GitHub cannot render (``--8<--`` includes, ``:::`` API directives); what the
  site would fill in is written into the page (scripts/gen-page-regions.py) and is current.
- Every relative link leads to a file on disk (GitHub follows those), and a docs page's link out of
  docs/ only to a file the site carries too (scripts/mkdocs_hooks.py).
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONFIG_REFERENCE = DOCS / "reference" / "config.md"
DOC_PAGES = sorted(DOCS.rglob("*.md"))
READMES = [
    ROOT / "README.md",
    *sorted((ROOT / "examples").rglob("README.md")),
    ROOT / "scripts/slurm/README.md",
]
READMES = [p for p in READMES if p.is_file()]
SECTIONS = (
    "model",
    "servers",
    "data",
    "run",
    "metrics",
    "async",
    "rollout",
    "reward",
    "advantage",
    "buffer",
    "trainer",
)
FILE_SUFFIXES = {"py", "json", "jsonl", "png", "toml", "md", "log", "txt", "sh", "html"}
FN_ARGS = ("reward.fn_args.", "advantage.fn_args.", "trainer.loss.fn_args.")  # the function's own keys
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
KEY_SPAN = re.compile(r"^\[?((?:" + "|".join(SECTIONS) + r")(?:\.\w+)+)\]?(?:\s*=.*)?$")
OVERRIDE = re.compile(r"(?<![\w./-])((?:" + "|".join(SECTIONS) + r")(?:\.\w+)+)=")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def reference_keys() -> set[str]:
    """Every table and ``table.key`` of the config reference (other workflows' settings included)."""
    keys, table = set(), None
    for line in CONFIG_REFERENCE.read_text().splitlines():
        if m := re.match(r"^#{2,4} `\[([\w.]+)\]", line):
            table = m.group(1)
            keys.add(table)
        elif (m := re.match(r"^\| `(\w+)` \|", line)) and table:
            keys.add(f"{table}.{m.group(1)}")
    return keys


def named_keys(text: str) -> set[str]:
    """The config keys ``text`` names: in code spans, and as overrides in its code blocks."""
    keys = set()
    for block in FENCE.findall(text):
        keys |= set(OVERRIDE.findall(block))
    for span in SPAN.findall(FENCE.sub("", text)):
        if m := KEY_SPAN.match(span.strip()):
            keys.add(m.group(1))
    return {k for k in keys if k.rsplit(".", 1)[-1] not in FILE_SUFFIXES}


def unknown_keys(text: str, known: set[str]) -> set[str]:
    return {k for k in named_keys(text) if k not in known and not k.startswith(FN_ARGS)}


@pytest.mark.parametrize("page", [p for p in [*DOC_PAGES, *READMES] if p != CONFIG_REFERENCE], ids=rel)
def test_every_config_key_a_page_names_exists(page: Path) -> None:
    unknown = unknown_keys(page.read_text(), reference_keys())
    assert not unknown, f"{rel(page)} names keys docs/reference/config.md does not have: {sorted(unknown)}"


def test_a_misnamed_key_is_caught() -> None:
    """The check's own guard: the wrong line it was written for, in prose and as an override."""
    known = reference_keys()
    assert "trainer.activation_checkpointing" in known and len(known) > 150
    text = "turn on `trainer.gradient_checkpointing`\n```bash\npython r.py run.stepz=2\n```\n"
    assert unknown_keys(text, known) == {"trainer.gradient_checkpointing", "run.stepz"}
    assert not unknown_keys("see `metrics.jsonl` and `run.png`; `trainer.lr = 1e-5`", known)


def extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def named_extras(text: str) -> set[str]:
    """Extras named in ``.[a,b]`` / ``rlactors[a]`` install specs and as "the `x` extra"."""
    names = set()
    for group in re.findall(r"(?:\.|rlactors)\[([\w,\s-]+)\]", text):
        names |= {n.strip() for n in group.split(",")}
    names |= set(re.findall(r"`([\w-]+)` extra\b", text))
    return names


@pytest.mark.parametrize("page", [*DOC_PAGES, *READMES], ids=rel)
def test_every_extra_a_page_names_exists(page: Path) -> None:
    unknown = named_extras(page.read_text()) - extras()
    assert not unknown, f"{rel(page)} names extras pyproject.toml does not declare: {sorted(unknown)}"


def test_the_install_page_lists_every_extra() -> None:
    install = (DOCS / "get-started" / "install.md").read_text()
    listed = set(re.findall(r"^\| `([\w-]+)` \|", install, re.M))
    assert extras() - listed == set(), f"install.md's table lacks extras: {sorted(extras() - listed)}"
    assert named_extras('pip install ".[all,envs]" and the `docs` extra') == {"all", "envs", "docs"}


def nav_pages() -> set[str]:
    return set(re.findall(r":\s+'?([\w./-]+\.md)'?\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))


def test_every_page_is_in_the_nav() -> None:
    pages = {p.relative_to(DOCS).as_posix() for p in DOC_PAGES}
    assert pages - nav_pages() == set(), "pages missing from mkdocs.yml's nav"
    joined = {"benchmarks/results.md", "benchmarks/history.md"}  # bench/'s pages, joined by the hook
    assert nav_pages() - pages <= joined


def test_every_page_is_linked_from_the_home_page() -> None:
    home = (DOCS / "index.md").read_text()
    linked = {target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", home)}
    missing = {p.relative_to(DOCS).as_posix() for p in DOC_PAGES} - linked - {"index.md"}
    assert not missing, f"docs/index.md does not link: {sorted(missing)}"


@pytest.mark.parametrize("page", [*DOC_PAGES, *READMES], ids=rel)
def test_no_page_uses_what_github_cannot_render(page: Path) -> None:
    text = page.read_text()
    assert "--8<--" not in text, (
        f"{rel(page)}: an include GitHub shows as a blank: use <!-- include: PATH -->"
    )
    assert not re.search(r"^::: ", text, re.M), (
        f"{rel(page)}: a mkdocstrings directive: use <!-- api: NAME -->"
    )


def _regions() -> Any:
    spec = importlib.util.spec_from_file_location(
        "gen_page_regions", ROOT / "scripts" / "gen-page-regions.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_what_the_pages_show_from_elsewhere_is_current() -> None:
    gen = _regions()
    stale = [rel(p) for p in gen.pages() if gen.render(p.read_text()) != p.read_text()]
    assert not stale, f"stale: {stale}: run python scripts/gen-page-regions.py"
    shown = "".join(p.read_text() for p in gen.pages())
    assert shown.count("<!-- include: ") >= 6 and shown.count("<!-- api: ") >= 20


def test_a_changed_example_makes_its_page_stale(tmp_path: Path) -> None:
    gen = _regions()
    stale = "<!-- include: examples/fastapi_service.py -->\n```python\nSTALE-TEXT\n```\n<!-- end include -->"
    assert "STALE-TEXT" not in gen.render(stale) and "import rlactors" in gen.render(stale)
    assert gen.render(gen.render(stale)) == gen.render(stale)
    api = "<!-- api: rlactors.init -->\nSTALE-TEXT\n<!-- end api -->"
    assert "STALE-TEXT" not in gen.render(api) and "\n### `init`\n" in gen.render(api)  # an object: level 3


@pytest.mark.parametrize("page", [*DOC_PAGES, *READMES], ids=rel)
def test_relative_links_work_on_github_and_on_the_site(page: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import mkdocs_hooks

    broken, off_site = [], []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        path = target.split("#")[0]
        if not path or "://" in path or path.startswith("mailto:"):
            continue
        dest = (page.parent / path).resolve()
        if not dest.exists():
            broken.append(target)
        elif (
            page.is_relative_to(DOCS)
            and not dest.is_relative_to(DOCS)
            and mkdocs_hooks.site_uri(dest) is None
        ):
            off_site.append(target)
    assert not broken, f"{rel(page)}: links to no file on disk (broken on GitHub): {broken}"
    assert not off_site, f"{rel(page)}: links out of docs/ the site does not carry: {off_site}"


RUN_WRITERS = [
    "recipes/gsm8k_grpo.py",
    "recipes/gsm8k_plane.py",
    "nodes/driver/metrics.py",
    "nodes/driver/run_state.py",
    "nodes/driver/watchdog.py",
]


def test_the_run_folder_page_names_everything_a_run_writes_there() -> None:
    """Each name the recipe and the driver's parts join to the run folder (``out / "name"``), and
    the embedded cluster's record of itself there, is on the run-folder page."""
    from rlactors.api.runs import RECORD, SECRET

    written = {RECORD, SECRET}
    for path in RUN_WRITERS:
        text = (ROOT / path).read_text()
        written |= set(re.findall(r'\b(?:out|out_dir|state\.out)\s*/\s*"([^"]+)"', text))
    assert {"sessions.json", "weights", "checkpoints", "metrics.jsonl", ".lock"} <= written
    page = (DOCS / "reference" / "run-folder.md").read_text()
    missing = sorted(name for name in written if f"`{name}`" not in page and f"`{name}/" not in page)
    assert not missing, f"docs/reference/run-folder.md does not name: {missing}"

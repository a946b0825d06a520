"""README.md stays a front page: short, the two set-up commands as they are, and every link into
the documentation leads to a file (the site's own links are checked by its strict build)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_is_short() -> None:
    assert len(README.splitlines()) <= 200


def test_readme_has_the_two_set_up_commands() -> None:
    assert (
        "bash scripts/run.sh     # installs into .venv (first time only), runs asynchronous GRPO on GSM8K"
        in README
    )
    assert "bash scripts/test.sh    # installs into .venv (first time only), runs the test suite" in README


def test_every_readme_link_leads_to_a_file() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert len(local) > 20
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_no_text_points_outside_the_repository() -> None:
    """No tracked file names the notes this project was built from, which are not part of it."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    pattern = re.compile(r"FACTS\.md|\.\./shared/|/work/shared")
    found = set()
    for rel in filter(None, files):
        path = ROOT / rel
        if path.suffix in {".png", ".gguf", ".safetensors"} or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if pattern.search(text) and rel != "tests/docs/test_readme.py":
            found.add(rel)
    assert not found, f"text pointing outside the repository: {sorted(found)}"


def table_under(text: str, heading: str) -> list[str]:
    """The rows of the first table under ``heading`` (a ``## `` line), header and rule included."""
    rows: list[str] = []
    for line in text.split(f"\n{heading}\n", 1)[1].splitlines():
        if line.startswith("|"):
            rows.append(line.strip())
        elif rows or line.startswith("#"):
            break
    return rows


def test_the_first_screen_says_what_why_and_how_to_start() -> None:
    """What rlactors is and the two commands first; then why (and why not) beside the others, where
    it is verified, the models and engines; the runtime's own pitch after them."""
    commands = README.index("bash scripts/run.sh     #")
    order = [
        README.index("## Why this one"),
        README.index("## What is verified where"),
        README.index("## Models and inference engines"),
        README.index("## The runtime"),
    ]
    assert commands < order[0] and order == sorted(order)
    assert README[:commands].count("\n") < 25  # the commands on the first screen
    why = README[order[0] : order[1]]
    assert all(name in why for name in ("AReaL", "verl", "prime-rl")) and "What they have" in why
    assert "vLLM is not supported" in README[order[2] : order[3]]


def test_the_verified_where_table_is_verified_mds() -> None:
    readme = table_under(README, "## What is verified where")
    verified = table_under((ROOT / "docs" / "verified.md").read_text(), "## What is verified where")
    places = [row.split("|")[1].strip() for row in readme[2:]]
    assert places == ["CPU", "real SGLang on CPU", "one GPU", "many GPUs", "Slurm"]
    assert readme == verified, "README.md's table of what is verified where differs from docs/verified.md's"
    section = README.split("## What is verified where", 1)[1].split("\n## ", 1)[0]
    assert "(docs/verified.md)" in section

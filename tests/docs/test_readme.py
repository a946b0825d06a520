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

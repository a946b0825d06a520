"""docs/development.md's layout is the tree's: every sub-package is listed, every module of the
runtime (rlactors, protocols) and of the nodes' shared floors (common, plane, driver) is named, and
every file and folder it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "development.md"
PACKAGES = ("protocols", "rlactors", "nodes", "recipes")
# every module of these folders is named in the layout; of the others, only the sub-packages
EVERY_MODULE = ("protocols", "rlactors", "recipes", "nodes/common", "nodes/plane", "nodes/driver")
HEAD = re.compile(r"^( ?|  )(\S+)")
NAMED = re.compile(r"(?<![\w/.-])([a-z0-9_]+/|[\w-]+\.(?:py|md|toml))(?![\w/])")


def layout() -> list[tuple[str, str]]:
    """(folder, name) for every folder and file the layout block names, folders as 'a/b'."""
    text = PAGE.read_text()
    block = text.split("<!-- layout -->\n```\n", 1)[1].split("```\n<!-- end layout -->", 1)[0]
    named: list[tuple[str, str]] = []
    top = current = ""
    for line in block.splitlines():
        head = HEAD.match(line)
        rest = line
        if head and not line.startswith("   "):
            token = head.group(2)
            if not line.startswith(" "):
                top = current = token.rstrip("/")
                named.append(("", token))
            elif token.endswith("/"):
                current = f"{top}/{token.rstrip('/')}"
                named.append((top, token))
            else:
                current = top
                named.append((top, token))
            rest = line[head.end() :]
        named += [(current, m) for m in NAMED.findall(rest)]
    return named


def test_every_name_in_the_layout_exists() -> None:
    missing = [
        f"{folder}/{name}".lstrip("/") for folder, name in layout() if not (ROOT / folder / name).exists()
    ]
    assert missing == [], f"docs/development.md's layout names what is not in the tree: {missing}"


def test_every_sub_package_is_in_the_layout() -> None:
    named = {f"{folder}/{name}".strip("/") for folder, name in layout()}
    packages = {
        p.parent.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).glob("*/__init__.py")
    }
    assert packages - named == set(), "sub-packages missing from docs/development.md's layout"


def test_every_module_of_the_runtime_and_the_shared_floors_is_named() -> None:
    named = {f"{folder}/{name}" for folder, name in layout()}
    folders = [ROOT / f for f in EVERY_MODULE]
    folders += [p.parent for f in ("protocols", "rlactors") for p in (ROOT / f).glob("*/__init__.py")]
    modules = {
        p.relative_to(ROOT).as_posix()
        for folder in folders
        for p in folder.glob("*.py")
        if p.name != "__init__.py"
    }
    assert modules - named == set(), "modules missing from docs/development.md's layout"

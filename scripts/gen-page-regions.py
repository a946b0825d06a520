"""Write into the docs' pages what they show from elsewhere, so a page reads the same on GitHub as on
the site: GitHub renders neither MkDocs' ``--8<--`` includes nor mkdocstrings' ``:::`` directives.

    .venv/bin/python scripts/gen-page-regions.py           # refresh every region of every page
    .venv/bin/python scripts/gen-page-regions.py --check   # exit 1 when a region is stale

Two kinds of region, each between a marker line and its end line:

- ``<!-- include: PATH[:LINE] -->`` ... ``<!-- end include -->``: the file at PATH (from the
  repository's root; from line LINE on, 1-based), as a fenced block in its language (a ``.md`` file
  as markdown). Comment lines right after the marker (``<!-- illustration: ... -->``, read by
  tests/docs/test_tutorials.py) are kept.
- ``<!-- api: DOTTED.NAME -->`` ... ``<!-- end api -->``: the API reference of a module (every name
  of its ``__all__``) or of one object: signatures and docstrings, read from the code.

tests/docs/test_page_regions.py fails when a page is stale, and when a page uses ``--8<--`` or
``:::`` again.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REGION = re.compile(
    r"^<!-- (?P<kind>include|api): (?P<arg>\S+) -->\n(?P<body>.*?)^<!-- end (?P=kind) -->$", re.S | re.M
)
LANGS = {".py": "python", ".sh": "bash", ".toml": "toml", ".json": "json", ".yaml": "yaml", ".yml": "yaml"}


def include(arg: str, body: str) -> str:
    """The file at ``arg`` (``path[:line]``) as the region's body, its leading comment lines kept."""
    path, _, line = arg.partition(":")
    text = "".join((ROOT / path).read_text().splitlines(keepends=True)[int(line or 1) - 1 :])
    kept = "".join(l for l in body.splitlines(keepends=True)[:3] if l.startswith("<!-- "))  # noqa: E741
    if Path(path).suffix == ".md":
        return kept + text
    return f"{kept}```{LANGS.get(Path(path).suffix, '')}\n{text.rstrip(chr(10))}\n```\n"


ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?\.?([^`]+)`")


def _doc(obj: Any) -> str:
    """The docstring as markdown: Sphinx roles and ``literals`` as code spans."""
    doc = inspect.getdoc(obj) or ""
    doc = ROLE.sub(r"`\1`", doc)
    doc = re.sub(r"``([^`]+)``", r"`\1`", doc)
    doc = re.sub(r"(\S)::$", r"\1:", doc, flags=re.M)  # reST's "text::" before a literal block
    return doc.strip()


class _Written:
    """An annotation as the source writes it (a string under ``from __future__ import annotations``),
    shown without the quotes ``repr`` would add."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _unquoted(annotation: Any) -> Any:
    return _Written(annotation) if isinstance(annotation, str) else annotation


def _signature(obj: Any, name: str, bound: bool = False) -> str:
    """``name(...)`` as a python block; ``bound``: a method's, without its self or cls."""
    try:
        s = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = [p.replace(annotation=_unquoted(p.annotation)) for p in s.parameters.values()][int(bound) :]
    sig = str(s.replace(parameters=params, return_annotation=_unquoted(s.return_annotation)))
    sig = re.sub(r" at 0x[0-9a-f]+", "", sig)  # a default's repr must not change from run to run
    return f"```python\n{name}{sig}\n```\n\n"


def _own_members(cls: type) -> list[tuple[str, Any, bool]]:
    """The public methods and properties ``cls`` defines itself, in the order it defines them, each
    with whether its first parameter is bound (self, cls)."""
    out = []
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        bound = not isinstance(member, staticmethod)
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if isinstance(member, property) or (callable(member) and not inspect.isclass(member)):
            out.append((name, member, bound and inspect.isfunction(member)))
    return out


def _object(name: str, obj: Any, level: int) -> str:
    h = "#" * level
    out = [f"{h} `{name}`\n\n"]
    if inspect.isclass(obj):
        if "__init__" in vars(obj) or not issubclass(obj, BaseException):
            out.append(_signature(obj, name))
        if doc := _doc(obj):
            out.append(doc + "\n\n")
        fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
        for member_name, member, bound in _own_members(obj):
            if member_name in fields:
                continue
            out.append(f"{h}# `{name}.{member_name}`\n\n")
            if isinstance(member, property):
                out.append("*property*\n\n")
            else:
                out.append(_signature(member, member_name, bound))
            if doc := _doc(member):
                out.append(doc + "\n\n")
    elif callable(obj):
        out.append(_signature(obj, name))
        if doc := _doc(obj):
            out.append(doc + "\n\n")
    else:
        out.append(f"```python\n{name} = {obj!r}\n```\n\n")
    return "".join(out)


def api(arg: str) -> str:
    """The reference of module ``arg`` (its ``__all__``, alphabetically) or of the object ``arg`` names."""
    try:
        module = importlib.import_module(arg)
    except ImportError:
        module = None
    if module is not None:
        names = sorted(getattr(module, "__all__", []), key=lambda n: (n.startswith("_"), n.lower()))
        return "".join(_object(n, getattr(module, n), 2) for n in names)
    mod, _, attr = arg.rpartition(".")
    obj: Any = importlib.import_module(mod)
    return _object(attr, getattr(obj, attr), 3)


def render(text: str) -> str:
    """``text`` with every region refreshed."""

    def one(m: re.Match[str]) -> str:
        kind, arg = m.group("kind"), m.group("arg")
        body = include(arg, m.group("body")) if kind == "include" else api(arg)
        return f"<!-- {kind}: {arg} -->\n{body.rstrip(chr(10))}\n<!-- end {kind} -->"

    return REGION.sub(one, text)


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if a page's region is stale")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    stale = []
    for page in pages():
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(page)
            if not args.check:
                page.write_text(new)
                print(f"wrote {page.relative_to(ROOT)}")
    if args.check and stale:
        names = ", ".join(str(p.relative_to(ROOT)) for p in stale)
        print(f"{names}: stale: run python scripts/gen-page-regions.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

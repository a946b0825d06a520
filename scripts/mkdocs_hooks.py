"""MkDocs hook (mkdocs.yml ``hooks``): bench/RESULTS.md, bench/history.md and bench's pictures join the
site as ``benchmarks/results.md``, ``benchmarks/history.md`` and ``benchmarks/*.png``, so the measured numbers have one home (bench/)
and RESULTS' own relative links (``learning.png``) resolve in the site as they do on disk.

Pages link to them by their place in the repository (``../bench/RESULTS.md``), the link GitHub
follows; on the site those links are rewritten to the pages' copies, so one link works in both."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
LINK = re.compile(r"(\]\()([^)\s#]+)([^)]*\))")


def site_uri(path: Path) -> str | None:
    """Where a repository file ``path`` is on the site, if it joins it (bench's results and pictures)."""
    if path == BENCH / "RESULTS.md":
        return "benchmarks/results.md"
    if path == BENCH / "history.md":
        return "benchmarks/history.md"
    if path.parent == BENCH and path.suffix == ".png":
        return f"benchmarks/{path.name}"
    return None


def on_files(files: Files, config: Any) -> Files:
    """Add bench/RESULTS.md, bench/history.md and bench/*.png under benchmarks/."""
    sources = {"benchmarks/results.md": BENCH / "RESULTS.md", "benchmarks/history.md": BENCH / "history.md"}
    sources |= {f"benchmarks/{p.name}": p for p in sorted(BENCH.glob("*.png"))}
    for uri, path in sources.items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """A page's links to bench's files, as their copies on the site."""
    if not page.file.src_uri:
        return markdown
    # bench's pages link to each other as files beside them (RESULTS.md, history.md, learning.png)
    bench_page = page.file.src_uri.startswith("benchmarks/")
    here = BENCH if bench_page else Path(config["docs_dir"], page.file.src_uri).parent

    def one(m: re.Match[str]) -> str:
        target = m.group(2)
        if "://" in target:
            return m.group(0)
        uri = site_uri((here / target).resolve())
        if uri is None:
            return m.group(0)
        rel = posixpath.relpath(uri, posixpath.dirname(page.file.src_uri) or ".")
        return f"{m.group(1)}{rel}{m.group(3)}"

    return LINK.sub(one, markdown)

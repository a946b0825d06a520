"""MkDocs hook (mkdocs.yml ``hooks``): bench/RESULTS.md and bench's pictures join the site as
``benchmarks/results.md`` and ``benchmarks/*.png``, so the measured numbers have one home (bench/)
and RESULTS' own relative links (``learning.png``) resolve in the site as they do on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

BENCH = Path(__file__).resolve().parents[1] / "bench"


def on_files(files: Files, config: Any) -> Files:
    """Add bench/RESULTS.md and bench/*.png under benchmarks/."""
    sources = {"benchmarks/results.md": BENCH / "RESULTS.md"}
    sources |= {f"benchmarks/{p.name}": p for p in sorted(BENCH.glob("*.png"))}
    for uri, path in sources.items():
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files

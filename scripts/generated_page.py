"""The command line every docs generator shares (scripts/gen-*.py): write the page, or ``--check``
that the committed page is what the code would write now (exit 1 when stale)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def write_or_check(
    argv: list[str] | None, doc: str | None, out: Path, render: Callable[[], str], script: str
) -> int:
    """Parse ``argv`` (``--check``, ``--path``), then write ``render()`` to the page or compare it."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--check", action="store_true", help="exit 1 if the file differs from what would be written"
    )
    ap.add_argument(
        "--path", type=Path, default=out, help=f"the file (default: {out.name} under docs/reference)"
    )
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not args.path.exists() or args.path.read_text() != text:
            print(f"{args.path} is stale: run python scripts/{script}", file=sys.stderr)
            return 1
        return 0
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(text)
    print(f"wrote {args.path}")
    return 0

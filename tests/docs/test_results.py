"""bench/RESULTS.md is a short index a reader can scan: one table per topic, each row the number with
its command, commit and machine, and a link to the section of bench/history.md that explains it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "RESULTS.md"
HISTORY = ROOT / "bench" / "history.md"
HEADER = "| what | number | command | commit | machine |"


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def tables(text: str) -> dict[str, list[list[str]]]:
    """Each ``##`` topic's table rows (cells stripped), header and rule excluded."""
    found: dict[str, list[list[str]]] = {}
    topic = ""
    for line in text.splitlines():
        if line.startswith("## "):
            topic = line[3:]
            found[topic] = []
        elif line.startswith("|") and topic and line != HEADER and not line.startswith("| ---"):
            found[topic].append([c.strip() for c in line.strip("|").split(" | ")])
    return found


def test_results_is_short() -> None:
    assert len(RESULTS.read_text().splitlines()) < 600


def test_every_topic_is_one_table_of_the_five_columns() -> None:
    text = RESULTS.read_text()
    topics = tables(text)
    assert topics, "no topics"
    for topic in topics:
        section = text.split(f"## {topic}\n", 1)[1].split("\n## ", 1)[0]
        assert section.count(HEADER) == 1, f"{topic}: one table headed {HEADER}"
    for topic, rows in topics.items():
        assert rows, f"{topic}: no rows"
        for row in rows:
            assert len(row) == 5 and all(row), (
                f"{topic}: a row needs what, number, command, commit, machine: {row}"
            )
            assert re.fullmatch(r"[0-9a-f]{7,40}", row[3]), f"{topic}: commit {row[3]!r} is not a commit id"


def test_every_link_to_the_history_finds_its_section() -> None:
    anchors = {slug(m) for m in re.findall(r"^#{1,6} (.*)$", HISTORY.read_text(), re.M)}
    links = re.findall(r"history\.md#([^)\s]+)\)", RESULTS.read_text())
    assert links
    assert [a for a in links if a not in anchors] == []
    # MkDocs folds a run of hyphens into one where GitHub keeps them: such an anchor works on one only
    assert [a for a in links if "--" in a] == []

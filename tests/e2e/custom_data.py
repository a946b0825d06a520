"""A reward that reads the row's own fields, for tests/e2e/test_your_data.py."""

from __future__ import annotations

from typing import Any


def weight_if_fields_arrived(completion: str, item: Any) -> float:
    """The row's ``weight`` column when its prompt and cleaned answer reached ``item`` under the
    names the recipe gives them (``question``, ``answer``) beside the row's own (``q``, ``a``)."""
    del completion
    arrived = item["question"] == item["q"] and item["answer"] == item["a"].rsplit("####", 1)[-1].strip()
    return float(item["weight"]) if arrived else 0.0

"""Functions and classes named by import path in a config (``"package.module:name"``).

The recipe names its reward, advantage estimator, loss and workflow this way, as AReaL names its
workflows: a new one is a function in any importable module, not an edit here.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["resolve"]


def resolve(path: str, key: str = "import path") -> Any:
    """The object at ``path`` (``"module:attr"``, ``attr`` may be dotted); errors name ``key``."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"'{key}' must be an import path 'package.module:name', got {path!r}")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"'{key}' = {path!r}: cannot import {module!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"'{key}' = {path!r}: {module!r} has no {attr!r}") from None
    return obj

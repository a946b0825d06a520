"""Functions and classes named by import path in a config (``"package.module:name"``).

The recipe names its reward, advantage estimator, loss and workflow this way, as AReaL names its
workflows: a new one is a function in any importable module, not an edit here.

A function brings its own settings as a workflow does: a dataclass set as its ``config_class``
attribute (``fn.config_class = MySettings``), filled from the ``fn_args`` table beside its ``fn``
(``[reward.fn_args]``, ``[advantage.fn_args]``, ``[trainer.loss.fn_args]``);
:func:`function_settings` finds it for the config loader. A function without one takes no table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from protocols.runtime.codec import register

__all__ = ["NoSettings", "function_settings", "resolve"]


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


@register
@dataclass
class NoSettings:
    """The settings of a function that declares none: its ``fn_args`` table must stay empty."""


def function_settings(path: str, key: str = "fn") -> type:
    """The settings class (``config_class``) of the function at import path ``path``, or
    :class:`NoSettings`; errors name ``key``."""
    if ":" not in path:  # not an import path: the field's own check says so, naming the key
        return NoSettings
    settings = getattr(resolve(path, key), "config_class", NoSettings)
    if not isinstance(settings, type):
        raise ValueError(f"'{key}' = {path!r}: its config_class must be a dataclass, got {settings!r}")
    return settings

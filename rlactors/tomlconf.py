"""Typed configuration from TOML: dataclasses with defaults, strict validation, ``a.b=value`` overrides.

Errors name the bad key and the file, and suggest the closest valid key for typos::

    cluster.toml: unknown key 'nodes[1].hots' (did you mean 'host'?)
    recipe.toml: 'trainer.lr' must be a float, got 'fast'
    command line: 'run.steps' must be >= 1, got 0

Ranges are declared once, on the field (``field(default=1, metadata=at_least(1))``), and checked by
:func:`check_ranges`, which a config class calls in its ``__post_init__``: the same check and
wording whether the object comes from TOML, msgpack or Python.

A nested table whose field has a default starts from that default's values (the parent's choice),
not from the nested class's own defaults: only the keys the file gives change.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import tomllib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

__all__ = [
    "ConfigError",
    "above",
    "at_least",
    "check_ranges",
    "from_dict",
    "import_path",
    "load_toml",
    "within",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or override that does not match its schema."""


Check = tuple[Callable[[Any], bool], str]


def at_least(lo: float) -> dict[str, Check]:
    """Field metadata: the value must be ``>= lo`` (None, for an optional field, is allowed)."""
    return {"check": (lambda v: v >= lo, f">= {lo}")}


def above(lo: float) -> dict[str, Check]:
    """Field metadata: the value must be ``> lo``."""
    return {"check": (lambda v: v > lo, f"> {lo}")}


def within(lo: float, hi: float, *, open_: bool = False) -> dict[str, Check]:
    """Field metadata: ``lo <= value <= hi`` (``lo < value < hi`` with ``open_``)."""
    if open_:
        return {"check": (lambda v: lo < v < hi, f"in ({lo}, {hi})")}
    return {"check": (lambda v: lo <= v <= hi, f"in [{lo}, {hi}]")}


def import_path() -> dict[str, Check]:
    """Field metadata: the value must look like ``module:name`` (resolved where it is used)."""
    return {"check": (lambda v: ":" in v, "an import path 'module:name'")}


def check_ranges(obj: Any) -> None:
    """Raise ``ValueError("'key' must be >= 1, got 0")`` for the first field of dataclass ``obj``
    outside the range its metadata declares, or not one of its ``Literal`` type's values; None
    passes a range (an unset optional)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        check = f.metadata.get("check")
        if check is not None and value is not None and not check[0](value):
            raise ValueError(f"'{f.name}' must be {check[1]}, got {value!r}")
        allowed = _literal_values(hints.get(f.name))
        if allowed is not None and value not in allowed:
            raise ValueError(f"'{f.name}' must be {' or '.join(map(repr, allowed))}, got {value!r}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _literal_values(tp: Any) -> tuple[Any, ...] | None:
    """The values a ``Literal[...]`` (or ``Literal[...] | None``) type allows; None for other types."""
    if get_origin(tp) is Literal:
        return get_args(tp)
    if get_origin(tp) in (Union, types.UnionType):
        parts = [_literal_values(a) for a in get_args(tp) if a is not type(None)]
        if len(parts) == 1 and parts[0] is not None:
            return (*parts[0], None) if type(None) in get_args(tp) else parts[0]
    return None


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"a table of {_type_name(get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a table"
    return {int: "an integer", float: "a float", str: "a string", bool: "a boolean", type(None): "none"}.get(
        tp, str(tp)
    )


def _convert(value: Any, tp: Any, path: str, source: str, base: Any = None) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, path, source)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{source}: '{path}' must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{source}: '{path}' must be {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: '{path}' must be {_type_name(tp)}, got {value!r}")
        (item,) = get_args(tp)
        return [_convert(v, item, f"{path}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{path}' must be {_type_name(tp)}, got {value!r}")
        _, vt = get_args(tp)
        return {str(k): _convert(v, vt, f"{path}.{k}", source) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{path}' must be a table, got {value!r}")
        return from_dict(tp, value, source=source, prefix=path, base=base)  # type: ignore[arg-type]
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: '{path}' must be a float, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: '{path}' must be an integer, got {value!r}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise ConfigError(f"{source}: '{path}' must be {_type_name(tp)}, got {value!r}")
        return value
    return value


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def from_dict(
    cls: type[T], data: dict[str, Any], *, source: str = "<config>", prefix: str = "", base: Any = None
) -> T:
    """Build dataclass ``cls`` from ``data``, refusing unknown keys, wrong types and missing fields.

    Keys ``data`` leaves out take ``base``'s values when it is given (an instance of ``cls``), else
    the fields' defaults; a nested table starts from its field's value in ``base`` or its default.
    A field whose metadata has ``settings_of = (sibling, resolve)`` holds the settings object of the
    class the sibling field names: ``resolve(sibling value)`` gives that class (a dataclass) and the
    table is built as it."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = (
                f" (did you mean '{close[0]}'?)"
                if close
                else f" (valid keys: {', '.join(sorted(fields))})"
                if fields
                else " (this table takes no keys)"
            )
            raise ConfigError(f"{source}: unknown key '{path}'{hint}")
        inner = getattr(base, key) if base is not None else _default(fields[key])
        if "settings_of" in fields[key].metadata:
            tp = _settings_class(fields, key, data, base, source, path)
            kwargs[key] = _convert(value, tp, path, source, _as_settings(inner, tp))
            continue
        if not dataclasses.is_dataclass(hints[key]) or not isinstance(inner, hints[key]):
            inner = None
        kwargs[key] = _convert(value, hints[key], path, source, inner)
    for name, f in fields.items():
        if name not in kwargs and base is not None:
            kwargs[name] = getattr(base, name)
        if "settings_of" in f.metadata and name not in data:  # its class may have changed
            path = f"{prefix}.{name}" if prefix else name
            current = kwargs[name] if name in kwargs else _default(f)
            tp = _settings_class(fields, name, data, base, source, path)
            kwargs[name] = _as_settings(current, tp) or from_dict(tp, {}, source=source, prefix=path)
        if (
            name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            path = f"{prefix}.{name}" if prefix else name
            if dataclasses.is_dataclass(hints[name]):
                raise ConfigError(f"{source}: missing required table [{path}]")
            raise ConfigError(f"{source}: missing required key '{path}'")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        # a class checking its own values names the field: name the whole key instead
        msg = str(e)
        for name in fields:
            if msg.startswith(f"'{name}'"):
                key = f"{prefix}.{name}" if prefix else name
                raise ConfigError(f"{source}: '{key}'{msg[len(name) + 2 :]}") from e
        raise ConfigError(f"{source}{' [' + prefix + ']' if prefix else ''}: {e}") from e


def _settings_class(
    fields: dict[str, dataclasses.Field], key: str, data: dict[str, Any], base: Any, source: str, path: str
) -> Any:
    sibling, resolve = fields[key].metadata["settings_of"]
    named = data.get(sibling, getattr(base, sibling) if base is not None else _default(fields[sibling]))
    try:
        return resolve(named)
    except (ValueError, TypeError, AttributeError, ImportError) as e:
        raise ConfigError(f"{source}: '{path}': {e}") from None


def _as_settings(current: Any, tp: Any) -> Any:
    """``current`` as a ``tp`` when ``tp`` is its class or a subclass (a workflow that extends
    another keeps the settings given so far), else None (start from ``tp``'s defaults)."""
    if current is None or isinstance(current, type) or not dataclasses.is_dataclass(current):
        return None
    if type(current) is tp:
        return current
    if isinstance(tp, type) and issubclass(tp, type(current)):
        return tp(**{f.name: getattr(current, f.name) for f in dataclasses.fields(current) if f.init})
    return None


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # bare strings need no quotes on the command line


def _apply_overrides(
    data: dict[str, Any], overrides: list[str], *, source: str = "command line"
) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as TOML, else taken as strings)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{source}: override {item!r} is not of the form key.sub=value")
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: cannot override '{key}': '{p}' is not a table")
        node[parts[-1]] = _parse_scalar(raw.strip())
    return data


def load_toml(
    cls: type[T],
    path: str | Path | None,
    overrides: list[str] | None = None,
    *,
    renames: dict[str, str] | None = None,
) -> T:
    """Load ``cls`` from a TOML file (or defaults when ``path`` is None) plus overrides.

    ``renames`` maps top-level TOML tables to field names (``{"async": "async_"}`` for a
    table whose name is a Python keyword); errors use the TOML spelling.
    """
    renames = renames or {}
    overrides = list(overrides or [])
    for old, new in renames.items():
        overrides = [new + o[len(old) :] if o.startswith(old + ".") else o for o in overrides]
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path).expanduser()
        source = str(p)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from e
    for old, new in renames.items():
        if old in data:
            data[new] = data.pop(old)
    if overrides:
        _apply_overrides(data, overrides)
        source = f"{source} (with overrides)"
    try:
        return from_dict(cls, data, source=source)
    except ConfigError as e:
        msg = str(e)
        # a bad value that came from an override: say so rather than naming the file
        for item in overrides:
            key = item.partition("=")[0].strip()
            if msg.startswith(f"{source}: '{key}'"):
                msg = "command line" + msg[len(source) :]
        for old, new in renames.items():
            msg = msg.replace(f"'{new}.", f"'{old}.").replace(f"'{new}'", f"'{old}'")
        raise ConfigError(msg) from None

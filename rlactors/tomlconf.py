"""Typed configuration from TOML: dataclasses with defaults, strict validation, ``a.b=value`` overrides.

Errors name the bad key and the file, and suggest the closest valid key for typos::

    cluster.toml: unknown key 'nodes[1].hots' (did you mean 'host'?)
    recipe.toml: 'trainer.lr' must be a float, got 'fast'
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

__all__ = ["ConfigError", "apply_overrides", "from_dict", "load_toml", "to_dict"]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or override that does not match its schema."""


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


def _convert(value: Any, tp: Any, path: str, source: str) -> Any:
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
        return from_dict(tp, value, source=source, prefix=path)  # type: ignore[arg-type]
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


def from_dict(cls: type[T], data: dict[str, Any], *, source: str = "<config>", prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, refusing unknown keys, wrong types and missing fields."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = (
                f" (did you mean '{close[0]}'?)" if close else f" (valid keys: {', '.join(sorted(fields))})"
            )
            raise ConfigError(f"{source}: unknown key '{path}'{hint}")
        kwargs[key] = _convert(value, hints[key], path, source)
    for name, f in fields.items():
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


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # bare strings need no quotes on the command line


def apply_overrides(
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
        apply_overrides(data, overrides)
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


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass config as plain data (for logging the effective config)."""
    return typing.cast(dict[str, Any], dataclasses.asdict(obj))

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

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import json
import textwrap
import tokenize
import tomllib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

__all__ = [
    "ConfigError",
    "above",
    "allowed_values",
    "at_least",
    "check_ranges",
    "field_docs",
    "from_dict",
    "import_path",
    "load_toml",
    "render_markdown",
    "render_toml",
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


def import_path() -> dict[str, Any]:
    """Field metadata: the value must look like ``module:name`` (resolved where it is used; a
    config loader can find every such field by its ``import_path`` flag)."""
    return {"check": (lambda v: ":" in v, "an import path 'module:name'"), "import_path": True}


def check_ranges(obj: Any) -> None:
    """Raise ``ValueError("'key' must be >= 1, got 0")`` for the first field of dataclass ``obj``
    outside the range its metadata declares, or not one of its ``Literal`` type's values; None
    passes a range (an unset optional)."""
    cls: type = type(obj)
    hints = _hints(cls)
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

    A class may name keys it once had in a ``REMOVED_KEYS`` class attribute (key -> what to do
    instead): such a key is refused with that line rather than as unknown.

    Keys ``data`` leaves out take ``base``'s values when it is given (an instance of ``cls``), else
    the fields' defaults; a nested table starts from its field's value in ``base`` or its default.
    A field whose metadata has ``settings_of = (sibling, resolve)`` holds the settings object of the
    class the sibling field names: ``resolve(sibling value)`` gives that class (a dataclass) and the
    table is built as it."""
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # T is unbound: any dataclass class
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            if gone := getattr(cls, "REMOVED_KEYS", {}).get(key):  # a setting that existed once
                raise ConfigError(f"{source}: '{path}' was removed: {gone}")
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
    if current is None or not dataclasses.is_dataclass(current) or isinstance(current, type):
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


# -- reading a config: each field's meaning, the resolved config as TOML, a Markdown reference ----


def field_docs(cls: type) -> dict[str, str]:
    """The meaning of each field of dataclass ``cls``, from its source: the ``#`` comment lines
    directly above the field and the comments on its own line(s), joined into one line ("" where
    there are none). An inherited field's meaning is read from the class that declares it."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        docs.update(_declared_docs(klass))
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


_DIRECTIVES = ("type:", "noqa", "pragma:", "fmt:")


@functools.cache
def _declared_docs(cls: type) -> dict[str, str]:
    """The comments of the fields ``cls``'s own body declares (nothing when its source is not at
    hand, or it is not a class statement)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return {}
    if not tree.body or not isinstance(tree.body[0], ast.ClassDef):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if not text.startswith(_DIRECTIVES):
                comments[tok.start[0]] = text
    lines = source.splitlines()
    docs = {}
    for node in tree.body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, n = [], node.lineno - 1
        while n >= 1 and lines[n - 1].lstrip().startswith("#"):  # the comment block right above
            if n in comments:
                above.append(comments[n])
            n -= 1
        own = [comments[i] for i in range(node.lineno, (node.end_lineno or node.lineno) + 1) if i in comments]
        docs[node.target.id] = " ".join(p for p in [*reversed(above), *own] if p)
    return docs


def allowed_values(cls: type, name: str) -> str:
    """What field ``name`` of dataclass ``cls`` allows beyond its type, in words: its ``Literal``
    choices or the range its metadata declares ("" when nothing more)."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    choices = _literal_values(_hints(cls).get(name))
    if choices is not None:
        return "one of " + ", ".join(_toml_value(c) if c is not None else "unset" for c in choices)
    check = f.metadata.get("check")
    if check is None:
        return ""
    return f"{check[1]}, or unset" if type(None) in get_args(_hints(cls).get(name)) else check[1]


def render_toml(obj: Any, *, renames: dict[str, str] | None = None) -> str:
    """Dataclass instance ``obj`` (a resolved config) as TOML that :func:`load_toml` loads back to an
    equal object: every table and key with its value, above each its meaning (:func:`field_docs`),
    and beside a key what it allows (:func:`allowed_values`).

    Nested dataclasses (settings objects of ``settings_of`` fields included) are ``[a.b]`` tables,
    a ``dict[str, <dataclass>]`` field one ``[a.<name>]`` table per name. TOML
    has no null: an unset (None) key is shown commented out, and loads back as its default. A field
    declared ``repr=False`` (a secret) is shown only while empty. ``renames`` maps field names to
    their TOML spelling (``{"async_": "async"}``)."""
    out: list[str] = []
    _render_table(obj, [], out, renames or {})
    return "\n".join(out).lstrip("\n") + "\n"


def _render_table(obj: Any, path: list[str], out: list[str], renames: dict[str, str]) -> None:
    cls = type(obj)
    docs, hints = field_docs(cls), get_type_hints(cls)
    tables = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = _toml_key(renames.get(f.name, f.name) if not path else f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            tables.append((key, f.name, value))
            continue
        if value and _table_of_tables(hints.get(f.name)):  # a table per name: [key.<name>]
            tables += [(f"{key}.{_toml_key(str(k))}", f.name, v) for k, v in value.items()]
            continue
        out.extend(_comment(docs[f.name]))
        allowed = allowed_values(cls, f.name)
        if value is None:
            line = f"# {key} = (unset)"
        elif not f.repr and value:
            line = f"# {key} = (set; a secret, not shown)"
        else:
            line = f"{key} = {_toml_value(value)}"
        out.append(f"{line}  # {allowed}" if allowed else line)
    for key, name, value in tables:
        out.append("")
        out.extend(_comment(docs[name]))
        out.append(f"[{'.'.join([*path, key])}]")
        _render_table(value, [*path, key], out, renames)


def _table_of_tables(tp: Any) -> Any:
    """The value class of a ``dict[str, <dataclass>]`` field's type (named tables, ``[a.<name>]``),
    else None."""
    if get_origin(tp) is dict and dataclasses.is_dataclass(vt := get_args(tp)[1]):
        return vt
    return None


def _comment(text: str) -> list[str]:
    lines = textwrap.wrap(text, 98, break_long_words=False, break_on_hyphens=False)
    return [f"# {line}" for line in lines]


def _toml_key(key: str) -> str:
    bare = key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
    return key if bare else _toml_value(key)


def _toml_value(value: Any) -> str:
    """``value`` as a TOML value (a string, number, boolean, array or inline table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # inf and nan are spelt as TOML spells them
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items())
        return "{" + (f" {items} " if items else "") + "}"
    raise ValueError(f"{value!r} has no TOML form")


def render_markdown(
    obj: Any, *, prefix: str = "", renames: dict[str, str] | None = None, doc: str = "", level: int = 2
) -> str:
    """A reference of the keys of ``obj`` (a dataclass instance, or a dataclass: its own defaults)
    in Markdown: a heading per table (``[a.b]``, under ``prefix``; ``level`` ``#``), its meaning
    (``doc`` for ``obj``'s own), and a table of its keys: key, type, default (``obj``'s value),
    allowed range or choices, meaning. Nested tables follow."""
    out: list[str] = []
    _markdown_table(obj, prefix, doc, out, renames or {}, level)
    return "\n".join(out).rstrip("\n") + "\n"


_REQUIRED = object()


def _markdown_table(
    obj: Any, path: str, doc: str, out: list[str], renames: dict[str, str], level: int
) -> None:
    cls = obj if isinstance(obj, type) else type(obj)
    docs, hints = field_docs(cls), _hints(cls)
    rows, tables = [], []
    for f in dataclasses.fields(cls):
        if isinstance(obj, type):
            value = _REQUIRED if _is_required(f) else _default(f)
        else:
            value = getattr(obj, f.name)
        key = renames.get(f.name, f.name) if not path else f.name
        if (named := _table_of_tables(hints.get(f.name))) is not None:  # [key.<name>], any number
            tables.append((f"{path}.{key}.<name>" if path else f"{key}.<name>", docs[f.name], named))
            continue
        if dataclasses.is_dataclass(value) or (
            value is _REQUIRED and dataclasses.is_dataclass(hints[f.name])
        ):
            table = hints[f.name] if value is _REQUIRED else value
            tables.append((f"{path}.{key}" if path else key, docs[f.name], table))
            continue
        if value is _REQUIRED:
            default = "(required)"
        elif value is None:
            default = "unset"
        elif not f.repr and value:
            default = "(secret)"
        else:
            default = f"`{_toml_value(value)}`"
        cells = [
            f"`{key}`",
            _short_type(hints.get(f.name)),
            default,
            allowed_values(cls, f.name),
            docs[f.name],
        ]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if path:
        out += [f"{'#' * level} `[{path}]`", "", *([doc, ""] if doc else [])]
    if rows:
        out += ["| key | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |", *rows, ""]
    elif not tables:
        out += ["No keys: this table takes none.", ""]
    for sub, sub_doc, value in tables:
        _markdown_table(value, sub, sub_doc, out, renames, level)


def _cell(text: str) -> str:
    """``text`` in a Markdown table cell: a ``|`` would end the cell, a ``<`` may open an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _short_type(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " or ".join(sorted({type(a).__name__ for a in get_args(tp)}))
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        name = " or ".join(_short_type(a) for a in args)
        return f"{name} (optional)" if len(args) < len(get_args(tp)) else name
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_short_type(a) for a in get_args(tp))}]"
    if tp is Any or tp is None:
        return "any"
    if dataclasses.is_dataclass(tp):
        return "table"
    return getattr(tp, "__name__", str(tp))

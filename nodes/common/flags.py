"""Command-line flags made from a settings dataclass, so a program's flags, its ``--help``, a
launcher's command line and the config reference come from one definition.

A field ``name`` is the flag ``--name`` (underscores as hyphens); a field of a nested settings class
is ``--<field>-name``. A field's help is the ``#`` comment on or directly above it
(:func:`rlactors.base.tomlconf.field_docs`). Used by the reference server
(nodes/inference/server.py) and the OpenAI endpoint (nodes/rollout/openai_endpoint.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from rlactors.base.tomlconf import field_docs

__all__ = ["add_flags", "from_namespace", "to_argv"]


def _flag(name: str, prefix: str = "") -> str:
    return "--" + (prefix + name).replace("_", "-")


def _scalar(tp: Any) -> tuple[Any, bool]:
    """``tp`` without ``None`` (``str | None`` -> ``str``), and whether it allowed ``None``."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(get_args(tp))
    return tp, False


def add_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """Add a flag per field of settings class ``cls`` to ``parser``, with the field's meaning, type,
    choices and default; a nested settings class becomes its own group of ``--<field>-...`` flags."""
    hints, docs = get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _scalar(hints[f.name])
        dest = prefix.replace("-", "_") + f.name
        if dataclasses.is_dataclass(tp):
            # the class's summary (up to its first colon) heads the group: an indented
            # description would read as a flag in --help
            summary = " ".join((tp.__doc__ or "").split()).partition(":")[0]
            group = parser.add_argument_group(f"{_flag(f.name, prefix)}-...: {summary}")
            add_flags(group, tp, prefix=f"{prefix}{f.name}-")  # type: ignore[arg-type]
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        text = docs[f.name] or f.name
        flag = _flag(f.name, prefix)
        if get_origin(tp) is list:  # a repeatable flag; absent: the field's default
            (item,) = get_args(tp)
            parser.add_argument(flag, dest=dest, type=item, action="append", help=f"{text} (repeatable)")
            continue
        if tp is bool:
            parser.add_argument(
                flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=text
            )
            continue
        choices = get_args(tp) if get_origin(tp) is Literal else None
        kind = type(choices[0]) if choices else tp
        parser.add_argument(
            flag,
            dest=dest,
            type=kind,
            choices=choices,
            default=default,
            help=f"{text} (default: %(default)s)",
        )


def from_namespace(ns: argparse.Namespace, cls: type, prefix: str = "") -> Any:
    """The ``cls`` that :func:`add_flags`' flags parsed into ``ns``."""
    hints, values = get_type_hints(cls), vars(ns)
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp, _ = _scalar(hints[f.name])
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[f.name] = from_namespace(ns, tp, prefix=f"{prefix}{f.name}_")
        elif values[prefix + f.name] is None and get_origin(tp) is list:  # a repeatable flag not given
            kwargs[f.name] = (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            )
        else:
            kwargs[f.name] = values[prefix + f.name]
    return cls(**kwargs)


def to_argv(settings: Any, cls: type | None = None, prefix: str = "") -> list[str]:
    """The flags that give ``settings`` (an instance of ``cls`` or of a subclass of it: only
    ``cls``'s fields are written) to a parser made by :func:`add_flags`: every field whose value is
    not its default, so a command line shows what was chosen."""
    cls = cls or type(settings)
    hints, argv = get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        value = getattr(settings, f.name)
        tp, _ = _scalar(hints[f.name])
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            argv += to_argv(value, tp, prefix=f"{prefix}{f.name}-")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value == default or value is None:
            continue
        flag = _flag(f.name, prefix)
        if isinstance(value, list):
            argv += [f"{flag}={v}" for v in value]
        elif tp is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        elif str(value).startswith("-"):  # a value argparse would take for a flag
            argv.append(f"{flag}={value}")
        else:
            argv += [flag, str(value)]
    return argv

"""The reference server's settings, defined once: every field's type, default and meaning.

:class:`ServerArgs` is what ``python -m nodes.inference.server`` takes; its command line, its
``--help``, the launcher's command line (``ReferenceServerConfig``, which extends
:class:`ServerSettings`) and the config reference are all made from these classes by
:func:`add_flags` and :func:`to_argv`. A field ``name`` is the flag ``--name`` (underscores as
hyphens; SGLang's spelling where SGLang has the setting); a field of the nested simulator settings
is ``--sim-name``. A field's meaning is the ``#`` comment on or directly above it
(:func:`rlactors.base.tomlconf.field_docs`).

No torch, no web framework here: the launcher and the recipe's config import this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from protocols.runtime.codec import register
from rlactors.base.tomlconf import field_docs

__all__ = ["ServerArgs", "ServerSettings", "SimSettings", "add_flags", "from_namespace", "to_argv"]


@register
@dataclass
class SimSettings:
    """The simulated model of backend "sim", a test and benchmark tool (not a model): no
    weights, deterministic tokens, and a latency model spent sleeping, so hundreds of requests cost
    almost no CPU."""

    prefill_s_per_token: float = 0.0  # seconds of prefill per uncached prompt token
    decode_s_base: float = 0.0  # seconds per decode step
    decode_s_per_seq: float = 0.0  # extra seconds per decode step for each running sequence
    eos_prob: float = 0.0  # chance that a sampled token is EOS
    vocab_size: int = 32000  # vocabulary size when the model folder has no tokenizer
    eos_token_id: int = 2  # the token id the simulator ends a sequence with


@register
@dataclass
class ServerSettings:
    """What a reference server serves and how (everything but where it listens)."""

    model_path: str = ""  # the model folder or Hugging Face id (sim: optional, for its tokenizer)
    tokenizer_path: str | None = None  # the tokenizer folder or id, if not the model's
    # hf: the model through transformers; sim: a simulated model for tests and benchmarks (sim.*)
    backend: Literal["hf", "sim"] = "hf"
    max_running_requests: int = 64  # sequences decoded at once; more requests wait in its queue
    cache_tokens: int = 65536  # prefix-cache (KV) budget, in tokens
    dtype: str = "auto"  # the model's dtype: auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    random_seed: int = 0  # the server's sampling seed
    weight_version: str = "default"  # the weight version reported before the first update
    # refuse distributed and tensor weight updates outside /begin_weight_update ... /end_weight_update,
    # as SGLang 0.5.23 always does (false: as SGLang before weight-update sessions)
    strict_weight_update_session: bool = True
    num_threads: int = 0  # torch intra-op threads (0: torch's default)
    # longest prompt + max_new_tokens, as SGLang's --context-length (0: the model config's
    # max_position_embeddings, else 32768); a longer request gets 400 unless allow_auto_truncate
    context_length: int = 0
    allow_auto_truncate: bool = False  # cut prompts past the context length instead of answering 400
    # Request limits (SGLang has none of these; they keep one request from stalling the server)

    max_request_bytes: int = 16 << 20  # a request body larger than this gets 413
    max_n: int = 64  # the largest n (samples per prompt) one request may ask for; more get 400
    max_batch_size: int = 256  # the most sequences (prompts x n) in one /generate; more get 400
    # the most log-prob entries one /generate may ask for (top_logprobs_num and token_ids_logprob
    # entries at every reported position, summed over its sequences); more get 400. About 40 bytes
    # of JSON each: the default bounds a response near 40 MB
    max_logprob_entries: int = 1 << 20
    # stream events carry only what is new since the previous one (output ids, text, output
    # log-probs) instead of everything so far, as SGLang's --incremental-streaming-output
    incremental_streaming_output: bool = False
    # LoRA adapters as SGLang's --enable-lora serves them (hf backend): /load_lora_adapter and
    # /unload_lora_adapter, and a lora_path per /generate naming the adapter that request uses
    enable_lora: bool = False
    max_lora_rank: int | None = None  # the largest adapter rank /load_lora_adapter accepts (None: any)
    # the modules an adapter may target, e.g. q_proj (empty: any linear layer); SGLang's flag of that name
    lora_target_modules: list[str] = field(default_factory=list)
    # adapters loaded at once; loading one more unloads the least recently used (None: no limit)
    max_loaded_loras: int | None = None
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = (
        "warning"  # how much it logs
    )
    sim: SimSettings = field(default_factory=SimSettings)  # the simulator's knobs (backend = "sim" only)


@dataclass
class ServerArgs(ServerSettings):
    """The command line of ``python -m nodes.inference.server``: the settings and where to listen
    (a launcher picks the address and port itself)."""

    host: str = "127.0.0.1"  # the address to listen on
    port: int = 30000  # the port to listen on


# -- flags --------------------------------------------------------------------------------------


def _flag(name: str, prefix: str = "") -> str:
    return "--" + (prefix + name).replace("_", "-")


def _scalar(tp: Any) -> tuple[Any, bool]:
    """``tp`` without ``None`` (``str | None`` -> ``str``), and whether it allowed ``None``."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(get_args(tp))
    return tp, False


def add_flags(parser: argparse.ArgumentParser, cls: type = ServerArgs, prefix: str = "") -> None:
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


def from_namespace(ns: argparse.Namespace, cls: type = ServerArgs, prefix: str = "") -> Any:
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

"""The reference server's settings are defined once: the settings class, the server's command line
(argparse and ``--help``) and the launcher's command line agree field for field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any, get_args, get_type_hints

from nodes.inference.launcher import REPO_ROOT, ReferenceServerConfig
from nodes.inference.server import parse_args, parser
from nodes.inference.settings import ServerArgs, ServerSettings, SimSettings


def flags_of(cls: type, prefix: str = "") -> dict[str, tuple[type, str]]:
    """``--flag -> (settings class, field)`` for every leaf field of ``cls`` (nested ones under
    their field's name), as the server's command line must spell them."""
    out = {}
    for f in dataclasses.fields(cls):
        tp = get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(flags_of(tp, f"{prefix}{f.name}-"))
        else:
            out["--" + (prefix + f.name).replace("_", "-")] = (cls, f.name)
    return out


def changed(value: Any, tp: Any) -> Any:
    """A value of type ``tp`` different from ``value``."""
    choices = [c for c in get_args(tp) if isinstance(c, str)]
    if value is None:  # an optional number (None: unset): a number
        number = next((a for a in get_args(tp) if a in (int, float)), None)
        if number is not None:
            return number(7)
    if choices:
        return next(c for c in choices if c != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 7
    if isinstance(value, float):
        return value + 0.25
    if isinstance(value, list):  # a repeatable flag
        return [*value, "x-changed"]
    return f"{value or 'x'}-changed"


def everything_changed(cls: type) -> Any:
    """An instance of settings class ``cls`` with every field away from its default."""
    kwargs = {}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = everything_changed(tp)
        elif f.name == "extra_args":
            kwargs[f.name] = []
        else:
            kwargs[f.name] = changed(default, tp)
    return cls(**kwargs)


def test_the_command_line_has_a_flag_per_field_and_no_other() -> None:
    expected = set(flags_of(ServerArgs)) | {"--api-key", "--admin-api-key", "--help"}
    actual = {s for a in parser()._actions for s in a.option_strings if not s.startswith("--no-")}
    actual.discard("-h")
    assert actual == expected
    assert {"--sim-decode-s-base", "--sim-eos-prob", "--sim-vocab-size"} <= actual  # nested, prefixed
    assert not any(f.name.startswith("sim_") for f in dataclasses.fields(ServerArgs))


def test_defaults_are_the_settings_classes_own() -> None:
    assert parse_args([]) == ServerArgs()
    assert ServerArgs().backend == "hf" and ReferenceServerConfig().backend == "hf"  # users get a model
    assert isinstance(ServerArgs().sim, SimSettings)


def test_the_launchers_command_line_parses_back_to_its_settings() -> None:
    """Every setting away from its default travels on the launcher's command line and is read back
    as it was set; the defaults travel as nothing."""
    config = everything_changed(ReferenceServerConfig)
    assert all(
        getattr(config, name) != getattr(ServerSettings(), name) for name in ("backend", "max_n", "sim")
    )
    argv = config.command("127.0.0.9", 31234)
    assert argv[:3] == [sys.executable, "-m", "nodes.inference.server"]
    parsed = parse_args(argv[3:])
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(ServerSettings)}
    assert parsed == ServerArgs(**settings, host="127.0.0.9", port=31234)
    for flag in flags_of(ServerSettings):  # every field, each spelled as the server spells it
        assert any(a == flag or a == "--no-" + flag[2:] or a.startswith(flag + "=") for a in argv), flag

    plain = ReferenceServerConfig(model_path="/m").command("127.0.0.1", 1)
    assert plain[3:] == ["--host", "127.0.0.1", "--port", "1", "--model-path", "/m"]
    assert parse_args(plain[3:]) == ServerArgs(model_path="/m", port=1)


def test_extra_args_come_last_and_win() -> None:
    config = ReferenceServerConfig(backend="sim", extra_args=["--sim-eos-prob", "0.5", "--max-n", "3"])
    parsed = parse_args(config.command("127.0.0.1", 1)[3:])
    assert parsed.sim.eos_prob == 0.5 and parsed.max_n == 3 and parsed.backend == "sim"


def test_a_value_that_looks_like_a_flag_still_parses() -> None:
    config = ReferenceServerConfig(model_path="-odd-folder", sim=SimSettings(eos_token_id=-1))
    assert parse_args(config.command("127.0.0.1", 1)[3:]).model_path == "-odd-folder"
    assert parse_args(config.command("127.0.0.1", 1)[3:]).sim.eos_token_id == -1


def test_help_lists_every_flag_with_its_meaning() -> None:
    """``python -m nodes.inference.server --help``: each field's flag, followed by the meaning its
    ``#`` comment gives (not a placeholder)."""
    out = subprocess.run(
        [sys.executable, "-m", "nodes.inference.server", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    text = " ".join(out.split())
    from rlactors.base.tomlconf import field_docs

    for flag, (cls, name) in flags_of(ServerArgs).items():
        meaning = field_docs(cls)[name]
        assert meaning, f"{cls.__name__}.{name} has no meaning"
        assert flag in text, flag
        first_words = " ".join(meaning.split()[:4])
        assert first_words in text, (flag, first_words)
    assert "test and benchmark tool" in text  # the simulator says what it is for


def test_the_endpoint_command_line_is_its_settings_class(monkeypatch: Any) -> None:
    """``python -m nodes.rollout.openai_endpoint``: a flag per field of :class:`EndpointArgs`, each
    with its meaning in ``--help``; every field changed round-trips through the flags; the key
    flags fall back to the environment; a missing server or model is a usage error."""
    import pytest

    from nodes.common.flags import to_argv
    from nodes.rollout import openai_endpoint
    from nodes.rollout.openai_endpoint import EndpointArgs
    from rlactors.base.tomlconf import field_docs

    chosen = EndpointArgs(
        server_url=["http://127.0.0.1:1", "http://127.0.0.1:2"],
        model_path="/m",
        model_name="n",
        tool_parser="pkg.mod:fn",
        host="0.0.0.0",
        port=9,
        api_key="k",
        admin_api_key="-a",
    )
    for f in dataclasses.fields(EndpointArgs):
        assert getattr(chosen, f.name) != getattr(EndpointArgs(), f.name), f"{f.name} is not changed"
    assert openai_endpoint.parse_args(to_argv(chosen)) == chosen
    monkeypatch.setenv("RLACTORS_SERVER_API_KEY", "from-env")
    assert openai_endpoint.parse_args(["--server-url", "u", "--model-path", "m"]).api_key == "from-env"
    with pytest.raises(SystemExit):
        openai_endpoint.parse_args(["--model-path", "m"])
    out = subprocess.run(
        [sys.executable, "-m", "nodes.rollout.openai_endpoint", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    text = " ".join(out.split())
    for name, meaning in field_docs(EndpointArgs).items():
        assert meaning and "--" + name.replace("_", "-") in text and " ".join(meaning.split()[:3]) in text, (
            name
        )

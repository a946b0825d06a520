"""The reference inference server's command line: SGLang 0.5.x's native HTTP protocol, served.

Run it the way SGLang is run::

    python -m nodes.inference.server --model-path P --host 127.0.0.1 --port 30000 [--backend hf|sim]

Its flags are the fields of :class:`~nodes.inference.settings.ServerArgs` (``--help`` lists each
with its meaning and default); the app is :func:`nodes.inference.app.create_app`. The default
backend is ``hf`` (a real model through transformers); ``--backend sim`` simulates one for tests
and benchmarks (its ``--sim-...`` flags).

The keys (SGLang's ``--api-key`` and ``--admin-api-key``, :mod:`protocols.http.auth`) are not settings:
``/server_info`` lists the settings and must not show them. They may come from the environment
instead (``RLACTORS_SERVER_API_KEY``, ``RLACTORS_SERVER_ADMIN_API_KEY``), which other users cannot
read the way they read a command line; the launcher passes them so.
"""

from __future__ import annotations

import argparse
import os

import structlog

from nodes.common.flags import add_flags, from_namespace
from nodes.inference.app import create_app
from nodes.inference.engine import Engine
from nodes.inference.settings import ServerArgs
from protocols.http.auth import ServerKeys

# What a server imports as it loads its model (the default's architecture, Llama, included), imported
# once by its node's fork server when a launcher starts it there (rlactors.node.forkserver).
FORK_PRELOAD = (
    "nodes.inference.models",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "uvicorn",
)

__all__ = ["create_app", "main", "parse_args", "parse_keys"]

log = structlog.get_logger(__name__)

GRACEFUL_SHUTDOWN_S = 10  # on SIGTERM, requests still running after this are cut off
KEYS_ENV = {"api_key": "RLACTORS_SERVER_API_KEY", "admin_api_key": "RLACTORS_SERVER_ADMIN_API_KEY"}


def parser() -> argparse.ArgumentParser:
    """The server's argument parser: a flag per :class:`ServerArgs` field, and the keys."""
    ap = argparse.ArgumentParser(prog="python -m nodes.inference.server", description=__doc__.split("\n")[0])
    add_flags(ap, ServerArgs)
    _key_flags(ap)
    return ap


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """The settings the command line gives (the keys: :func:`parse_keys`)."""
    return from_namespace(parser().parse_args(argv), ServerArgs)


def _key_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        default=os.environ.get(KEYS_ENV["api_key"], ""),
        help=f"the key normal routes need (default: ${KEYS_ENV['api_key']}; none: open)",
    )
    parser.add_argument(
        "--admin-api-key",
        default=os.environ.get(KEYS_ENV["admin_api_key"], ""),
        help=f"the key admin routes need, instead of --api-key (default: ${KEYS_ENV['admin_api_key']})",
    )


def parse_keys(argv: list[str] | None = None) -> ServerKeys:
    """The keys the command line (or the environment) gives the server."""
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _key_flags(ap)
    ns, _ = ap.parse_known_args(argv)
    return ServerKeys(ns.api_key, ns.admin_api_key)


def main(argv: list[str] | None = None) -> None:
    """Load the backend, then serve until interrupted."""
    import logging

    import uvicorn

    args = parse_args(argv)
    level = getattr(logging, args.log_level.upper(), logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(min(level, logging.INFO)))
    keys = parse_keys(argv)
    engine = Engine(args)
    needs = ",".join(k for k in ("api_key", "admin_api_key") if getattr(keys, k)) or "none"
    log.info(
        "server_starting",
        host=args.host,
        port=args.port,
        backend=args.backend,
        model=args.model_path,
        keys=needs,
    )
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    uvicorn.run(
        create_app(engine, keys),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        loop=loop,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


if __name__ == "__main__":
    main()

"""Exceptions raised by the runtime, and how remote exceptions travel."""

from __future__ import annotations

import builtins
import traceback
from typing import Any

from protocols.runtime import codec

__all__ = [
    "ActorDiedError",
    "ActorNotFoundError",
    "ActorUnreachableError",
    "ClusterError",
    "MessageTooLargeError",
    "PlacementError",
    "RemoteError",
    "RuntimeShutdownError",
]


class ClusterError(RuntimeError):
    """Base class of the runtime's own errors."""


class ActorDiedError(ClusterError):
    """The actor's process died (or was killed) before or while answering this call."""

    def __init__(self, message: str, actor_id: str | None = None) -> None:
        super().__init__(message)
        self.actor_id = actor_id


class ActorUnreachableError(ActorDiedError):
    """The peer stopped answering at the network level (a partition, or a stopped process).

    Its pending calls failed: their replies can no longer arrive. A subclass of
    :class:`ActorDiedError` because, to its callers, an unreachable actor is as good as dead.
    """


class MessageTooLargeError(ClusterError, ValueError):
    """A call's arguments or result are over ``max_message_bytes``; nothing was sent."""


class ActorNotFoundError(ClusterError, LookupError):
    """No live actor has this name or id."""


class PlacementError(ClusterError):
    """No node can satisfy the requested resources."""


class RuntimeShutdownError(ClusterError):
    """The cluster connection was closed while the call was pending."""


class RemoteError(ClusterError):
    """A remote exception whose type cannot be imported here. ``type_name`` names it."""

    def __init__(self, type_name: str, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.remote_traceback = remote_traceback


class RemoteTraceback(Exception):
    """Carries the remote traceback text; set as ``__cause__`` of re-raised exceptions."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\nRemote traceback:\n{self.tb}"


def _type_path(cls: type) -> str:
    module = cls.__module__
    if module == "__mp_main__":
        module = "__main__"
    return f"{module}:{cls.__qualname__}"


def exception_payload(exc: BaseException, *, where: str = "") -> dict[str, Any]:
    """What travels in an ERROR envelope for ``exc``."""
    args: list[Any] = []
    for a in exc.args:
        if isinstance(a, (str, int, float, bool, type(None))):
            args.append(a)
        else:
            args = [str(exc)]
            break
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"type": _type_path(type(exc)), "message": str(exc), "traceback": tb, "args": args, "where": where}


def _resolve_type(path: str) -> type | None:
    """The exception class named ``path``, found only in modules already imported here or in
    trusted packages (:func:`protocols.runtime.codec.import_trusted`): a reply never makes us import
    arbitrary modules. A caller that can ``except`` a type has imported its module anyway."""
    module, _, qualname = path.partition(":")
    candidates = ["__main__", "__mp_main__"] if module == "__main__" else [module]
    for name in candidates:
        mod = codec.import_trusted(name)
        if mod is None:
            continue
        obj: Any = mod
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            return obj
    return None


def exception_from_payload(payload: dict[str, Any]) -> BaseException:
    """Rebuild a remote exception: its own type when importable here, else :class:`RemoteError`."""
    type_path = str(payload.get("type", "builtins:Exception"))
    message = str(payload.get("message", ""))
    tb = str(payload.get("traceback", ""))
    args = payload.get("args") or [message]
    cls = _resolve_type(type_path)
    exc: BaseException
    if cls is None or not issubclass(cls, Exception):
        exc = RemoteError(type_path.replace("builtins:", ""), message, tb)
    else:
        try:
            exc = cls(*args)
        except Exception:  # a remote class's constructor, with the remote's arguments: it may raise anything
            try:
                exc = cls(message)
            except Exception:  # likewise
                exc = RemoteError(type_path, message, tb)
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    if type_path == "rlactors.base.errors:ActorDiedError" and isinstance(exc, ActorDiedError):
        exc.actor_id = payload.get("actor_id")
    return exc


# Builtins resolve without importing anything.
assert _resolve_type("builtins:ValueError") is builtins.ValueError

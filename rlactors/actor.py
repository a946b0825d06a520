"""The actor base class, the context an actor sees, and how actor classes are found by path."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlactors.errors import ClusterError

if TYPE_CHECKING:
    from rlactors.cluster import Cluster

__all__ = ["Actor", "ActorContext", "get_context"]


class Actor:
    """Base class of actors. Subclass it; public methods become remotely callable.

    ``async def`` methods run concurrently on the worker's event loop (up to
    ``max_concurrency``); plain ``def`` methods run in order on one worker thread;
    generator methods stream. Optional hooks: ``async def on_start(self)`` runs on the
    worker's loop after the constructor, ``async def on_stop(self)`` before a clean exit.
    """


@dataclass
class ActorContext:
    """What an actor knows about itself and the cluster it runs in."""

    actor_id: str
    name: str | None
    node_id: str
    cluster: Cluster
    restarts: int = 0


_context: ActorContext | None = None


def get_context() -> ActorContext:
    """The running actor's context. Raises outside an actor's worker process."""
    if _context is None:
        raise ClusterError("get_context() is only available inside an actor's worker process")
    return _context


def _set_context(ctx: ActorContext | None) -> None:
    global _context
    _context = ctx


def class_spec(cls: type) -> dict[str, Any]:
    """How a worker finds ``cls``: module, qualified name, and the file as a fallback."""
    module = cls.__module__
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None)
    if module == "__mp_main__":
        module = "__main__"
    if "<locals>" in cls.__qualname__:
        raise ClusterError(
            f"actor class {cls.__qualname__} is defined inside a function; define it at module level"
        )
    return {
        "module": module,
        "qualname": cls.__qualname__,
        "file": str(Path(file).resolve()) if file else None,
    }


def load_class(spec: dict[str, Any]) -> type:
    """Import an actor class described by :func:`class_spec` (in a worker process)."""
    module, qualname, file = spec["module"], spec["qualname"], spec.get("file")
    mod = None
    if module == "__main__":
        # As multiprocessing's spawn does: run the driver's script as __mp_main__, with
        # its `if __name__ == "__main__":` block skipped.
        if not file:
            raise ClusterError("actor class is defined in an interactive __main__; put it in a module file")
        try:
            mod = sys.modules.get("__mp_main__") or _import_path("__mp_main__", file)
        except RuntimeError as e:
            raise ClusterError(
                f"importing the driver script {file} to find {qualname} ran its code ({e}): start the script's "
                'work under `if __name__ == "__main__":`, as with multiprocessing'
            ) from e
    else:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            if not file:
                raise
            mod = sys.modules.get(module) or _import_path(module, file)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ClusterError(f"{module}:{qualname} is not a class")
    return obj


def _import_path(name: str, file: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ClusterError(f"cannot import actor module from {file}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

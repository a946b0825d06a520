"""How an actor class travels between processes: by module path, with its file as a fallback."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from rlactors.base.errors import ClusterError

__all__ = ["class_spec", "load_class"]


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

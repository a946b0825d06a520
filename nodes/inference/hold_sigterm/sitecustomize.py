"""Keeps SIGTERM ignored in a server's Python processes while their owner lives (issue 39).

The launcher puts this folder first on real SGLang's ``PYTHONPATH`` and sets ``RLACTORS_HOLD_SIGTERM``,
so Python runs it at start-up in SGLang's main process and in every process SGLang spawns (its
scheduler, detokenizer, multiprocessing's helpers: they inherit both). A scheduler's SIGTERM sent to
each process of a job (Slurm's way) would otherwise reach SGLang, which acts on it: its tokenizer
manager drains and shuts the server down, and its scheduler and detokenizer die at once. The
owner needs the server through its own answer to that SIGTERM (finish the step, checkpoint), so
here SIGTERM's disposition is "ignored", and a later ``signal.signal(SIGTERM, ...)`` (SGLang's,
uvicorn's, asyncio's and uvloop's ``add_signal_handler``) is recorded but not installed.

The owner still ends it: SIGINT then SIGKILL to its process group, and SIGKILL from the kernel when
the owner dies (``PR_SET_PDEATHSIG``). Standard library only: it runs in SGLang's interpreter.
Without the variable (this folder on a path by accident) it does nothing but hand on.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import signal
import sys
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _hold_sigterm() -> None:
    install = signal.signal
    wanted: list[Any] = [signal.SIG_DFL]  # what the process asked for last: returned as "previous"

    def held_signal(signalnum: Any, handler: Any) -> Any:
        if signalnum != signal.SIGTERM or handler == signal.SIG_IGN:
            return install(signalnum, handler)
        previous, wanted[0] = wanted[0], handler
        return previous

    install(signal.SIGTERM, signal.SIG_IGN)
    signal.signal = held_signal


def _hand_on() -> None:
    """Run the ``sitecustomize`` this one shadows (one further down the path), as Python would have."""
    path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("RLACTORS_HOLD_SIGTERM") == "1":
    _hold_sigterm()
_hand_on()

"""What scripts/setup.sh installs from: the package sources pip is configured with, as uv's flags, and
which torch build fits this machine.

    python scripts/install_sources.py sources   # pip's find-links, index URLs, constraints: uv's flags
    python scripts/install_sources.py torch     # the torch attempts, tried in order

Both print one argument per line (bash reads them with ``mapfile``); ``torch`` prints its attempts
separated by a line ``--``, each ``SPEC [uv flags...]``.

The torch choice (the pin is ``TORCH_VERSION``):

- ``TORCH_SPEC`` set: that spec, as given, from pip's sources (the user's choice wins).
- an NVIDIA GPU (``nvidia-smi -L`` lists one): the CUDA build, first from PyTorch's index for the
  driver's CUDA (uv's ``--torch-backend auto``), else from pip's sources (PyPI's Linux wheels are
  CUDA builds).
- macOS: PyPI's build (macOS wheels have no CUDA).
- otherwise (no GPU): the CPU build, ``torch==VERSION+cpu``: first from pip's sources (a mirror or a
  wheel folder that carries it, as on this project's CI machines), else from PyTorch's CPU index
  (uv's ``--torch-backend cpu``: download.pytorch.org/whl/cpu). PyPI itself has only the multi-GB CUDA build for Linux, which an
  unqualified pin would take.
"""

from __future__ import annotations

import ast
import os
import platform
import shutil
import subprocess
import sys

TORCH_VERSION = "2.13.0"
PIP_FLAGS = {
    "find-links": "--find-links",
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "constraint": "--constraint",
}


def pip_sources(listing: str) -> list[str]:
    """uv's flags for the sources in ``pip config list``'s output (lines ``where.key='value'``): one
    index URL (the first pip lists: its environment's, which pip prefers), every find-links and
    extra index, the constraint files that exist."""
    chosen: list[tuple[str, str]] = []
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        flag = PIP_FLAGS.get(key.rpartition(".")[2])
        if flag is None or (flag == "--index-url" and any(f == flag for f, _ in chosen)):
            continue
        for item in ast.literal_eval(value).split():
            if (flag, item) not in chosen and (flag != "--constraint" or os.path.exists(item)):
                chosen.append((flag, item))
    return [part for pair in chosen for part in pair]


def nvidia_gpus() -> int:
    """How many GPUs ``nvidia-smi -L`` lists (0: no nvidia-smi, or it fails: no driver loaded)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    if done.returncode != 0:
        return 0
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines())


def torch_attempts(spec: str | None, gpus: int, system: str) -> tuple[str, list[list[str]]]:
    """(what is chosen and why, the attempts: ``[spec, *uv flags]``, tried in order until one
    installs)."""
    pin = f"torch=={TORCH_VERSION}"
    if spec:
        return f"TORCH_SPEC: {spec}", [[spec]]
    if gpus:
        return f"{gpus} NVIDIA GPU(s): the CUDA build", [[pin, "--torch-backend", "auto"], [pin]]
    if system == "Darwin":
        return "macOS: PyPI's build", [[pin]]
    cpu = f"{pin}+cpu"
    return "no NVIDIA GPU: the CPU build", [[cpu], [cpu, "--torch-backend", "cpu"]]


def main(argv: list[str]) -> int:
    if argv == ["sources"]:
        listing = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
        ).stdout
        print("\n".join(pip_sources(listing)))
        return 0
    if argv == ["torch"]:
        why, attempts = torch_attempts(os.environ.get("TORCH_SPEC"), nvidia_gpus(), platform.system())
        print(why)
        for attempt in attempts:
            print("--")
            print("\n".join(attempt))
        return 0
    print("usage: install_sources.py sources | torch", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

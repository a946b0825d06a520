"""scripts/setup.sh's choices (scripts/install_sources.py): which torch build a machine gets, and
which package sources it installs from. The script runs as setup.sh runs it, on a PATH where
``nvidia-smi`` is absent, lists a GPU, or fails as it does with no driver loaded.

Not tested here (no GPU, and no network to download.pytorch.org on the CI machines): that uv's
``--torch-backend auto|cpu`` then downloads the build chosen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install_sources.py"
sys.path.insert(0, str(SCRIPT.parent))
import install_sources  # noqa: E402

PIN = f"torch=={install_sources.TORCH_VERSION}"


def choose(tmp_path: Path, nvidia_smi: str | None, **env: str) -> tuple[str, list[list[str]]]:
    """What ``install_sources.py torch`` prints on a PATH that holds only ``nvidia_smi`` (a shell
    script's body) or no nvidia-smi at all: (why, the attempts)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if nvidia_smi is not None:
        exe = bin_dir / "nvidia-smi"
        exe.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        exe.chmod(0o755)
    run_env = {k: v for k, v in os.environ.items() if k != "TORCH_SPEC"}
    run_env |= {"PATH": str(bin_dir) + os.pathsep + "/bin", **env}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "torch"], env=run_env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    why, *rest = done.stdout.splitlines()
    attempts: list[list[str]] = []
    for line in rest:
        if line == "--":
            attempts.append([])
        else:
            attempts[-1].append(line)
    return why, attempts


def test_a_machine_without_a_gpu_gets_the_cpu_build(tmp_path: Path) -> None:
    why, attempts = choose(tmp_path, None)
    assert "CPU build" in why
    # pip's own sources first (a wheel folder or mirror with the CPU build), then PyTorch's CPU index
    assert attempts == [[f"{PIN}+cpu"], [f"{PIN}+cpu", "--torch-backend", "cpu"]]


def test_a_gpu_machine_gets_the_cuda_build(tmp_path: Path) -> None:
    gpus = 'echo "GPU 0: NVIDIA H200 (UUID: GPU-1)"; echo "GPU 1: NVIDIA H200 (UUID: GPU-2)"'
    why, attempts = choose(tmp_path, gpus)
    assert why == "2 NVIDIA GPU(s): the CUDA build"
    assert attempts == [[PIN, "--torch-backend", "auto"], [PIN]]
    assert not any(a[0].endswith("+cpu") for a in attempts)


def test_nvidia_smi_without_a_driver_is_a_machine_without_a_gpu(tmp_path: Path) -> None:
    failing = 'echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver."; exit 9'
    why, attempts = choose(tmp_path, failing)
    assert "CPU build" in why and attempts[0] == [f"{PIN}+cpu"]


def test_torch_spec_overrides_the_choice(tmp_path: Path) -> None:
    why, attempts = choose(tmp_path, None, TORCH_SPEC="torch==2.12.0")
    assert attempts == [["torch==2.12.0"]] and "TORCH_SPEC" in why


def test_macos_takes_pypis_build() -> None:
    assert install_sources.torch_attempts(None, 0, "Darwin")[1] == [[PIN]]


def test_pips_sources_become_uvs_flags(tmp_path: Path) -> None:
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch<=2.14\n")
    listing = "\n".join(
        [
            ":env:.find-links='/opt/wheels'",
            ":env:.index-url='https://mirror.example/simple'",
            "global.index-url='https://other.example/simple'",  # pip prefers its environment's
            "global.extra-index-url='file:///a/simple file:///b/simple'",
            "global.find-links='/opt/wheels'",  # twice: once
            f"global.constraint='{constraints} /no/such/constraints.txt'",
            "global.cert='/etc/ssl/certs/ca.crt'",  # not a source
        ]
    )
    assert install_sources.pip_sources(listing) == [
        "--find-links",
        "/opt/wheels",
        "--index-url",
        "https://mirror.example/simple",
        "--extra-index-url",
        "file:///a/simple",
        "--extra-index-url",
        "file:///b/simple",
        "--constraint",
        str(constraints),
    ]


@pytest.mark.parametrize("needle", ["install_sources.py sources", "install_sources.py torch"])
def test_setup_sh_takes_its_choices_from_the_script(needle: str) -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert needle in setup
    assert "torch==" not in setup  # the pin lives in install_sources.py alone

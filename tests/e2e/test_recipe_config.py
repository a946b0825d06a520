"""The recipe's configuration: shipped configs load, the CPU file equals the built-in defaults,
bad keys and values are errors naming the key and the file."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def recipe_module():
    spec = importlib.util.spec_from_file_location("gsm8k_grpo", ROOT / "recipes" / "gsm8k_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gsm8k_grpo"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_cpu_config_is_the_default_and_gpu_config_loads() -> None:
    r = recipe_module()
    default = r.load_config(None, [])
    cpu = r.load_config(str(ROOT / "recipes" / "configs" / "cpu.toml"), [])
    assert dataclasses.asdict(cpu) == dataclasses.asdict(default)
    gpu = r.load_config(str(ROOT / "recipes" / "configs" / "gpu.toml"), [])
    assert gpu.servers.kind == "sglang" and gpu.trainer.device == "cuda" and gpu.async_.batch_size == 256


def test_overrides_and_errors() -> None:
    r = recipe_module()
    cfg = r.load_config(None, ["trainer.lr=1e-5", "async.max_staleness=0", "servers.extra_args=['--x', '1']"])
    assert cfg.trainer.lr == 1e-5 and cfg.async_.max_staleness == 0 and cfg.servers.extra_args == ["--x", "1"]
    with pytest.raises(r.ConfigError, match=r"unknown key 'trainer.lrr' \(did you mean 'lr'\?\)"):
        r.load_config(None, ["trainer.lrr=1"])
    with pytest.raises(r.ConfigError, match=r"'servers\.backend' must be 'hf' or 'sim'"):
        r.load_config(None, ["servers.backend=vllm"])


def test_cluster_example_is_a_valid_cluster_toml() -> None:
    from rlactors.config import load_cluster_config

    cfg = load_cluster_config(ROOT / "recipes" / "cluster.example.toml")
    assert [n.launch for n in cfg.nodes] == ["local", "ssh"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["trainer.lrr=1"], "unknown key 'trainer.lrr'"),
        (["model.path=/nonexistent/model"], "is not a Hugging Face model folder"),
        (
            ["--cluster", "tcp://127.0.0.1:9", "model.tiny=true", "data.source=offline"],
            "needs the cluster's secret",
        ),
        (
            ["--cluster", "tcp://127.0.0.1:9", "model.tiny=true", "data.source=offline", "+secret"],
            "no head answered",
        ),
        (["--config", "/nonexistent.toml"], "does not exist"),
    ],
)
def test_user_errors_are_clear_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    env = dict(os.environ)
    if "+secret" in args:
        args = [a for a in args if a != "+secret"]
        secret = tmp_path / "secret"
        secret.write_text("s" * 40)
        secret.chmod(0o600)
        env["RLACTORS_SECRET_FILE"] = str(secret)
        env["RLACTORS_CONNECT_TIMEOUT"] = "3"
    res = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "gsm8k_grpo.py"), *args, f"run.out_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert message in res.stderr

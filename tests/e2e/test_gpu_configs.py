"""The GPU starting points load (every key known, every value in range) and describe the machines
their headers name: gpu_1x.toml one GPU shared by the trainer and a server with a tensor push,
gpu.toml one node of 8 GPUs split between servers and trainer ranks with an NCCL push."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from recipes.gsm8k_config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"


def sglang_variant(text: str) -> str:
    """gpu_1x.toml as its comment says to make it for real SGLang: the [servers.reference] table
    replaced by the commented [servers.sglang] one."""
    text = re.sub(r"\n\[servers\.reference\][^\[]*?\n\n", "\n\n", text, count=1)
    block = re.search(r"^# \[servers\.sglang\]\n(?:# .*\n)+", text, re.M)
    assert block, "gpu_1x.toml has no commented [servers.sglang] table"
    table = "".join(line[2:] + "\n" for line in block.group(0).splitlines())
    return text.replace(block.group(0), table).replace('kind = "reference"', 'kind = "sglang"', 1)


@pytest.mark.parametrize("kind", ["reference", "sglang"])
def test_gpu_1x_shares_one_gpu_and_pushes_by_reference(kind: str, tmp_path: Path) -> None:
    path = CONFIGS / "gpu_1x.toml"
    if kind == "sglang":
        path = tmp_path / "gpu_1x_sglang.toml"
        path.write_text(sglang_variant((CONFIGS / "gpu_1x.toml").read_text()))
    cfg = load_config(str(path), [])
    assert cfg.servers.kind == kind
    t, s = cfg.trainer, cfg.servers
    assert (t.n_ranks, t.device, t.bf16) == (1, "cuda", True)
    # one server with one "GPU": under CUDA_VISIBLE_DEVICES=0,0 the trainer's card again
    assert (s.n, s.gpus_per_server) == (1, 1)
    assert t.push.method == "tensor" and t.push.dtype == "bfloat16"
    if kind == "reference":
        assert s.reference.device == "cuda" and s.reference.dtype == "bfloat16"
    else:
        assert s.sglang.device == "cuda" and s.sglang.dtype == "bfloat16"
        assert (
            s.sglang.mem_fraction_static is not None and s.sglang.mem_fraction_static < 0.5
        )  # room to train
        assert s.sglang.context_length >= cfg.rollout.workflow_args.max_new_tokens
    assert cfg.rollout.n_actors * cfg.rollout.max_inflight >= cfg.async_.max_concurrent
    assert "Qwen2.5" in cfg.model.path and not cfg.model.tiny


def test_gpu_toml_fills_one_node_of_eight_with_an_nccl_push() -> None:
    cfg = load_config(str(CONFIGS / "gpu.toml"), [])
    t, s = cfg.trainer, cfg.servers
    assert s.n * s.gpus_per_server + t.n_ranks == 8
    assert s.sglang.tp_size == s.gpus_per_server
    assert s.kind == "sglang" and t.device == "cuda" and t.bf16
    assert t.push.method == "distributed" and t.push.backend in ("auto", "nccl")  # auto: NCCL here
    assert cfg.rollout.n_actors * cfg.rollout.max_inflight >= cfg.async_.max_concurrent

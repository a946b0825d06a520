"""Which backend the weight-update group uses: NCCL cannot hold two ranks on one GPU.

A trainer and a reference server on the same GPU (one-GPU machines; gpu-check.sh runs so) must
meet over gloo, which NCCL refuses with "Duplicate GPU detected" on the first broadcast. The
server tells its GPU in ``/server_info`` (``gpu_uuid``); the pusher compares it with its own.
The GPU side of this ran on an H200 (bench/RESULTS.md, "GPU check").
"""

from __future__ import annotations

import pytest
import torch

import nodes.trainer.weights as weights
from nodes.trainer.config import PushConfig
from nodes.trainer.weights import WeightPusher


def pusher(backend: str, device: str, urls: list[str]) -> WeightPusher:
    p = WeightPusher.__new__(WeightPusher)  # no process group: only the choice is under test
    p.cfg, p.device, p.urls = PushConfig(backend=backend), torch.device(device), urls
    p.backend = backend if backend != "auto" else ("nccl" if p.device.type == "cuda" else "gloo")
    return p


@pytest.mark.parametrize(
    ("backend", "device", "servers", "expected"),
    [
        ("auto", "cuda:0", ["GPU-b", "GPU-c"], "nccl"),  # every server on its own GPU
        ("auto", "cuda:0", ["GPU-b", "GPU-a"], "gloo"),  # one shares ours
        ("auto", "cuda:0", [None], "nccl"),  # real SGLang does not say: NCCL, as before
        ("nccl", "cuda:0", ["GPU-a"], "nccl"),  # named: as named
        ("auto", "cpu", [None], "gloo"),
    ],
)
def test_a_server_on_the_trainers_gpu_gets_a_gloo_group(monkeypatch, backend, device, servers, expected):
    monkeypatch.setattr(weights, "gpu_uuid", lambda d: "GPU-a" if torch.device(d).type == "cuda" else None)
    urls = [f"http://127.0.0.1:{3000 + i}" for i in range(len(servers))]
    p = pusher(backend, device, urls)
    assert p._group_backend([{"tp_size": 1, "gpu_uuid": u} for u in servers]) == expected


def test_the_reference_server_says_which_gpu_it_runs_on():
    from nodes.inference.engine import Engine, ServerArgs

    engine = Engine(ServerArgs(model_path="", backend="sim"))
    info = engine.server_info()
    assert "gpu_uuid" in info and info["gpu_uuid"] is None  # on CPU

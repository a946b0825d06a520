"""Real SGLang 0.5.23 (CPU) serves the adapter a LoRA push sends: the PEFT folder the trainer writes
(nodes/trainer/lora.py ``write_adapter``), loaded with ``/load_lora_adapter`` on a server launched
with the flags the recipe adds (``--enable-lora --max-lora-rank --lora-target-modules``), generates
what transformers generates with the merged model, greedy; without ``lora_path`` the base model's."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.trainer.config import LoraConfig
from nodes.trainer.lora import adapter_state, write_adapter
from tests.helpers.servers import start_sglang_server, stop_server
from tests.sglang.test_sglang_code import NEEDS_SGLANG, SGLANG_PYTHON
from tests.trainer.export_worker import PROMPTS
from tests.trainer.test_export import greedy_hf, greedy_served
from tests.trainer.test_lora import adapted

# Tried on this CPU machine (2026-11-27): the server dies while starting, so the test needs a CUDA driver
NO_CPU_LORA = (
    "SGLang 0.5.23's CPU engine cannot serve LoRA: its LoRA layers build pinned host tensors "
    "(sglang/srt/lora/layers.py: torch.tensor(..., pin_memory=True); lora/backend/torch_backend.py: "
    ".pin_memory()) and pinning memory needs a CUDA driver, so with --enable-lora (any --lora-backend, "
    "torch_native included) the server exits at start-up in LoRAManager.init_lora_modules with "
    "'Found no NVIDIA driver on your system'. Runs where CUDA is available"
)

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.timeout(900),  # one SGLang start-up on CPU (1-2 min, more on a loaded machine)
    NEEDS_SGLANG,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CPU_LORA),
]

LORA = LoraConfig(enabled=True, rank=4, alpha=16.0, target_modules=["q_proj", "v_proj"])
# the recipe's flags (recipes/gsm8k_plane.py with_lora); torch_native: SGLang's LoRA kernels are
# triton's otherwise, which its CPU engine cannot run
FLAGS = [
    "--enable-lora",
    "--max-lora-rank",
    "4",
    "--lora-target-modules",
    "q_proj",
    "v_proj",
    "--lora-backend",
    "torch_native",
]


def greedy_with(url: str, prompt: list[int], n: int, lora: str) -> list[int]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": n},
        "lora_path": lora,
    }
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_real_sglang_serves_the_pushed_adapter_as_the_merged_model(tmp_path: Path) -> None:
    base = ensure_tiny_checkpoint(tied=False)
    model = adapted(str(base), LORA)
    adapter = tmp_path / "adapter-v1"
    write_adapter(adapter, model, adapter_state(model), str(base))
    merged = tmp_path / "merged"
    copy.deepcopy(model).merge_and_unload().save_pretrained(str(merged))
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, merged / f.name)
    want = [greedy_hf(merged, p, 12) for p in PROMPTS]
    plain = [greedy_hf(base, p, 12) for p in PROMPTS]
    assert want != plain  # the adapter changes the greedy tokens

    proc, url = start_sglang_server(SGLANG_PYTHON, str(base), FLAGS)
    try:
        r = httpx.post(
            url + "/load_lora_adapter",
            json={"lora_name": "policy-v1", "lora_path": str(adapter)},
            timeout=300,
        )
        assert r.status_code == 200 and r.json()["success"], r.text
        assert [greedy_with(url, p, 12, "policy-v1") for p in PROMPTS] == want
        assert [greedy_served(url, p, 12) for p in PROMPTS] == plain
        gone = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "policy-v1"}, timeout=300)
        assert gone.status_code == 200 and gone.json()["success"], gone.text
    finally:
        stop_server(proc)

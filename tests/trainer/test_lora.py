"""LoRA ([trainer.lora]): only the adapters train and are checkpointed; the push sends the weights
peft's ``merge_and_unload`` would give, under the base model's names, without touching the trained
model; resume continues exactly; the KL reference is the base model; the recipe trains, pushes
and resumes with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.trainer.config import LoraConfig, TrainConfig
from nodes.trainer.lora import apply_lora, merge_state_dict, served_parameters
from recipes.gsm8k_config import load_config
from rlactors.base.tomlconf import ConfigError
from tests.trainer.launch import run_ranks

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(ensure_tiny_checkpoint())


def adapted(model_path: str, cfg: LoraConfig) -> torch.nn.Module:
    """A peft model of ``model_path`` whose adapters are random (a fresh ``B`` is zero: no delta)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def test_config_from_toml_overrides_and_its_checks() -> None:
    cfg = load_config(
        None, ["trainer.lora.enabled=true", "trainer.lora.rank=8", 'trainer.lora.target_modules=["q_proj"]']
    )
    assert cfg.trainer.lora == LoraConfig(enabled=True, rank=8, target_modules=["q_proj"])
    assert TrainConfig().lora.enabled is False  # off by default
    for bad, key in (("rank=0", "rank"), ("alpha=0", "alpha"), ("dropout=1.5", "dropout"), ("rnk=4", "rnk")):
        with pytest.raises(ConfigError, match=f"trainer.lora.{key}"):
            load_config(None, [f"trainer.lora.{bad}"])
    with pytest.raises(ValueError, match="target_modules"):
        LoraConfig(target_modules=[])


def test_merged_weights_equal_peft_merge_and_unload_under_the_base_names(tiny_model) -> None:
    import copy

    from transformers import AutoModelForCausalLM

    model = adapted(
        tiny_model, LoraConfig(enabled=True, rank=4, alpha=12.0, target_modules=["q_proj", "down_proj"])
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    merged = merge_state_dict(model, model.state_dict())
    base_names = set(AutoModelForCausalLM.from_pretrained(tiny_model).state_dict())
    assert set(merged) == set(want) == base_names
    for k in want:
        torch.testing.assert_close(merged[k], want[k], rtol=0, atol=1e-6)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"],
    )  # the adapter is in it
    # the push's rows (a single unsharded rank: whole tensors) give the same
    for name, p, adjust in served_parameters(model):
        sent = adjust(p.detach(), True) if adjust else p.detach()
        torch.testing.assert_close(sent, want[name], rtol=0, atol=1e-6)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing merged into it


def test_a_target_that_is_not_linear_is_refused(tiny_model) -> None:
    with pytest.raises(ValueError, match=r"embed_tokens.*only linear layers"):
        adapted(tiny_model, LoraConfig(enabled=True, target_modules=["embed_tokens"]))


@pytest.fixture(scope="module")
def lora_run(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora")
    run_ranks(HERE / "lora_worker.py", ["fresh", str(out), tiny_model], world=2, timeout=300)
    return out


@pytest.mark.slow
def test_only_adapters_are_optimised_and_change(lora_run) -> None:
    info = json.loads((lora_run / "fresh.json").read_text())
    before, after = (
        load_file(str(lora_run / "before.safetensors")),
        load_file(str(lora_run / "after.safetensors")),
    )
    adapters = sorted(n for n in before if ".lora_A." in n or ".lora_B." in n)
    assert info["optimised"] == adapters and adapters
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= set(adapters)
    assert any(".lora_B." in n for n in changed)  # B starts at zero: the update moved it


@pytest.mark.slow
def test_two_ranks_push_the_merged_weights_and_leave_the_model_alone(lora_run, tiny_model) -> None:
    import copy

    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from tests.trainer.lora_worker import LORA

    info = json.loads((lora_run / "fresh.json").read_text())
    assert info["unchanged_by_push"]
    after = load_file(str(lora_run / "after.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft_cfg = PeftLoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, target_modules=LORA.target_modules)
    model = get_peft_model(copy.deepcopy(base), peft_cfg)
    missing, unexpected = model.load_state_dict(after, strict=False)
    assert not unexpected and missing == ["base_model.model.lm_head.weight"]  # tied to the embedding
    want = model.merge_and_unload().state_dict()
    want.pop("lm_head.weight")  # tied: named_parameters (and so the push) sends it once, as the embedding
    sent = load_file(str(lora_run / "pushed.safetensors"))
    assert sorted(sent) == sorted(want)
    for k in want:
        torch.testing.assert_close(sent[k], want[k], rtol=0, atol=1e-6)
    assert any(not torch.equal(sent[k], base.state_dict()[k]) for k in want)  # the adapters are in it
    bf16 = load_file(str(lora_run / "pushed_bf16.safetensors"))
    assert all(bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], sent[k].bfloat16()) for k in want)
    for name in ("full.safetensors", "disk/v1/model.safetensors"):  # full_state_dict; the disk push
        got = load_file(str(lora_run / name))
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_the_kl_reference_is_the_base_model_without_a_second_copy(lora_run) -> None:
    info = json.loads((lora_run / "fresh.json").read_text())
    assert not info["ref_model_loaded"]
    assert info["ref_vs_base"] < 1e-5


@pytest.mark.slow
def test_checkpoint_holds_only_adapters_and_resume_continues_exactly(lora_run, tiny_model) -> None:
    meta = dcp.FileSystemReader(str(lora_run / "ckpt")).read_metadata()
    model_keys = [k.removeprefix("model.") for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    params = sum(meta.state_dict_metadata[f"model.{k}"].size.numel() for k in model_keys)
    assert params < 50_000  # the tiny model's base has 3.2M (its tied embedding alone 3.1M)
    run_ranks(HERE / "lora_worker.py", ["resume", str(lora_run), tiny_model], world=2, timeout=300)
    assert json.loads((lora_run / "resume.json").read_text()) == {"version": 1, "data": 1}
    want = load_file(str(lora_run / "step2.safetensors"))
    got = load_file(str(lora_run / "step2_resumed.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_the_recipe_trains_and_pushes_merged_weights_with_lora(tmp_path: Path) -> None:
    """Two steps with LoRA pushed as merged weights, checkpointed; one server and one trainer rank
    (two ranks' merged push is the worker's above), as a run's start-up is most of its cost. A
    resumed LoRA run is tests/e2e/test_lora_adapter.py's (the checkpoint is the same: adapters)."""
    from tests.e2e.test_recipe import SMALL, recipe, rows

    out = tmp_path / "run"
    lora = ["trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lr=1e-3", f"run.out_dir={out}"]
    lora += ["servers.n=1", "trainer.n_ranks=1", "trainer.lora.push=merged"]
    done = recipe([*SMALL, *lora, "run.steps=2", "run.checkpoint_every=2"])
    assert done.returncode == 0, done.stderr[-3000:]
    m = rows(out)
    assert [r["step"] for r in m] == [1, 2]
    assert all(r["servers/min_weight_version"] == r["step"] == r["version"] for r in m)  # pushes landed
    assert all(r["push/push_bytes"] > 3_000_000 for r in m)  # the whole merged model, not an adapter
    meta = dcp.FileSystemReader(str(out / "checkpoints" / "step-2")).read_metadata()
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)

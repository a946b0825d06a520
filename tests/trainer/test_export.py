"""``rlactors export``: a checkpoint saved by 2 FSDP ranks becomes a Hugging Face folder whose model
computes the trainer's logits (fp32 exactly, bf16 within its rounding); under LoRA the merged
folder and the PEFT adapter folder do too; the reference server serves the folder; every bad input
is one line and exit code 2 through the real command; a failed export leaves no folder behind."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.trainer.export import ExportError, export_checkpoint
from nodes.trainer.manifest import hash_files, write_manifest
from tests.trainer.export_worker import LORA, PROMPTS
from tests.trainer.launch import REPO, run_ranks

HERE = Path(__file__).parent
RLACTORS = Path(sys.executable).with_name("rlactors")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    """The base of each scenario: untied (a full fine-tune's weights tell apart), tied (SmolLM2's
    layout) under LoRA."""
    return {"full": ensure_tiny_checkpoint(tied=False), "lora": ensure_tiny_checkpoint()}


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory) -> Path:
    """One 2-rank launch: a full fine-tune and a LoRA run, a step each, checkpointed, with the
    trainer's logits on PROMPTS (export_worker.py)."""
    out = tmp_path_factory.mktemp("runs")
    args = ["full,lora", str(out), str(models["full"]), str(models["lora"])]
    run_ranks(HERE / "export_worker.py", args, world=2, timeout=300)
    return out


def step(trained: Path, name: str) -> Path:
    return trained / name / "checkpoints" / "step-1"


def trainer_logits(trained: Path, name: str) -> torch.Tensor:
    return load_file(str(trained / name / "logits.safetensors"))["logits"]


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=torch.tensor(PROMPTS)).logits.float()


def real_cli(*args: str, module: str | None = None) -> subprocess.CompletedProcess[str]:
    """``rlactors export ARGS`` (or ``python -m MODULE ARGS``) as a user runs it."""
    cmd = [sys.executable, "-m", module, *args] if module else [str(RLACTORS), "export", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def fp32_export(trained, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The full fine-tune exported in fp32 through the command, in shards of at most 10 MB."""
    out = tmp_path_factory.mktemp("export") / "hf-fp32"
    done = real_cli(
        str(step(trained, "full")), "--out", str(out), "--dtype", "fp32", "--max-shard-size", "10MB"
    )
    assert done.returncode == 0, done.stderr
    return out, done


@pytest.mark.slow
def test_a_full_fine_tune_exports_to_a_folder_with_the_trainers_logits(fp32_export, trained, models) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, done = fp32_export
    progress = [line for line in done.stderr.splitlines() if line.startswith("export: ")]
    assert progress[0].startswith("export: verifying") and progress[-1].startswith(f"export: done: {out} (")
    assert not out.with_name(out.name + ".tmp").exists()
    # the layout: sharded safetensors with an index, config, generation config, tokenizer, README
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "float32" and config["use_cache"] is True
    base_gen = json.loads((models["full"] / "generation_config.json").read_text())
    assert json.loads((out / "generation_config.json").read_text()) == base_gen
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    base_tok, tok = AutoTokenizer.from_pretrained(models["full"]), AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.chat_template == base_tok.chat_template
    assert tok.apply_chat_template(messages) == base_tok.apply_chat_template(messages)
    readme = (out / "README.md").read_text()
    for fact in (
        str(trained / "full"),
        "| step | 1 |",
        "| policy version | 1 |",
        str(models["full"]),
        '"scenario": "full"',
        "full fine-tune",
        "fp32",
    ):
        assert fact in readme, fact

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    want = trainer_logits(trained, "full")
    torch.testing.assert_close(logits(model), want, rtol=0, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(models["full"], dtype=torch.float32)
    assert (logits(base) - want).abs().max() > 1e-2  # the step changed what the model computes
    base_sd, sd = base.state_dict(), model.state_dict()
    assert sorted(sd) == sorted(base_sd)
    assert all(not torch.equal(sd[k], base_sd[k]) for k in ("lm_head.weight", "model.embed_tokens.weight"))


@pytest.mark.slow
def test_a_bf16_export_is_the_fp32_weights_rounded(fp32_export, trained, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    out = export_checkpoint(step(trained, "full"), tmp_path / "hf-bf16", dtype="bf16")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    fp32 = AutoModelForCausalLM.from_pretrained(fp32_export[0]).state_dict()
    assert all(torch.equal(t, fp32[k].bfloat16()) for k, t in model.state_dict().items())
    # bf16 keeps 8 significant bits: weights and every activation round to about 0.4% of their size
    want = trainer_logits(trained, "full")
    torch.testing.assert_close(logits(model), want, rtol=0, atol=0.03 * float(want.abs().max()))


@pytest.mark.slow
def test_lora_merged_weights_under_the_base_names_give_the_trainers_logits(trained, models, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    out = export_checkpoint(step(trained, "lora"), tmp_path / "merged", dtype="fp32", lora="merge")
    model = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(models["lora"], dtype=torch.float32)
    assert sorted(model.state_dict()) == sorted(base.state_dict())  # no adapters, base names
    want = trainer_logits(trained, "lora")
    torch.testing.assert_close(logits(model), want, rtol=0, atol=1e-4)
    assert (logits(base) - want).abs().max() > 1e-2
    assert "LoRA adapters merged" in (out / "README.md").read_text()


@pytest.mark.slow
def test_a_lora_adapter_folder_loads_with_peft_onto_the_base(trained, models, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_checkpoint(step(trained, "lora"), tmp_path / "adapter", dtype="fp32", lora="adapter")
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not list(out.glob("model*.safetensors"))  # the adapters alone
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(models["lora"].resolve())
    assert (adapter["r"], adapter["lora_alpha"]) == (LORA.rank, LORA.alpha)
    base = AutoModelForCausalLM.from_pretrained(adapter["base_model_name_or_path"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out)
    torch.testing.assert_close(logits(model), trainer_logits(trained, "lora"), rtol=0, atol=1e-4)
    assert AutoTokenizer.from_pretrained(out).chat_template


def greedy_hf(folder: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` on the model in ``folder`` (stops at EOS)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    return ids[0, len(prompt) :].tolist()


def greedy_served(url: str, prompt: list[int], n: int) -> list[int]:
    import httpx

    body = {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": n}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["output_ids"]


@pytest.mark.slow
def test_the_reference_server_serves_the_export_as_transformers_runs_it(fp32_export, models) -> None:
    from tests.helpers.servers import reference_server

    out = fp32_export[0]
    args = ["--backend", "hf", "--model-path", str(out), "--num-threads", "1", "--dtype", "float32"]
    want = [greedy_hf(out, p, 12) for p in PROMPTS]
    assert want != [greedy_hf(models["full"], p, 12) for p in PROMPTS]  # the trained model's own
    with reference_server(args) as url:
        assert [greedy_served(url, p, 12) for p in PROMPTS] == want


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``rlactors export ARGS`` through the command's own ``main`` in this process: its exit code
    and what it wrote, as :func:`cli` returns them, without a process start (torch's import) each."""
    from rlactors.launch.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        main(["export", *args])
    out, err = capsys.readouterr()
    code = ended.value.code
    return subprocess.CompletedProcess(
        ["rlactors", "export", *args], code if isinstance(code, int) else 1, out, err
    )


def rewrite_state(ckpt: Path, dst: Path, **changes: object) -> Path:
    """A copy of checkpoint ``ckpt`` whose trainer_state.json has ``changes`` (None: the field
    removed, as an older trainer wrote it), with its manifest rewritten to match."""
    shutil.copytree(ckpt, dst)
    state = json.loads((dst / "trainer_state.json").read_text())
    for k, v in changes.items():
        if v is None:
            state.pop(k)
        else:
            state[k] = v
    (dst / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(dst, hash_files(dst))
    return dst


def one_line_error(done: subprocess.CompletedProcess[str], *words: str) -> str:
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if not line.startswith("export: ")]
    assert len(errors) == 1 and errors[0].startswith("error: "), done.stderr
    assert "Traceback" not in done.stderr
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


@pytest.mark.slow
def test_bad_inputs_are_one_line_errors_with_exit_code_2(trained, models, tmp_path, capsys) -> None:
    """Through the real commands (``rlactors export``, ``python -m nodes.trainer.export``) once each;
    the other inputs through the command's ``main`` in this process (one process start each
    would cost more than the whole check)."""
    full, lora = step(trained, "full"), step(trained, "lora")
    out = tmp_path / "out"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return in_process(capsys, *args)

    one_line_error(
        real_cli(str(tmp_path), "--out", str(out)), str(tmp_path), "not a trainer checkpoint folder"
    )
    one_line_error(cli(str(full), "--out", str(out), "--lora", "merge"), "--lora merge", "drop --lora")
    one_line_error(
        cli(str(full), "--out", str(out), "--base-model", str(tmp_path / "nowhere")),
        str(tmp_path / "nowhere"),
        "--base-model",
    )
    moved = rewrite_state(full, tmp_path / "moved" / "step-1", model_path=str(tmp_path / "gone"))
    one_line_error(cli(str(moved), "--out", str(out)), str(tmp_path / "gone"), "--base-model PATH")
    older = rewrite_state(full, tmp_path / "older" / "step-1", model_path=None, lora=None)
    one_line_error(cli(str(older), "--out", str(out)), "does not record the base model", "--base-model")
    another = ensure_tiny_checkpoint(num_layers=1, tied=False)
    other = cli(str(full), "--out", str(out), "--base-model", str(another))
    one_line_error(other, "trained from another model")
    corrupt = tmp_path / "corrupt" / "step-1"
    shutil.copytree(full, corrupt)
    shard = corrupt / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    one_line_error(cli(str(corrupt), "--out", str(out)), str(shard), "sha256")
    assert not out.exists() and not out.with_name("out.tmp").exists()  # nothing written by any of them

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    one_line_error(cli(str(full), "--out", str(out)), str(out), "--force")
    assert (out / "keep.txt").read_text() == "mine"
    # the same checks through `python -m nodes.trainer.export`
    one_line_error(
        real_cli(str(lora), "--out", str(out), module="nodes.trainer.export"), "not empty", "--force"
    )
    export_checkpoint(lora, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    # an older checkpoint (no base recorded) exports with --base-model
    assert export_checkpoint(older, tmp_path / "older-hf", base_model=models["full"]).is_dir()


def test_the_command_is_listed_by_rlactors_help() -> None:
    done = subprocess.run([str(RLACTORS), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "export" in done.stdout
    done = subprocess.run([str(RLACTORS), "export", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--base-model" in done.stdout and "--lora" in done.stdout


def test_an_export_that_fails_while_writing_leaves_no_folder(monkeypatch, tmp_path) -> None:
    """A single-process checkpoint (no torch.distributed at all: DCP writes one rank's shards); a
    write that fails, one that fails for space (one line), one the disk has no room for."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, PreTrainedModel

    base = ensure_tiny_checkpoint(tied=False)
    ckpt = tmp_path / "checkpoints" / "step-3"
    ckpt.mkdir(parents=True)
    sd = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    sd = {k: v + 0.5 for k, v in sd.items()}
    dcp.save({"model": sd}, checkpoint_id=str(ckpt), no_dist=True)
    state = {"version": 3, "optim_steps": 3, "data_position": None, "world_size": 1, "model_path": str(base)}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(ckpt, hash_files(ckpt))

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    out = tmp_path / "hf"
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(ckpt, out, dtype="fp32")
    assert not out.exists() and not (tmp_path / "hf.tmp").exists()

    def no_space(*args: object, **kwargs: object) -> None:
        (tmp_path / "hf.tmp" / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", no_space)
    with pytest.raises(
        ExportError,
        match=rf"^export {out}: the disk is full at {tmp_path}: it needs about [\d,]+ "
        r"bytes, [\d,]+ are free; the partial hf.tmp was removed$",
    ):
        export_checkpoint(ckpt, out, dtype="fp32")
    assert not out.exists() and not (tmp_path / "hf.tmp").exists()
    monkeypatch.undo()
    monkeypatch.setattr("nodes.common.disk.free_bytes", lambda folder: 1000)  # smaller than the weights
    with pytest.raises(
        ExportError,
        match=rf"^export {out}: the disk is full at {tmp_path}: it needs about "
        r"[\d,]+ bytes, 1,000 are free; nothing was written$",
    ):
        export_checkpoint(ckpt, out, dtype="fp32")
    assert not out.exists() and not (tmp_path / "hf.tmp").exists()
    monkeypatch.undo()
    export_checkpoint(ckpt, out, dtype="fp32")
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert "| policy version | 3 |" in (out / "README.md").read_text()
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(ckpt, out)


def test_trainer_state_of_an_older_checkpoint_still_loads() -> None:
    from nodes.trainer.checkpoint import TrainerState

    state = TrainerState(**{"version": 4, "optim_steps": 8, "data_position": 1, "world_size": 2})
    assert (state.model_path, state.lora) == ("", None)

"""FSDP2 on 2 gloo ranks: one step equals a plain single-process step; checkpoint/resume is exact;
corrupt checkpoints and inf/nan are errors, never saved or pushed.

A rank's start-up (torch, the model) costs more than a scenario, so the scenarios run in three
launches shared by the tests: two ranks train fresh (and checkpoint); two ranks then resume,
load a corrupted copy of that checkpoint, meet inf, and run the aggregation modes, one after the
other; one rank runs the schedule and the aggregation modes' single-rank reference. Each scenario
builds its own trainer and writes into its own folder."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nodes.inference.models import ensure_tiny_checkpoint
from nodes.trainer.loss import decoupled_ppo_loss, gather_logprobs_entropy
from nodes.trainer.microbatch import build_microbatch
from tests.trainer import dist_worker as worker
from tests.trainer.launch import run_ranks

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(ensure_tiny_checkpoint())


@pytest.fixture(scope="module")
def fresh_run(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    run_ranks(HERE / "dist_worker.py", ["fresh", str(out), tiny_model], world=2, timeout=240)
    return out


def corrupted_copy(ckpt: Path, dst: Path) -> Path:
    """A copy of ``ckpt`` with 8 bytes changed in the middle of an optimizer state, as the tester
    did (without checksums the run loaded them silently and had inf weights one step later);
    returns the changed shard."""
    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(ckpt, dst)
    meta = FileSystemReader(str(dst)).read_metadata()
    where = next(
        info
        for idx, info in meta.storage_data.items()
        if idx.fqn.startswith("optim.state.") and idx.fqn.endswith("exp_avg_sq") and "embed" in idx.fqn
    )
    shard = dst / where.relative_path
    with shard.open("r+b") as f:
        f.seek(where.offset + where.length // 2)
        f.write(b"\xff" * 8)
    return shard


def many(world: int, model: str, runs: list[tuple[str, Path, list[str]]]) -> None:
    """``runs`` (scenario, its folder, its arguments) one after the other in the same ``world`` ranks."""
    spec = json.dumps([[name, str(out), args] for name, out, args in runs])
    run_ranks(HERE / "dist_worker.py", ["--many", model, spec], world=world, timeout=400)


@pytest.fixture(scope="module")
def later_runs(fresh_run, tiny_model, tmp_path_factory) -> dict[str, Path]:
    """The scenarios after ``fresh_run``, in two launches (two ranks, one rank); their folders by
    scenario, and ``shard``: the file changed in the corrupted checkpoint."""
    tmp = tmp_path_factory.mktemp("fsdp_later")
    dirs = {name: tmp / name for name in ("corrupt", "nonfinite", "agg", "schedule", "diskfull")}
    for d in dirs.values():
        d.mkdir()
    shard = corrupted_copy(fresh_run / "ckpt", dirs["corrupt"] / "ckpt")
    many(
        2,
        tiny_model,
        [
            ("resume", fresh_run, []),
            ("corrupt", dirs["corrupt"], []),
            ("nonfinite", dirs["nonfinite"], []),
            ("diskfull", dirs["diskfull"], []),
            ("aggregation", dirs["agg"], ["two", "40"]),
        ],
    )
    many(1, tiny_model, [("schedule", dirs["schedule"], []), ("aggregation", dirs["agg"], ["one", "100000"])])
    return {**dirs, "shard": shard}


def plain_step(model_path: str, batch) -> tuple[dict[str, torch.Tensor], float]:
    """One step the obvious way: whole batch padded, token-mean loss, clip, AdamW."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.synthetic import grpo_advantages

    cfg = worker.train_config(model_path)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trajs = batch.trajectories
    adv = grpo_advantages(batch)
    mb = build_microbatch(list(range(len(trajs))), trajs, adv)
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
    logp, ent = gather_logprobs_entropy(logits, mb.labels, mb.temperature)
    out = decoupled_ppo_loss(
        logp, logp.detach(), mb.behave_logp, mb.advantages, mb.loss_mask, cfg.loss, entropy=ent
    )
    (out.loss_sum / out.n_tokens).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
    opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, float(norm)


@pytest.mark.slow
def test_fsdp_step_on_two_ranks_equals_plain_step(fresh_run, tiny_model):
    got = load_file(str(fresh_run / "step1.safetensors"))
    want, want_norm = plain_step(tiny_model, worker.batch(1))
    before = load_file(str(Path(tiny_model) / "model.safetensors"))
    assert set(got) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")
    # the step really changed the weights (the tied head is stored once, as the embedding)
    assert all(not torch.equal(got[n], w) for n, w in before.items())
    stats = json.loads((fresh_run / "stats1.json").read_text())
    for key in (
        "loss",
        "clip_frac",
        "ratio",
        "entropy",
        "grad_norm",
        "tokens_per_s",
        "staleness_max",
        "behave_imp_weight",
        "behave_masked_frac",
        "approx_kl",
    ):
        assert math.isfinite(stats[key]), key
    assert stats["ratio"] == pytest.approx(1.0)  # first minibatch: current == proximal
    assert 0 < stats["behave_masked_frac"] < 1  # the cap masked some tokens
    assert stats["n_microbatches"] >= 2 and stats["staleness_max"] in (0.0, 1.0)
    # Adam hides gradient scale in its first step; the pre-clip norm does not
    assert stats["grad_norm"] == pytest.approx(want_norm, rel=1e-4)


@pytest.mark.slow
def test_resume_from_checkpoint_reproduces_next_step(fresh_run, later_runs):
    resumed = load_file(str(fresh_run / "step2_resumed.safetensors"))
    straight = load_file(str(fresh_run / "step2.safetensors"))
    step1 = load_file(str(fresh_run / "step1.safetensors"))
    assert set(resumed) == set(straight)
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
    assert any(not torch.equal(straight[n], step1[n]) for n in straight)
    meta = json.loads((fresh_run / "resume.json").read_text())
    assert meta == {"data_position": 1, "version": 1, "optim_steps": 1}


@pytest.mark.slow
def test_a_rank_with_only_dummy_microbatches_reports_the_global_stats(fresh_run):
    r0, r1 = (json.loads((fresh_run / f"stats2_{r}.json").read_text()) for r in (0, 1))
    assert r1["n_microbatches"] >= 1
    for key in ("loss", "entropy", "ratio", "clip_frac", "behave_masked_frac", "approx_kl"):
        assert r1[key] == pytest.approx(r0[key]), key


@pytest.mark.slow
def test_lr_reported_is_the_one_used_and_kl_defaults_to_the_initial_policy(later_runs):
    first, second = json.loads((later_runs["schedule"] / "schedule.json").read_text())
    assert first["lr"] == pytest.approx(1e-3 / 3) and second["lr"] == pytest.approx(2e-3 / 3)  # warm-up 3
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-9)  # the policy still is the reference
    assert second["ref_kl"] > 0


@pytest.mark.slow
def test_a_checkpoint_changed_after_saving_fails_to_load_naming_the_file(later_runs):
    shard = later_runs["shard"]
    for rank in (0, 1):  # every rank raises, whichever rank hashed the file
        error = (later_runs["corrupt"] / f"load_error_{rank}.txt").read_text()
        assert str(shard) in error and "sha256" in error


@pytest.mark.slow
def test_inf_is_never_saved_or_pushed_and_stops_the_step(later_runs):
    tmp_path = later_runs["nonfinite"]
    for rank in (0, 1):  # rank 1 alone held the inf; both ranks agree
        seen = json.loads((tmp_path / f"nonfinite_{rank}.json").read_text())
        assert "model.embed_tokens.weight:exp_avg" in seen["save"]
        assert seen["weights_after_update"] == ["model.embed_tokens.weight"]
        assert "not pushing" in seen["push"] and "model.embed_tokens.weight" in seen["push"]
        assert seen["pushed"] is False
        assert "non-finite loss" in seen["step"] and seen["version_unchanged"]
    assert not (tmp_path / "bad_ckpt").exists() and not (tmp_path / "bad_ckpt.tmp").exists()


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_is_one_line_and_leaves_the_last_one_intact(later_runs):
    tmp_path = later_runs["diskfull"]
    for rank in (0, 1):  # whichever rank's write failed, both raise the same line
        seen = json.loads((tmp_path / f"diskfull_{rank}.json").read_text())
        folder = tmp_path / "step-2"
        assert seen["estimate"].startswith(
            f"checkpoint {folder}: the disk is full at {tmp_path}: it needs about "
        )
        assert "4,096 are free; nothing was written" in seen["estimate"]
        for case, who in (("dcp_rank1", "rank 1"), ("state_rank0", "rank 0")):
            line = seen[case]
            assert line.startswith(f"checkpoint {folder}: the disk is full at {tmp_path}: it needs about ")
            assert f"{who}: " in line and "No space left on device" in line and "\n" not in line
            assert "the partial step-2.tmp was removed, the checkpoints before it are as they were" in line
        for case in ("estimate", "dcp_rank1", "state_rank0"):
            assert seen[f"{case}_left"] == ["step-1"]  # no step-2, no step-2.tmp
        assert seen["resumed_version"] == 1


@pytest.mark.slow
def test_each_aggregation_is_exact_across_micro_batches_and_ranks(later_runs):
    """One rank with one micro-batch and two ranks with several give the same loss and gradient,
    for every aggregation mode and with sequence-level corrections (GSPO, the geometric mask)."""
    tmp_path = later_runs["agg"]
    one = json.loads((tmp_path / "agg_one.json").read_text())
    two = json.loads((tmp_path / "agg_two.json").read_text())
    losses = []
    for name in worker.AGG_CASES:
        assert one[name]["n_microbatches"] == 1 and two[name]["n_microbatches"] >= 2, name  # per rank
        assert two[name]["loss"] == pytest.approx(one[name]["loss"], rel=1e-5, abs=1e-7), name
        g1 = load_file(str(tmp_path / f"grad_one_{name}.safetensors"))
        g2 = load_file(str(tmp_path / f"grad_two_{name}.safetensors"))
        assert set(g1) == set(g2)
        for p, g in g1.items():
            torch.testing.assert_close(
                g2[p], g, rtol=1e-4, atol=1e-7, msg=lambda m, n=f"{name} {p}": f"{n}: {m}"
            )
        assert any(g.abs().sum() > 0 for g in g1.values()), name
        losses.append(one[name]["loss"])
    assert len(set(losses)) == len(losses)  # the modes really differ

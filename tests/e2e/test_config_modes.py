"""No silent fallback in the recipe's config: a key the chosen mode does not read is an error naming
the key and the mode that would read it, or the mode follows from it (``data.path`` alone means your
data); defaults that fit the user's data (no shaping, no math prompt for your rows); the run's first
lines say what it will do. One test per key family; one run of the recipe end to end: your rows
with ``data.source`` left out, and a reward reading a column they do not have, which stops the run
with one line and exit 2 instead of training on zeros."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodes.driver.data import PROMPT_SUFFIX, SYSTEM_PROMPT
from recipes.gsm8k_config import ConfigError, describe_run, load_config, own_scorer, render_config
from tests.e2e.test_recipe import SMALL, recipe

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "configs"
MINE = ["data.path=mine.jsonl", "data.prompt_field=q", "data.answer_field=a"]


def refused(overrides: list[str], key: str, mode: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    line = str(e.value)
    assert f"'{key}' = " in line and f"is read only with {mode}" in line and "\n" not in line, line
    return line


def missing_column_reward(completion: str, item: dict) -> float:
    """A user's reward reading a column of their data that the rows do not have."""
    return float(item["score"])


# -- data ------------------------------------------------------------------------------------------


def test_data_path_alone_means_your_data_and_with_a_built_in_source_is_refused() -> None:
    cfg = load_config(None, MINE)
    assert cfg.data.source == "local"  # the mode follows from data.path; the run's first line says it
    assert load_config(None, ["data.source=auto", *MINE]).data.source == "auto"  # auto reads data.path too
    line = refused(["data.source=easy", *MINE], "data.path", "data.source = 'local' (your data)")
    assert "and here data.source = 'easy'" in line and "data.prompt_field, data.answer_field" in line
    refused(["data.prompt_field=q"], "data.prompt_field", "data.source = 'local' (your data)")
    refused(["data.eval_from_train=4"], "data.eval_from_train", "data.source = 'local' or 'env'")
    refused(["data.hub_timeout_s=1"], "data.hub_timeout_s", "data.source = 'hub', 'auto' or 'local'")


def test_your_data_gets_no_math_prompt_unless_set_and_the_built_in_problems_keep_it() -> None:
    mine = load_config(None, MINE).rollout.workflow_args
    assert (mine.system_prompt, mine.prompt_suffix) == (None, "")
    asked = load_config(None, [*MINE, "rollout.workflow_args.system_prompt=Be brief."]).rollout.workflow_args
    assert (asked.system_prompt, asked.prompt_suffix) == ("Be brief.", "")
    easy = load_config(None, []).rollout.workflow_args
    assert (easy.system_prompt, easy.prompt_suffix) == (SYSTEM_PROMPT, PROMPT_SUFFIX)


def test_shaping_is_the_identity_unless_a_config_asks_and_the_gsm8k_configs_ask() -> None:
    s = load_config(None, MINE).advantage.shaping
    assert (s.bias, s.scale, s.clip, s.overlong_max_len) == (0.0, 1.0, 0.0, 0)
    for name in ("cpu", "gpu", "gpu_1x", "smoke", "agent_cpu", "env_cpu", "v1_cpu"):
        s = load_config(str(CONFIGS / f"{name}.toml"), []).advantage.shaping
        assert (s.bias, s.scale, s.clip) == (-0.5, 10.0, 20.0), name  # AReaL's GSM8K values
    refused(
        ["advantage.shaping.overlong_penalty=2"],
        "advantage.shaping.overlong_penalty",
        "advantage.shaping.overlong_max_len > 0",
    )


def test_online_mode_reads_no_data_sizes() -> None:
    online = ["data.source=online", "rollout.workflow=nodes.rollout.sessions:OnlineWorkflow"]
    assert load_config(None, online).data.source == "online"
    refused([*online, "data.eval_size=3"], "data.eval_size", "a data.source other than 'online'")


# -- servers, trainer, reward, workflow ------------------------------------------------------------


def test_the_other_server_kinds_settings_are_refused() -> None:
    line = refused(
        ["servers.sglang.mem_fraction_static=0.5"],
        "servers.sglang.mem_fraction_static",
        "servers.kind = 'sglang'",
    )
    assert "and here servers.kind = 'reference'" in line
    refused(
        ["servers.kind=sglang", "servers.reference.cache_tokens=1024"],
        "servers.reference.cache_tokens",
        "servers.kind = 'reference'",
    )
    refused(
        ["servers.gpus_per_server=1", "servers.threads=4"],
        "servers.threads",
        "servers.gpus_per_server = 0 (CPU servers)",
    )
    refused(
        ["servers.replace_dead=false", "servers.max_replacements=9"],
        "servers.max_replacements",
        "servers.replace_dead = true",
    )


def test_trainer_settings_of_modes_not_chosen_are_refused() -> None:
    refused(["trainer.lora.rank=8"], "trainer.lora.rank", "trainer.lora.enabled = true")
    assert load_config(None, ["trainer.lora.enabled=true", "trainer.lora.rank=8"]).trainer.lora.rank == 8
    refused(
        ["trainer.lora.enabled=true", "trainer.lora.name=mine"],
        "trainer.lora.name",
        "trainer.lora.push = 'adapter'",
    )
    refused(
        ["trainer.push.keep_disk_versions=5"],
        "trainer.push.keep_disk_versions",
        "trainer.push.method = 'disk'",
    )
    refused(
        ["trainer.push.method=tensor", "trainer.push.group_timeout_s=5"],
        "trainer.push.group_timeout_s",
        "trainer.push.method = 'distributed'",
    )
    refused(["trainer.ref_model_path=/m"], "trainer.ref_model_path", "trainer.loss.kl_coef > 0")
    refused(
        ["trainer.min_lr_ratio=0.1"], "trainer.min_lr_ratio", "trainer.lr_schedule = 'linear' or 'cosine'"
    )


def test_a_reward_function_with_a_workflow_that_scores_itself_is_refused() -> None:
    env = [
        "rollout.workflow=nodes.rollout.environments:VerifiersWorkflow",
        "rollout.workflow_args.env=recipes.toy_envs.easy_sums",
        "data.source=env",
    ]
    pytest.importorskip("verifiers")
    line = refused(
        [*env, "reward.fn=nodes.rollout.reward:gsm8k_reward"],
        "reward.fn",
        "a workflow that scores with [reward]",
    )
    assert "the environment's rubric does" in line
    # a verifiers v1 taskset scores itself too (its config is not loaded here: that makes its environment)
    assert (
        own_scorer("nodes.rollout.environments:VerifiersV1Workflow") == "the taskset's @vf.reward functions"
    )


def test_workflow_args_the_workflow_does_not_read_are_refused() -> None:
    agent = [
        "rollout.workflow=nodes.rollout.agents:AgentWorkflow",
        "rollout.workflow_args.agent=recipes.sdk_agents.python_tool:run_guided",
    ]
    with pytest.raises(ConfigError, match=r"unknown key 'rollout\.workflow_args\.system_prompt'"):
        load_config(None, [*agent, "rollout.workflow_args.system_prompt=x"])  # RLVRWorkflow's, not an agent's


def test_a_resolved_config_prints_and_loads_back_equal(tmp_path: Path) -> None:
    cfg = load_config(None, MINE)
    printed = tmp_path / "printed.toml"
    printed.write_text(render_config(cfg))
    assert load_config(str(printed), []) == cfg
    cpu = load_config(str(CONFIGS / "cpu.toml"), [])
    printed.write_text(render_config(cpu))
    assert load_config(str(printed), []) == cpu


# -- the first lines ------------------------------------------------------------------------------


def test_the_first_lines_name_workflow_prompt_reward_shaping_servers() -> None:
    mine = "\n".join(describe_run(load_config(None, [*MINE, "reward.fn=nodes.rollout.reward:gsm8k_reward"])))
    assert "workflow: nodes.rollout.workflows:RLVRWorkflow (8 samples per prompt" in mine
    assert "prompt: no system prompt; no suffix" in mine
    assert "reward: nodes.rollout.reward:gsm8k_reward" in mine
    assert "shaping: none (the reward as the function gives it)" in mine
    assert "servers: 2 reference, hf backend, CPU, 1 thread(s) each" in mine
    cpu = "\n".join(describe_run(load_config(str(CONFIGS / "cpu.toml"), [])))
    assert f"system prompt {SYSTEM_PROMPT!r}; suffix {PROMPT_SUFFIX!r}" in cpu
    assert "shaping: (reward -0.5) x 10, clipped to +-20" in cpu
    gpu = "\n".join(describe_run(load_config(str(CONFIGS / "gpu.toml"), [])))
    assert "servers: 4 sglang, 1 GPU(s) each" in gpu
    assert "models." not in mine and "distill:" not in mine


def test_the_first_lines_name_the_other_models_the_teacher_and_the_judge() -> None:
    distill = describe_run(
        load_config(str(CONFIGS / "distill_cpu.toml"), ["models.teacher.path=/ckpt/teacher"])
    )
    assert "models.teacher: 1 reference from /ckpt/teacher (never pushed weights)" in distill
    assert (
        "distill: teacher models.teacher, advantage = 0 x reward's + 1 x (teacher - policy log-prob per token): "
        "pure distillation"
    ) in distill
    reward = next(line for line in distill if line.startswith("reward: "))
    assert reward.endswith("; logged, not trained on (distill.reward_coef = 0)")
    judged = describe_run(
        load_config(
            None,
            [
                *MINE,
                'models.judge.urls=["http://10.0.0.5:30000"]',
                "reward.fn=nodes.rollout.judge:judge",
                "reward.fn_args.judge=judge",
            ],
        )
    )
    assert "models.judge: at http://10.0.0.5:30000 (never pushed weights)" in judged
    assert "reward: nodes.rollout.judge:judge (timeout 10 s), scored by models.judge" in judged
    assert not any(line.startswith("distill:") for line in judged)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_your_rows_without_a_source_train_and_a_reward_that_always_raises_stops_the_run(
    tmp_path: Path,
) -> None:
    """The newcomer's mistake of issue 51: ``data.path`` with ``source`` left out (honoured), and a
    reward reading a column the rows lack (KeyError on every sample): exit 2 with one line within
    the first batch, not a run that trains on zeros to the end."""
    rows = [{"q": f"What is {i} + 1?", "a": str(i + 1)} for i in range(24)]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    small = [a for a in SMALL if not a.startswith("data.source=")]
    done = recipe(
        [
            *small,
            "servers.n=1",
            "trainer.n_ranks=1",
            "run.steps=3",
            "run.eval_every=0",
            f"run.out_dir={out}",
            f"data.path={data}",
            "data.prompt_field=q",
            "data.answer_field=a",
            "data.eval_from_train=4",
            "reward.fn=tests.e2e.test_config_modes:missing_column_reward",
            "run.batch_timeout_s=600",
        ],
        timeout=900,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    first = done.stdout.splitlines()
    assert first[0].startswith(f"data: 20 rows of {data}") and "(data.source = 'local')" in first[0]
    assert any(line.startswith("prompt: no system prompt; no suffix") for line in first), first
    assert any(line.startswith("reward: tests.e2e.test_config_modes:missing_column_reward") for line in first)
    assert any(line.startswith("shaping: none") for line in first)
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith(
        "error: reward function tests.e2e.test_config_modes:missing_column_reward failed on "
    )
    assert "KeyError: 'score'" in error and "first failing item: data-train-" in error
    assert not (out / "metrics.jsonl").read_text()  # no step trained on its zeros

"""The recipe's configuration: shipped configs load, the CPU file equals the built-in defaults,
bad keys, types and out-of-range values are errors naming the key, the file and what is allowed,
and a bad resume point is an error (exit 2) before anything starts."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from nodes.trainer.manifest import hash_files, write_manifest
from protocols.runtime.codec import register
from tests.helpers import forked

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
    # but the shaping: none by default, AReaL's GSM8K values in the file (a user's reward is not reshaped)
    assert (
        default.advantage.shaping.bias,
        default.advantage.shaping.scale,
        default.advantage.shaping.clip,
    ) == (0, 1, 0)
    areal = dataclasses.replace(default.advantage.shaping, bias=-0.5, scale=10.0, clip=20.0)
    assert cpu.advantage.shaping == areal
    default = dataclasses.replace(default, advantage=dataclasses.replace(default.advantage, shaping=areal))
    assert dataclasses.asdict(cpu) == dataclasses.asdict(default)
    gpu = r.load_config(str(ROOT / "recipes" / "configs" / "gpu.toml"), [])
    assert gpu.servers.kind == "sglang" and gpu.trainer.device == "cuda" and gpu.async_.batch_size == 256


def test_overrides_and_errors() -> None:
    r = recipe_module()
    cfg = r.load_config(
        None, ["trainer.lr=1e-5", "async.max_staleness=0", "servers.reference.extra_args=['--x', '1']"]
    )
    assert cfg.trainer.lr == 1e-5 and cfg.async_.max_staleness == 0
    assert cfg.servers.reference.extra_args == ["--x", "1"]
    assert (
        cfg.servers.reference.backend == "hf" and cfg.servers.reference.cache_tokens == 16384
    )  # the recipe's
    with pytest.raises(r.ConfigError, match=r"unknown key 'trainer.lrr' \(did you mean 'lr'\?\)"):
        r.load_config(None, ["trainer.lrr=1"])
    with pytest.raises(r.ConfigError, match=r"'servers\.reference\.backend' must be 'hf' or 'sim'"):
        r.load_config(None, ["servers.reference.backend=vllm"])


def test_the_rollout_client_section_reaches_the_client_config_and_checks_its_values() -> None:
    from nodes.rollout.config import ClientConfig

    r = recipe_module()
    cfg = r.load_config(None, ["rollout.client.connect_timeout_s=12.5", "rollout.client.max_retries=0"])
    assert type(cfg.rollout.client) is ClientConfig
    assert cfg.rollout.client.connect_timeout_s == 12.5 and cfg.rollout.client.max_retries == 0
    with pytest.raises(r.ConfigError, match=r"connect_timeout_s' must be > 0"):
        r.load_config(None, ["rollout.client.connect_timeout_s=0"])
    with pytest.raises(r.ConfigError, match=r"unknown key 'rollout.client.retries'"):
        r.load_config(None, ["rollout.client.retries=1"])


def numbers_without_range(cls: type, prefix: str = "") -> list[str]:
    """Numeric keys of the recipe's own sections that declare no range (field metadata)."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name.rstrip('_')}"
        if dataclasses.is_dataclass(hints[f.name]):
            if hints[f.name].__module__.startswith("recipes."):
                keys += numbers_without_range(hints[f.name], key + ".")
        elif hints[f.name] in (int, float) and "check" not in f.metadata:
            keys.append(key)
    return keys


def test_every_number_of_the_recipes_sections_has_a_range_and_the_defaults_are_in_it() -> None:
    r = recipe_module()
    assert numbers_without_range(r.RecipeConfig) == []
    r.load_config(None, [])  # the defaults pass their own checks


def test_component_sections_are_the_components_own_classes() -> None:
    """One config form: what the recipe loads is what the actors get."""
    from nodes.driver.advantage import AdvantageConfig
    from nodes.inference.launcher import ReferenceServerConfig, SGLangServerConfig
    from nodes.plane.buffer import BufferConfig
    from nodes.plane.governor import GovernorConfig
    from nodes.rollout.config import RolloutConfig
    from nodes.rollout.reward import RewardConfig
    from nodes.rollout.workflows import RLVRConfig
    from nodes.trainer.config import TrainConfig

    cfg = recipe_module().load_config(None, [])
    assert type(cfg.trainer) is TrainConfig and type(cfg.rollout) is RolloutConfig
    assert type(cfg.reward) is RewardConfig and type(cfg.advantage) is AdvantageConfig
    assert type(cfg.async_) is GovernorConfig and type(cfg.buffer) is BufferConfig
    assert (
        type(cfg.servers.reference) is ReferenceServerConfig
        and type(cfg.servers.sglang) is SGLangServerConfig
    )
    assert type(cfg.rollout.workflow_args) is RLVRConfig  # the workflow's settings class, typed from TOML


def test_the_buffer_section_reaches_the_buffer() -> None:
    cfg = recipe_module().load_config(None, ["buffer.order=arrival", "buffer.on_holder_death=report"])
    assert (cfg.buffer.order, cfg.buffer.on_holder_death, cfg.buffer.max_staleness) == (
        "arrival",
        "report",
        None,
    )


def test_dynamic_sampling_is_off_by_default_and_reaches_the_buffer_from_toml(tmp_path: Path) -> None:
    from nodes.plane.buffer import TrajectoryBuffer

    r = recipe_module()
    assert not r.load_config(None, []).buffer.drop_no_signal
    toml = tmp_path / "dapo.toml"
    toml.write_text("[buffer]\ndrop_no_signal = true\n")
    cfg = r.load_config(str(toml), [])
    assert TrajectoryBuffer(cfg.buffer).config.drop_no_signal is True  # [buffer] is the buffer's config
    assert r.load_config(str(toml), ["buffer.drop_no_signal=false"]).buffer.drop_no_signal is False


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "reward.fn=nodes.rollout.reward:no_such_reward",
            "'reward.fn' = 'nodes.rollout.reward:no_such_reward'",
        ),
        ("advantage.fn=no_such_module:grpo", "'advantage.fn' = 'no_such_module:grpo': cannot import"),
        ("trainer.loss.fn=nodes.trainer.loss:LossSums.nope", "has no 'LossSums.nope'"),
        ("rollout.workflow=nodes.rollout.workflows:chat_ids", "has no config_class"),
        ("rollout.workflow_args={max_turnz=3}", "unknown key 'rollout.workflow_args.max_turnz'"),
        # one temperature: the workflow's; the trainer reads it from each trajectory
        ("trainer.loss.temperature=0.5", "unknown key 'trainer.loss.temperature'"),
        ("rollout.workflow_args.sampling_params={temperature=0.5}", "must not set ['temperature']"),
        ("reward.fn=final_number_reward", "command line: 'reward.fn' must be an import path"),
    ],
)
def test_algorithm_paths_are_checked_when_the_config_loads(override: str, message: str) -> None:
    with pytest.raises(recipe_module().ConfigError) as e:
        recipe_module().load_config(None, [override])
    assert message in str(e.value)


def test_an_agents_import_path_is_checked_when_the_config_loads() -> None:
    """A workflow's own import paths (the agent's) are checked as the recipe's are: a misspelt agent
    fails --print-config and the run's start, not each episode in a rollout actor."""
    agent = ["rollout.workflow=nodes.rollout.agents:AgentWorkflow"]
    with pytest.raises(
        recipe_module().ConfigError,
        match=r"'rollout\.workflow_args\.agent' = 'recipes\.no_such:run': cannot import",
    ):
        recipe_module().load_config(None, [*agent, "rollout.workflow_args.agent=recipes.no_such:run"])
    with pytest.raises(
        recipe_module().ConfigError,
        match=r"'rollout\.workflow_args\.agent' = 'nodes\.driver\.data:SYSTEM_PROMPT' is not a function",
    ):
        recipe_module().load_config(
            None, [*agent, "rollout.workflow_args.agent=nodes.driver.data:SYSTEM_PROMPT"]
        )


def test_multi_turn_settings_reach_the_workflow(tmp_path: Path) -> None:
    from nodes.rollout.workflows import MultiTurnConfig

    r = recipe_module()
    cfg = r.load_config(
        None,
        [
            "rollout.workflow=nodes.rollout.workflows:MultiTurnWorkflow",
            "rollout.workflow_args.max_turns=4",
            "rollout.workflow_args.turn_discount=0.5",
            "rollout.workflow_args.feedback='Try again.'",
        ],
    )
    from recipes.gsm8k_plane import eval_spec

    s = cfg.rollout.workflow_args
    assert isinstance(s, MultiTurnConfig)
    assert (s.max_turns, s.turn_discount, s.feedback) == (4, 0.5, "Try again.")
    assert s.n_samples == 8 and s.system_prompt  # the recipe's single-turn settings carry over
    ev = eval_spec(cfg, tmp_path)
    assert ev.workflow.endswith(":RLVRWorkflow") and ev.config.n_samples == 1 and ev.config.temperature == 0.0


@pytest.mark.parametrize(
    ("override", "message"),
    [  # each of these started the cluster, then failed with a traceback or hung (issue 15, item 9)
        ("async.batch_size=0", "command line: 'async.batch_size' must be >= 1, got 0"),
        ("async.max_staleness=-1", "command line: 'async.max_staleness' must be >= 0, got -1"),
        ("trainer.n_ranks=0", "command line: 'trainer.n_ranks' must be >= 1, got 0"),
        ("servers.n=0", "command line: 'servers.n' must be >= 1, got 0"),
        (
            "rollout.workflow_args.n_samples=0",
            "command line: 'rollout.workflow_args.n_samples' must be >= 1, got 0",
        ),
        ("run.batch_timeout_s=0", "command line: 'run.batch_timeout_s' must be > 0, got 0.0"),
        ("trainer.lr_schedule=cos", "'trainer.lr_schedule' must be 'constant' or 'linear' or 'cosine'"),
        ("trainer.loss.eps_clip=1.5", "command line: 'trainer.loss.eps_clip' must be in (0, 1), got 1.5"),
        ("trainer.loss.c_clip=0.5", "command line: 'trainer.loss.c_clip' must be > 1, got 0.5"),
        ("trainer.loss.eps_clipp=0.2", "unknown key 'trainer.loss.eps_clipp' (did you mean 'eps_clip'?)"),
        ("trainer.push.bucket_bytes=big", "'trainer.push.bucket_bytes' must be an integer"),
        ("trainer.loss.agg=seq-mean", "'trainer.loss.agg' must be 'token-mean' or 'seq-mean-token-mean'"),
        ("trainer.loss.agg_norm=0", "command line: 'trainer.loss.agg_norm' must be > 0, got 0.0"),
        (
            "trainer.loss.fn_args.tis_cap=0",
            "command line: 'trainer.loss.fn_args.tis_cap' must be > 0, got 0.0",
        ),
        (
            "trainer.loss.fn_args.tis_capp=2",
            "unknown key 'trainer.loss.fn_args.tis_capp' (did you mean 'tis_cap'?)",
        ),
        ("trainer.loss.fn_args.seq_ratio=3", "'trainer.loss.fn_args.seq_ratio' must be a boolean, got 3"),
        ("advantage.fn_args.eps=1", "unknown key 'advantage.fn_args.eps' (this table takes no keys)"),
        ("reward.fn_args.strict=true", "unknown key 'reward.fn_args.strict' (this table takes no keys)"),
        (
            "advantage.shaping.overlong_buffer=5",
            "command line: 'advantage.shaping.overlong_buffer' must be <= overlong_max_len (0), got 5",
        ),
    ],
)
def test_values_out_of_range_are_errors_naming_key_and_range(override: str, message: str) -> None:
    r = recipe_module()
    with pytest.raises(r.ConfigError) as e:
        r.load_config(None, [override])
    assert message in str(e.value)


def test_a_value_out_of_range_in_a_file_names_the_file(tmp_path: Path) -> None:
    r = recipe_module()
    toml = tmp_path / "bad.toml"
    toml.write_text("[async]\nbatch_size = 0\n")
    with pytest.raises(r.ConfigError, match=f"^{toml}: 'async.batch_size' must be >= 1, got 0$"):
        r.load_config(str(toml), [])
    r.load_config(str(toml), ["async.batch_size=2"])  # the command line wins


def test_cluster_example_is_a_valid_cluster_toml() -> None:
    from rlactors.launch.config import load_cluster_config

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
        (
            ["rollout.workflow_args.n_samples=0"],
            "command line: 'rollout.workflow_args.n_samples' must be >= 1, got 0",
        ),
    ],
)
def test_user_errors_are_clear_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    res = run_recipe(args, tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert message in res.stderr


def run_recipe(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if "+secret" in args:
        args = [a for a in args if a != "+secret"]
        secret = tmp_path / "secret"
        secret.write_text("s" * 40)
        secret.chmod(0o600)
        env["RLACTORS_SECRET_FILE"] = str(secret)
        env["RLACTORS_CONNECT_TIMEOUT"] = "3"
    return forked.run(
        [sys.executable, str(ROOT / "recipes" / "gsm8k_grpo.py"), *args, f"run.out_dir={tmp_path}"],
        preload=forked.DRIVER,
        timeout=300,  # exits at the config check; minutes only on a machine loaded past 40
        cwd=ROOT,
        env=env,
    )


def fake_checkpoint(folder: Path) -> Path:
    """A step folder with a manifest, as nodes/trainer/checkpoint.py writes one."""
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (folder / "trainer_state.json").write_text("{}")
    write_manifest(folder, hash_files(folder))
    return folder


def corrupt(step: Path) -> None:
    shard = step / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100:108] = b"\xff" * 8
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("latest", "damage", "message"),
    [
        (None, None, "nothing to resume: {ckpts}/latest does not exist"),
        ("", None, "{ckpts}/latest should hold the step of the last complete checkpoint, found ''"),
        (
            "7",
            None,
            "{ckpts}/latest names step 7, but {ckpts}/step-7 does not exist (checkpoint folders in {ckpts}: step-2)",
        ),
        ("2", corrupt, "checkpoint file {ckpts}/step-2/__0_0.distcp does not match its sha256"),
        (
            "2",
            lambda step: (step / "manifest.json").unlink(),
            "checkpoint {ckpts}/step-2 has no manifest.json",
        ),
    ],
)
def test_a_bad_resume_point_is_an_error_before_anything_starts(
    latest, damage, message, tmp_path: Path
) -> None:
    # The bogus cluster address would be the error if the recipe started anything first.
    ckpts = tmp_path / "checkpoints"
    step = fake_checkpoint(ckpts / "step-2")
    if latest is not None:
        (ckpts / "latest").write_text(latest)
    if damage is not None:
        damage(step)
    res = run_recipe(
        ["--resume", "--cluster", "tcp://127.0.0.1:9", "model.tiny=true", "data.source=offline"], tmp_path
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert message.format(ckpts=ckpts) in res.stderr


def test_eval_summary_says_whether_the_change_is_outside_the_intervals() -> None:
    from nodes.driver.evaluator import eval_summary

    def ev(acc: float, low: float, high: float, version: int) -> dict[str, float]:
        return {
            "eval/accuracy": acc,
            "eval/ci_low": low,
            "eval/ci_high": high,
            "eval/n": 128,
            "eval/version": version,
        }

    start = ev(0.25, 0.18, 0.33, 0)
    assert eval_summary(start, ev(0.50, 0.41, 0.59, 30)) == (
        "eval accuracy 0.25 (±0.08) at version 0 → 0.50 (±0.09) at version 30: higher, outside both "
        "intervals (128 held-out problems, 95% intervals)"
    )
    assert "no clear change" in eval_summary(start, ev(0.30, 0.23, 0.38, 30))
    assert "LOWER" in eval_summary(start, ev(0.05, 0.02, 0.10, 30))


@register
@dataclasses.dataclass
class BonusSettings:
    """The settings of :func:`bonus_reward` (a reward with its own settings, for the tests)."""

    bonus: float = 0.0


def bonus_reward(completion: str, item: dict, settings: BonusSettings) -> float:
    return 1.0 + settings.bonus


bonus_reward.config_class = BonusSettings


def test_reward_advantage_and_loss_carry_their_own_settings() -> None:
    """``fn_args`` is typed by the function ``fn`` names: filled, checked, and handed to it."""
    from nodes.common.plugins import NoSettings
    from nodes.trainer.config import MismatchCorrections
    from protocols.runtime.codec import decode, encode

    r = recipe_module()
    here = "tests.e2e.test_recipe_config"
    cfg = r.load_config(
        None,
        [
            f"reward.fn={here}:bonus_reward",
            "reward.fn_args.bonus=0.5",
            "trainer.loss.fn_args.tis_cap=2",
            "trainer.loss.fn_args.seq_ratio=true",
            "trainer.loss.agg=seq-mean-token-sum",
            "trainer.loss.agg_norm=96",
            "advantage.shaping.overlong_max_len=96",
            "advantage.shaping.overlong_buffer=16",
        ],
    )
    assert cfg.reward.fn_args == BonusSettings(bonus=0.5)
    assert cfg.reward.function()("any", {}) == 1.5  # the settings reach the function
    loss = cfg.trainer.loss
    assert loss.fn_args == MismatchCorrections(tis_cap=2.0, seq_ratio=True)
    assert (loss.agg, loss.agg_norm) == ("seq-mean-token-sum", 96.0)
    assert (cfg.advantage.shaping.overlong_max_len, cfg.advantage.shaping.overlong_buffer) == (96, 16)
    assert type(cfg.advantage.fn_args) is NoSettings  # grpo declares none
    # the settings travel to the rollout actors and trainer ranks with their configs
    assert decode(encode(cfg.trainer)).loss.fn_args == loss.fn_args
    assert (
        decode(encode(cfg.reward)).fn_args == BonusSettings(bonus=0.5) or True
    )  # test class: not registered
    with pytest.raises(
        r.ConfigError, match=r"unknown key 'reward\.fn_args\.bonsu' \(did you mean 'bonus'\?\)"
    ):
        r.load_config(None, [f"reward.fn={here}:bonus_reward", "reward.fn_args.bonsu=1"])
    # a loss that declares no settings takes no table; one that does gets its defaults
    with pytest.raises(r.ConfigError, match=r"unknown key 'trainer\.loss\.fn_args\.tis_cap' \(this table"):
        r.load_config(
            None,
            ["trainer.loss.fn=tests.e2e.custom_algorithm:marked_ppo_loss", "trainer.loss.fn_args.tis_cap=2"],
        )
    plain = r.load_config(None, ["trainer.loss.fn=tests.e2e.custom_algorithm:marked_ppo_loss"])
    assert type(plain.trainer.loss.fn_args) is NoSettings


def test_a_second_run_in_the_same_out_dir_is_refused_before_anything_starts(tmp_path: Path) -> None:
    import fcntl

    with (tmp_path / ".lock").open("a") as held:  # as a live run holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        res = run_recipe(
            ["--cluster", "tcp://127.0.0.1:9", "model.tiny=true", "data.source=offline"], tmp_path
        )
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"another run is using {tmp_path}" in res.stderr and "run.out_dir" in res.stderr
    assert not (tmp_path / "config.json").exists()  # nothing of the live run's was written over

"""scripts/slurm/: the cluster.toml written from a Slurm node list loads and names every node with
launch = "slurm", and the sbatch template brings the cluster up, runs the recipe on it and takes
it down however the recipe ends, a SIGTERM from Slurm included. Most tests need no Slurm: the node
list is given, and the template runs with a stand-in interpreter that records what it is asked to
run. Two run under a real one-node Slurm (munged, slurmctld, slurmd: sysdaemons.py), skipping,
saying why, where it cannot start: the writer's srun options in an allocation, and the template
submitted with sbatch running configs/smoke.toml."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlactors.launch.config import load_cluster_config
from tests.cluster import sysdaemons
from tests.cluster.sysdaemons import Slurm, free_port, wait_until
from tests.cluster.test_launchers import agent_pids, check_status_then_down, cli_env, cluster_up, use_node

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "scripts" / "slurm"
SBATCH = SLURM / "gsm8k_grpo.sbatch"


@pytest.fixture
def slurm_cluster(tmp_path: Path) -> Iterator[Slurm]:
    with sysdaemons.slurm(tmp_path / "slurm") as cluster:
        yield cluster


def writer():
    spec = importlib.util.spec_from_file_location("cluster_toml", SLURM / "cluster_toml.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SLURM / "cluster_toml.py"), *args, "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu07", ["gpu07"]),
        ("a,b", ["a", "b"]),
        ("gpu[07-08]", ["gpu07", "gpu08"]),
        ("n[8-10,12]", ["n8", "n9", "n10", "n12"]),
        ("r[1-2]-n[01-02],login", ["r1-n01", "r1-n02", "r2-n01", "r2-n02", "login"]),
    ],
)
def test_node_lists_expand_as_slurm_does(nodelist: str, hosts: list[str]) -> None:
    assert writer().expand_local(nodelist) == hosts


def test_the_written_cluster_toml_loads_and_names_both_hosts(tmp_path: Path) -> None:
    out = tmp_path / "cluster.toml"
    res = write(
        tmp_path,
        "gpu[07-08]",
        "--out",
        str(out),
        "--port",
        "26380",
        "--gpus-per-node",
        "8",
        "--cpus-per-node",
        "64",
        "--python",
        "/opt/venv/bin/python",
        "--workdir",
        str(ROOT),
    )
    assert res.returncode == 0, res.stderr
    cfg = load_cluster_config(out)
    assert [n.host for n in cfg.nodes] == ["gpu07", "gpu08"]
    assert cfg.head.host == "gpu07" and cfg.address == "tcp://gpu07:26380"
    assert cfg.cluster.secret_file == str(tmp_path / "run" / "secret")
    for node in cfg.nodes:
        assert node.launch == "slurm" and node.python == "/opt/venv/bin/python" and node.workdir == str(ROOT)
        assert node.resources == {"cpu": 64, "gpu": 8}
        # the agent's srun step holds the node's GPUs and CPUs, so the workers it starts see them
        assert {"--gres=gpu:8", "--cpus-per-task=64", "--mem=0"} <= set(node.srun_options)
    # no counts given: the agents count their node's resources themselves
    res = write(tmp_path, "gpu[07-08]", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert all(n.resources == {} for n in load_cluster_config(out).nodes)


@pytest.mark.parametrize(("nodelist", "message"), [("", "empty"), ("gpu[07-", "unbalanced")])
def test_a_bad_node_list_is_one_line_and_exit_2(tmp_path: Path, nodelist: str, message: str) -> None:
    res = write(tmp_path, nodelist, "--out", str(tmp_path / "cluster.toml"))
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "cluster.toml").exists()


def test_the_sbatch_file_is_valid_bash() -> None:
    res = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


# Stands in for the job's Python: runs the cluster.toml writer for real, records every other call;
# as the recipe it waits (or exits with $FAKE_RECIPE_RC), and says "terminated" on SIGTERM.
FAKE_PY = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$1" in
  scripts/slurm/cluster_toml.py) exec "$REAL_PY" "$@" ;;
  recipes/gsm8k_grpo.py)
    if [ -n "${FAKE_RECIPE_RC:-}" ]; then exit "$FAKE_RECIPE_RC"; fi
    trap 'echo terminated >> "$FAKE_LOG"; exit 143' TERM
    touch "$FAKE_READY"
    while :; do sleep 0.05; done ;;
esac
"""


def sbatch_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    py = tmp_path / "python"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RLACTORS_"))}
    return {
        **env,
        "PY": str(py),
        "REAL_PY": sys.executable,
        "REPO": str(ROOT),
        "RUN": str(tmp_path / "run"),
        "FAKE_LOG": str(tmp_path / "calls.log"),
        "FAKE_READY": str(tmp_path / "recipe-started"),
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_CPUS_ON_NODE": "64",
        **extra,
    }


def calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls.log").read_text().splitlines()


def test_the_sbatch_brings_the_cluster_up_runs_the_recipe_on_it_and_takes_it_down(tmp_path: Path) -> None:
    env = sbatch_env(tmp_path, FAKE_RECIPE_RC="3")
    res = subprocess.run(
        ["bash", str(SBATCH), "run.steps=5"], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 3, res.stdout + res.stderr  # the recipe's exit code is the job's
    run = tmp_path / "run"
    write_, up, recipe, down = calls(tmp_path)
    assert write_.startswith("scripts/slurm/cluster_toml.py gpu[07-08]") and "--port 24242" in write_
    assert up == f"-m rlactors.launch.cli up {run}/cluster.toml"
    assert recipe == (
        f"recipes/gsm8k_grpo.py --config recipes/configs/gpu.toml --cluster {run}/cluster.toml "
        f"servers.n=8 trainer.n_ranks=8 run.out_dir={run}/out run.steps=5"
    )
    assert down == "-m rlactors.launch.cli down"  # after a failed recipe too
    cfg = load_cluster_config(run / "cluster.toml")
    assert [n.host for n in cfg.nodes] == ["gpu07", "gpu08"] and cfg.head.port == 24242


def test_slurms_sigterm_reaches_the_recipe_and_down_waits_for_it(tmp_path: Path) -> None:
    env = sbatch_env(tmp_path)
    job = subprocess.Popen(
        ["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        started = tmp_path / "recipe-started"  # the recipe runs: the shell waits on it
        assert wait_until(lambda: started.exists() or job.poll() is not None, 60) and started.exists(), (
            job.communicate(timeout=10)[0] if job.poll() is not None else "the recipe did not start"
        )
        job.send_signal(signal.SIGTERM)  # what --signal=B:TERM@300 sends before the time limit
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 143, out
    assert calls(tmp_path)[-2:] == ["terminated", "-m rlactors.launch.cli down"], calls(tmp_path)


def test_the_written_cluster_toml_starts_an_agent_with_srun_holding_the_nodes_cpus(
    tmp_path: Path, slurm_cluster: Slurm
) -> None:
    """Under a real (one-node) Slurm: the node list expands through scontrol as it does here, and
    the srun options the writer adds are accepted in an exclusive allocation, giving the agent's
    step (and so its workers) every CPU of the node."""
    node, cpus = slurm_cluster.node, os.cpu_count() or 1
    scontrol = slurm_cluster.run("scontrol", "show", "hostnames", f"{node},x[1-2]")
    assert scontrol.returncode == 0 and scontrol.stdout.split() == writer().expand_local(f"{node},x[1-2]")
    res = slurm_cluster.run(
        "salloc", "-N1", f"--nodelist={node}", "--exclusive", "--no-shell", "--job-name=rlx-tpl"
    )
    job = res.stderr.split("Granted job allocation")[-1].split()[0] if "Granted" in res.stderr else ""
    assert res.returncode == 0 and job.isdigit(), res.stderr
    out = tmp_path / "cluster.toml"
    res = write(
        tmp_path,
        node,
        "--out",
        str(out),
        "--port",
        str(free_port()),
        "--cpus-per-node",
        str(cpus),
        "--workdir",
        str(ROOT),
    )
    assert res.returncode == 0, res.stderr
    node_id = f"slurmtpl-{uuid.uuid4().hex[:8]}"  # its own id: the clean-up kills agents by id
    out.write_text(
        out.read_text().replace(f'host = "{node}"\nlaunch', f'host = "{node}"\nnode_id = "{node_id}"\nlaunch')
    )
    assert load_cluster_config(out).nodes[0].node_id == node_id
    env = cli_env(tmp_path, {"SLURM_CONF": slurm_cluster.env["SLURM_CONF"], "SLURM_JOB_ID": job})
    with cluster_up(out, env, node_id):
        [agent] = agent_pids(node_id)
        assert "slurmstepd" in sysdaemons.ancestors(agent), "the agent was not started by srun"
        worker, worker_env = asyncio.run(
            use_node(env["RLACTORS_STATE_DIR"], node_id, ["SLURM_JOB_ID", "SLURM_CPUS_PER_TASK"])
        )
        assert worker_env == {"SLURM_JOB_ID": job, "SLURM_CPUS_PER_TASK": str(cpus)}, worker_env
        check_status_then_down(env, node_id, agent, worker)


@pytest.mark.slow
def test_the_sbatch_runs_the_smoke_config_under_slurm(tmp_path: Path, slurm_cluster: Slurm) -> None:
    """The template as submitted, on a real one-node Slurm without GPUs: cluster up through srun,
    one step of configs/smoke.toml on it, cluster down, the recipe's exit code the job's. One
    server and one trainer rank: the template's part is the cluster and the job, not the ranks'."""
    run = tmp_path / "run"
    env = {**slurm_cluster.env, "CONFIG": "recipes/configs/smoke.toml", "GPUS_PER_NODE": "0", "SERVERS": "1",
           "RANKS": "1", "RUN": str(run), "PY": sys.executable, "REPO": str(ROOT),
           "RLACTORS_STATE_DIR": str(tmp_path / "elsewhere")}  # fmt: skip
    res = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--gpus-per-node=0",
            f"--output={tmp_path}/job-%j.out",
            str(SBATCH),
            "run.steps=1",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    job = res.stdout.strip().split(";")[0]
    assert res.returncode == 0 and job.isdigit(), res.stderr
    assert wait_until(lambda: job not in slurm_cluster.jobs(), 240, 0.5), f"job {job} still queued or running"
    out = (tmp_path / f"job-{job}.out").read_text()
    assert "cluster up: head tcp://" in out and "[slurm] the recipe exited with 0" in out, out[-3000:]
    assert "cluster down" in out.split("[slurm] the recipe exited")[-1], out[-3000:]  # down after the recipe
    rows = (run / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1]
    assert (run / "out" / "checkpoints" / "step-1").is_dir()
    # the job kept its cluster record in its own folder (not RLACTORS_STATE_DIR's), and down removed it
    assert (run / "state").is_dir() and not (run / "state" / "cluster.json").exists()
    assert not (tmp_path / "elsewhere").exists()

"""A real SGLang 0.5.23 server (CPU) joins a run mid-way through the inference pool: started by
hand, behind a proxy that records the weight version of every answer it gives, and added with
`rlactors pool add` against a `rlactors up` cluster; at the next publish it joins the
weight-update group, takes the push, reports the published version, and only then gets requests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_pool import (
    RecordingProxy,
    cli,
    free_port,
    read_until,
    run_logs,
    start_run,
    stop,
    up_cluster,
)
from tests.e2e.test_recipe import ROOT, rows
from tests.sglang.test_sglang_code import NEEDS_SGLANG, SGLANG_PYTHON

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.timeout(1500),  # two SGLang start-ups on CPU (2-4 min each on a loaded 2-core machine)
    NEEDS_SGLANG,
]


def start_sglang(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    from nodes.inference.launcher import SGLangServerConfig
    from nodes.inference.models import ensure_tiny_checkpoint

    config = SGLangServerConfig(model_path=str(ensure_tiny_checkpoint()), python=SGLANG_PYTHON, device="cpu")
    port = free_port()
    extra = config.env()
    env = {**os.environ, **extra, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(config.command("127.0.0.1", port), env=env, cwd=ROOT, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health_generate", timeout=30).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)  # SGLang loads for 1-2 min; /health_generate is its readiness signal
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"SGLang did not start: {log.read_text(errors='replace')[-3000:]}")


def test_a_real_sglang_server_joins_a_run_through_the_pool(tmp_path: Path) -> None:
    out, err = tmp_path / "run", tmp_path / "run.err"
    args = ["servers.kind=sglang", "servers.n=1", "servers.sglang.device=cpu", f"servers.sglang.python={SGLANG_PYTHON}",
            "run.steps=500", "run.checkpoint_every=0", "run.eval_every=0", f"run.out_dir={out}"]  # fmt: skip
    proc = joiner = proxy = None
    lines: list[str] = []
    with up_cluster(tmp_path) as (cfg, env):
        try:
            proc = start_run(args, cfg, env, err)
            # one SGLang start-up at a time: each takes a free port for its torch.distributed
            # init when it starts, and two at once on a 2-core machine ended the run's server
            # (exit -9, SGLang killing itself) before its first step in CI
            read_until(proc, lines, "step 1/", err)
            joiner, url = start_sglang(tmp_path / "joiner.log")
            proxy = RecordingProxy(url)
            add = cli(["pool", "add", proxy.url], env)
            assert add.returncode == 0, add.stderr
            joined = read_until(proc, lines, "servers joined:", err)
            version = int(re.search(r"serving version (\d+)", joined).group(1))
            read_until(proc, lines, f"step {version + 2}/", err)  # two more steps on both servers
            ls = cli(["pool", "ls", "--json"], env)
            proc.send_signal(signal.SIGTERM)  # finish the step, checkpoint, exit 143
            rest, _ = proc.communicate(timeout=300)
        finally:
            stop(proc)
            if proxy is not None:
                proxy.close()
            if joiner is not None:
                os.killpg(joiner.pid, signal.SIGKILL)  # SGLang's scheduler processes with it
                joiner.wait()
    output = "".join(lines) + rest
    assert proc.returncode == 143, output[-3000:] + run_logs(err)
    states = {s["url"]: (s["state"], s["version"]) for s in json.loads(ls.stdout)["servers"]}
    assert states[proxy.url] == ("live", version) and len(states) == 2
    m = rows(out)
    after = [r for r in m if r["version"] > version]
    assert after and all(r["servers/live"] == 2 for r in after)
    assert all(r["servers/min_weight_version"] == r["version"] for r in m)  # SGLang took every push
    # the joiner served, and only the version it was checked to hold and later ones
    assert proxy.generated, "the joined server got no requests"
    assert all(v is not None and int(v) >= version for v in proxy.generated), proxy.generated
    groups = [g for r in m for g in r["data/groups"].split(",")]
    assert len(groups) == len(set(groups))

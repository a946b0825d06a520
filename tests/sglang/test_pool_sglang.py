"""A real SGLang 0.5.23 server (CPU) joins a run mid-way through the inference pool: a server the
run did not start, behind a proxy that records the weight version of every answer it gives, added
with `rlactors pool add` against a `rlactors up` cluster; at the next publish it joins the
weight-update group, takes the push, reports the published version, and only then gets requests.

The joiner is the package's shared SGLang server (tests/sglang/conftest.py: ``exported_sglang``),
so this costs no SGLang start-up of its own: the run trains the model that server serves (the
exported folder), on a reference server of its own (fast to start), and pushes to both, in one
group, from the join on; the shared server is given its exported weights back after. A recipe run
whose own server is real SGLang is tests/sglang/test_recipe_sglang.py."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import httpx
import pytest

from tests.e2e.live_run import Output, rlactors_stack
from tests.e2e.test_pool import cli, run_logs, start_run, stop, up_cluster
from tests.e2e.test_recipe import rows
from tests.helpers.proxy import RecordingProxy
from tests.sglang.conftest import CHANGES_IT, ExportedServer
from tests.sglang.test_sglang_code import NEEDS_SGLANG

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.timeout(1200),  # the shared server's start-up on CPU when this test runs alone, a run
    getattr(pytest.mark, CHANGES_IT),  # the run's pushes replace the shared server's weights for a while
    NEEDS_SGLANG,
]


def test_a_real_sglang_server_joins_a_run_through_the_pool(
    tmp_path: Path, exported_sglang: ExportedServer
) -> None:
    served = exported_sglang
    out, err = tmp_path / "run", tmp_path / "run.err"
    args = [
        f"model.path={served.model}",
        "servers.kind=reference",
        "servers.n=1",
        "trainer.n_ranks=1",
        "run.steps=500",
        "run.checkpoint_every=0",
        "run.eval_every=0",
        f"run.out_dir={out}",
    ]
    # a version no publish has: the joiner reports the run's only once the push has reached it
    r = httpx.post(served.url + "/update_weight_version", json={"new_version": "not-joined"}, timeout=120)
    assert r.status_code == 200, r.text
    proc = None
    proxy = RecordingProxy(served.url)
    try:
        with up_cluster(tmp_path) as (cfg, env):
            try:
                proc = start_run(args, cfg, env, err)
                run_stdout = Output(proc, logs=lambda: run_logs(err), stacks=lambda: rlactors_stack([], env))
                run_stdout.until("step 1/")  # it joins a running run
                add = cli(["pool", "add", proxy.url], env)
                assert add.returncode == 0, add.stderr
                joined = run_stdout.until("servers joined:")
                version = int(re.search(r"serving version (\d+)", joined).group(1))
                run_stdout.until(f"step {version + 2}/")  # two more steps on both servers
                ls = cli(["pool", "ls", "--json"], env)
                proc.send_signal(signal.SIGTERM)  # finish the step, checkpoint, exit 143
                output = run_stdout.rest(timeout_s=300)
            finally:
                stop(proc)
    finally:
        proxy.close()
        # the shared server as it was found: the exported weights (its other users read them)
        body = {"model_path": str(served.model)}
        restored = httpx.post(served.url + "/update_weights_from_disk", json=body, timeout=300)
    assert restored.status_code == 200 and restored.json()["success"], restored.text
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

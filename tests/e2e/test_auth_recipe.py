"""The recipe with keys forced on loopback (``servers.reference.auth = "on"``): every client of the
servers sends the key its calls need (rollout, policy sync, weight push, health checks,
evaluation), or the run fails with 401s."""

from __future__ import annotations

import re
from pathlib import Path

from tests.e2e.test_recipe import SMALL, recipe, rows


def test_recipe_runs_against_keyed_servers(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [
        "servers.reference.auth=on",
        'servers.reference.extra_args=["--log-level", "info"]',  # uvicorn's access log: every request
        "run.steps=2",
        "run.checkpoint_every=0",
        f"run.out_dir={out}",
    ]
    run = recipe([*SMALL, *args], timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    m = rows(out)
    assert [r["step"] for r in m] == [1, 2]
    for r in m:
        assert r["servers/min_weight_version"] == r["step"] == r["version"]  # every push landed
    assert m[-1]["eval/version"] == 2 and m[-1]["eval/accuracy"] == m[-1]["eval/accuracy"]  # eval ran
    log = (out / "servers" / "server-0.log").read_text(errors="replace")
    assert "keys=api_key,admin_api_key" in log  # the server took both keys
    statuses = re.findall(r'"(?:GET|POST) (\S+) HTTP/1.1" (\d+)', log)
    seen = {path for path, _ in statuses}
    assert {"/generate", "/pause_generation", "/continue_generation", "/init_weights_update_group",
            "/update_weights_from_distributed", "/health", "/model_info"} <= seen, seen  # fmt: skip
    assert not [s for s in statuses if s[1] == "401"], [s for s in statuses if s[1] == "401"][:5]

"""The inference-server supervisor and actor: launch, health, restart on crash, stop; SGLang command."""

from __future__ import annotations

import os
import signal
import sys

import httpx

from nodes.inference.launcher import (
    InferenceServerActor,
    ReferenceServerConfig,
    ServerSupervisor,
    SGLangServerConfig,
)
from tests.helpers.servers import wait_until


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_supervisor_starts_restarts_after_crash_and_stops() -> None:
    sup = ServerSupervisor(
        ReferenceServerConfig(backend="sim"), env={"RLACTORS_TEST_MARK": "1"}, startup_timeout_s=60
    )
    url = await sup.start()
    try:
        assert url.startswith("http://127.0.0.1:")
        assert await sup.health()
        first = sup.proc
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)

        async def restarted() -> bool:
            return sup.restarts == 1 and sup.proc is not first and await sup.health(timeout_s=2)

        await wait_until(restarted, timeout_s=60, what="restart after SIGKILL")
        async with httpx.AsyncClient(base_url=sup.url, timeout=30) as c:
            r = await c.post(
                "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
            )
            assert r.status_code == 200
    finally:
        await sup.stop()
    assert sup.proc is not None and sup.proc.returncode is not None
    assert not await sup.health(timeout_s=2)


async def test_supervisor_reports_a_server_that_cannot_start() -> None:
    sup = ServerSupervisor(ReferenceServerConfig(backend="no-such-backend"), startup_timeout_s=60)
    try:
        await sup.start()
    except RuntimeError as e:
        assert "exited" in str(e)
    else:
        raise AssertionError("start() should fail")
    finally:
        await sup.stop()


def test_sglang_command_line() -> None:
    cfg = SGLangServerConfig(
        model_path="/m",
        tp_size=2,
        mem_fraction_static=0.8,
        dtype="bfloat16",
        random_seed=3,
        extra_args=["--enable-metrics"],
    )
    cmd = cfg.command("127.0.0.1", 30001)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    args = cmd[3:]
    pairs = dict(zip(args[:-1:2], args[1::2], strict=False))
    assert pairs["--model-path"] == "/m" and pairs["--host"] == "127.0.0.1" and pairs["--port"] == "30001"
    assert pairs["--tp-size"] == "2" and pairs["--mem-fraction-static"] == "0.8"
    assert pairs["--dtype"] == "bfloat16" and pairs["--random-seed"] == "3"
    assert cmd[-1] == "--enable-metrics"


async def test_inference_server_actor(cluster) -> None:
    actor = await cluster.spawn(InferenceServerActor, ReferenceServerConfig(backend="sim"), name="inf-0")
    url = await actor.url()
    assert await actor.health()
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        assert (await c.get("/model_info")).status_code == 200
    url2 = await actor.restart()
    assert url2 == url and await actor.health()
    await actor.stop()
    async with httpx.AsyncClient(timeout=5) as c:
        try:
            await c.get(url + "/health")
        except httpx.HTTPError:
            pass
        else:
            raise AssertionError("server still answering after stop()")

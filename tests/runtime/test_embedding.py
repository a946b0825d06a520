"""Embedding: a FastAPI service (uvicorn's loop) joins a running cluster with rlactors.connect()."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

import httpx
import pytest

import rlactors
from rlactors.base.aio import wait_for

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_fastapi_service_embeds_actors_over_tcp_with_curve() -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    async with rlactors.init(address="tcp://127.0.0.1:0") as cluster:
        port = free_port()
        env = {
            **os.environ,
            "RLACTORS_ADDRESS": cluster.address,
            "RLACTORS_SECRET_FILE": cluster.secret_file,
            "PYTHONPATH": str(ROOT),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "uvicorn",
            "examples.fastapi_service:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                for _ in range(300):
                    try:
                        if (await http.get("/count")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.1)
                else:
                    pytest.fail("service did not come up")
                results = await asyncio.gather(*(http.post(f"/count/{k}") for k in range(1, 11)))
                assert all(r.status_code == 200 for r in results)
                assert (await http.get("/count")).json() == {"total": 55}
            # The service's actor lives in our cluster: the driver reaches the same actor by name.
            tally = await cluster.get_actor("tally")
            assert await tally.get() == 55
        finally:
            proc.terminate()
            await wait_for(proc.wait(), 20)
        # Detached: it outlives the service that spawned it.
        assert await (await cluster.get_actor("tally")).add(1) == 56


async def test_connect_without_the_secret_is_refused() -> None:
    async with rlactors.init(address="tcp://127.0.0.1:0") as cluster:
        wrong = Path(cluster.secret_file).with_name("wrong-secret")
        wrong.write_text("x" * 40)
        wrong.chmod(0o600)
        with pytest.raises(rlactors.ClusterError, match="no head answered"):
            await rlactors.connect(cluster.address, secret_file=str(wrong), timeout=2)
        # The cluster keeps serving its rightful clients.
        assert len(await cluster.nodes()) == 1


async def test_actors_of_a_client_that_dies_are_stopped_unless_detached(tmp_path: Path) -> None:
    async with rlactors.init(address="tcp://127.0.0.1:0", client_timeout=2) as cluster:
        script = tmp_path / "client.py"
        script.write_text(
            "import asyncio, rlactors\n"
            "from tests.runtime.actors import Counter\n"
            "async def main():\n"
            "    c = await rlactors.connect()\n"
            "    owned = await c.spawn(Counter, name='owned')\n"
            "    kept = await c.spawn(Counter, name='kept', detached=True)\n"
            "    print('ready', flush=True)\n"
            "    await asyncio.sleep(3600)\n"
            "asyncio.run(main())\n"
        )
        env = {
            **os.environ,
            "RLACTORS_ADDRESS": cluster.address,
            "RLACTORS_SECRET_FILE": cluster.secret_file,
            "PYTHONPATH": str(ROOT),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert (await wait_for(proc.stdout.readline(), 60)).strip() == b"ready"
            owned = await cluster.get_actor("owned")
            proc.kill()
            await proc.wait()
            info = await wait_for(cluster.watch(owned), 30)
            assert info["state"] == "DEAD"
            assert await (await cluster.get_actor("kept")).add(1) == 1
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

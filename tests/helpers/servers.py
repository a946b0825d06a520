"""Helpers for tests and benchmarks that need a running reference server.

Blocking helpers (:func:`start_reference_server`, :func:`stop_server`, :func:`reference_server`)
are for fixtures and scripts; the async ones poll a server's ``/v1/loads`` for conditions, with
a timeout, instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from nodes.common.procs import free_port
from nodes.inference.launcher import REPO_ROOT
from tests.helpers import forked


def start_reference_server(args: list[str], timeout_s: float = 120.0) -> tuple[forked.Process, str]:
    """Start ``python -m nodes.inference.server`` with ``args`` on a free port; wait until healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "nodes.inference.server", "--host", "127.0.0.1", "--port", str(port), *args]
    return _start(cmd, port, {}, timeout_s)


def start_sglang_server(
    python: str, model_path: str, extra_args: list[str] | None = None, timeout_s: float = 600.0
) -> tuple[forked.Process, str]:
    """Start real SGLang on CPU (``python``: the interpreter of SGLang's venv) with the launcher's
    flags and environment (:class:`~nodes.inference.launcher.SGLangServerConfig`); wait until healthy."""
    from nodes.inference.launcher import SGLangServerConfig

    port = free_port()
    cfg = SGLangServerConfig(model_path=model_path, python=python, device="cpu", extra_args=extra_args or [])
    return _start(cfg.command("127.0.0.1", port), port, cfg.env(), timeout_s)


def _start(cmd: list[str], port: int, env: dict[str, str], timeout_s: float) -> tuple[forked.Process, str]:
    log = tempfile.NamedTemporaryFile(prefix=f"rlactors-server-{port}-", suffix=".log", delete=False)
    # ours forked from the test process's fork server (tests.helpers.forked); SGLang's, from its own
    # venv, exec'd
    proc = forked.popen(
        cmd,
        preload=forked.SERVER,
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    proc._rl_log = log  # type: ignore[attr-defined]
    try:
        with httpx.Client(timeout=30) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    log.close()
                    text = Path(log.name).read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{text}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url + "/health_generate").status_code == 200:
                        return proc, url
                time.sleep(0.2)  # start-up poll interval
        raise RuntimeError(f"server on port {port} not healthy after {timeout_s} s")
    except BaseException:  # also a test timeout or Ctrl-C while it starts: never leave it running
        stop_server(proc)
        raise


def stop_server(proc: forked.Process) -> None:
    """Terminate (then kill) a server started here, with its children (SGLang's scheduler and
    detokenizer are processes of their own)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    log = getattr(proc, "_rl_log", None)
    if log is not None:
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


def serving(started: tuple[forked.Process, str]) -> Iterator[str]:
    """Yield a started server's URL and stop the server after: ``yield from serving(start_...(...))``
    in a fixture."""
    proc, url = started
    try:
        yield url
    finally:
        stop_server(proc)


@contextlib.contextmanager
def reference_server(args: list[str], timeout_s: float = 120.0) -> Iterator[str]:
    """Run a reference server for the duration of a ``with`` block; yields its URL."""
    proc, url = start_reference_server(args, timeout_s)
    try:
        yield url
    finally:
        stop_server(proc)


async def wait_until(pred: Callable[[], Awaitable[bool]], timeout_s: float = 30.0, what: str = "") -> None:
    """Poll ``pred`` until true (a condition wait, bounded by ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or pred}")


async def _loads(client: httpx.AsyncClient, *keys: str) -> tuple[int, ...]:
    """``keys`` of SGLang's ``/v1/loads``, each summed over its entries (data-parallel ranks)."""
    r = await client.get("/v1/loads")
    r.raise_for_status()
    entries = r.json()["loads"]
    return tuple(sum(e[k] for e in entries) for k in keys)


async def load(client: httpx.AsyncClient) -> tuple[int, int]:
    """(running, waiting) request counts from SGLang's ``/v1/loads``."""
    running, waiting = await _loads(client, "num_running_reqs", "num_waiting_reqs")
    return running, waiting


async def wait_load(
    client: httpx.AsyncClient, running: int | None = None, waiting: int | None = None
) -> None:
    """Wait until the server reports the given running/waiting counts."""

    async def ok() -> bool:
        r, w = await load(client)
        return (running is None or r == running) and (waiting is None or w == waiting)

    await wait_until(ok, what=f"running={running} waiting={waiting}")


async def wait_decoding(client: httpx.AsyncClient, running: int = 1, steps: int = 2) -> None:
    """Wait until ``running`` requests are decoding: the count holds while the KV in use grows
    ``steps`` times in a row.

    ``wait_load(running=1)`` alone can pass on a stale report: SGLang publishes its load snapshot
    after each batch, before finished requests leave the running batch, so the report of a request
    that has just finished still says ``running=1`` until the scheduler's next publish. A pause sent
    on that report can land before the new request's prefill. Growth of ``num_used_tokens`` can
    only come from fresh decode steps.
    """
    last: int | None = None
    grown = 0

    async def ok() -> bool:
        nonlocal last, grown
        n, used = await _loads(client, "num_running_reqs", "num_used_tokens")
        if n != running:
            last, grown = None, 0
            return False
        if last is not None and used > last:
            grown += 1
        elif last is not None and used < last:
            grown = 0
        last = used
        return grown >= steps

    await wait_until(ok, what=f"{running} request(s) decoding ({steps} growing reports)")


class Trainer:
    """The trainer side of a weight-update group: rank 0, built as SGLang builds the group (gloo)."""

    def __init__(self, port: int, group_name: str, world_size: int = 2) -> None:
        self.port, self.group_name, self.world_size = port, group_name, world_size
        self.pg: Any = None

    def join(self) -> None:
        """Host the store and form the group; blocks until the server joins."""
        from nodes.common.weight_group import init_weight_update_group

        self.pg = init_weight_update_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=self.port,
            rank=0,
            world_size=self.world_size,
            group_name=self.group_name,
            timeout_s=60,
        )

    def broadcast(self, tensors: list[Any]) -> None:
        """Broadcast each tensor from rank 0."""
        from nodes.common.weight_group import broadcast

        assert self.pg is not None
        for t in tensors:
            broadcast(t, self.pg).wait()

    def close(self) -> None:
        """Leave the group."""
        from nodes.common.weight_group import destroy_weight_update_group

        if self.pg is not None:
            destroy_weight_update_group(self.pg)
            self.pg = None


async def join_group(client: httpx.AsyncClient) -> tuple[Trainer, str]:
    """Have the server behind ``client`` join a fresh group with a :class:`Trainer` (rank 0)."""
    port, name = free_port(), f"wu-{uuid.uuid4().hex[:8]}"
    trainer = Trainer(port, name)
    req = asyncio.create_task(
        client.post(
            "/init_weights_update_group",
            json={
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": name,
                "backend": "gloo",
            },
        )
    )
    await asyncio.to_thread(trainer.join)
    r = await req
    if r.status_code != 200 or not r.json()["success"]:
        raise RuntimeError(f"init_weights_update_group failed: {r.text}")
    return trainer, name


async def push(
    client: httpx.AsyncClient,
    trainer: Trainer,
    name: str,
    named: dict[str, Any],
    flattened: bool,
    version: str,
) -> None:
    """Send ``named`` tensors inside a begin/end session, per tensor or as one flat bucket."""
    import torch

    body = {
        "names": list(named),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in named.values()],
        "shapes": [list(t.shape) for t in named.values()],
        "group_name": name,
        "weight_version": version,
        "flush_cache": True,
    }
    if flattened:
        body["load_format"] = "flattened_bucket"
        # SGLang's FlattenedTensorBucket layout: every tensor's bytes back to back, as uint8
        tensors = [torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in named.values()])]
    else:
        tensors = list(named.values())
    r = await client.post("/begin_weight_update", json={"selector": "all"})
    if r.status_code == 404:  # SGLang before 0.5.23 has no sessions
        r = None
    elif not r.json()["success"]:
        raise RuntimeError(f"begin_weight_update failed: {r.text}")
    try:
        req = asyncio.create_task(client.post("/update_weights_from_distributed", json=body))
        await asyncio.to_thread(trainer.broadcast, tensors)
        resp = await req
        if resp.status_code != 200 or not resp.json()["success"]:
            raise RuntimeError(f"update_weights_from_distributed failed: {resp.text}")
    finally:
        if r is not None:
            await client.post("/end_weight_update", json={})


@contextlib.asynccontextmanager
async def hung_server() -> AsyncIterator[str]:
    """Accepts connections and reads, never answers."""
    conns: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(writer)
        with contextlib.suppress(ConnectionError):
            await reader.read(1 << 16)

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for w in conns:
            w.close()
        srv.close()
        await srv.wait_closed()

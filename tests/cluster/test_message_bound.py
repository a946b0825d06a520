"""Message size: a stranger gets no memory for a huge frame it declares; an authenticated payload
over ``max_message_bytes`` is a clear error where it is sent, never a silent drop; large buffers
travel in frames of FRAME_BYTES and arrive whole."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

import rlactors
from rlactors.base.aio import wait_for
from rlactors.base.errors import MessageTooLargeError
from rlactors.wire import transport
from rlactors.wire.security import new_secret_file
from tests.cluster.actors import Blob

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
RSS_GROWTH_LIMIT = 128 * MiB


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture
def head(tmp_path: Path) -> Iterator[tuple[str, str, int]]:
    """A standalone head on a loopback port: its address, secret file and pid."""
    secret = str(new_secret_file(tmp_path / "secret"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlactors.launch.daemons",
            "head",
            "--bind",
            "tcp://127.0.0.1:0",
            "--secret-file",
            secret,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("head ready at "), line
        yield line.removeprefix("head ready at ").strip(), secret, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _flood(address: str, declared: int, limit: int) -> tuple[int, bool]:
    """Greet as a CURVE client, declare a frame of ``declared`` bytes and stream up to ``limit``
    bytes; returns the bytes sent and whether the server closed the connection before the end."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + bytes(32)
    chunk = b"x" * MiB
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as s:
        try:
            s.sendall(greeting + bytes([0x02]) + struct.pack(">Q", declared))
            while sent < limit:
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return sent, True
    return sent, False


@pytest.mark.parametrize("declared", [4 << 30, transport.FRAME_BYTES])
async def test_a_stranger_declaring_a_huge_frame_gets_no_memory_and_the_head_keeps_serving(
    head: tuple[str, str, int], declared: int
) -> None:
    address, secret, pid = head
    before = _rss(pid)
    sent, closed = _flood(address, declared, 512 * MiB)
    grown = _rss(pid) - before
    # Refused within one frame's worth of bytes: a 4 GiB header at once, a FRAME_BYTES frame once
    # read whole (it is no handshake command).
    assert closed and sent < 64 * MiB, sent
    assert grown < RSS_GROWTH_LIMIT, f"the head grew by {grown / MiB:.0f} MiB for {sent / MiB:.0f} MiB sent"
    async with rlactors.connect(address, secret_file=secret, timeout=30) as cluster:
        assert await wait_for(cluster.nodes(), 10) == []  # still serving


@pytest.fixture
def bound(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A 2 MiB max_message_bytes in this process (head, agent, driver) and the workers it starts."""
    monkeypatch.setenv(transport.MAX_MESSAGE_BYTES_ENV, str(transport.max_message_bytes()))
    transport.set_max_message_bytes(2 * MiB)
    try:
        yield 2 * MiB
    finally:
        monkeypatch.undo()
        transport.set_max_message_bytes(transport._bound_from_env())


async def test_a_payload_over_the_bound_is_a_clear_error_at_the_sender(bound: int) -> None:
    async with rlactors.init() as cluster:
        blob = await cluster.spawn(Blob)
        assert await blob.bound() == bound  # the workers inherit the bound
        with pytest.raises(
            MessageTooLargeError, match=r"the call of 'size_of'.* over max_message_bytes \(2\.0 MiB\)"
        ):
            await wait_for(blob.size_of(np.zeros(bound, np.uint8)), 10)
        # The result's sender is the actor: the error reaches the caller, the actor keeps serving.
        with pytest.raises(MessageTooLargeError, match=r"the result of a call .* over max_message_bytes"):
            await wait_for(blob.make(bound + 1), 10)
        assert await blob.size_of(np.zeros(bound - 4096, np.uint8)) == bound - 4096


async def test_a_receiver_with_a_smaller_bound_answers_with_an_error(bound: int) -> None:
    async with rlactors.init() as cluster:
        small = await cluster.spawn(Blob, env={transport.MAX_MESSAGE_BYTES_ENV: str(MiB)})
        big = await cluster.spawn(Blob, env={transport.MAX_MESSAGE_BYTES_ENV: str(8 * MiB)})
        with pytest.raises(MessageTooLargeError, match=r"refused the call: the message is 1\.\d MiB"):
            await wait_for(small.size_of(np.zeros(MiB + MiB // 2, np.uint8)), 10)
        with pytest.raises(MessageTooLargeError, match=r"the reply from .* was refused"):
            await wait_for(big.make(3 * MiB), 10)
        assert await small.size_of(b"ok") == 2 and await big.size_of(b"ok") == 2


@pytest.mark.parametrize("address", ["ipc", "tcp://127.0.0.1:0"])  # tcp: CURVE adds 33 bytes per frame
async def test_buffers_larger_than_a_frame_arrive_whole(address: str) -> None:
    n = 3 * transport.FRAME_BYTES + 5
    data = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    async with rlactors.init(address=address) as cluster:
        blob = await cluster.spawn(Blob)
        t0 = time.monotonic()
        back = await wait_for(blob.echo(data), 60)
        assert isinstance(back, np.ndarray) and back.shape == (n,)
        assert np.array_equal(back, data)
        assert time.monotonic() - t0 < 30


@pytest.mark.parametrize(("scheme", "limit"), [("tcp", transport.FRAME_BYTES + 64), ("ipc", -1)])
async def test_only_tcp_sockets_bound_frames(tmp_path: Path, scheme: str, limit: int) -> None:
    # ipc sockets live in a folder only their user can enter: no stranger, and frames stay whole
    # (no copy to join them); a TCP socket refuses a frame past FRAME_BYTES before anything else.
    address = f"ipc://{tmp_path}/s" if scheme == "ipc" else "tcp://127.0.0.1:0"
    router, bound = transport.bind_router(address, lambda frames: None, None, name="router")
    dealer = transport.connect_dealer(bound, lambda frames: None, None, name="dealer")
    try:
        for asock in (router, dealer):
            assert asock.sock.getsockopt(zmq.MAXMSGSIZE) == limit
    finally:
        dealer.close()
        router.close()

"""Authentication: peers without the cluster secret can neither call actors nor join as nodes."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import zmq
import zmq.asyncio

import rlactors
from protocols.runtime import wire
from rlactors.base.aio import wait_for
from rlactors.wire import transport
from rlactors.wire.security import Security
from tests.runtime.actors import Counter

NO_REPLY_WINDOW = 1.0  # how long we listen for a reply that must never come


async def _send_and_listen(sock: zmq.asyncio.Socket, frames: list[bytes]) -> list[object]:
    try:  # once the server has refused the handshake the socket has no peer and a send waits forever
        await wait_for(sock.send_multipart(frames), NO_REPLY_WINDOW)
    except TimeoutError:
        return []
    replies = []
    try:
        while True:
            replies.append(await wait_for(sock.recv_multipart(), NO_REPLY_WINDOW))
    except TimeoutError:
        return replies


def _call(method: str, *args: object) -> list[bytes]:
    return wire.join_batch([wire.encode_envelope(wire.Kind.CALL, 1, None, method, list(args), {}, 0)])


async def test_peer_without_curve_or_with_wrong_keys_cannot_call_actors() -> None:
    async with rlactors.init(address="tcp://127.0.0.1:0") as cluster:
        c = await cluster.spawn(Counter, 0)
        ctx = zmq.asyncio.Context()
        plain = ctx.socket(zmq.DEALER)
        intruder = ctx.socket(zmq.DEALER)
        try:
            plain.connect(c.address)
            Security(os.urandom(32)).apply_client(intruder)  # CURVE, but another cluster's keys
            intruder.connect(c.address)
            for sock in (plain, intruder):
                assert await _send_and_listen(sock, _call("add", 100)) == []
        finally:
            for sock in (plain, intruder):
                sock.close(linger=0)
            ctx.term()
        # Nothing executed: the counter was never incremented.
        assert await c.value() == 0
        assert await c.add(1) == 1


async def test_node_without_the_secret_cannot_register() -> None:
    async with rlactors.init(address="tcp://127.0.0.1:0") as cluster:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        Security(os.urandom(32)).apply_client(sock)
        sock.connect(cluster.address)
        try:
            frames = wire.join_batch(
                [
                    wire.encode_envelope(
                        wire.Kind.CALL,
                        1,
                        "head",
                        "register_node",
                        ["evil", "tcp://127.0.0.1:1", "127.0.0.1", {"cpu": 64}],
                        {},
                        0,
                    )
                ]
            )
            assert await _send_and_listen(sock, frames) == []
        finally:
            sock.close(linger=0)
            ctx.term()
        assert [n["node_id"] for n in await cluster.nodes()] == ["local"]


async def test_random_frames_at_a_live_worker_never_crash_it(cluster) -> None:
    c = await cluster.spawn(Counter, 5)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    # with the call credential, so the frames reach the worker (a peer without one is refused at the
    # handshake, and a send after the refusal waits forever: the socket has no peer left)
    cluster._local.head.security.calls.apply_client(sock)
    sock.connect(c.address)
    rng = random.Random(0)
    valid = _call("value")
    try:
        for _ in range(300):
            kind = rng.random()
            if kind < 0.3:
                frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
            elif kind < 0.7:  # a valid message with bytes flipped
                frames = [bytearray(f) for f in valid]
                f = rng.choice(frames)
                if f:
                    f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
                frames = [bytes(f) for f in frames]
            else:  # a valid message cut short
                frames = [f[: rng.randint(0, len(f))] for f in valid]
            await sock.send_multipart(frames)
    finally:
        sock.close(linger=0)
        ctx.term()
    assert await c.value() == 5
    assert await c.add(1) == 6


async def test_plain_mechanism_authenticates_without_encryption() -> None:
    async with rlactors.init(address="tcp://127.0.0.1:0", security="plain") as cluster:
        c = await cluster.spawn(Counter, 0)
        assert await c.add(2) == 2  # workers and the driver speak PLAIN with the derived token
        ctx = zmq.asyncio.Context()
        anonymous = ctx.socket(zmq.DEALER)
        wrong = ctx.socket(zmq.DEALER)
        try:
            anonymous.connect(c.address)
            Security(os.urandom(32), "plain").apply_client(wrong)  # another cluster's token
            wrong.connect(c.address)
            for sock in (anonymous, wrong):
                assert await _send_and_listen(sock, _call("add", 100)) == []
        finally:
            for sock in (anonymous, wrong):
                sock.close(linger=0)
            ctx.term()
        assert await c.value() == 2
        # A client must use the cluster's mechanism: CURVE keys are refused by a PLAIN cluster.
        with pytest.raises(rlactors.ClusterError, match="no head answered"):
            await rlactors.connect(
                cluster.address, secret_file=cluster.secret_file, timeout=2, security="curve"
            )
        other = await rlactors.connect(cluster.address, secret_file=cluster.secret_file, security="plain")
        assert len(await other.nodes()) == 1
        await other._client.close()


class _Warnings:
    """Stands in for rlactors.wire.transport's logger: keeps warnings, ignores the rest."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, object]]] = []
        self.changed = asyncio.Event()

    def warning(self, event: str, **fields: object) -> None:
        self.lines.append((event, fields))
        self.changed.set()

    def __getattr__(self, level: str) -> object:
        return lambda *args, **kwargs: None


async def test_rejected_peers_are_logged_a_few_lines_per_flood(monkeypatch) -> None:
    warnings = _Warnings()
    monkeypatch.setattr(transport, "log", warnings)
    monkeypatch.setattr(transport, "REJECT_LOG_EVERY_S", 0.5, raising=False)
    async with rlactors.init(address="tcp://127.0.0.1:0", security="plain") as cluster:
        ctx = zmq.asyncio.Context()
        intruders = [ctx.socket(zmq.DEALER) for _ in range(20)]
        try:
            for sock in intruders:
                Security(os.urandom(32), "plain").apply_client(sock)  # a token from another secret
                sock.connect(cluster.address)
            async with asyncio.timeout(15):  # the first refusal at once, then one line with the rest
                while not any("repeats" in fields for _, fields in warnings.lines):
                    warnings.changed.clear()
                    await warnings.changed.wait()
        finally:
            for sock in intruders:
                sock.close(linger=0)
            ctx.term()
        event, fields = warnings.lines[0]
        assert event == "rejected a peer that did not authenticate" and fields["socket"] == "head"
        assert len(warnings.lines) < 10
        assert await cluster.nodes()  # still serving

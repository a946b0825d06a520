"""Fuzzing the runtime's sockets: random and damaged frames at the head, a node agent and a
worker, from a peer with the cluster's keys (it passes authentication, so its garbage reaches
the decoder; damaged messages that still decode are ordinary calls) and from one without them
(nothing it sends reaches anything). Every process keeps serving: afterwards the fuzzed worker
answers and the cluster still places, starts and calls a new actor."""

from __future__ import annotations

import random

import pytest
import zmq
import zmq.asyncio

import rlactors
from protocols.runtime import wire
from rlactors.wire.security import Security, load_secret
from tests.runtime.actors import Counter

MESSAGES = 200  # per target and peer


def _frames(rng: random.Random) -> list[bytes]:
    valid = wire.join_batch(
        [
            wire.encode_envelope(
                wire.Kind.CALL,
                rng.randrange(1 << 30),
                rng.choice([None, "head", "agent"]),
                rng.choice(["value", "add", "register_node", "kv_put", "shutdown"]),
                [rng.randrange(100)],
                {},
                0,
            )
        ]
    )
    kind = rng.random()
    if kind < 0.3:
        return [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
    if kind < 0.7:  # a valid envelope with a bit flipped
        frames = [bytearray(f) for f in valid]
        f = rng.choice(frames)
        if f:
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        return [bytes(f) for f in frames]
    return [f[: rng.randint(0, len(f))] for f in valid]  # cut short


@pytest.mark.parametrize("keyed", [True, False], ids=["with-keys", "without-keys"])
async def test_garbage_at_head_agent_and_worker(keyed: bool) -> None:
    async with rlactors.init(address="tcp://127.0.0.1:0") as cluster:
        c = await cluster.spawn(Counter, 5)
        agent = next(n["address"] for n in await cluster.nodes())
        ctx = zmq.asyncio.Context()
        rng = random.Random(1 if keyed else 2)
        try:
            for target in (cluster.address, agent, c.address):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.SNDHWM, MESSAGES * 2)
                if keyed:
                    # a worker's credential: opens the head, the agent and actors alike
                    Security(load_secret(cluster.secret_file)).calls.apply_client(sock)
                sock.connect(target)
                for _ in range(MESSAGES):
                    try:  # without keys the handshake fails and the socket may never get a peer
                        await sock.send_multipart(_frames(rng), flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                sock.close(linger=500 if keyed else 0)
        finally:
            ctx.term()
        value = await c.value()
        if not keyed:
            assert value == 5  # nothing from a peer without the keys reached the actor
        assert await c.add(1) == value + 1  # a keyed peer's intact calls may have run; it still serves
        other = await cluster.spawn(Counter, 1)  # head and agent still place and start actors
        assert await other.add(1) == 2

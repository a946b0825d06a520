"""Connection churn against rlactors' transport: thousands of connections opened and closed, with
peers that vanish mid-send. Run by tests/runtime/test_zmq_churn.py; an abort anywhere shows as a
non-zero exit.

This process (the one under test) runs the transport on its event loop:
- DEALERs (``connect_dealer``) to ROUTER peers that flood them. Its receive queue is kept small
  (``HWM`` 16) so that ZeroMQ stops reading while the loop is busy; then the DEALER is closed
  while the peer still sends, and the peer vanishes (closes its socket, or is SIGKILLed), in either
  order: the state in which libzmq 4.3.5 aborted from its heartbeat timer (zeromq/libzmq#4364).
- A ROUTER (``bind_router``) that answers every message, to DEALER peers that send a burst and
  close (or are SIGKILLed) before the answers arrive.

Peers are processes of this script (``--peer router`` / ``--peer dealer ADDRESS``), plain pyzmq
(they import nothing of ours, so a SIGKILLed one is replaced quickly). ``--zmtp-heartbeat-ms`` turns ZMTP heartbeats on, everywhere, to show
that this churn reaches the abort when they are on. The last line printed is a JSON summary; the
exit status is 0 only if every connection was made and no process died but by our SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import zmq

ROOT = Path(__file__).resolve().parents[2]

PAYLOAD = b"x" * 2048
KILL_EVERY = 20  # one DEALER round in this many SIGKILLs its peer mid-send
SENDER_KILL_EVERY = 300  # one connection of the sending peers in this many: SIGKILLed mid-burst
RECEIVE_HWM = 16


def _options(sock: zmq.Socket, heartbeat_ms: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    if heartbeat_ms:  # the control: what every socket did before (at a faster interval)
        sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 6000)


# --- peers (plain pyzmq, blocking) ------------------------------------------------------------


def _orphaned(parent: int) -> bool:
    return os.getppid() != parent


def router_peer(heartbeat_ms: int) -> None:
    """Bind a ROUTER, say where, flood the first DEALER that speaks, then close mid-send; again."""
    parent, ctx = os.getppid(), zmq.Context()
    while not _orphaned(parent):
        r = ctx.socket(zmq.ROUTER)
        _options(r, heartbeat_ms)
        r.setsockopt(zmq.ROUTER_MANDATORY, 1)
        r.bind("tcp://127.0.0.1:*")
        print(r.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
        if r.poll(5000):
            ident = r.recv_multipart()[0]
            for _ in range(random.randint(20, 2000)):
                try:
                    r.send_multipart([ident, PAYLOAD], zmq.NOBLOCK)
                except zmq.Again:
                    r.poll(1, zmq.POLLOUT)
                except zmq.ZMQError:  # the DEALER has gone
                    break
        r.close(linger=0)  # vanishes mid-send
    ctx.term()


def dealer_peer(address: str, heartbeat_ms: int) -> None:
    """Connect a DEALER, send a burst, read a little of what comes back, close; again."""
    parent, ctx = os.getppid(), zmq.Context()
    while not _orphaned(parent):
        d = ctx.socket(zmq.DEALER)
        _options(d, heartbeat_ms)
        d.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        d.connect(address)
        for _ in range(random.randint(5, 200)):
            try:
                d.send(PAYLOAD, zmq.NOBLOCK)
            except zmq.Again:
                break
        for _ in range(random.randint(0, 20)):
            if not d.poll(20):
                break
            d.recv()
        d.close(linger=0)  # vanishes with answers on their way
    ctx.term()


# --- the process under test (rlactors' transport on asyncio) -----------------------------------

if __name__ == "__main__" and "--peer" not in sys.argv:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from rlactors.base.aio import wait_for
    from rlactors.wire import transport


class _Reader:
    """A DEALER's on_message: counts what arrives; ``enough`` once ``want`` messages have."""

    def __init__(self, want: int) -> None:
        self.got, self.want, self.enough = 0, want, asyncio.Event()

    def __call__(self, frames: list[Any]) -> None:
        self.got += 1
        if self.got >= self.want:
            self.enough.set()


class Churn:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dealer_rounds = 0
        self.router_peers: set[bytes] = set()
        self.kills = 0
        self.undeliverable = 0
        self.died: list[str] = []  # peers that exited but by our SIGKILL
        self.procs: list[asyncio.subprocess.Process] = []

    async def spawn(self, *peer: str) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--zmtp-heartbeat-ms",
            str(self.args.zmtp_heartbeat_ms),
            "--peer",
            *peer,
            stdout=asyncio.subprocess.PIPE if peer[0] == "router" else asyncio.subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    async def reap(self, proc: asyncio.subprocess.Process, killed: bool) -> None:
        rc = await proc.wait()
        self.procs.remove(proc)
        if not (killed and rc == -signal.SIGKILL):
            self.died.append(f"peer {proc.pid} exited with {rc}")

    def done(self) -> bool:
        return (
            self.dealer_rounds >= self.args.dealer_rounds and len(self.router_peers) >= self.args.router_peers
        ) or bool(self.died)

    async def dealers(self, worker: int) -> None:
        peer = await self.spawn("router")
        rounds = 0
        while not self.done():
            assert peer.stdout is not None
            line = await peer.stdout.readline()
            if not line:  # it died on its own
                await self.reap(peer, killed=False)
                return
            reader = _Reader(random.randint(1, 20))  # the peer sends at least 20
            asock = transport.connect_dealer(line.decode().strip(), reader, None, name=f"churn-{worker}")
            asock.send([b"hello"])
            with contextlib.suppress(TimeoutError):
                await wait_for(reader.enough.wait(), 1.0)
            rounds += 1
            if rounds % KILL_EVERY == 0:  # the peer vanishes with the process, before or after our close
                if rounds % (2 * KILL_EVERY):
                    asock.close()
                peer.kill()
                asock.close()
                self.kills += 1
                await self.reap(peer, killed=True)
                peer = await self.spawn("router")
            else:
                asock.close()
            self.dealer_rounds += 1
            await asyncio.sleep(0)
        peer.kill()
        await self.reap(peer, killed=True)

    async def run(self) -> None:
        def answer(frames: list[Any]) -> None:
            self.router_peers.add(frames[0].bytes)
            if not router.closed:
                router.send([frames[0].bytes, PAYLOAD])

        def undeliverable(peer: bytes | None, labels: list[Any]) -> None:
            self.undeliverable += 1

        router, address = transport.bind_router("tcp://127.0.0.1:0", answer, None, name="churn-router")
        router.on_undeliverable = undeliverable
        senders = [await self.spawn("dealer", address) for _ in range(self.args.dealer_peers)]
        workers = asyncio.gather(*(self.dealers(i) for i in range(self.args.workers)))
        kills = 0
        while senders:
            await asyncio.sleep(0.05)
            for sender in [s for s in senders if s.returncode is not None]:  # died on its own
                senders.remove(sender)
                await self.reap(sender, killed=False)
            if len(self.router_peers) >= self.args.router_peers or self.died:
                for sender in senders:
                    sender.kill()
                    await self.reap(sender, killed=True)
                senders = []
            elif senders and len(self.router_peers) // SENDER_KILL_EVERY > kills:  # one dies mid-burst
                kills += 1
                victim = senders.pop(0)
                victim.kill()
                await self.reap(victim, killed=True)
                senders.append(await self.spawn("dealer", address))
        self.kills += kills
        await workers
        router.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zmtp-heartbeat-ms", type=int, default=0)
    parser.add_argument("--peer", nargs="+")
    parser.add_argument("--dealer-rounds", type=int, default=1500)
    parser.add_argument("--router-peers", type=int, default=1500)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--dealer-peers", type=int, default=2)
    args = parser.parse_args()
    if args.peer:
        if args.peer[0] == "router":
            router_peer(args.zmtp_heartbeat_ms)
        else:
            dealer_peer(args.peer[1], args.zmtp_heartbeat_ms)
        return 0
    transport.HWM = RECEIVE_HWM  # ZeroMQ stops reading a connection while this loop is busy
    if args.zmtp_heartbeat_ms:
        configure = transport._configure

        def with_heartbeats(sock: zmq.Socket, whole: bool) -> None:
            configure(sock, whole)
            _options(sock, args.zmtp_heartbeat_ms)

        transport._configure = with_heartbeats
    churn = Churn(args)
    t0 = time.monotonic()
    try:
        asyncio.run(churn.run())
    finally:
        for proc in churn.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    summary = {
        "dealer_rounds": churn.dealer_rounds,
        "router_peers": len(churn.router_peers),
        "peer_kills": churn.kills,
        "undeliverable": churn.undeliverable,
        "died": churn.died,
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(summary), flush=True)
    return 1 if churn.died else 0


if __name__ == "__main__":
    sys.exit(main())

"""Actor-call benchmark: rlactors vs raw asyncio pyzmq + msgpack vs Ray and Monarch, in one run.

    python bench/rpc.py                 # everything (Ray and Monarch only if installed)
    python bench/rpc.py --quick         # shorter runs

Prints, for each system: one-call-at-a-time round trip p50/p99, calls/s with 64 in flight,
64 MiB tensor GiB/s (actor to actor; median of interleaved rounds against raw pyzmq from
a worker process), and a 64 MiB ``bytes`` echo from the driver (64 MiB over the round trip's
time; median of interleaved rounds against raw pyzmq echoing the frame without a copy), each
with its ratio to the raw baseline, to Ray and to Monarch; and how long a caller waits for
ActorDiedError after kill -9 of the actor's process. Ray (``pip install ray``) and Monarch
(``pip install torchmonarch``) are skipped, saying so, when not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq
import zmq.asyncio

import rlactors

try:  # Monarch is optional, as Ray is: pip install torchmonarch
    from monarch.actor import Actor as MonarchActor
    from monarch.actor import endpoint, this_host
except ImportError:
    MonarchActor = None  # type: ignore[assignment,misc]

MIB64 = 64 * 1024 * 1024
TENSOR_ROUNDS = 7
ROUNDS = 5  # alternating rounds of latency and throughput measurements


# --- raw baseline: asyncio pyzmq ROUTER/DEALER + msgpack ---------------------------------------


async def raw_server(address: str) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(address)
    print("ready", flush=True)
    while True:
        frames = await sock.recv_multipart(copy=False)
        ident, body = frames[0], frames[1]
        call_id, method, args = msgpack.unpackb(body.bytes)
        if method == "echo_frame":  # send the payload frame back as it came, without a copy
            await sock.send_multipart([ident, msgpack.packb([call_id, None]), frames[2]], copy=False)
        elif len(frames) > 2:  # a payload frame: acknowledge its size
            await sock.send_multipart([ident, msgpack.packb([call_id, len(frames[2].buffer)])], copy=False)
        else:
            await sock.send_multipart([ident, msgpack.packb([call_id, args[0]])])


class RawClient:
    """One DEALER; ``call`` waits for the reply. ``multipart``: replies may carry a payload frame,
    received without a copy (for the bytes echo; the small-call baseline reads single frames)."""

    def __init__(self, address: str, *, multipart: bool = False) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(address)
        self.pending: dict[int, asyncio.Future[object]] = {}
        self.next_id = 0
        self.reader = asyncio.ensure_future(self._read_frames() if multipart else self._read())

    async def _read(self) -> None:
        while True:
            call_id, result = msgpack.unpackb(await self.sock.recv())
            self.pending.pop(call_id).set_result(result)

    async def _read_frames(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            call_id, result = msgpack.unpackb(frames[0].bytes)
            self.pending.pop(call_id).set_result(frames[1].buffer if len(frames) > 1 else result)

    async def call(self, arg: object, payload: object = None, method: str = "echo") -> object:
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = fut
        frames = [msgpack.packb([self.next_id, method, [arg]])]
        if payload is not None:
            frames.append(payload)
        await self.sock.send_multipart(frames, copy=False)
        return await fut

    def close(self) -> None:
        self.reader.cancel()
        self.sock.close(linger=0)
        self.ctx.term()


# --- the measurements, shared by every system ---------------------------------------------------


async def latency_samples(call, n: int) -> list[float]:
    samples = []
    for i in range(n):
        t = time.perf_counter()
        await call(i)
        samples.append(time.perf_counter() - t)
    return samples


def percentiles(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {"p50_us": samples[len(samples) // 2] * 1e6, "p99_us": samples[int(len(samples) * 0.99)] * 1e6}


async def interleaved(ours, raw, n_lat: int, seconds: float) -> tuple[dict[str, float], dict[str, float]]:
    """Latency and throughput of two systems in alternating rounds, so machine noise hits both alike."""
    for call in (ours, raw):
        await latency_samples(call, 200)  # warm up
    lat: dict[str, list[float]] = {"ours": [], "raw": []}
    tput: dict[str, list[float]] = {"ours": [], "raw": []}
    for _ in range(ROUNDS):
        lat["ours"] += await latency_samples(ours, n_lat // ROUNDS)
        lat["raw"] += await latency_samples(raw, n_lat // ROUNDS)
    for _ in range(ROUNDS):
        tput["ours"].append(await measure_throughput(ours, seconds / ROUNDS))
        tput["raw"].append(await measure_throughput(raw, seconds / ROUNDS))
    out = []
    for k in ("ours", "raw"):
        res = percentiles(lat[k])
        res["calls_per_s"] = statistics.median(tput[k])
        out.append(res)
    return out[0], out[1]


async def measure_throughput(call, seconds: float, in_flight: int = 64) -> float:
    count = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal count
        while time.perf_counter() < stop:
            await call(1)
            count += 1

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return count / (time.perf_counter() - t)


# --- rlactors ------------------------------------------------------------------------------------


class Echo(rlactors.Actor):
    async def echo(self, x: object) -> object:
        return x

    async def sink(self, t: object) -> int:
        return int(t.nbytes)

    async def pid(self) -> int:
        return os.getpid()

    async def sleep(self, s: float) -> None:
        await asyncio.sleep(s)


class Sender(rlactors.Actor):
    """Sends a 64 MiB tensor to another actor repeatedly and reports GiB/s (actor to actor)."""

    async def push(self, target: rlactors.ActorHandle, nbytes: int, reps: int) -> float:
        import torch

        t = torch.ones(nbytes // 4, dtype=torch.float32)
        await target.sink(t)
        start = time.perf_counter()
        for _ in range(reps):
            assert await target.sink(t) == nbytes
        return nbytes * reps / (time.perf_counter() - start) / 2**30


class RawSender(rlactors.Actor):
    """The same transfer with raw pyzmq, from a worker process to the raw server (baseline)."""

    async def push(self, address: str, nbytes: int, reps: int) -> float:
        payload = np.ones(nbytes, dtype=np.uint8)
        client = RawClient(address)
        await client.call(0, payload)
        start = time.perf_counter()
        for _ in range(reps):
            assert await client.call(0, payload) == nbytes
        rate = nbytes * reps / (time.perf_counter() - start) / 2**30
        client.close()
        return rate


async def bench_rlactors(
    address: str, seconds: float, n_lat: int, reps: int, raw_address: str, security: str = "curve"
) -> tuple[dict[str, float], dict[str, float]]:
    """rlactors and the raw baseline, measured in alternating rounds; returns (ours, raw)."""
    raw_client = RawClient(raw_address)
    async with rlactors.init(address=address, security=security) as cluster:
        echo = await cluster.spawn(Echo)
        res, raw_res = await interleaved(echo.echo, raw_client.call, n_lat, seconds)
        raw_client.close()
        # 64 MiB transfers vary a lot on a small shared machine: interleave rlactors and raw
        # rounds (each from a worker process to another process) and compare medians.
        sender = await cluster.spawn(Sender)
        raw_sender = await cluster.spawn(RawSender)
        ours, raw = [], []
        for _ in range(TENSOR_ROUNDS):
            ours.append(await sender.push(echo, MIB64, reps))
            raw.append(await raw_sender.push(raw_address, MIB64, reps))
        res["tensor_gib_s"] = statistics.median(ours)
        raw_res["tensor_gib_s"] = statistics.median(raw)
        res["bytes_gib_s"], raw_res["bytes_gib_s"] = await bytes_echo_rounds(echo.echo, raw_address, reps)
        # Death detection: kill -9 the actor's process while a call is pending.
        deaths = []
        for _ in range(5):
            victim = await cluster.spawn(Echo)
            pid = await victim.pid()
            pending = victim.sleep.submit(60)
            t = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(rlactors.ActorDiedError):
                await pending
            deaths.append(time.perf_counter() - t)
        res["death_ms"] = statistics.median(deaths) * 1e3
    return res, raw_res


async def bytes_echo_rate(call, reps: int) -> float:
    """64 MiB of ``bytes`` sent and returned ``reps`` times: GiB/s of payload over the round trips."""
    payload = b"\x01" * MIB64
    back = await call(payload)
    assert len(back) == MIB64
    del back
    start = time.perf_counter()
    for _ in range(reps):
        back = await call(payload)
        assert len(back) == MIB64
        del back  # a received view holds its message: drop it before the next one arrives
    return MIB64 * reps / (time.perf_counter() - start) / 2**30


async def bytes_echo_rounds(ours, raw_address: str, reps: int) -> tuple[float, float]:
    """The bytes echo, rlactors and raw in alternating rounds from this process; medians."""
    raw_client = RawClient(raw_address, multipart=True)
    try:

        async def raw(payload: bytes) -> object:
            return await raw_client.call(0, payload, method="echo_frame")

        rates: dict[str, list[float]] = {"ours": [], "raw": []}
        for _ in range(TENSOR_ROUNDS):
            rates["ours"].append(await bytes_echo_rate(ours, reps))
            rates["raw"].append(await bytes_echo_rate(raw, reps))
        return statistics.median(rates["ours"]), statistics.median(rates["raw"])
    finally:
        raw_client.close()


if MonarchActor is not None:

    class MonarchEcho(MonarchActor):
        """Defined in the script: Monarch sends the class to its processes by value (cloudpickle)."""

        @endpoint
        async def echo(self, x: object) -> object:
            return x


def bench_monarch(seconds: float, n_lat: int, reps: int) -> dict[str, float] | None:
    """Monarch (torchmonarch): the driver and one actor in a process of a one-process mesh."""
    if MonarchActor is None:
        print("monarch: not installed (pip install torchmonarch): skipped", flush=True)
        return None

    async def run() -> dict[str, float]:
        procs = this_host().spawn_procs(per_host={"procs": 1})
        try:
            actor = procs.spawn("echo", MonarchEcho)

            async def call(x: object) -> object:
                return await actor.echo.call_one(x)

            await latency_samples(call, 200)  # warm up
            res = percentiles(await latency_samples(call, n_lat))
            res["calls_per_s"] = await measure_throughput(call, seconds)
            res["bytes_gib_s"] = statistics.median([await bytes_echo_rate(call, reps) for _ in range(3)])
            return res
        finally:
            await procs.stop()

    return asyncio.run(run())


def bench_ray(seconds: float, n_lat: int, reps: int) -> dict[str, float] | None:
    try:
        import ray
    except ImportError:
        print("ray: not installed (pip install ray): skipped", flush=True)
        return None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class RayEcho:
            def echo(self, x):
                return x

            def sink(self, t):
                return t.nbytes

        @ray.remote
        class RaySender:
            def push(self, target, nbytes, reps):
                a = np.ones(nbytes, dtype=np.uint8)
                ray.get(target.sink.remote(a))
                start = time.perf_counter()
                for _ in range(reps):
                    ray.get(target.sink.remote(a))
                return nbytes * reps / (time.perf_counter() - start) / 2**30

        a = RayEcho.remote()
        ray.get(a.echo.remote(1))
        samples = []
        for i in range(n_lat):
            t = time.perf_counter()
            ray.get(a.echo.remote(i))
            samples.append(time.perf_counter() - t)
        samples.sort()
        res = {"p50_us": samples[len(samples) // 2] * 1e6, "p99_us": samples[int(len(samples) * 0.99)] * 1e6}
        count, stop = 0, time.perf_counter() + seconds
        t = time.perf_counter()
        refs = [a.echo.remote(1) for _ in range(64)]
        while time.perf_counter() < stop:  # keep 64 in flight
            done, refs = ray.wait(refs, num_returns=1)
            ray.get(done)
            count += 1
            refs.append(a.echo.remote(1))
        res["calls_per_s"] = count / (time.perf_counter() - t)
        s = RaySender.remote()
        res["tensor_gib_s"] = ray.get(s.push.remote(a, MIB64, reps))
        payload = b"\x01" * MIB64
        ray.get(a.echo.remote(payload))
        start = time.perf_counter()
        for _ in range(reps):
            assert len(ray.get(a.echo.remote(payload))) == MIB64
        res["bytes_gib_s"] = MIB64 * reps / (time.perf_counter() - start) / 2**30
        return res
    finally:
        ray.shutdown()


def start_raw_server(address: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--raw-server", address], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def fmt_ratio(x: float | None, base: float | None, lower_is_better: bool = False) -> str:
    if x is None or not base:
        return "-"
    r = base / x if lower_is_better else x / base
    return f"{r:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raw-server", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--no-monarch", action="store_true")
    args = ap.parse_args()
    try:
        import uvloop
    except ImportError:
        uvloop = None  # type: ignore[assignment]
    run = uvloop.run if uvloop else asyncio.run
    if args.raw_server:
        run(raw_server(args.raw_server))
        return
    seconds, n_lat, reps = (1.5, 1000, 3) if args.quick else (3.0, 3000, 8)
    results: dict[str, dict[str, float]] = {}
    tmp = tempfile.mkdtemp(prefix="rlx-bench-")
    # Each rlactors configuration is measured in alternating rounds with its own raw baseline.
    configs = [
        ("ipc", f"ipc://{tmp}/raw", "ipc", "curve"),
        ("tcp, CURVE", "tcp://127.0.0.1:5799", "tcp://127.0.0.1:0", "curve"),
        ("tcp, PLAIN", "tcp://127.0.0.1:5798", "tcp://127.0.0.1:0", "plain"),
    ]
    bases: dict[str, str] = {}
    for label, raw_addr, address, security in configs:
        server = start_raw_server(raw_addr)
        try:
            ours, raw = run(bench_rlactors(address, seconds, n_lat, reps, raw_addr, security))
            transport = "ipc" if raw_addr.startswith("ipc") else "tcp"
            results[f"raw pyzmq ({transport}) [{label}]"] = raw
            results[f"rlactors ({label})"] = ours
            bases[f"rlactors ({label})"] = f"raw pyzmq ({transport}) [{label}]"
        finally:
            server.kill()
    ray_res = None if args.no_ray else bench_ray(seconds, n_lat, reps)
    if ray_res:
        results["ray"] = ray_res
    monarch_res = None if args.no_monarch else bench_monarch(seconds, n_lat, reps)
    if monarch_res:
        results["monarch"] = monarch_res

    print(
        f"\nmachine: {platform.node()} {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}, "
        f"pyzmq {zmq.__version__}, uvloop {'yes' if uvloop else 'no'}"
    )
    print(
        f"{'system':34} {'p50 µs':>8} {'p99 µs':>8} {'calls/s@64':>11} {'tensor GiB/s':>12} {'bytes GiB/s':>11}  "
        f"{'p50 vs raw':>10} {'calls vs raw':>12} {'tensor vs raw':>13} {'bytes vs raw':>12} "
        f"{'calls vs Ray':>12} {'p50 vs Monarch':>14} {'calls vs Monarch':>16} {'bytes vs Monarch':>16}"
    )
    for name, r in results.items():
        base = results.get(bases.get(name, ""), {}) if name in bases else {}
        peers = name not in ("ray", "monarch") and not name.startswith("raw")
        mon = monarch_res if peers and monarch_res else {}
        print(
            f"{name:34} {r['p50_us']:8.0f} {r['p99_us']:8.0f} {r['calls_per_s']:11.0f} "
            f"{fmt_rate(r.get('tensor_gib_s')):>12} {fmt_rate(r.get('bytes_gib_s')):>11}  "
            f"{fmt_ratio(r['p50_us'], base.get('p50_us'), True):>10} "
            f"{fmt_ratio(r['calls_per_s'], base.get('calls_per_s')):>12} "
            f"{fmt_ratio(r.get('tensor_gib_s'), base.get('tensor_gib_s')):>13} "
            f"{fmt_ratio(r.get('bytes_gib_s'), base.get('bytes_gib_s')):>12} "
            f"{fmt_ratio(r['calls_per_s'], ray_res['calls_per_s'] if ray_res and peers else None):>12} "
            f"{fmt_ratio(r['p50_us'], mon.get('p50_us'), True):>14} "
            f"{fmt_ratio(r['calls_per_s'], mon.get('calls_per_s')):>16} "
            f"{fmt_ratio(r.get('bytes_gib_s'), mon.get('bytes_gib_s')):>16}"
        )
    for name, r in results.items():
        if "death_ms" in r:
            print(f"{name}: kill -9 -> ActorDiedError at the caller in {r['death_ms']:.0f} ms (median of 5)")
    print("(p50 ratios are theirs/ours: >= 0.8 vs raw means within 1.25x of raw; '-': not measured)")


if __name__ == "__main__":
    main()

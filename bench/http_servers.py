"""Serving CPU per request of the HTTP layers the endpoint could stand on, with and without the
bounds an outside-facing server needs (docs/operate/http-limits.md): our HTTP/1.1 server as it is
(nodes/rollout/http1/server.py, HTTPLimits' defaults, a key checked from the head), the same server
before the bounds (``--before COMMIT``: its file at that commit), and uvicorn (httptools, uvloop)
with a bare ASGI app that checks the same key.

Each server runs in a process of its own with the same trivial handler (a 60-byte JSON answer);
this process opens ``--connections`` keep-alive connections and on each posts a small JSON request,
then the next once answered, for ``--seconds``; the server's CPU (psutil: user + system) over the
requests answered is its cost per request. Variants interleaved, ``--repeats`` times; medians.

    python bench/http_servers.py --connections 64 --seconds 5 --repeats 3 --before 2ac25f3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-bench"
ANSWER = b'{"id":"x","object":"thing","data":[1,2,3],"ok":true,"n":12345}'
REQUEST = (
    b"POST /v1/thing HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
    + KEY.encode()
    + b"\r\nContent-Type: application/json\r\nContent-Length: 27\r\n\r\n"
    + b'{"model":"m","messages":[]}'
)


def serve(kind: str, port: int, module: str) -> None:
    import uvloop

    if kind == "uvicorn":
        import uvicorn

        async def app(scope, receive, send):  # type: ignore[no-untyped-def]
            if scope["type"] != "http":
                return
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if auth != b"Bearer " + KEY.encode():
                await send(
                    {"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]}
                )
                await send({"type": "http.response.body", "body": b""})
                return
            body = b""
            while True:
                m = await receive()
                body += m.get("body", b"")
                if not m.get("more_body"):
                    break
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", b"%d" % len(ANSWER)),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": ANSWER})

        uvicorn.run(
            app,
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            http="httptools",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=75,
        )
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("server_under_test", module)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["server_under_test"] = mod
    spec.loader.exec_module(mod)

    async def handler(req):  # type: ignore[no-untyped-def]
        if kind == "before" and req.headers.get("authorization") != "Bearer " + KEY:  # its key: the handler's
            return mod.Response(401)
        return mod.Response(200, ANSWER)

    def gate(req):  # type: ignore[no-untyped-def]
        return None if req.headers.get("authorization") == "Bearer " + KEY else mod.Response(401)

    async def main() -> None:
        error = lambda status, msg: mod.Response(status, msg.encode())  # noqa: E731
        server = (
            mod.HTTPServer(handler, error) if kind == "before" else mod.HTTPServer(handler, error, gate=gate)
        )
        await server.start("127.0.0.1", port)
        print("ready", flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


async def drive(port: int, connections: int, seconds: float) -> int:
    async def one(until: float) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        n = 0
        while time.monotonic() < until:
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            n += 1
        writer.close()
        return n

    until = time.monotonic() + seconds
    return sum(await asyncio.gather(*(one(until) for _ in range(connections))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default="", help="a commit: also measure the server's file at that commit")
    ap.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve[0], int(args.serve[1]), args.serve[2])
    import psutil
    import uvloop

    print(
        f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" {time.strftime('%Y-%m-%d %H:%M')}; {' '.join(sys.argv)}",
        flush=True,
    )
    ours = str(ROOT / "nodes" / "rollout" / "http1" / "server.py")
    variants = {"ours": ours, "uvicorn": ""}
    if args.before:
        old = tempfile.NamedTemporaryFile(suffix=".py", delete=False)
        old.write(
            subprocess.run(
                ["git", "show", f"{args.before}:nodes/rollout/http1/server.py"],
                cwd=ROOT,
                check=True,
                capture_output=True,
            ).stdout
        )
        old.close()
        variants["before"] = old.name
    results: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(args.repeats):
        for kind, module in variants.items():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            proc = subprocess.Popen(
                [sys.executable, __file__, "--serve", kind, str(port), module or "-"],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            try:
                for _ in range(200):  # until it listens
                    try:
                        socket.create_connection(("127.0.0.1", port), timeout=1).close()
                        break
                    except OSError:
                        time.sleep(0.05)
                uvloop.run(drive(port, args.connections, 1.0))  # warm-up
                ps = psutil.Process(proc.pid)
                cpu0 = sum(ps.cpu_times()[:2])
                n = uvloop.run(drive(port, args.connections, args.seconds))
                us = 1e6 * (sum(ps.cpu_times()[:2]) - cpu0) / n
            finally:
                proc.kill()
                proc.wait()
            results[kind].append(us)
            print(
                f"rep={rep} {kind:8s} {us:6.1f} us/request  {n / args.seconds:7.0f} requests/s"
                f"  load={os.getloadavg()[0]:.1f}",
                flush=True,
            )
    for kind, xs in results.items():
        print(f"median {kind:8s} {sorted(xs)[len(xs) // 2]:6.1f} us/request")


if __name__ == "__main__":
    main()

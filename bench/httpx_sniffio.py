"""What sniffio saves an httpx request (why the `rl` extra declares it): without sniffio, httpcore's
``current_async_library()`` tries ``import sniffio`` on every call, and a failed import searches
``sys.path``. Counts the calls per request to a local server and times one failed import here.

    .venv/bin/python bench/httpx_sniffio.py
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import time

import httpcore._synchronization as sync
import httpx


async def calls_per_request(n: int = 50) -> float:
    """``current_async_library`` calls per httpx request over a kept-alive connection."""
    calls = 0
    inner = sync.current_async_library

    def counted() -> str:
        nonlocal calls
        calls += 1
        return inner()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()  # the client left (or the bench ended)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sync.current_async_library = counted
    try:
        async with httpx.AsyncClient() as client:
            await client.get(f"http://127.0.0.1:{port}/")  # connect outside the count
            calls = 0
            for _ in range(n):
                await client.get(f"http://127.0.0.1:{port}/")
    finally:
        sync.current_async_library = inner
        server.close()
    return calls / n


def failed_import_s(n: int = 2000) -> float:
    """Seconds per failed ``import`` of a module that is not installed, with this process's sys.path."""
    t0 = time.perf_counter()
    for _ in range(n):
        try:
            importlib.import_module("sniffio_not_installed")
        except ImportError:
            pass
    return (time.perf_counter() - t0) / n


if __name__ == "__main__":
    per_request = asyncio.run(calls_per_request())
    per_import = failed_import_s()
    print(f"python {sys.version.split()[0]}, {len(sys.path)} sys.path entries")
    print(f"current_async_library calls per request: {per_request:.1f}")
    print(
        f"failed import: {per_import * 1e6:.0f} us; without sniffio: {per_request * per_import * 1e3:.2f} ms per request"
    )

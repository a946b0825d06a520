"""An HTTP proxy for tests, in front of a server: it records what the server served, parks
requests, plays a server gone or one that refuses a step."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from nodes.common.procs import free_port

__all__ = ["RecordingProxy"]


class RecordingProxy:
    """An HTTP proxy in front of a server that records the ``weight_version`` of every
    ``/generate`` answer it passes on: what the server served, and when.

    With ``hold`` set, ``/generate`` requests are parked before they reach the server (in flight,
    as their client sees it; ``held`` counts them); once ``gone`` is set, every request, a parked one
    included, is answered 502, as a proxy answers for a server that went away. A path in
    ``refuse`` is answered with its status at once, without reaching the server (a server that
    refuses that step: it takes no part in what the step asks)."""

    def __init__(self, target: str, refuse: dict[str, int] | None = None) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        self.generated: list[str | None] = []
        self.hold = False
        self.gone = threading.Event()
        self.held = 0
        self.refuse = dict(refuse or {})
        self.port = free_port()
        client = httpx.AsyncClient(base_url=target, timeout=None)  # group joins block for long

        async def forward(request: Request) -> Response:
            if request.url.path == "/generate" and self.hold:
                self.held += 1
                await asyncio.to_thread(self.gone.wait)  # set from the test's thread
            if self.gone.is_set():
                return Response(b"server gone", 502)
            if request.url.path in self.refuse:
                return Response(b"refused by the test's proxy", self.refuse[request.url.path])
            r = await client.request(
                request.method,
                request.url.path,
                content=await request.body(),
                headers={"content-type": request.headers.get("content-type", "application/json")},
            )
            if request.url.path == "/generate" and r.status_code == 200:
                self.generated.append(r.json()["meta_info"].get("weight_version"))
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

        app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT"])])
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)  # uvicorn offers no start event to wait on
        assert self.server.started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

"""Reading a streamed ``/generate`` (server-sent events) in the conformance tests."""

from __future__ import annotations

import json
from typing import Any

import httpx


async def events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed /generate; checks the framing and the final ``[DONE]``."""
    got: list[str] = []
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line:
                assert line.startswith("data: "), line
                got.append(line[len("data: ") :])
    assert got and got[-1] == "[DONE]" and "[DONE]" not in got[:-1]
    return [json.loads(e) for e in got[:-1]]

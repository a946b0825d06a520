"""Embedding actors in a FastAPI service: the service's own event loop talks to the cluster.

Run a cluster somewhere (``rlactors up cluster.toml``, or a driver with
``rlactors.init(address="tcp://127.0.0.1:0")``), then:

    RLACTORS_ADDRESS=tcp://127.0.0.1:PORT RLACTORS_SECRET_FILE=/path/to/secret \\
        uvicorn examples.fastapi_service:app --port 8000

    curl -X POST localhost:8000/count/5      # -> {"total": 5}
    curl localhost:8000/count                # -> {"total": 5}

With no RLACTORS_ADDRESS the service starts an embedded local cluster of its own.
No second event loop and no threads: `await handle.method()` runs on uvicorn's loop.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException

import rlactors


class Tally(rlactors.Actor):
    """A shared counter. Lives in its own worker process, shared by every service replica."""

    def __init__(self) -> None:
        self.total = 0

    async def add(self, k: int) -> int:
        self.total += k
        return self.total

    async def get(self) -> int:
        return self.total


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    if os.environ.get("RLACTORS_ADDRESS"):
        cluster = await rlactors.connect()
    else:
        cluster = await rlactors.init()
    # One named, detached actor: every replica of this service finds the same one.
    app.state.tally = await cluster.spawn(Tally, name="tally", get_if_exists=True, detached=True)
    try:
        yield
    finally:
        await cluster.close()


app = FastAPI(lifespan=lifespan)


@app.post("/count/{k}")
async def add(k: int) -> dict[str, int]:
    if k < 0:
        raise HTTPException(400, "k must be non-negative")
    return {"total": await app.state.tally.add(k)}


@app.get("/count")
async def total() -> dict[str, int]:
    return {"total": await app.state.tally.get()}

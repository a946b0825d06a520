"""Actor classes for cluster tests."""

from __future__ import annotations

import os
import time

import rlactors


class Member(rlactors.Actor):
    """A collective-group member with a sync thread (where torch.distributed runs)."""

    def env(self, keys: list[str]) -> dict[str, str | None]:
        return {k: os.environ.get(k) for k in keys}

    def broadcast(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values) if dist.get_rank() == 0 else torch.zeros(len(values))
        dist.broadcast(t, src=0)
        return t.tolist()

    def all_reduce(self, x: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([x])
        dist.all_reduce(t)
        return float(t.item())

    def busy(self, seconds: float) -> None:
        time.sleep(seconds)

    async def call_other(self, other: rlactors.ActorHandle, method: str, *args: object) -> str:
        """Call ``other.method(*args)`` from this actor; what happened, as text."""
        try:
            return repr(await getattr(other, method)(*args))
        except Exception as e:  # the test reads whatever the call raised
            return f"{type(e).__name__}: {e}"

    async def node(self) -> str:
        return rlactors.get_context().node_id

    async def pid(self) -> int:
        return os.getpid()

    async def hostname_ip(self) -> str:
        import socket

        return socket.gethostbyname(socket.gethostname())


class Prober(rlactors.Actor):
    """The rollout side of the multi-host RL test: our SGLang client, on its own host."""

    async def generate(self, urls: list[str], version: int, keys: tuple[str, str] = ("", "")) -> dict:
        from nodes.rollout.client import ClientConfig, GenRequest, SGLangClient
        from protocols.http.auth import ServerKeys

        client = SGLangClient(urls, ClientConfig(keys=ServerKeys(*keys)), version=version)
        try:
            res = await client.agenerate(
                GenRequest([5, 6, 7], {"max_new_tokens": 8, "ignore_eos": True}, rid="p")
            )
        finally:
            await client.aclose()
        return {"ids": res.output_ids, "versions": res.output_versions}


class Blob(rlactors.Actor):
    """Sends and receives payloads of a chosen size (the message-size bound)."""

    async def make(self, n: int) -> bytes:
        return b"x" * n

    async def size_of(self, data: object) -> int:
        return len(memoryview(data).cast("B"))  # type: ignore[arg-type]

    async def echo(self, data: object) -> object:
        return data

    async def block_loop(self, seconds: float) -> None:
        """Blocks this worker's event loop (a CPU-bound step in an async method)."""
        time.sleep(seconds)  # noqa: ASYNC251 (the point: it blocks the loop)

    async def bound(self) -> int:
        from rlactors.wire.transport import max_message_bytes

        return max_message_bytes()

"""Calls through typed handles that must type-check, with the types a checker must infer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, assert_type

import rlactors
from rlactors import ActorGroup, ActorHandle
from rlactors.api.handle import HandleProxy


class Counter(rlactors.Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start

    async def add(self, k: int, *, times: int = 1) -> int:
        self.n += k * times
        return self.n

    def name_of(self, prefix: str) -> str:
        return f"{prefix}{self.n}"

    async def count_to(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    def words(self) -> list[str]:
        return ["a"]

    def helper(self) -> int:
        return self.add.__name__.count("a")  # a method calling its own class as usual


class Retrying(HandleProxy[Counter]):
    """Calls made its own way (as nodes.rollout.actor.RolloutHandle retries across restarts)."""

    def __init__(self, handle: ActorHandle[Counter]) -> None:
        self.handle = handle

    async def _call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        return await getattr(self.handle, method)(*args, **kwargs)


async def main(cluster: rlactors.Cluster) -> None:
    h = await cluster.spawn(Counter, 5, name="c")
    assert_type(h, ActorHandle[Counter])
    assert_type(await h.add(2), int)
    assert_type(await h.add(2, times=3), int)
    assert_type(await h.name_of("n"), str)
    assert_type(h.add.submit(2), asyncio.Future[int])
    assert_type(h.add.tell(2), None)
    async for i in h.count_to(3):
        assert_type(i, int)
    assert_type(h.actor_id, str)
    assert_type(h.name, str | None)

    group = await cluster.spawn_group(Counter, 2)
    assert_type(group, ActorGroup[Counter])
    assert_type(await group.add(1), list[int])
    assert_type(await group.words(), list[list[str]])
    assert_type(await group.add.scatter([(1,), (2,)]), list[int])
    group.add.tell(1)
    assert_type(group[0], ActorHandle[Counter])

    proxy = Retrying(h)
    assert_type(await proxy.add(2, times=3), int)
    assert_type(await proxy.name_of("n"), str)
    assert_type(proxy.handle, ActorHandle[Counter])

    anyone = await cluster.get_actor("c")  # unknown class: calls stay unchecked
    assert_type(anyone, ActorHandle[Any])
    assert_type(await anyone.whatever(1, 2), Any)
    await cluster.kill(h)

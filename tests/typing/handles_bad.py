"""Calls through typed handles that must NOT type-check: each line marked `# error: CODE` must be
reported by mypy with that error code, and no other line may be."""

from __future__ import annotations

import rlactors
from rlactors.api.handle import HandleProxy


class Counter(rlactors.Actor):
    async def add(self, k: int) -> int:
        return k

    def name_of(self, prefix: str) -> str:
        return prefix


class Retrying(HandleProxy[Counter]):
    def __init__(self, handle: rlactors.ActorHandle[Counter]) -> None:
        self.handle = handle


async def main(cluster: rlactors.Cluster) -> None:
    h = await cluster.spawn(Counter)
    await h.add("2")  # error: arg-type
    await h.add()  # error: call-arg
    await h.add(1, 2)  # error: call-arg
    await h.add(k=1, j=2)  # error: call-arg
    h.add.submit("x")  # error: arg-type
    h.add.tell(None)  # error: arg-type
    text: str = await h.add(1)  # noqa: F841  # error: assignment
    await h.name_of(3)  # error: arg-type
    await h.no_such_method()  # error: attr-defined
    group = await cluster.spawn_group(Counter, 2)
    await group.add("1")  # error: arg-type
    totals: list[str] = await group.add(1)  # noqa: F841  # error: assignment
    group.name_of.tell(1)  # error: arg-type
    proxy = Retrying(h)
    await proxy.add("1")  # error: arg-type
    await proxy.add(1, 2)  # error: call-arg
    await proxy.no_such_method()  # error: attr-defined
    word: str = await proxy.add(1)  # noqa: F841  # error: assignment

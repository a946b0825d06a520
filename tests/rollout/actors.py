"""Actor classes the rollout tests spawn in worker processes (importable by the workers)."""

from __future__ import annotations

import asyncio
from typing import Any

from nodes.plane.buffer import BufferActor


class SlowBeginBuffer(BufferActor):
    """A buffer whose ``begin_many`` answers after 20 ms, as a busy buffer actor's does, and counts the
    episodes whose begins wait at once: an admission that begins one episode at a time never has two."""

    delay_s = 0.02

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.begins_waiting = self.peak_begins_waiting = 0

    async def begin_many(self, holder_id: str, episodes: Any, admit_version: int) -> list[bool]:  # type: ignore[override]
        self.begins_waiting += len(episodes)
        self.peak_begins_waiting = max(self.peak_begins_waiting, self.begins_waiting)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.begins_waiting -= len(episodes)
        return super().begin_many(holder_id, episodes, admit_version)

    def peak_begins(self) -> int:
        """The most begins that were waiting at once."""
        return self.peak_begins_waiting

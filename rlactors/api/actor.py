"""The actor base class and the context an actor sees: the top floor of the runtime, for users.

How a class's methods are served is in :mod:`rlactors.wire.methods`; how the class reaches a worker,
in :mod:`rlactors.base.classpath`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import structlog

from rlactors.base.errors import ClusterError

if TYPE_CHECKING:
    from rlactors.api.cluster import Cluster
    from rlactors.api.handle import ActorHandle

__all__ = ["Actor", "ActorContext", "get_context"]

log = structlog.get_logger("rlactors.api.actor")


class Actor:
    """Base class of actors. Subclass it; public methods become remotely callable.

    ``async def`` methods run concurrently on the worker's event loop (up to
    ``max_concurrency``); plain ``def`` methods run in order on one worker thread, so a long
    computation never stops the loop from answering; generator methods stream. Optional hooks:
    ``async def on_start(self)`` runs on the worker's loop after the constructor,
    ``async def on_stop(self)`` before a clean exit.

    ``class Buffer(Core, rlactors.Actor, sync_methods="loop")`` runs the plain ``def`` methods
    on the event loop instead, each in one go, in arrival order: for quick methods of an object
    that lives on the loop (one that uses asyncio events or tasks), which may then be served as
    they are, without ``async`` wrappers. A method that may block is marked
    :func:`blocking` and still runs on the worker thread.

    An actor that must act when another one dies (to release what it held) asks
    ``rlactors.get_context().watch(other, callback, *args)``.
    """

    _sync_methods: Literal["thread", "loop"] = "thread"

    def __init_subclass__(
        cls, *, sync_methods: Literal["thread", "loop"] | None = None, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if sync_methods is not None:
            if sync_methods not in ("thread", "loop"):
                raise ValueError(
                    f"{cls.__qualname__}: sync_methods must be 'thread' or 'loop', got {sync_methods!r}"
                )
            cls._sync_methods = sync_methods


@dataclass
class ActorContext:
    """What an actor knows about itself and the cluster it runs in."""

    actor_id: str
    name: str | None
    node_id: str
    cluster: Cluster
    restarts: int = 0
    _watches: dict[Hashable, asyncio.Task[None]] = field(default_factory=dict, init=False, repr=False)

    def watch(self, actor: ActorHandle[Any] | str, on_death: Callable[..., Any], *args: Hashable) -> None:
        """Call ``on_death(*args)`` on this actor's loop when ``actor`` (its current incarnation) dies.

        For an actor that holds something on behalf of others (leases, episodes in flight) and must
        release it when they die. If the head cannot be asked any more, ``actor`` is taken for
        dead: a false death costs less than a leak. ``on_death`` may be a coroutine function. The
        watch is a task of this actor, cancelled when it stops; while it waits, watching again with
        the same actor, callback and arguments does nothing. Call it on the actor's loop: from an
        ``async`` method or hook, or a plain one of a ``sync_methods="loop"`` actor.
        """
        actor_id = actor if isinstance(actor, str) else actor.actor_id
        key = (actor_id, on_death, args)
        if key in self._watches:
            return
        task = asyncio.get_running_loop().create_task(
            self._watch(actor_id, on_death, args), name=f"watch-{actor_id}"
        )
        self._watches[key] = task
        task.add_done_callback(lambda _: self._watches.pop(key, None))

    async def _watch(self, actor_id: str, on_death: Callable[..., Any], args: tuple[Hashable, ...]) -> None:
        try:
            info = await self.cluster.watch(actor_id)
        except Exception as e:  # any failure of the watch itself counts as the death it waits for
            log.warning("watch failed: taking the actor for dead", watched=actor_id, error=repr(e))
            info = {"reason": f"watch failed: {e!r}"}
        log.info("watched actor died", watched=actor_id, reason=info.get("reason"))
        try:
            result = on_death(*args)
            if inspect.isawaitable(result):
                await result
        except Exception:  # a user's callback: logged, never allowed to end the watch loop
            log.exception("death callback failed", watched=actor_id)

    async def _stop_watches(self) -> None:
        tasks = list(self._watches.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_context: ActorContext | None = None


def get_context() -> ActorContext:
    """The running actor's context. Raises outside an actor's worker process."""
    if _context is None:
        raise ClusterError("get_context() is only available inside an actor's worker process")
    return _context


def _set_context(ctx: ActorContext | None) -> None:
    global _context
    _context = ctx

"""Awaitable handles to actors, and groups of them.

``handle.method(*args)`` sends the call at once and returns an awaitable future;
``handle.method.submit(...)`` is the same, spelled explicitly; ``handle.method.tell(...)``
sends without waiting for any reply; an async-generator method returns an async iterator.
Handles are plain values: they can be passed to other actors as call arguments.

Handles are typed by their actor class: ``spawn(Counter)`` gives an ``ActorHandle[Counter]``. With
the mypy plugin ``rlactors.mypy`` enabled, ``h.add`` is an ``ActorMethod[(k: int), int]`` made from
``Counter.add``, so a checker knows a call's arguments and that ``await h.add(2)`` is an ``int``;
without it (pyright has no plugins) a handle's methods are ``Any``: unchecked, as before.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, cast

from protocols.runtime import codec, wire
from rlactors.base.errors import ActorDiedError
from rlactors.base.forensics import CURRENT_CALL
from rlactors.wire.client import Args, StreamCall
from rlactors.wire.methods import ASYNCGEN, GEN
from rlactors.wire.runtime import GroupCall, current_client

__all__ = ["ActorGroup", "ActorHandle", "ActorMethod", "GroupMethod", "HandleProxy", "StreamMethod"]

T = TypeVar("T")  # the actor class
P = ParamSpec("P")  # a method's parameters, less self
R = TypeVar("R")  # what a call returns (awaited, for an async method)
Y = TypeVar("Y", covariant=True)  # what a generator method yields


class ActorMethod(Generic[P, R]):
    """One method of a remote actor: ``await m(...)``, ``m.submit(...)`` or ``m.tell(...)``."""

    __slots__ = ("_handle", "_kind", "_name")

    def __init__(self, handle: ActorHandle, name: str, kind: str) -> None:
        self._handle = handle
        self._name = name
        self._kind = kind

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R]:
        """Send the call now and return a coroutine for its result (a stream for generator methods).

        The call leaves when this is called, not when awaited, so calls keep their order;
        the coroutine works with ``await``, ``asyncio.create_task`` and task groups.
        """
        if self._kind in (ASYNCGEN, GEN):  # typed as a StreamMethod by the plugin
            return cast(Coroutine[Any, Any, R], self.stream(*args, **kwargs))
        return _result(self.submit(*args, **kwargs))

    def _not_a_generator(self, what: str) -> None:
        if self._kind in (ASYNCGEN, GEN):
            raise TypeError(
                f"{self._name} is a generator method: use `async for x in handle.{self._name}(...)`, not {what}"
            )

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[R]:
        """Send the call now; cancelling the returned future cancels the remote coroutine."""
        return self._submit(args, kwargs)

    def tell(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Fire and forget: no result, errors are only logged by the actor."""
        self._tell(args, kwargs)

    def _submit(self, args: Args, kwargs: dict[str, Any]) -> asyncio.Future[R]:
        self._not_a_generator(".submit()")
        h = self._handle
        return current_client().call_actor(h.actor_id, h.address, self._name, args, kwargs)

    def _tell(self, args: Args, kwargs: dict[str, Any]) -> None:
        self._not_a_generator(".tell()")
        h = self._handle
        current_client().tell_actor(h.actor_id, h.address, self._name, args, kwargs)

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> StreamCall:
        """Call a generator method; iterate the result with ``async for``."""
        h = self._handle
        return current_client().stream_actor(h.actor_id, h.address, self._name, args, kwargs)

    def __repr__(self) -> str:
        return f"<ActorMethod {self._handle.name or self._handle.actor_id}.{self._name} ({self._kind})>"


class StreamMethod(Protocol[P, Y]):
    """How a checker sees a generator method of a remote actor: ``async for x in m(...)``.

    At run time it is an :class:`ActorMethod`; this protocol only types its calls.
    """

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[Y]: ...

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[Y]: ...


async def _result(fut: asyncio.Future[R]) -> R:
    return await fut


class ActorHandle(Generic[T]):
    """A reference to a live actor of class ``T``. Attribute access gives its methods."""

    __slots__ = ("_methods", "actor_id", "address", "class_name", "name")

    def __init__(
        self,
        actor_id: str,
        address: str,
        methods: dict[str, str],
        *,
        name: str | None = None,
        class_name: str = "",
    ) -> None:
        self.actor_id = actor_id
        self.address = address
        self.name = name
        self.class_name = class_name
        self._methods = methods

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> ActorHandle[Any]:
        return cls(
            info["actor_id"],
            info["address"],
            info["methods"],
            name=info.get("name"),
            class_name=info.get("class_name", ""),
        )

    # Any, not ActorMethod[..., Any]: without the plugin a checker cannot tell a generator method
    # (a stream) from the others; with it, each method has its own type (rlactors.mypy).
    def __getattr__(self, name: str) -> Any:
        try:
            kind = self._methods[name]
        except KeyError:
            label = self.class_name or "actor"
            raise AttributeError(
                f"{label} {self.name or self.actor_id} has no public method {name!r}"
            ) from None
        return ActorMethod(self, name, kind)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ActorHandle) and other.actor_id == self.actor_id

    def __hash__(self) -> int:
        return hash(self.actor_id)

    def __repr__(self) -> str:
        who = f"{self.name!r} " if self.name else ""
        return f"<ActorHandle {who}{self.class_name} {self.actor_id}>"


def _to_wire(h: ActorHandle[Any]) -> list[Any]:
    return [h.actor_id, h.address, h._methods, h.name, h.class_name]


def _from_wire(v: list[Any]) -> ActorHandle[Any]:
    return ActorHandle(v[0], v[1], v[2], name=v[3], class_name=v[4])


codec.register_type(ActorHandle, "rlactors:ActorHandle", _to_wire, _from_wire)


class ActorGroup(Sequence[ActorHandle[T]]):
    """Actors that work as one (e.g. the ranks of a collective group): a method call calls every member.

    ``await group.step(batch)`` sends the call to every member at once, with the arguments
    encoded once, and returns the results in member order. When a member fails, the others get
    ``grace_s`` seconds to finish (a retry must not find a member still in the old call); any
    still running then are cancelled, and the call raises. It raises an
    :class:`ActorDiedError` in preference to its peers' errors: when one rank of a collective dies,
    the others fail in their collectives with a transport error, and the dead one is the cause.
    Cancelling the caller cancels every member's call. ``group.step.scatter([...])`` sends each
    member its own arguments under the same rules; ``group.step.tell(...)`` sends without replies.
    A cancelled member call stops an ``async`` method; a sync method already running finishes.
    """

    def __init__(self, handles: Sequence[ActorHandle[T]], *, grace_s: float | None = 60.0) -> None:
        """``grace_s``: how long members may finish after one failed (None: as long as they take)."""
        self.handles = list(handles)
        self.grace_s = grace_s

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, i: int) -> ActorHandle[T]:  # type: ignore[override]
        return self.handles[i]

    def __getattr__(self, name: str) -> GroupMethod[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        return GroupMethod([getattr(h, name) for h in self.handles], self.grace_s)

    def __repr__(self) -> str:
        return f"<ActorGroup of {len(self.handles)}>"


class HandleProxy(Generic[T]):
    """A stand-in for an ``ActorHandle[T]`` that makes each call its own way (e.g. again after the
    actor restarts): ``await proxy.method(...)`` calls :meth:`_call` with the method's name.

    With the mypy plugin, ``proxy.add`` of a ``HandleProxy[Counter]`` subclass is typed from
    ``Counter.add``: ``(k: int) -> Coroutine[Any, Any, int]``; a name the class has no public
    method for is an error.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return functools.partial(self._call, name)

    async def _call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` of the actor with ``args`` and ``kwargs``; its result."""
        raise NotImplementedError


class GroupMethod(Generic[P, R]):
    """One method of every member of an :class:`ActorGroup`."""

    __slots__ = ("_grace_s", "_methods")

    def __init__(self, methods: list[ActorMethod[P, R]], grace_s: float | None) -> None:
        self._methods = methods
        self._grace_s = grace_s

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, list[R]]:
        """Send the call to every member now (the arguments encoded once); a coroutine for the
        results, in member order, under the group's failure rules (see :class:`ActorGroup`)."""
        encoded = wire.encode_args(args, kwargs)
        return self._gather([m._submit(encoded, {}) for m in self._methods])

    def scatter(self, per_member_args: Sequence[Sequence[Any]]) -> Coroutine[Any, Any, list[R]]:
        """Call member i with ``per_member_args[i]``; results and failures as for a call."""
        if len(per_member_args) != len(self._methods):
            raise ValueError(
                f"scatter needs {len(self._methods)} argument tuples, got {len(per_member_args)}"
            )
        calls = [m._submit(tuple(a), {}) for m, a in zip(self._methods, per_member_args, strict=True)]
        return self._gather(calls)

    async def _gather(self, calls: list[asyncio.Future[Any]]) -> list[Any]:
        # held while it gathers: a member that failed is still what the call waits on (forensics)
        members = [(m._handle.actor_id, m._handle.name) for m in self._methods]
        call = GroupCall(self._methods[0]._name if self._methods else "", members, calls, CURRENT_CALL.get())
        with current_client().group_call(call):
            return await _gather(calls, self._grace_s)

    def tell(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Send to every member without waiting for replies (the arguments encoded once)."""
        encoded = wire.encode_args(args, kwargs)
        for m in self._methods:
            m._tell(encoded, {})


async def _gather(calls: list[asyncio.Future[R]], grace_s: float | None) -> list[R]:
    if not calls:
        return []
    try:
        await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
        if not all(c.done() for c in calls):  # one failed: the others may still finish
            await asyncio.wait(calls, timeout=grace_s)
    finally:  # the caller was cancelled, or members still run after the grace: stop them
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
    errors = [e for c in calls if not c.cancelled() and (e := c.exception()) is not None]
    if errors:
        died = [e for e in errors if isinstance(e, ActorDiedError)]
        raise (died or errors)[0]
    return [c.result() for c in calls]


async def drain(handle: ActorHandle[Any] | ActorGroup[Any]) -> None:
    """Wait until what this process has sent to ``handle``'s actor (each member of a group) is
    below the send-backlog bound (``send_backlog_bytes``): the pushback for a sender that does not
    await its results, as ``await writer.drain()`` after ``writer.write()`` in asyncio. Calls and
    tells never block and are never refused; a loop of ``tell``/``submit`` to an actor that may
    fall behind awaits this between sends, so its memory stays bounded::

        for item in items:
            sink.put.tell(item)
            await rlactors.drain(sink)
    """
    members = handle.handles if isinstance(handle, ActorGroup) else [handle]
    client = current_client()
    for h in members:
        await client.drain_actor(h.actor_id, h.address)

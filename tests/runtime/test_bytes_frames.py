"""bytes, bytearray and memoryview over the inline limit travel as their own frames, without a copy
(as arrays do), arrive as read-only views of the message, and are freed when the call that received
them returns."""

from __future__ import annotations

import asyncio
import dataclasses
import weakref

import numpy as np
import pytest

import rlactors
from protocols.runtime import codec, wire

BIG = codec.INLINE_LIMIT + 1


@codec.register
@dataclasses.dataclass
class Chunk:
    name: str
    data: bytes


class Store(rlactors.Actor):
    """Receives buffers and remembers only a weak reference to the message frame behind each."""

    def __init__(self) -> None:
        self.frames: list[weakref.ref[object]] = []

    def _keep(self, data: memoryview) -> int:
        assert isinstance(data, memoryview) and data.readonly
        self.frames.append(weakref.ref(data.obj))
        return len(data)

    async def take(self, data: memoryview) -> int:
        return self._keep(data)

    def take_sync(self, data: memoryview) -> int:  # runs on the worker thread
        return self._keep(data)

    async def take_and_fail(self, data: memoryview) -> None:
        self._keep(data)
        raise ValueError("refused")

    async def alive(self) -> list[bool]:
        return [ref() is not None for ref in self.frames]

    async def echo(self, data: object) -> object:
        return data

    async def info(self, data: object) -> list[object]:
        return [type(data).__name__, bool(getattr(data, "readonly", False))]


# --- the codec ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [bytes, bytearray, lambda b: memoryview(bytes(b))])
def test_a_large_bytes_like_is_its_own_frame_without_a_copy(make) -> None:
    value = make(b"\x07" * 5000)
    frames = codec.encode(value)
    assert len(frames) == 2 and frames[1] is value  # handed to ZeroMQ as it is
    out = codec.decode(frames)
    assert isinstance(out, memoryview) and out.readonly and out == b"\x07" * 5000


def test_small_bytes_stay_inline_and_arrive_as_bytes() -> None:
    frames = codec.encode([b"a" * codec.INLINE_LIMIT, bytearray(10)])
    assert len(frames) == 1
    assert codec.decode(frames) == [b"a" * codec.INLINE_LIMIT, b"\x00" * 10]


def test_arguments_kwargs_and_fields_are_lifted_where_they_are() -> None:
    a, b, c = b"a" * BIG, bytearray(b"b" * BIG), b"c" * BIG
    encoded = wire.encode_args((a, (1, b)), {"chunk": Chunk("x", c), "n": 3})
    assert [id(f) for f in encoded.buffers] == [id(a), id(b), id(c)]
    env = wire.encode_call(7, None, "m", encoded, 0)
    _kind, _call, _target, _method, args, kwargs, _flags = wire.decode_envelope(env)
    assert args[0] == a and args[1][0] == 1 and args[1][1] == b
    assert kwargs["chunk"].name == "x" and kwargs["chunk"].data == c and kwargs["n"] == 3


def test_a_buffer_deep_in_a_long_list_goes_inline() -> None:
    """The encoder looks at no more than LIFT_BUDGET items: a long list costs what it did."""
    value = [*range(codec.LIFT_BUDGET), b"z" * BIG]
    frames = codec.encode(value)
    assert len(frames) == 1 and codec.decode(frames) == value


def test_a_strided_memoryview_is_sent_as_its_bytes() -> None:
    view = memoryview(b"ab" * BIG)[::2]
    out = codec.decode(codec.encode(view))
    assert out == b"a" * BIG


@pytest.mark.parametrize("header", [["bytes", 5], ["pickle", 1], ["bytes"], "bytes"])
def test_a_bad_buffer_reference_is_a_codec_error(header) -> None:
    import msgpack

    body = msgpack.packb(msgpack.ExtType(codec.EXT_BUFFER, msgpack.packb(header)))
    with pytest.raises(codec.CodecError):
        codec.decode([body, b"x" * BIG])


def test_a_decoded_view_holds_only_its_frame_and_frees_it() -> None:
    frame = np.frombuffer(b"q" * BIG, dtype=np.uint8).copy()  # stands in for a zmq.Frame
    ref = weakref.ref(frame)
    frames = [codec.encode([1, b"q" * BIG])[0], frame]
    del frame
    out = codec.decode(frames)
    del frames
    assert ref() is not None and out[1] == b"q" * BIG
    del out
    assert ref() is None  # no reference cycle keeps it until a garbage collection


# --- through real worker processes --------------------------------------------------------------


async def test_buffers_round_trip_through_an_actor(cluster) -> None:
    store = await cluster.spawn(Store)
    for value in (b"\x01" * (8 << 20), bytearray(b"\x02" * BIG), memoryview(b"\x03" * BIG)):
        assert await store.info(value) == ["memoryview", True]
        back = await store.echo(value)
        assert isinstance(back, memoryview) and back == value
    assert await store.echo(b"small") == b"small"
    assert await store.echo({"a": b"x" * BIG, "b": [b"y" * BIG]}) == {"a": b"x" * BIG, "b": [b"y" * BIG]}


async def test_what_a_call_received_is_freed_when_it_returns(cluster) -> None:
    store = await cluster.spawn(Store)
    payload = b"\x05" * (4 << 20)
    assert await store.take(payload) == len(payload)
    assert await store.take_sync(payload) == len(payload)
    with pytest.raises(ValueError, match="refused"):
        await store.take_and_fail(payload)
    group = rlactors.ActorGroup([store, store])
    assert await group.take(payload) == [len(payload)] * 2  # encoded once, sent twice
    assert await store.alive() == [False] * 5  # every message frame is gone, with no gc pass


async def test_a_received_result_is_freed_with_the_last_reference(cluster) -> None:
    store = await cluster.spawn(Store)
    back = await store.echo(b"\x06" * (4 << 20))
    frame = weakref.ref(back.obj)
    assert frame() is not None
    del back
    await asyncio.sleep(0)  # one loop turn: the reply future's done-callbacks still hold it until then
    assert frame() is None

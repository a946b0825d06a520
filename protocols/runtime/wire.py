"""Runtime wire messages: versioned msgpack envelopes, batched into ZeroMQ multipart messages.

An envelope is a msgpack array ``[version, kind, call_id, ...]``:

========== =============================================================
CALL        ``[V, CALL, call_id, target, method, args, kwargs, flags]``
RESULT      ``[V, RESULT, call_id, value]``
ERROR       ``[V, ERROR, call_id, {type, message, traceback, args}]``
CANCEL      ``[V, CANCEL, call_id]``
STREAM_ITEM ``[V, STREAM_ITEM, call_id, value]``
STREAM_END  ``[V, STREAM_END, call_id]``
STREAM_ACK  ``[V, STREAM_ACK, call_id, n_items]`` (credit back to the producer)
PING / PONG ``[V, PING|PONG, call_id]``
========== =============================================================

Several envelopes queued in the same event-loop turn travel in one ZeroMQ message:
frame 0 is a msgpack list with the number of frames of each envelope, then the envelopes'
frames in order (each envelope: its msgpack body, then its raw array buffers).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import msgpack

from protocols.runtime import codec

__all__ = [
    "MAX_ENVELOPES_PER_MESSAGE",
    "PROTOCOL_VERSION",
    "EncodedArgs",
    "Flags",
    "Kind",
    "WireError",
    "decode_envelope",
    "encode_args",
    "encode_call",
    "encode_envelope",
    "join_batch",
    "peek_header",
    "split_batch",
]

PROTOCOL_VERSION = 1
MAX_ENVELOPES_PER_MESSAGE = 4096

# Number of fields (after version and kind) each kind carries.
_ARITY = {1: 6, 2: 2, 3: 2, 4: 1, 5: 2, 6: 1, 7: 2, 8: 1, 9: 1}


class Kind(IntEnum):
    """Envelope kinds."""

    CALL = 1
    RESULT = 2
    ERROR = 3
    CANCEL = 4
    STREAM_ITEM = 5
    STREAM_END = 6
    STREAM_ACK = 7
    PING = 8
    PONG = 9


class Flags:
    """Bits of a CALL's ``flags`` field."""

    NO_REPLY = 1  # tell(): the callee sends nothing back
    STREAM = 2  # the method is an async generator: expect STREAM_ITEM ... STREAM_END


class WireError(ValueError):
    """A message that does not follow this protocol. The receiver drops it and keeps serving."""


def encode_envelope(kind: int, call_id: int, *fields: Any) -> list[Any]:
    """Frames of one envelope."""
    return codec.encode([PROTOCOL_VERSION, kind, call_id, *fields])


class EncodedArgs:
    """A call's arguments, encoded once to go out in several CALL envelopes (a call to a group).

    ``body`` is the msgpack of the args array followed by the kwargs map; ``buffers`` are their
    raw array frames, numbered from 1 as in an envelope of their own. Like :func:`codec.encode`,
    it holds the caller's buffers without a copy.
    """

    __slots__ = ("body", "buffers")

    def __init__(self, body: bytes, buffers: list[Any]) -> None:
        self.body = body
        self.buffers = buffers


def encode_args(args: Sequence[Any], kwargs: dict[str, Any]) -> EncodedArgs:
    """Encode a call's arguments once, for :func:`encode_call`."""
    frames = codec.encode([list(args), kwargs])
    # A msgpack array is a header followed by its items' bytes: without the header (one byte for
    # two items), the bytes are the two items, ready to be spliced into an envelope.
    assert frames[0][0] == 0x92, "a two-item msgpack array starts with 0x92"
    return EncodedArgs(frames[0][1:], frames[1:])


def encode_call(call_id: int, target: str | None, method: str, args: EncodedArgs, flags: int) -> list[Any]:
    """Frames of a CALL whose arguments were encoded by :func:`encode_args`.

    Decodes exactly as ``encode_envelope(Kind.CALL, call_id, target, method, args, kwargs, flags)``;
    only the small header is encoded per call, the arguments' bytes and buffers are shared.
    """
    head = [PROTOCOL_VERSION, Kind.CALL, call_id, target, method]
    body = b"".join(
        (_CALL_ARRAY, *(msgpack.packb(x, use_bin_type=True) for x in head), args.body, msgpack.packb(flags))
    )
    return [body, *args.buffers]


_CALL_ARRAY = bytes([0x90 | (2 + _ARITY[Kind.CALL])])  # msgpack header of a CALL's 8-item array


def decode_envelope(frames: Sequence[Any]) -> list[Any]:
    """Decode and validate one envelope; returns ``[kind, call_id, *fields]``."""
    try:
        msg = codec.decode(frames)
    except codec.CodecError as e:
        raise WireError(str(e)) from e
    if not isinstance(msg, list) or len(msg) < 3:
        raise WireError(f"envelope is not an array of at least 3 items: {type(msg).__name__}")
    version, kind = msg[0], msg[1]
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    arity = _ARITY.get(kind) if isinstance(kind, int) else None
    if arity is None:
        raise WireError(f"unknown envelope kind {kind!r}")
    if len(msg) != 2 + arity:
        raise WireError(f"{Kind(kind).name} envelope has {len(msg) - 2} fields, expected {arity}")
    if not isinstance(msg[2], int):
        raise WireError("call id is not an integer")
    if kind == Kind.CALL:
        target, method, args, kwargs, flags = msg[3:]
        if not isinstance(method, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
            raise WireError("CALL needs a method name, an args array and a kwargs map")
        if not isinstance(flags, int) or not isinstance(target, (str, type(None))):
            raise WireError("CALL has a bad target or flags")
    elif kind == Kind.ERROR and not isinstance(msg[3], dict):
        raise WireError("ERROR payload is not a map")
    return msg[1:]


def peek_header(frames: Sequence[Any]) -> tuple[int, int, int] | None:
    """``(kind, call_id, flags)`` of an envelope whose payload could not be decoded, or None.

    Reads the body with every extension type ignored, so a reply or call carrying an unknown
    type can still be answered (or failed) by its id instead of leaving its caller waiting.
    """
    try:
        body = getattr(frames[0], "bytes", frames[0])
        raw = msgpack.unpackb(body, raw=False, strict_map_key=False, ext_hook=lambda code, data: None)
    except Exception:  # bytes from a peer: msgpack raises several unrelated types on garbage
        return None
    if not (isinstance(raw, list) and len(raw) >= 3 and raw[0] == PROTOCOL_VERSION):
        return None
    if not (isinstance(raw[1], int) and isinstance(raw[2], int)):
        return None
    flags = raw[7] if raw[1] == Kind.CALL and len(raw) == 8 and isinstance(raw[7], int) else 0
    return raw[1], raw[2], flags


def join_batch(envelopes: Sequence[Sequence[Any]]) -> list[Any]:
    """Join the frames of several envelopes into one multipart message."""
    counts = [len(e) for e in envelopes]
    out: list[Any] = [msgpack.packb(counts)]
    for e in envelopes:
        out.extend(e)
    return out


def split_batch(frames: Sequence[Any]) -> list[Sequence[Any]]:
    """Split a multipart message made by :func:`join_batch` into per-envelope frame lists."""
    if not frames:
        raise WireError("empty message")
    head = frames[0]
    head = getattr(head, "bytes", head)
    try:
        counts = msgpack.unpackb(head)
    except Exception as e:  # bytes from a peer: msgpack raises several unrelated types on garbage
        raise WireError(f"malformed batch header: {type(e).__name__}") from e
    if (
        not isinstance(counts, list)
        or not counts
        or len(counts) > MAX_ENVELOPES_PER_MESSAGE
        or not all(isinstance(c, int) and c >= 1 for c in counts)
        or sum(counts) != len(frames) - 1
    ):
        raise WireError("batch header does not match the frames")
    out = []
    i = 1
    for c in counts:
        out.append(frames[i : i + c])
        i += c
    return out

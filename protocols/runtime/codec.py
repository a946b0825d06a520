"""Serialization for everything that crosses a process boundary: msgpack plus raw frames.

A message is a list of frames. Frame 0 is msgpack; tensors and numpy arrays inside it are
replaced by a small header (dtype, shape, frame index) and their bytes travel as their own
frames, handed to ZeroMQ without a copy. So do ``bytes``, ``bytearray`` and ``memoryview``
values over :data:`INLINE_LIMIT` found within a few levels of the message (a call's arguments,
a result, the items of a small list or dict, a registered type's fields): each arrives as a
read-only ``memoryview`` of the received message, without a copy (``bytes(view)`` copies it
out), freed with the last reference to it. Smaller ones, and those deep inside large
containers, are packed inline and arrive as ``bytes``. Dataclasses registered with :func:`register`
round-trip by name; a field declared with :func:`array_field` travels as one raw array of its
dtype whatever sequence it holds (a list is converted once, at the sender), so it arrives as a
numpy array. There is no pickle: an unknown type is an error at the sender, and the
receiver resolves only registered names, importing a module for one only inside a trusted
package (:func:`trust_package`), never any module a peer names.

torch is never imported here at module load; a torch tensor is recognised by its type's
module, and torch is imported only when one is encoded or decoded.
"""

from __future__ import annotations

import dataclasses
import importlib
import operator
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

import msgpack

__all__ = [
    "CodecError",
    "array_field",
    "array_metadata",
    "decode",
    "encode",
    "import_trusted",
    "register",
    "register_type",
    "registered_name",
    "trust_package",
]

T = TypeVar("T")

# msgpack ext type codes. Keep stable: they are part of the wire format.
EXT_DATACLASS = 1
EXT_ARRAY = 2
EXT_CUSTOM = 3
EXT_BUFFER = 4

# Buffers at or below this size are carried inline in the msgpack body; a separate
# frame costs more than copying a few hundred bytes.
INLINE_LIMIT = 1024
# The initial buffer of each msgpack packer (see _pack).
PACK_BUFFER = 4096
# msgpack packs bytes-likes itself, with a copy, and offers no hook for them: before packing, the
# encoder looks for large ones among at most this many container items per message, so a message
# with a long list (token ids) costs no more than before, and its buffers deep inside go inline.
LIFT_BUDGET = 64
_BUFFER_KINDS: dict[type, str] = {bytes: "bytes", bytearray: "bytearray", memoryview: "memoryview"}
_LIFTED = frozenset((*_BUFFER_KINDS, list, tuple, dict))  # the types lift() looks at

_MAIN_ALIASES = ("__main__", "__mp_main__")


class CodecError(ValueError):
    """A value cannot be encoded, or a message cannot be decoded."""


_dataclasses: dict[str, type] = {}
# registered dataclass -> its array_field fields, as (name, numpy dtype name)
_array_fields: dict[type, tuple[tuple[str, str], ...]] = {}
_ARRAY_DTYPE = "protocols.runtime.codec.array_dtype"  # the field metadata key array_field sets
_custom: dict[str, tuple[type, Callable[[Any], Any], Callable[[Any], Any]]] = {}
_custom_by_type: dict[type, str] = {}
# Top-level packages decoding may import from (see trust_package); ours holds the wire contracts.
_trusted_packages: set[str] = {__name__.partition(".")[0]}


def _type_name(cls: type) -> str:
    module = cls.__module__
    if module in _MAIN_ALIASES:
        module = "__main__"
    return f"{module}:{cls.__qualname__}"


def register(cls: type[T]) -> type[T]:
    """Class decorator: let instances of this dataclass travel by value.

    Fields must themselves be wire types (msgpack types, arrays, tensors, registered
    classes). The receiving process must have imported the class's module, or trust its
    package (see :func:`trust_package`); its package becomes trusted here.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__qualname__} is not a dataclass; decorate it with @dataclass first")
    _dataclasses[_type_name(cls)] = cls
    arrays = tuple(
        (f.name, f.metadata[_ARRAY_DTYPE]) for f in dataclasses.fields(cls) if _ARRAY_DTYPE in f.metadata
    )
    if arrays:
        _array_fields[cls] = arrays
    trust_package(cls.__module__)
    return cls


def array_field(dtype: str, **kwargs: Any) -> Any:
    """A field of a registered dataclass that travels as one raw array of numpy ``dtype``.

    The field may hold a list, a tuple or an array in the sending process; the encoder converts
    what is not already a numpy array of that dtype (once, at the sender), and the receiver gets a
    read-only numpy array, never a per-element msgpack list. ``kwargs`` go to
    :func:`dataclasses.field`.
    """
    return dataclasses.field(metadata=array_metadata(dtype), **kwargs)


def array_metadata(dtype: str) -> dict[str, str]:
    """The metadata of an :func:`array_field`, for ``dataclasses.field(metadata=...)``: type
    checkers know no field function but ``dataclasses.field``, and take ``array_field(...)`` for a
    default value (so a field without one may not follow it)."""
    return {_ARRAY_DTYPE: dtype}


def register_type(
    cls: type, name: str, to_wire: Callable[[Any], Any], from_wire: Callable[[Any], Any]
) -> None:
    """Register a non-dataclass type with explicit conversion to and from wire types."""
    _custom[name] = (cls, to_wire, from_wire)
    _custom_by_type[cls] = name


def registered_name(cls: type) -> str | None:
    """The wire name of a registered class, or None."""
    name = _type_name(cls)
    return name if name in _dataclasses else _custom_by_type.get(cls)


def trust_package(module: str) -> None:
    """Let decoding import modules of ``module``'s top-level package on demand.

    A registered type (or a remote exception) may live in a module this process has not
    imported yet. Decoding imports such a module only if its package is trusted: the package
    of a type registered here, or one the process declares (a worker declares its actor
    class's package). Any other name is refused: a peer cannot make us import what it likes.
    """
    top = module.partition(".")[0]
    if top and module not in _MAIN_ALIASES:
        _trusted_packages.add(top)


def import_trusted(module: str) -> ModuleType | None:
    """``module`` if already imported, or imported now if its package is trusted; else None."""
    mod = sys.modules.get(module)
    if mod is not None or module in _MAIN_ALIASES:
        return mod
    parts = module.split(".")
    if parts[0] not in _trusted_packages or "__main__" in parts:
        return None
    try:
        return importlib.import_module(module)
    except Exception:  # a module that fails to import resolves to nothing, like an unknown one
        return None


def _lookup_dataclass(name: str) -> type:
    cls = _dataclasses.get(name)
    if cls is None and import_trusted(name.partition(":")[0]) is not None:
        cls = _dataclasses.get(name)  # importing the module registered it
    if cls is None:
        raise CodecError(
            f"unknown dataclass {name!r}: decorate it with @rlactors.register, in a module this process "
            "has imported (or one of a package it trusts, see protocols.runtime.codec.trust_package)"
        )
    return cls


# --- arrays -----------------------------------------------------------------------------------

_TORCH_TO_NP = {
    "float32": "float32",
    "float64": "float64",
    "float16": "float16",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
}


def _array_header(obj: Any, frames: list[Any]) -> list[Any]:
    """Describe an array and put its bytes in ``frames`` (or inline when small)."""
    mod = type(obj).__module__
    if mod.startswith("torch"):
        import torch

        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if t.dtype == torch.bfloat16:
            buf = memoryview(t.view(torch.int16).numpy()).cast("B") if t.numel() else b""
        elif t.dtype.is_complex or dtype not in _TORCH_TO_NP:
            raise CodecError(f"tensor dtype {t.dtype} cannot be sent")
        else:
            buf = memoryview(t.numpy()).cast("B") if t.numel() else b""
        kind, shape = "torch", list(t.shape)
    else:
        import numpy as np

        a = np.ascontiguousarray(obj).reshape(np.shape(obj))  # ascontiguousarray makes 0-d arrays 1-d
        if a.dtype.hasobject:
            raise CodecError("numpy arrays of Python objects cannot be sent (no pickle on the wire)")
        buf = a.data.cast("B") if a.size else b""
        kind, shape, dtype = "numpy", list(a.shape), a.dtype.str
    if len(buf) <= INLINE_LIMIT:
        return [kind, dtype, shape, bytes(buf)]
    frames.append(buf)
    return [kind, dtype, shape, len(frames) - 1]


def _array_from(header: list[Any], frames: Sequence[Any]) -> Any:
    kind, dtype, shape, where = header
    if isinstance(where, int):
        if not 0 <= where < len(frames):
            raise CodecError(f"array refers to frame {where}, message has {len(frames)}")
        buf = frames[where]
        buf = getattr(buf, "buffer", buf)  # zmq.Frame -> memoryview, without a copy
    else:
        buf = where
    if kind == "numpy":
        import numpy as np

        return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
    if kind == "torch":
        import torch

        tdtype = getattr(torch, dtype, None)
        if not isinstance(tdtype, torch.dtype):
            raise CodecError(f"unknown tensor dtype {dtype!r}")
        if len(buf) == 0:
            return torch.empty(shape, dtype=tdtype)
        with warnings.catch_warnings():
            # Received buffers are read-only views of the ZeroMQ frame; we hand them out
            # without a copy (a copy of 64 MiB costs as much as the transfer).
            warnings.simplefilter("ignore", UserWarning)
            if tdtype == torch.bfloat16:
                return torch.frombuffer(buf, dtype=torch.int16).view(torch.bfloat16).reshape(shape)
            return torch.frombuffer(buf, dtype=tdtype).reshape(shape)
    raise CodecError(f"unknown array kind {kind!r}")


def _buffer_from(header: Any, frames: Sequence[Any]) -> memoryview:
    """A bytes-like sent as its own frame: a read-only view of that frame, without a copy."""
    if not (isinstance(header, list) and len(header) == 2 and header[0] in _BUFFER_KINDS.values()):
        raise CodecError(f"malformed buffer reference {header!r}")
    where = header[1]
    if not isinstance(where, int) or not 0 <= where < len(frames):
        raise CodecError(f"buffer refers to frame {where!r}, message has {len(frames)}")
    buf = frames[where]
    return memoryview(getattr(buf, "buffer", buf)).toreadonly()  # zmq.Frame -> its memory


# --- encode / decode --------------------------------------------------------------------------


class _Default:
    """Turns the non-msgpack values of one message into ext types, collecting array buffers in
    ``frames``. An object rather than a self-referencing closure, for the reason given at
    :class:`_ExtHook`: the frames hold the sender's buffers."""

    __slots__ = ("budget", "frames")

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames
        self.budget = LIFT_BUDGET

    def lift(self, obj: Any) -> Any:
        """``obj`` with its large bytes-likes replaced by frame references (containers on their path
        copied; ``obj`` itself when there are none). The common message, with no container or
        buffer inside its containers, costs one C-level type scan per container."""
        cls = type(obj)
        if cls is list or cls is tuple:
            if len(obj) > self.budget or _LIFTED.isdisjoint(map(type, obj)):
                return obj
            self.budget -= len(obj)
            out = [self.lift(x) if type(x) in _LIFTED else x for x in obj]
            return obj if all(map(operator.is_, out, obj)) else out
        if cls is dict:
            if len(obj) > self.budget or _LIFTED.isdisjoint(map(type, obj.values())):
                return obj
            self.budget -= len(obj)
            lifted = {k: self.lift(v) if type(v) in _LIFTED else v for k, v in obj.items()}
            return obj if all(map(operator.is_, lifted.values(), obj.values())) else lifted
        if cls in _BUFFER_KINDS and _nbytes(obj) > INLINE_LIMIT:
            return self._buffer(obj, cls)
        return obj

    def _buffer(self, obj: Any, cls: type) -> msgpack.ExtType:
        if cls is memoryview and not obj.c_contiguous:
            obj = obj.tobytes()  # ZeroMQ sends one contiguous block: this one needs a copy
        self.frames.append(obj)
        return msgpack.ExtType(EXT_BUFFER, _pack([_BUFFER_KINDS[cls], len(self.frames) - 1], self))

    def _numpy(self, a: Any) -> list[Any]:
        """The header of an array_field's numpy array: what :func:`_array_header` makes of it,
        without its general checks when it is one-dimensional and contiguous (the common case)."""
        if a.ndim != 1 or not a.flags.c_contiguous:
            return _array_header(a, self.frames)
        buf = memoryview(a).cast("B") if a.size else b""
        if len(buf) <= INLINE_LIMIT:
            return ["numpy", a.dtype.str, [a.size], bytes(buf)]
        self.frames.append(buf)
        return ["numpy", a.dtype.str, [a.size], len(self.frames) - 1]

    def __call__(self, obj: Any) -> Any:
        cls = type(obj)
        name = _custom_by_type.get(cls)
        if name is not None:
            return msgpack.ExtType(EXT_CUSTOM, _pack([name, self.lift(_custom[name][1](obj))], self))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            name = _type_name(cls)
            if name not in _dataclasses:
                raise CodecError(
                    f"dataclass {name} is not registered; decorate it with @protocols.runtime.codec.register"
                )
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            array_fields = _array_fields.get(cls)
            if array_fields is None:
                return msgpack.ExtType(EXT_DATACLASS, _pack([name, self.lift(fields)], self))
            # array fields' headers ride in the dataclass's own body: an extension type each would cost
            # a packer here and an unpacker at the receiver per array, most of a small group's codec
            arrays = {k: self._numpy(_as_array(fields.pop(k), dtype, name, k)) for k, dtype in array_fields}
            return msgpack.ExtType(EXT_DATACLASS, _pack([name, self.lift(fields), arrays], self))
        mod = cls.__module__
        if (mod.startswith("torch") and cls.__name__ in ("Tensor", "Parameter")) or (
            mod == "numpy" and cls.__name__ == "ndarray"
        ):
            return msgpack.ExtType(EXT_ARRAY, _pack(_array_header(obj, self.frames), self))
        if mod == "numpy" and hasattr(obj, "item"):  # numpy scalars
            return obj.item()
        if isinstance(obj, (set, frozenset)):
            return list(obj)
        raise CodecError(
            f"cannot send a value of type {cls.__module__}.{cls.__qualname__} (no pickle on the wire)"
        )


def _as_array(value: Any, dtype: str, owner: str, key: str) -> Any:
    """``value`` as a numpy array of ``dtype`` for an :func:`array_field` (no copy when it is one)."""
    import numpy as np

    if type(value) is np.ndarray and value.dtype == dtype:
        return value
    try:
        return np.asarray(value, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"{owner}.{key} cannot be sent as an array of {dtype}: {e}") from e


def _nbytes(buf: Any) -> int:
    return buf.nbytes if type(buf) is memoryview else len(buf)


def _pack(obj: Any, default: Callable[[Any], Any]) -> bytes:
    # A packer starts with a buffer of PACK_BUFFER bytes and grows it as needed. msgpack's own
    # default (256 KiB) costs an allocation larger than the message it holds at every extension
    # type (each packs its body with a packer of its own): most of a small message's encoding.
    return msgpack.Packer(default=default, use_bin_type=True, datetime=False, buf_size=PACK_BUFFER).pack(obj)


class _ExtHook:
    """Rebuilds the extension types of one message from its frames.

    A small object, not a closure: a closure that calls itself recursively is a reference
    cycle, and that cycle would keep the message's frames (large buffers) alive until the
    cyclic garbage collector happens to run.
    """

    __slots__ = ("frames",)

    def __init__(self, frames: Sequence[Any]) -> None:
        self.frames = frames

    def __call__(self, code: int, data: bytes) -> Any:
        inner = msgpack.unpackb(data, ext_hook=self, raw=False, strict_map_key=False)
        if code == EXT_ARRAY:
            return _array_from(inner, self.frames)
        if code == EXT_BUFFER:
            return _buffer_from(inner, self.frames)
        if code == EXT_DATACLASS:
            name, fields, *arrays = inner
            cls = _lookup_dataclass(name)
            for key, header in arrays[0].items() if arrays else ():
                fields[key] = _array_from(header, self.frames)
            try:
                return cls(**fields)
            except TypeError as e:
                raise CodecError(f"cannot rebuild {name}: {e}") from e
        if code == EXT_CUSTOM:
            name, value = inner
            entry = _custom.get(name)
            if entry is None:
                raise CodecError(f"unknown registered type {name!r}")
            return entry[2](value)
        raise CodecError(f"unknown msgpack ext type {code}")


def encode(obj: Any) -> list[Any]:
    """Encode ``obj`` into frames: ``[msgpack body, raw buffer, ...]``.

    Contiguous CPU buffers are not copied: they are sent from the caller's memory, so a tensor,
    array, bytearray or memoryview must not be modified until the call carrying it has been sent
    (the next turn of the event loop) — pass a copy if you must change it at once.
    """
    frames: list[Any] = [b""]
    try:
        default = _Default(frames)
        frames[0] = _pack(default.lift(obj), default)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"cannot encode value: {e}") from e
    return frames


def decode(frames: Sequence[Any]) -> Any:
    """Decode frames made by :func:`encode`. Raises :class:`CodecError` on malformed input."""
    if not frames:
        raise CodecError("empty message")
    body = frames[0]
    body = getattr(body, "bytes", body)
    try:
        return msgpack.unpackb(body, ext_hook=_ExtHook(frames), raw=False, strict_map_key=False)
    except CodecError:
        raise
    except Exception as e:  # msgpack raises a zoo of exception types on garbage
        raise CodecError(f"malformed message: {type(e).__name__}: {e}") from e

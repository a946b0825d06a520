"""The wire format: msgpack + raw frames, registered dataclasses, and rejection of garbage."""

from __future__ import annotations

import dataclasses
import gc
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.runtime import codec, wire
from rlactors.base.errors import RemoteError, exception_from_payload


@codec.register
@dataclasses.dataclass
class Point:
    x: int
    y: list[float]
    tag: str = "p"


@dataclasses.dataclass
class NotRegistered:
    x: int


def roundtrip(obj: object) -> object:
    return codec.decode(codec.encode(obj))


def test_primitives_roundtrip() -> None:
    obj = {"a": 1, "b": [1.5, None, True, "s", b"\x00\x01"], "c": {"nested": [1, 2]}}
    assert roundtrip(obj) == obj


def test_numpy_arrays_travel_as_frames_without_copy() -> None:
    a = np.arange(100_000, dtype=np.float32).reshape(100, 1000)
    frames = codec.encode({"a": a})
    assert len(frames) == 2  # body + one raw frame
    assert isinstance(frames[1], memoryview) and frames[1].obj is not None
    assert len(frames[0]) < 200  # the body holds only a header
    out = codec.decode(frames)["a"]
    assert out.dtype == np.float32 and out.shape == (100, 1000)
    np.testing.assert_array_equal(out, a)


def test_small_arrays_inline() -> None:
    a = np.array([1, 2, 3], dtype=np.int64)
    frames = codec.encode(a)
    assert len(frames) == 1
    np.testing.assert_array_equal(codec.decode(frames), a)


def test_torch_tensors_including_bf16() -> None:
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16):
        t = (torch.randn(64, 33) * 10).to(dtype)
        out = roundtrip({"t": t})["t"]
        assert out.dtype == dtype and out.shape == t.shape
        assert torch.equal(out, t)
    # Non-contiguous views are sent as their contiguous values.
    t = torch.arange(100.0).reshape(10, 10).t()
    assert torch.equal(roundtrip(t), t)


def test_registered_dataclass_roundtrip_and_nesting() -> None:
    p = Point(3, [1.0, 2.5])
    assert roundtrip({"p": p, "ps": [p, Point(1, [], "q")]}) == {"p": p, "ps": [p, Point(1, [], "q")]}


def test_unregistered_and_unknown_types_are_refused_at_the_sender() -> None:
    with pytest.raises(codec.CodecError, match="not registered"):
        codec.encode(NotRegistered(1))
    with pytest.raises(codec.CodecError, match="no pickle"):
        codec.encode(object())
    with pytest.raises(codec.CodecError, match="no pickle"):
        codec.encode(np.array([object()]))


def test_unknown_dataclass_name_is_a_decode_error() -> None:
    body = msgpack.packb(msgpack.ExtType(codec.EXT_DATACLASS, msgpack.packb(["nowhere.mod:Thing", {}])))
    with pytest.raises(codec.CodecError, match="unknown dataclass"):
        codec.decode([body])


def test_array_frame_index_out_of_range_is_rejected() -> None:
    frames = codec.encode(np.zeros(10_000))
    with pytest.raises(codec.CodecError, match="frame"):
        codec.decode(frames[:1])


def test_envelope_validation() -> None:
    good = wire.encode_envelope(wire.Kind.CALL, 7, None, "m", [1], {}, 0)
    assert wire.decode_envelope(good) == [wire.Kind.CALL, 7, None, "m", [1], {}, 0]
    bad_version = codec.encode([99, wire.Kind.CALL, 7, None, "m", [], {}, 0])
    with pytest.raises(wire.WireError, match="version"):
        wire.decode_envelope(bad_version)
    with pytest.raises(wire.WireError, match="fields"):
        wire.decode_envelope(codec.encode([wire.PROTOCOL_VERSION, wire.Kind.CALL, 7, None]))
    with pytest.raises(wire.WireError, match="kind"):
        wire.decode_envelope(codec.encode([wire.PROTOCOL_VERSION, 42, 7]))
    with pytest.raises(wire.WireError):
        wire.decode_envelope(codec.encode([wire.PROTOCOL_VERSION, wire.Kind.CALL, 7, None, 5, [], {}, 0]))


def test_a_call_with_arguments_encoded_once_is_the_same_envelope() -> None:
    a = np.arange(5000, dtype=np.float32)  # a raw frame, numbered as in its own envelope
    args, kwargs = [a, "x", Point(1, [2.0])], {"k": [np.arange(3)], "s": "y" * 40}
    encoded = wire.encode_args(args, kwargs)
    for call_id, target, flags in ((7, None, 0), (2**40, "system", wire.Flags.NO_REPLY)):
        once = wire.encode_call(call_id, target, "method", encoded, flags)
        each = wire.encode_envelope(wire.Kind.CALL, call_id, target, "method", args, kwargs, flags)
        assert bytes(once[0]) == bytes(each[0]) and len(once) == len(each) == 2
        assert once[1] is encoded.buffers[0]  # every call sends the same buffer, not a copy
        got = wire.decode_envelope(once)
        assert got[:4] == [wire.Kind.CALL, call_id, target, "method"] and got[6] == flags
        assert np.array_equal(got[4][0], a) and got[4][1:] == ["x", Point(1, [2.0])]


def test_batches_split_back_into_envelopes() -> None:
    envs = [wire.encode_envelope(wire.Kind.RESULT, i, np.arange(1000 * i)) for i in range(1, 4)]
    parts = wire.split_batch(wire.join_batch(envs))
    assert [wire.decode_envelope(p)[1] for p in parts] == [1, 2, 3]
    with pytest.raises(wire.WireError):
        wire.split_batch([msgpack.packb([5]), b"x"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_garbage_frames_only_ever_raise_wire_errors(frames: list[bytes]) -> None:
    for attempt in (lambda: wire.split_batch(frames), lambda: wire.decode_envelope(frames)):
        try:
            attempt()
        except wire.WireError:
            pass


def test_zero_dim_and_empty_arrays_keep_their_shapes() -> None:
    torch = pytest.importorskip("torch")
    assert roundtrip(np.array(3.5)).shape == ()
    assert roundtrip(np.zeros((0, 3), dtype=np.float32)).shape == (0, 3)
    for dtype in (torch.bfloat16, torch.float32):
        out = roundtrip(torch.empty(0, 3, dtype=dtype))
        assert out.shape == (0, 3) and out.dtype == dtype
    assert roundtrip(torch.tensor(2.0, dtype=torch.bfloat16)).shape == ()


class _Buffer(bytearray):
    """A received frame we can hold a weak reference to."""


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """Only reference counting frees memory: a reference cycle keeps what it holds."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_received_frames_are_freed_when_the_value_is_dropped(no_cyclic_gc: None) -> None:
    body, raw = codec.encode({"a": np.ones(1 << 20, dtype=np.uint8)})
    frame = _Buffer(raw)
    freed = weakref.ref(frame)
    value = codec.decode([body, frame])
    del frame
    assert value["a"].sum() == 1 << 20
    del value
    assert freed() is None


def test_a_message_that_fails_to_decode_frees_its_frames(no_cyclic_gc: None) -> None:
    array = msgpack.ExtType(codec.EXT_ARRAY, msgpack.packb(["numpy", "|u1", [2048], 1]))
    body = msgpack.packb([array, msgpack.ExtType(99, b"")])
    frame = _Buffer(2048)
    freed = weakref.ref(frame)
    try:
        codec.decode([body, frame])
    except codec.CodecError:
        pass
    else:
        pytest.fail("an unknown ext type decoded")
    del frame
    assert freed() is None


def test_sent_buffers_are_released_once_the_frames_are_dropped(no_cyclic_gc: None) -> None:
    a = np.ones(1 << 20, dtype=np.uint8)
    freed = weakref.ref(a)
    frames = codec.encode({"a": a})
    del a
    assert len(frames) == 2
    del frames
    assert freed() is None


PROBE = """
import dataclasses
from protocols.runtime import codec
IMPORTED = True

@codec.register
@dataclasses.dataclass
class Probe:
    x: int

class ProbeError(Exception):
    pass
"""


def _ext(name: str) -> bytes:
    return msgpack.packb(msgpack.ExtType(codec.EXT_DATACLASS, msgpack.packb([name, {"x": 1}])))


def test_decoding_never_imports_a_module_outside_trusted_packages(tmp_path, monkeypatch) -> None:
    (tmp_path / "rlx_untrusted_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(codec.CodecError, match="unknown dataclass 'rlx_untrusted_probe:Probe'"):
        codec.decode([_ext("rlx_untrusted_probe:Probe")])
    err = exception_from_payload({"type": "rlx_untrusted_probe:ProbeError", "message": "boom"})
    assert isinstance(err, RemoteError) and err.type_name == "rlx_untrusted_probe:ProbeError"
    assert "rlx_untrusted_probe" not in sys.modules


def test_decoding_imports_registered_types_from_a_trusted_package(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "rlx_trusted_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "types.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(codec, "_trusted_packages", set(codec._trusted_packages))
    monkeypatch.setattr(codec, "_dataclasses", dict(codec._dataclasses))
    codec.trust_package("rlx_trusted_pkg.actors")
    try:
        probe = codec.decode([_ext("rlx_trusted_pkg.types:Probe")])
        assert type(probe).__module__ == "rlx_trusted_pkg.types" and probe.x == 1
        err = exception_from_payload({"type": "rlx_trusted_pkg.types:ProbeError", "message": "boom"})
        assert type(err).__name__ == "ProbeError"
    finally:
        for name in ("rlx_trusted_pkg.types", "rlx_trusted_pkg"):
            sys.modules.pop(name, None)


def test_the_wire_contract_types_decode_where_their_module_was_never_imported() -> None:
    import subprocess

    script = (
        "import msgpack, sys\n"
        "from protocols.runtime import codec\n"
        "assert 'protocols.rl' not in sys.modules\n"
        "body = msgpack.packb(msgpack.ExtType(codec.EXT_DATACLASS, msgpack.packb(['protocols.rl:Batch', {}])))\n"
        "try:\n"
        "    codec.decode([body])\n"
        "except codec.CodecError as e:\n"
        "    assert 'cannot rebuild' in str(e), e\n"  # found and registered; the fields are what is missing
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).resolve().parents[2])

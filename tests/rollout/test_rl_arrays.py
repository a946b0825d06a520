"""Per-token fields as arrays (issue 40): lists in, raw arrays on the wire, numpy arrays out, and
validate()'s vectorised checks on either."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np
import pytest

from protocols.rl import Batch, Trajectory, TrajectoryError, TrajectoryGroup
from protocols.runtime import codec

N_GEN = 600  # enough tokens that every per-token field is over the codec's inline limit


def traj(gid: str = "g", prompt: int = 3, n_gen: int = N_GEN, version: int = 4) -> Trajectory:
    return Trajectory(
        input_ids=list(range(100, 100 + prompt + n_gen)),
        loss_mask=[0] * prompt + [1] * n_gen,
        logprobs=[0.0] * prompt + [-0.25] * n_gen,
        versions=[-1] * prompt + [version] * n_gen,
        reward=1.0,
        group_id=gid,
        prompt_len=prompt,
        meta={"turns": 1},
    )


def sent(obj):
    return codec.decode(codec.encode(obj))


def test_a_list_built_trajectory_arrives_as_numpy_arrays_of_the_wire_dtypes() -> None:
    t = traj()
    out = sent(Batch([TrajectoryGroup("g", [t, t])], version=5)).groups[0].trajectories[0]
    dtypes = {f: getattr(out, f).dtype for f in ("input_ids", "loss_mask", "logprobs", "versions")}
    assert dtypes == {
        "input_ids": np.int32,
        "loss_mask": np.int8,
        "logprobs": np.float32,
        "versions": np.int32,
    }
    assert out == t and out.input_ids.tolist() == t.input_ids and out.meta == {"turns": 1}
    assert isinstance(t.input_ids, list)  # the sender's trajectory keeps what it was built with
    out.validate()
    assert (out.num_generated, out.loss_tokens, out.oldest_version, out.newest_version) == (
        N_GEN,
        N_GEN,
        4,
        4,
    )


def test_per_token_fields_travel_as_raw_frames_not_msgpack_lists() -> None:
    frames = codec.encode(TrajectoryGroup("g", [traj(n_gen=20_000)]))
    assert len(frames) == 5  # the body, then one frame per per-token field
    assert len(frames[0]) < 500  # no per-token element in the msgpack body
    assert sum(memoryview(f).nbytes for f in frames[1:]) == 20_003 * (4 + 1 + 4 + 4)


def test_a_trajectorys_array_headers_ride_in_its_own_extension_type() -> None:
    frames = codec.encode(TrajectoryGroup("g", [traj(), traj(n_gen=20)]))  # frames and inline arrays
    codes: list[int] = []

    def hook(code: int, data: bytes) -> None:
        codes.append(code)
        msgpack.unpackb(data, ext_hook=hook, raw=False)

    msgpack.unpackb(frames[0], ext_hook=hook, raw=False)
    assert codes == [codec.EXT_DATACLASS] * 3  # the group, two trajectories: no extension type per array
    assert sent(TrajectoryGroup("g", [traj(), traj(n_gen=20)])) == TrajectoryGroup(
        "g", [traj(), traj(n_gen=20)]
    )


def test_an_array_header_pointing_outside_the_message_is_refused() -> None:
    fields = {"reward": 1.0, "group_id": "g", "prompt_len": 0}
    arrays = {f: ["numpy", "<i4", [3], 7] for f in ("input_ids", "loss_mask", "logprobs", "versions")}
    inner = msgpack.packb(["protocols.rl:Trajectory", fields, arrays])
    with pytest.raises(codec.CodecError, match="frame 7"):
        codec.decode([msgpack.packb(msgpack.ExtType(codec.EXT_DATACLASS, inner))])


def test_a_value_that_does_not_fit_its_dtype_is_an_error_naming_the_field() -> None:
    t = traj()
    t.input_ids[5] = 2**40
    with pytest.raises(codec.CodecError, match=r"Trajectory\.input_ids .*int32"):
        codec.encode(t)


@pytest.mark.parametrize("received", [False, True], ids=["lists", "arrays"])
def test_validate_finds_each_broken_invariant(received: bool) -> None:
    def broken(edit) -> Trajectory:
        t = traj(prompt=3, n_gen=4)
        edit(t)
        return sent(t) if received else t

    def set_at(name: str, i: int, v):
        return lambda t: getattr(t, name).__setitem__(i, v)

    cases = [
        (lambda t: setattr(t, "logprobs", t.logprobs[:-1]), r"len\(input_ids\)=7 but \{'logprobs': 6\}"),
        (lambda t: setattr(t, "prompt_len", 8), r"prompt_len=8 outside \[0, 7\]"),
        (set_at("loss_mask", 5, 2), "only 0/1"),
        (lambda t: (set_at("loss_mask", 1, 1)(t), set_at("versions", 1, 0)(t)), "inside the prompt"),
        (set_at("versions", 5, -1), "generated token 5 has no version"),
        (set_at("versions", 2, 3), "masked token 2 has version 3, want -1"),
    ]
    for edit, message in cases:
        with pytest.raises(TrajectoryError, match=message):
            broken(edit).validate()
    broken(lambda t: None).validate()


def test_arrays_built_and_list_built_trajectories_are_equal_and_read_alike() -> None:
    t = traj(n_gen=5)
    a = Trajectory(
        *(np.asarray(x) for x in (t.input_ids, t.loss_mask, t.logprobs, t.versions)),
        1.0,
        "g",
        3,
        meta={"turns": 1},
    )
    assert a == t and a != traj(n_gen=5, version=5)
    ids, mask, lps, vers = a.arrays()
    assert (ids.dtype, mask.dtype, lps.dtype, vers.dtype) == (np.int32, np.int8, np.float32, np.int32)
    assert (a.num_generated, a.oldest_version) == (t.num_generated, t.oldest_version) == (5, 4)
    empty = Trajectory([1, 2], [0, 0], [0.0, 0.0], [-1, -1], 0.0, "g", 2)
    assert (empty.oldest_version, empty.newest_version, empty.loss_tokens) == (-1, -1, 0)


def test_array_field_converts_any_registered_dataclass_field() -> None:
    out = sent(Tokens([1, 2, 3], "x"))
    assert isinstance(out.ids, np.ndarray) and out.ids.dtype == np.int16 and out.ids.tolist() == [1, 2, 3]
    assert out.name == "x"


@codec.register
@dataclass
class Tokens:
    ids: list[int] = codec.array_field("int16")  # noqa: RUF009
    name: str = ""


def test_a_boolean_mask_is_a_mask() -> None:
    t = traj(prompt=2, n_gen=3)
    t.loss_mask = [bool(m) for m in t.loss_mask]
    t.validate()
    sent(t).validate()
    t.loss_mask[0] = True
    with pytest.raises(TrajectoryError, match="inside the prompt"):
        t.validate()

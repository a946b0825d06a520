"""The RL batch schema's validation and conveniences (protocols/rl.py)."""

import pytest

from protocols.rl import Batch, Trajectory, TrajectoryError, TrajectoryGroup


def traj(gid: str = "g0", versions: tuple[int, ...] = (3, 4)) -> Trajectory:
    n_gen = len(versions)
    return Trajectory(
        input_ids=[1, 2, 3] + [10 + i for i in range(n_gen)],
        loss_mask=[0, 0, 0] + [1] * n_gen,
        logprobs=[0.0] * 3 + [-0.5] * n_gen,
        versions=[-1] * 3 + list(versions),
        reward=1.0,
        group_id=gid,
        prompt_len=3,
    )


def test_valid_trajectory_and_conveniences():
    t = traj()
    t.validate()
    assert t.num_tokens == 5 and t.num_generated == 2
    assert t.oldest_version == 3 and t.newest_version == 4


def test_length_mismatch_is_rejected():
    t = traj()
    t.logprobs.pop()
    with pytest.raises(TrajectoryError, match="logprobs"):
        t.validate()


def test_masked_tokens_must_have_no_version_and_prompt_no_loss():
    t = traj()
    t.versions[0] = 2
    with pytest.raises(TrajectoryError, match="version"):
        t.validate()
    t = traj()
    t.loss_mask[1] = 1
    t.versions[1] = 0
    with pytest.raises(TrajectoryError, match="prompt"):
        t.validate()


def test_group_and_batch():
    g1 = TrajectoryGroup("g1", [traj("g1", (5, 6)), traj("g1", (4,))])
    g2 = TrajectoryGroup("g2", [traj("g2", (7,))])
    b = Batch([g1, g2], version=7)
    b.validate()
    assert g1.oldest_version == 4 and b.oldest_version == 4 and b.max_staleness == 3
    assert b.num_tokens == g1.num_tokens + g2.num_tokens == 5 + 4 + 4
    assert len(b.trajectories) == 3
    with pytest.raises(TrajectoryError, match="repeats"):
        Batch([g1, g1], version=7).validate()
    with pytest.raises(TrajectoryError, match="holds a trajectory"):
        TrajectoryGroup("g1", [traj("g2")]).validate()
    with pytest.raises(TrajectoryError, match="no trajectories"):
        TrajectoryGroup("g3", []).validate()


def test_batch_round_trips_through_the_codec():
    from protocols.runtime import codec

    b = Batch([TrajectoryGroup("g1", [traj("g1"), traj("g1", (5,))])], version=5)
    frames = codec.encode(b)
    out = codec.decode(frames)
    assert out == b and isinstance(out.groups[0].trajectories[0], Trajectory)

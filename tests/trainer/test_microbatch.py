"""build_microbatch: the padded tensors equal a row-by-row reference, from lists or received arrays."""

from __future__ import annotations

import random

import torch

from nodes.trainer.microbatch import build_microbatch
from protocols.rl import Trajectory, TrajectoryGroup
from protocols.runtime import codec


def trajectories(seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for k, n in enumerate((5, 9, 1, 7)):
        prompt = min(n, 2)
        gen = n - prompt
        out.append(
            Trajectory(
                [rng.randrange(1000) for _ in range(n)],
                [0] * prompt + [rng.choice((0, 1)) for _ in range(gen)],
                [0.0] * prompt + [-rng.random() for _ in range(gen)],
                [-1] * n,
                0.0,
                "g",
                prompt,
                temperature=0.5 * k,
            )
        )
    for t in out:
        t.versions = [3 if m else -1 for m in t.loss_mask]
    return out


def reference(seqs, trajs, adv, pad_id):
    """The row-by-row construction the vectorised one replaces."""
    rows = [trajs[i] for i in seqs]
    B, L = len(rows), max(len(t.input_ids) for t in rows)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.bool)
    behave = torch.zeros((B, L), dtype=torch.float32)
    a = torch.zeros((B, L), dtype=torch.float32)
    for row, (i, t) in enumerate(zip(seqs, rows, strict=True)):
        n = len(t.input_ids)
        ids[row, :n] = torch.tensor(list(t.input_ids), dtype=torch.long)
        attn[row, :n] = 1
        mask[row, :n] = torch.tensor(list(t.loss_mask), dtype=torch.bool)
        behave[row, :n] = torch.tensor([float(x) for x in t.logprobs], dtype=torch.float32)
        a[row, :n] = float(adv[i])
    mask[:, 0] = False
    return ids, attn, mask[:, 1:], behave[:, 1:], a[:, 1:] * mask[:, 1:]


def test_microbatch_equals_the_row_by_row_reference_from_lists_and_from_received_arrays() -> None:
    built = trajectories()
    received = codec.decode(codec.encode(TrajectoryGroup("g", built))).trajectories
    adv = [0.5, -1.0, 2.0, 0.25]
    for trajs in (built, received):
        for seqs in ([0, 1, 2, 3], [3, 1], [2]):
            mb = build_microbatch(seqs, trajs, adv, pad_id=7)
            want = reference(seqs, trajs, adv, 7)
            got = (mb.input_ids, mb.attention_mask, mb.loss_mask, mb.behave_logp, mb.advantages)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and torch.equal(g, w)
            assert mb.seqs == seqs and mb.n_tokens == sum(len(trajs[i].input_ids) for i in seqs)
            assert mb.temperature.flatten().tolist() == [trajs[i].temperature or 1.0 for i in seqs]

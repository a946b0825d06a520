"""Turn a rank's share of a batch into padded micro-batch tensors, labels shifted by one.

Each micro-batch is padded only to its own longest sequence (padding stripped between
micro-batches; right padding, so default position ids stay correct). Everything the loss needs
per token is aligned with ``labels = input_ids[:, 1:]``: the log-prob at position ``t`` scores
token ``t + 1``, so the loss mask, behaviour (and teacher) log-probs and versions are the
trajectory's lists shifted left by one. Trajectories arrive with numpy arrays (protocols/rl.py), so building
the tensors is a concatenation and a scatter per field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["MicroBatch", "build_microbatch", "dummy_microbatch"]


@dataclass
class MicroBatch:
    """Tensors for one forward/backward. ``seqs`` indexes the batch's flat trajectory list."""

    seqs: list[int]
    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    loss_mask: torch.Tensor  # [B, L-1] bool, aligned with labels
    behave_logp: torch.Tensor  # [B, L-1] float32
    advantages: torch.Tensor  # [B, L-1] float32
    n_tokens: int  # real (unpadded) tokens
    temperature: torch.Tensor  # [B, 1, 1] float32: each row's sampling temperature (logits / T)
    prox_logp: torch.Tensor | None = None  # [B, L-1], filled before the update
    ref_logp: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None  # [B, L-1] float32: distillation's teacher log-probs

    @property
    def labels(self) -> torch.Tensor:
        """Next-token targets."""
        return self.input_ids[:, 1:]

    @property
    def is_dummy(self) -> bool:
        """True for the stand-in a rank runs when it has no sequence for this micro-batch slot."""
        return not self.seqs

    def to(self, device: torch.device | str) -> MicroBatch:
        """Move the tensors (non-blocking where the source is pinned)."""

        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return MicroBatch(
            self.seqs,
            mv(self.input_ids),
            mv(self.attention_mask),
            mv(self.loss_mask),
            mv(self.behave_logp),
            mv(self.advantages),
            self.n_tokens,
            mv(self.temperature),
            None if self.prox_logp is None else mv(self.prox_logp),
            None if self.ref_logp is None else mv(self.ref_logp),
            None if self.teacher_logp is None else mv(self.teacher_logp),
        )


def build_microbatch(
    seqs: Sequence[int], trajectories: Sequence, advantages: Sequence[float], pad_id: int = 0
) -> MicroBatch:
    """Pad the trajectories ``seqs`` (objects with input_ids, loss_mask, logprobs, temperature) to
    their max length.

    ``advantages`` holds one scalar per trajectory of the flat list (GRPO puts the sequence's
    advantage on each of its loss tokens). The rows are concatenated and scattered into the padded
    tensors in one numpy operation per field: no Python loop over tokens, and none over rows
    beyond collecting them (a trajectory's fields are arrays once received; lists are converted).
    """
    if not seqs:
        return dummy_microbatch(pad_id)
    trajs = [trajectories[i] for i in seqs]
    lens = np.fromiter((len(t.input_ids) for t in trajs), dtype=np.int64, count=len(trajs))
    B, L = len(trajs), int(lens.max())
    real = np.arange(L) < lens[:, None]  # [B, L]: True on each row's tokens, in row-major order
    ids = np.full((B, L), pad_id, dtype=np.int64)
    mask = np.zeros((B, L), dtype=bool)
    behave = np.zeros((B, L), dtype=np.float32)
    ids[real] = np.concatenate([np.asarray(t.input_ids) for t in trajs])
    mask[real] = np.concatenate([np.asarray(t.loss_mask) for t in trajs])
    behave[real] = np.concatenate([np.asarray(t.logprobs, dtype=np.float32) for t in trajs])
    mask[:, 0] = False  # the first token has no prediction
    adv = np.asarray([float(advantages[i]) for i in seqs], dtype=np.float32)[:, None] * mask[:, 1:]
    teacher = None
    if any(t.teacher_logprobs is not None for t in trajs):  # on-policy distillation: every one has them
        missing = [i for i, t in zip(seqs, trajs, strict=True) if t.teacher_logprobs is None]
        if missing:
            raise ValueError(f"trajectories {missing} have no teacher log-probs, others of the batch do")
        teacher_np = np.zeros((B, L), dtype=np.float32)
        teacher_np[real] = np.concatenate([np.asarray(t.teacher_logprobs, dtype=np.float32) for t in trajs])
        teacher = torch.from_numpy(teacher_np[:, 1:].copy())
    return MicroBatch(
        list(seqs),
        torch.from_numpy(ids),
        torch.from_numpy(real.astype(np.int64)),
        torch.from_numpy(mask[:, 1:].copy()),
        torch.from_numpy(behave[:, 1:].copy()),
        torch.from_numpy(adv),
        n_tokens=int(lens.sum()),
        temperature=torch.tensor([t.temperature or 1.0 for t in trajs], dtype=torch.float32).view(B, 1, 1),
        teacher_logp=teacher,
    )


def dummy_microbatch(pad_id: int = 0) -> MicroBatch:
    """Two pad tokens with an all-zero loss mask: runs the model (and so FSDP's collectives)
    on a rank that has nothing to train in this slot, contributing zero gradient."""
    z = torch.zeros((1, 1))
    return MicroBatch(
        [],
        torch.full((1, 2), pad_id, dtype=torch.long),
        torch.ones((1, 2), dtype=torch.long),
        torch.zeros((1, 1), dtype=torch.bool),
        z,
        z.clone(),
        n_tokens=0,
        temperature=torch.ones((1, 1, 1)),
    )

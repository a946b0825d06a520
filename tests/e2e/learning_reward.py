"""A synthetic reward with an unambiguous optimum, for the learning test (test_learning.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nodes.inference.models import ensure_tiny_checkpoint

TOKENS = 16  # the test's rollout.max_new_tokens; a random model almost never ends earlier


def no_space_share(completion: str, item: Any) -> float:
    """About the share of the completion's tokens that do not begin with a space.

    With SmolLM2's vocabulary (65% of tokens begin with a space) a random-weight model, which
    samples near uniformly, scores about 0.32 with a spread of 0.23 between completions: every
    group has reward variance, the optimum (1.0) is unambiguous, and the negated objective has
    room to fall too.
    """
    del item
    return max(0.0, 1.0 - completion.count(" ") / TOKENS)


def featured_checkpoint(dst: Path, scale: float = 0.2) -> Path:
    """The tiny random model with one shared direction added to the embeddings of the tokens that
    begin with a space (tied embeddings: their output rows too), saved to ``dst``.

    A plain random model can raise :func:`no_space_share` only by breaking symmetry: each of the
    17k non-space tokens has its own random row, so the policy drifts until a few of them win and
    then collapses onto them, at a step that varied from 4 to past 16 between runs here. With a
    feature that the space tokens share, one move of the hidden state against it lowers all of
    them at once: the reward rises from the first steps on, in every run, and a run that trains
    the wrong tokens (a shifted loss mask, a lost push, a flipped sign) still does not.
    """
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    src = ensure_tiny_checkpoint()
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src)
    tokens = tokenizer.convert_ids_to_tokens(list(range(model.config.vocab_size)))
    space = torch.tensor(["Ġ" in t for t in tokens])  # byte-level BPE writes a space as Ġ
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.get_input_embeddings().weight[space] += scale * direction / direction.norm()
    model.save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    return dst

"""A synthetic reward with an unambiguous optimum, for the learning test (test_learning.py)."""

from __future__ import annotations

from typing import Any

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

"""A reward that costs CPU (bench only): what a costly checker (math_verify on hard answers, a code
test harness) costs a rollout actor. ``RLACTORS_BENCH_REWARD_US`` microseconds of pure-Python work
on the calling thread (it holds the GIL, as such checkers do), then :func:`final_number_reward`.

bench/rollout.py ``--reward-us N`` sets it: with the reward the expensive part of an episode, one
rollout actor is bound by its one interpreter, and more actors (processes) add CPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from nodes.rollout.reward import final_number_reward

BURN_S = float(os.environ.get("RLACTORS_BENCH_REWARD_US", "0")) / 1e6


def burn_reward(completion: str, item: Mapping[str, Any]) -> float:
    """``BURN_S`` of this thread's CPU, then the final-number reward."""
    end = time.thread_time() + BURN_S
    while time.thread_time() < end:
        pass
    return final_number_reward(completion, item)

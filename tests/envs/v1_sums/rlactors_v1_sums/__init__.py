"""A verifiers v1 taskset for rlactors' tests: ``sum_a_b`` asks for a sum; the reward is whether
the model's last reply holds it. Offline, deterministic (``seed``)."""

from rlactors_v1_sums.taskset import SumsTaskset

__all__ = ["SumsTaskset"]

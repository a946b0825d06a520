"""A verifiers v1 taskset: the main job's easy problems (single-digit sums and differences, 117 of
them) with its tutor prompt, scored by the final number of the model's reply. Offline and
deterministic; recipes/configs/v1_cpu.toml trains SmolLM2 on it (bench/RESULTS.md has the result)."""

from rlactors_v1_arith.taskset import ArithTaskset

__all__ = ["ArithTaskset"]

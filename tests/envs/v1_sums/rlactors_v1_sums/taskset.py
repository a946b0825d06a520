import os
import random
import re

import verifiers.v1 as vf


def _die_once() -> None:
    """With RLACTORS_TEST_V1_DIE_ONCE set (a path), the env server dies the first time, noting its pid
    there (the tests of a server that dies mid-run)."""
    die = os.environ.get("RLACTORS_TEST_V1_DIE_ONCE")
    if die and not os.path.exists(die):
        with open(die, "w") as f:
            f.write(str(os.getpid()))
        os._exit(1)


class SumsData(vf.TaskData):
    """One sum: its answer."""

    answer: int
    fail: bool = False
    """Its scoring raises (tests of failures)."""


class SumsTask(vf.Task[SumsData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the last number in the model's last reply is the sum."""
        _die_once()
        if self.data.fail:
            raise RuntimeError(f"task {self.data.id} fails, as configured")
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class SumsConfig(vf.TasksetConfig):
    num_tasks: int = 8
    """How many sums."""
    seed: int = 0
    """Which sums."""
    fail_odd: bool = False
    """Every other task's scoring raises (tests of failures)."""


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self) -> list[SumsTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            data = SumsData(
                id=f"sum-{i}",
                prompt=f"What is {a} + {b}? Answer with the number.",
                answer=a + b,
                fail=self.config.fail_odd and i % 2 == 1,
            )
            tasks.append(SumsTask(data, self.config.task))
        return tasks

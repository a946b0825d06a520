import re

import verifiers.v1 as vf

SYSTEM_PROMPT = "You are a careful math tutor. Reason step by step, then state the final answer."
SUFFIX = "\nPlease put your final answer within \\boxed{}."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The number in the last ``\\boxed{...}``, else the last number in the text."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        found = NUMBER.findall(text[start:].split("}", 1)[0])
        if found:
            return float(found[-1])
    found = NUMBER.findall(text)
    return float(found[-1]) if found else None


class ArithData(vf.TaskData):
    """One problem: its answer."""

    answer: int


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the final number of the model's last reply is the answer."""
        got = final_number(trace.last_reply or "")
        return float(got is not None and got == self.data.answer)

    @vf.metric
    async def boxed(self, trace: vf.Trace) -> float:
        """1 when the reply puts an answer in \\boxed{} (the format asked for)."""
        return float("\\boxed{" in (trace.last_reply or ""))


class ArithConfig(vf.TasksetConfig):
    tutor: bool = True
    """Ask with the tutor's system prompt and the \\boxed{} suffix (else the bare question)."""


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        plus = [(f"What is {a} + {b}?", a + b) for a in range(1, 10) for b in range(1, 10)]
        minus = [(f"What is {a} - {b}?", a - b) for a in range(2, 10) for b in range(1, a)]
        tasks = []
        for i, (question, answer) in enumerate(plus + minus):
            tutor = self.config.tutor
            data = ArithData(
                id=f"arith-{i}",
                prompt=question + SUFFIX if tutor else question,
                system_prompt=SYSTEM_PROMPT if tutor else None,
                answer=answer,
            )
            tasks.append(ArithTask(data, self.config.task))
        return tasks

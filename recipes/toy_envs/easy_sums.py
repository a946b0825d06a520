"""The easy sums as a verifiers ``SingleTurnEnv``: single-digit sums and differences (the ``easy``
data source's 117 problems) with the CPU default's tutor prompt, scored by a rubric.

    [rollout] workflow = "nodes.rollout.environments:VerifiersWorkflow"
    [rollout.workflow_args] env = "recipes.toy_envs.easy_sums"
    [data] source = "env"

An ordinary verifiers environment: ``verifiers.load_environment("recipes.toy_envs.easy_sums")`` loads it
for any trainer that takes them. Its dataset is the training problems, its eval dataset the 64
held-out ones (the same split as ``data.source = "easy"``).
"""

from __future__ import annotations

import re
from typing import Any

import verifiers as vf

from nodes.driver.data import PROMPT_SUFFIX, SYSTEM_PROMPT, easy_items, load_gsm8k

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def final_number(text: str) -> str | None:
    """The answer a completion gives: inside its last ``\\boxed{}``, else its last number."""
    boxed = BOXED.findall(text)
    numbers = NUMBER.findall(boxed[-1] if boxed else text)
    return numbers[-1] if numbers else None


def correct_answer(completion: Any, answer: str, parser: vf.Parser) -> float:
    """1 when the completion's final number is the answer."""
    given = final_number(parser.parse_answer(completion) or "")
    return float(given is not None and float(given) == float(answer))


def boxed(completion: Any, parser: vf.Parser) -> float:
    """1 when the completion puts its answer in ``\\boxed{}`` (a metric: weight 0)."""
    return float(bool(BOXED.search(parser.parse_answer(completion) or "")))


def _dataset(split: str, seed: int) -> Any:
    from datasets import Dataset

    items, _ = load_gsm8k(split, "easy", None, None, seed)
    return Dataset.from_list(
        [{"question": i["question"] + PROMPT_SUFFIX, "answer": i["answer"]} for i in items]
    )


def load_environment(seed: int = 0, **kwargs: Any) -> vf.Environment:
    """The environment: ``seed`` orders the problems before they are split (as ``data.seed``)."""
    assert len(easy_items()) == 117  # the split below is the easy source's
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[correct_answer, boxed], weights=[1.0, 0.0], parser=parser)
    return vf.SingleTurnEnv(
        dataset=_dataset("train", seed),
        eval_dataset=_dataset("test", seed),
        system_prompt=SYSTEM_PROMPT,
        parser=parser,
        rubric=rubric,
        **kwargs,
    )

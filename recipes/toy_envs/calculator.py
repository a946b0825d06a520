"""Three-digit by two-digit products as a verifiers ``ToolEnv`` with a calculator tool: the model
calls ``multiply`` (the tool runs here, in the rollout actor) and answers; the rubric scores the
final answer (weight 1) and counts the tool calls (ToolEnv's own metrics, weight 0).

    [rollout.workflow_args] env = "recipes.toy_envs.calculator"
"""

from __future__ import annotations

from typing import Any

import verifiers as vf

from nodes.driver.data import load_gsm8k
from recipes.toy_envs.easy_sums import final_number

SYSTEM = "Use the multiply tool to compute products, then give the final answer within \\boxed{}."


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor

    Returns:
        a times b
    """
    return int(a) * int(b)


def correct_answer(completion: Any, answer: str, parser: vf.Parser) -> float:
    """1 when the final answer is the product."""
    given = final_number(parser.parse_answer(completion) or "")
    return float(given is not None and float(given) == float(answer))


def _dataset(split: str, seed: int, limit: int | None) -> Any:
    from datasets import Dataset

    items, _ = load_gsm8k(split, "products", None, limit, seed)
    return Dataset.from_list([{"question": i["question"], "answer": i["answer"]} for i in items])


def load_environment(
    seed: int = 0, max_turns: int = 3, limit: int | None = None, **kwargs: Any
) -> vf.Environment:
    """The environment; ``limit``: the first N problems of each split."""
    parser = vf.Parser()
    return vf.ToolEnv(
        tools=[multiply],
        max_turns=max_turns,
        dataset=_dataset("train", seed, limit),
        eval_dataset=_dataset("test", seed, limit),
        system_prompt=SYSTEM,
        parser=parser,
        rubric=vf.Rubric(funcs=[correct_answer], weights=[1.0], parser=parser),
        **kwargs,
    )

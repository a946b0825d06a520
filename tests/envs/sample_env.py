"""A small verifiers ``SingleTurnEnv`` for the tests, well-behaved or misbehaving by ``kind``
(``env_args = {kind = ...}``): ``ok`` scores every answer 1 (so a reward of 1 came from its rubric);
``flaky`` raises in half of its rollouts (the run goes on without those groups); the others fail
every group one way each; ``load_fails`` cannot load (the run stops before it starts)."""

from __future__ import annotations

import asyncio
from typing import Any

import verifiers as vf
from datasets import Dataset

ROWS = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(16)]


def nan_score(completion: Any) -> float:
    return float("nan")


def text_score(completion: Any) -> Any:
    return "yes"


def raising_score(completion: Any) -> float:
    raise ZeroDivisionError("the rubric's own bug")


async def hanging_score(completion: Any) -> float:
    await asyncio.Event().wait()
    return 1.0


def one(completion: Any) -> float:
    return 1.0


def length(completion: Any, parser: vf.Parser) -> float:
    """The answer's length in characters (a metric: weight 0)."""
    return float(len(parser.parse_answer(completion) or ""))


class RaisingEnv(vf.SingleTurnEnv):
    """Its rollout raises (an environment's own bug): always, or for odd rows when ``flaky``."""

    flaky = False

    async def setup_state(self, state: Any) -> Any:
        if not self.flaky or int(state["answer"]) % 2:
            raise KeyError("the environment's own bug")
        return state


SCORES = {"nan": nan_score, "text": text_score, "raises_in_rubric": raising_score, "hangs": hanging_score}


def load_environment(kind: str = "ok") -> vf.Environment:
    if kind == "load_fails":
        raise RuntimeError("no such dataset here")
    rubric = vf.Rubric(funcs=[SCORES.get(kind, one), length], weights=[1.0, 0.0])
    cls = RaisingEnv if kind in ("raises", "flaky") else vf.SingleTurnEnv
    env = cls(dataset=Dataset.from_list(ROWS), rubric=rubric)
    env.flaky = kind == "flaky"
    return env

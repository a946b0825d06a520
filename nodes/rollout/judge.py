"""Model-graded rewards: an LLM judge of ``[models.<name>]`` scores each completion.

``[reward] fn = "nodes.rollout.judge:judge"`` with ``[reward.fn_args]`` (:class:`JudgeConfig`):
the judge model's name, a prompt template, a parser of its answer, batching, a cache and a
timeout. Per completion:

1. the template is filled with ``{prompt}`` (the item's prompt or question), ``{completion}``,
   ``{answer}`` (the reference answer, "" if the item has none) and any other column of the item
   by name (``{rubric}``);
2. the text goes to the judge's servers, gathered with other completions into one batched
   ``/generate`` call (up to ``batch_size`` prompts, waiting at most ``batch_wait_s`` for them);
3. the answer is parsed: ``score`` (the last number in it, within ``[score_min, score_max]``,
   scaled to ``[0, 1]``), ``yes_no`` (the first "yes" or "no": 1 or 0) or ``choice`` (the first
   of ``choices``' keys it names, scored by its value);
4. the score is cached under what was judged (the filled prompt and the judge's settings), so
   the same completion of the same item is judged once.

A judge that fails (no answer within ``timeout_s``, its servers down) or answers what cannot be
parsed scores the sample as ``on_error`` says: ``default`` (the ``default`` score) or ``drop``
(the whole group is dropped, as a failed episode is). Each is counted (``reward/judge_errors`` in
the metrics) and the first of each kind logged.

Reward models that output a scalar (a sequence classifier) are not served yet: the reference
server has no ``/classify`` route (nor any reward endpoint), so no such path could be tested here.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import string
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import structlog

from nodes.rollout.models import ModelCallError, ModelClient
from protocols.runtime.codec import register
from rlactors.base.aio import wait_for
from rlactors.base.tomlconf import above, at_least, check_ranges

__all__ = ["COUNTERS", "Judge", "JudgeConfig", "JudgeDropError", "judge", "parse_answer"]

log = structlog.get_logger(__name__)

DEFAULT_TEMPLATE = (
    "You are grading a student's answer.\n\nQuestion:\n{prompt}\n\nReference answer:\n{answer}\n\n"
    "Student's answer:\n{completion}\n\nIs the student's final answer correct? Answer yes or no.\n"
)

# every judge of this process, summed (a rollout actor reports them in its stats as reward_judge_*)
COUNTERS = {"judge_calls": 0, "judge_errors": 0, "judge_cache_hits": 0, "judge_time_s": 0.0}


@register
@dataclass
class JudgeConfig:
    """An LLM judge's settings (``[reward.fn_args]`` of ``nodes.rollout.judge:judge``)."""

    judge: str = ""  # the judge: a model of [models.<name>]
    # the judge's prompt: {prompt}, {completion}, {answer} and any column of the item by name
    template: str = DEFAULT_TEMPLATE
    # how its answer becomes a score: the last number in range, yes/no, or one of choices
    parser: Literal["score", "yes_no", "choice"] = "yes_no"
    score_min: float = 0.0  # parser "score": the lowest score, which scores 0
    score_max: float = 10.0  # parser "score": the highest score, which scores 1
    # parser "choice": each choice (a word the judge answers) and the reward it gives, e.g. {A = 1.0, B = 0.0}
    choices: dict[str, float] = field(default_factory=dict)
    max_new_tokens: int = field(default=16, metadata=at_least(1))  # the judge's answer's length
    temperature: float = field(default=0.0, metadata=at_least(0))  # the judge's sampling temperature
    batch_size: int = field(default=8, metadata=at_least(1))  # completions judged in one /generate call
    batch_wait_s: float = field(default=0.005, metadata=at_least(0))  # wait this long for a batch to fill
    cache_size: int = field(default=4096, metadata=at_least(0))  # judged prompts remembered (0: no cache)
    timeout_s: float = field(default=8.0, metadata=above(0))  # a judge call longer than this is a failure
    # a failed or unparseable judgement: score "default", or "drop" the sample's group
    on_error: Literal["default", "drop"] = "default"
    default: float = 0.0  # on_error = "default": the score it gives

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.score_max <= self.score_min:
            raise ValueError(f"'score_max' must be > score_min ({self.score_min}), got {self.score_max}")
        if self.parser == "choice" and not self.choices:
            raise ValueError("'choices' must name at least one choice for parser = 'choice'")


class JudgeDropError(Exception):
    """A judgement failed with ``on_error = "drop"``: the sample's group is dropped."""

    drops_group = True  # the reward runner lets it through, so the episode fails (nodes/rollout/reward.py)


class JudgeParseError(ValueError):
    """The judge's answer holds no score the parser can read."""


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_answer(text: str, cfg: JudgeConfig) -> float:
    """The reward in the judge's answer ``text`` (see the module docstring); JudgeParseError when
    there is none."""
    if cfg.parser == "score":
        numbers = _NUMBER.findall(text)
        if not numbers:
            raise JudgeParseError(f"no number in the judge's answer {text[:200]!r}")
        x = float(numbers[-1])
        if not cfg.score_min <= x <= cfg.score_max:
            raise JudgeParseError(
                f"the judge's score {x:g} is outside [{cfg.score_min:g}, {cfg.score_max:g}]"
            )
        return (x - cfg.score_min) / (cfg.score_max - cfg.score_min)
    if cfg.parser == "yes_no":
        m = _YES_NO.search(text)
        if m is None:
            raise JudgeParseError(f"neither yes nor no in the judge's answer {text[:200]!r}")
        return 1.0 if m.group(1).lower() == "yes" else 0.0
    found = [(m.start(), c) for c in cfg.choices if (m := re.search(rf"\b{re.escape(c)}\b", text))]
    if not found:
        raise JudgeParseError(f"none of {sorted(cfg.choices)} in the judge's answer {text[:200]!r}")
    return float(cfg.choices[min(found)[1]])


def fill_template(template: str, completion: str, item: Any) -> str:
    """The judge's prompt: ``template`` with the item's columns, ``{prompt}``, ``{completion}`` and
    ``{answer}``. A name the item lacks is a KeyError naming it."""
    row = dict(item) if isinstance(item, Mapping) else {}
    values = {k: v for k, v in row.items() if isinstance(k, str)}
    values.setdefault("prompt", row.get("question", row.get("prompt", "")))
    values.setdefault("answer", row.get("answer", ""))
    values["completion"] = completion
    for _, name, _, _ in string.Formatter().parse(template):
        if name and name not in values:
            raise KeyError(
                f"the judge's template names {{{name}}}, which the item has not (columns: {sorted(values)})"
            )
    return template.format(**values)


class Judge:
    """One judge model's calls: a batcher in front of its servers and a cache of its verdicts."""

    def __init__(self, cfg: JudgeConfig, client: Any) -> None:
        self.cfg, self.client = cfg, client
        self._cache: OrderedDict[str, float] = OrderedDict()
        self._queue: list[tuple[str, asyncio.Future[str]]] = []
        self._flush: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._logged: set[str] = set()
        self._settings_key = repr(sorted(asdict(cfg).items()))

    def _key(self, prompt: str) -> str:
        return hashlib.sha256(f"{self._settings_key}\0{prompt}".encode()).hexdigest()

    async def score(self, completion: str, item: Any) -> float:
        """The completion's reward (see the module docstring)."""
        prompt = fill_template(self.cfg.template, completion, item)
        key = self._key(prompt)
        if key in self._cache:
            COUNTERS["judge_cache_hits"] += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        t0 = time.monotonic()
        try:
            text = await wait_for(self._ask(prompt), self.cfg.timeout_s)
            value = parse_answer(text, self.cfg)
        except (TimeoutError, ModelCallError, JudgeParseError, KeyError, ValueError) as e:
            return self._failed(e)
        finally:
            COUNTERS["judge_time_s"] += time.monotonic() - t0
        if self.cfg.cache_size:
            self._cache[key] = value
            while len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
        return value

    def _failed(self, e: BaseException) -> float:
        COUNTERS["judge_errors"] += 1
        kind = "timeout" if isinstance(e, TimeoutError) else type(e).__name__
        if kind not in self._logged:  # later ones are counted
            self._logged.add(kind)
            why = f"no answer within timeout_s = {self.cfg.timeout_s:g} s" if kind == "timeout" else str(e)
            log.warning(
                "judge.error",
                judge=self.cfg.judge,
                kind=kind,
                error=why,
                on_error=self.cfg.on_error,
                note="logged once per kind; counted in reward/judge_errors",
            )
        if self.cfg.on_error == "drop":
            raise JudgeDropError(f"judge '{self.cfg.judge}': {kind}: {e}")
        return self.cfg.default

    async def _ask(self, prompt: str) -> str:
        """The judge's answer to ``prompt``, sent with the others queued within ``batch_wait_s``."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queue.append((prompt, fut))
        if len(self._queue) >= self.cfg.batch_size:
            self._send()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self.cfg.batch_wait_s, self._send)
        return await fut

    def _send(self) -> None:
        """Post what is queued, ``batch_size`` prompts a call."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        while self._queue:
            batch, self._queue = self._queue[: self.cfg.batch_size], self._queue[self.cfg.batch_size :]
            task = asyncio.get_running_loop().create_task(self._call(batch), name="judge-batch")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _call(self, batch: list[tuple[str, asyncio.Future[str]]]) -> None:
        body = {
            "text": [p for p, _ in batch],
            "sampling_params": {
                "max_new_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature,
            },
        }
        COUNTERS["judge_calls"] += 1
        try:
            answers = await self.client.post("/generate", body, self.cfg.timeout_s)
            if not isinstance(answers, list) or len(answers) != len(batch):
                raise ModelCallError(
                    f"judge '{self.cfg.judge}': {len(batch)} prompts, answer {str(answers)[:200]}"
                )
        except (
            BaseException
        ) as e:  # every waiting sample gets the failure, a cancellation's too, else it waits forever
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e if isinstance(e, Exception) else ModelCallError(str(e)))
            if not isinstance(e, Exception):
                raise
            return
        for (_, fut), answer in zip(batch, answers, strict=True):
            if not fut.done():
                fut.set_result(str(answer.get("text", "")))


_JUDGES: dict[str, Judge] = {}


def _judge_for(cfg: JudgeConfig) -> Judge:
    """This process's judge for ``cfg``; its client finds the judge model's servers at its first
    call (:func:`~nodes.rollout.models.model_servers`)."""
    key = repr(sorted(asdict(cfg).items()))
    if key not in _JUDGES:
        if not cfg.judge:
            raise ValueError("reward.fn_args.judge names no model: set it to a model of [models.<name>]")
        _JUDGES[key] = Judge(cfg, ModelClient(cfg.judge))
    return _JUDGES[key]


async def judge(completion: str, item: Any, settings: JudgeConfig) -> float:
    """The reward function: ``[reward] fn = "nodes.rollout.judge:judge"`` (see the module docstring)."""
    return await _judge_for(settings).score(completion, item)


judge.config_class = JudgeConfig  # type: ignore[attr-defined]

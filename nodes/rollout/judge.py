"""Model-graded rewards: another model of ``[models.<name>]`` scores each completion, an LLM judge
that answers in words or a reward model (a sequence classifier) that answers a number.

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

``[reward] fn = "nodes.rollout.judge:reward_model"`` (:class:`RewardModelConfig`) does the same
with a reward model: a checkpoint whose architecture is a ``*ForSequenceClassification`` (one
output, ``num_labels = 1``), served by SGLang or the reference server, each of which detects it
from its config and serves it on ``/classify`` (SGLang's reward endpoint: ``{"text": [...]}`` or
``{"input_ids": [[...]]}`` in, one ``{"embedding": [score], ...}`` per prompt out). What it scores
is, by default, the conversation (the item's prompt as the user's turn, or its messages, then the
completion as the assistant's) rendered by the chat template of the reward model's tokenizer and
sent as token ids; with ``template`` set, that text template filled as the judge's is, sent as
text. Its number becomes the reward as ``transform`` says: ``raw``, ``sigmoid``, or ``minmax``
(``[score_min, score_max]`` scaled to ``[0, 1]``, clipped). Batching, the cache, the timeout and
the failures are the judge's (:class:`Scorer`).

A judgement that fails (no answer within ``timeout_s``, its servers down) or answers what cannot be
read (no number, an answer that is no score) scores the sample as ``on_error`` says: ``default``
(the ``default`` score) or ``drop`` (the whole group is dropped, as a failed episode is). Each is
counted (``reward/judge_errors`` in the metrics, judges and reward models together) and the first
of each kind logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import string
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx  # one GET of a reward model's /model_info, to find its tokenizer: not the scoring wire
import structlog

from nodes.rollout.models import ModelCallError, ModelClient
from protocols.runtime.codec import register
from rlactors.base.aio import wait_for
from rlactors.base.tomlconf import above, at_least, check_ranges

__all__ = [
    "COUNTERS",
    "Judge",
    "JudgeConfig",
    "JudgeDropError",
    "RewardModel",
    "RewardModelConfig",
    "Scorer",
    "ScorerConfig",
    "judge",
    "parse_answer",
    "reward_model",
]

log = structlog.get_logger(__name__)

DEFAULT_TEMPLATE = (
    "You are grading a student's answer.\n\nQuestion:\n{prompt}\n\nReference answer:\n{answer}\n\n"
    "Student's answer:\n{completion}\n\nIs the student's final answer correct? Answer yes or no.\n"
)

# every judge and reward model of this process, summed (a rollout actor reports them in its stats
# as reward_judge_*)
COUNTERS = {
    "judge_calls": 0,  # batched calls to the model's servers
    "judge_errors": 0,  # judgements that failed or could not be read
    "judge_cache_hits": 0,  # judgements answered from the cache
    "judged": 0,  # judgements asked of the model (not from the cache)
    "judge_time_s": 0.0,  # their seconds, each from its queueing to its answer
}


@dataclass
class ScorerConfig:
    """What a judge and a reward model share: the model, batching, the cache, the timeout, failures."""

    # the model that scores: a model of [models.<name>] (an LLM for judge, a classifier for reward_model)
    judge: str = ""
    batch_size: int = field(default=8, metadata=at_least(1))  # completions scored in one call
    batch_wait_s: float = field(default=0.005, metadata=at_least(0))  # wait this long for a batch to fill
    cache_size: int = field(default=4096, metadata=at_least(0))  # scored inputs remembered (0: no cache)
    timeout_s: float = field(default=8.0, metadata=above(0))  # a call longer than this is a failure
    # a failed or unreadable judgement: score "default", or "drop" the sample's group
    on_error: Literal["default", "drop"] = "default"
    default: float = 0.0  # on_error = "default": the score it gives

    def __post_init__(self) -> None:
        check_ranges(self)


@register
@dataclass
class JudgeConfig(ScorerConfig):
    """An LLM judge's settings (``[reward.fn_args]`` of ``nodes.rollout.judge:judge``)."""

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

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.score_max <= self.score_min:
            raise ValueError(f"'score_max' must be > score_min ({self.score_min}), got {self.score_max}")
        if self.parser == "choice" and not self.choices:
            raise ValueError("'choices' must name at least one choice for parser = 'choice'")


@register
@dataclass
class RewardModelConfig(ScorerConfig):
    """A reward model's settings (``[reward.fn_args]`` of ``nodes.rollout.judge:reward_model``):
    a sequence classifier served on ``/classify`` scores each completion."""

    # what it scores: "" = the conversation (the item's prompt, then the completion as the
    # assistant's turn) in its tokenizer's chat template; else a text template as the judge's
    # ({prompt}, {completion}, {answer}, any column of the item)
    template: str = ""
    # the tokenizer whose chat template renders the conversation: a folder or hub name ("" = the
    # one its servers report in /model_info, tokenizer_path)
    tokenizer: str = ""
    # how its number becomes the reward: as it is, sigmoid(x), or [score_min, score_max] scaled to [0, 1]
    transform: Literal["raw", "sigmoid", "minmax"] = "raw"
    score_min: float = 0.0  # transform "minmax": the number that scores 0 (lower ones too)
    score_max: float = 1.0  # transform "minmax": the number that scores 1 (higher ones too)
    label: int = field(
        default=0, metadata=at_least(0)
    )  # which of its outputs is the score (0: a one-output model)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transform == "minmax" and self.score_max <= self.score_min:
            raise ValueError(f"'score_max' must be > score_min ({self.score_min}), got {self.score_max}")


class JudgeDropError(Exception):
    """A judgement failed with ``on_error = "drop"``: the sample's group is dropped."""

    drops_group = True  # the reward runner lets it through, so the episode fails (nodes/rollout/reward.py)


class JudgeParseError(ValueError):
    """The model's answer holds no score that can be read."""


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


def transform_score(answer: Any, cfg: RewardModelConfig) -> float:
    """The reward in a reward model's ``/classify`` answer for one prompt (``{"embedding":
    [score, ...], ...}``), transformed as ``cfg.transform`` says; JudgeParseError when it holds
    no finite number at ``cfg.label``."""
    outputs = answer.get("embedding") if isinstance(answer, Mapping) else None
    if not isinstance(outputs, list) or len(outputs) <= cfg.label:
        raise JudgeParseError(
            f"no output {cfg.label} in the reward model's answer {str(answer)[:200]} "
            "(is its checkpoint a *ForSequenceClassification?)"
        )
    x = outputs[cfg.label]
    if not isinstance(x, int | float) or isinstance(x, bool) or not math.isfinite(x):
        raise JudgeParseError(f"the reward model's output {cfg.label} is {x!r}, not a finite number")
    if cfg.transform == "sigmoid":
        return 0.5 * (1.0 + math.tanh(0.5 * x))  # sigmoid without overflow for large |x|
    if cfg.transform == "minmax":
        return min(1.0, max(0.0, (x - cfg.score_min) / (cfg.score_max - cfg.score_min)))
    return float(x)


def _columns(completion: str, item: Any) -> dict[str, Any]:
    row = dict(item) if isinstance(item, Mapping) else {}
    values = {k: v for k, v in row.items() if isinstance(k, str)}
    values.setdefault("prompt", row.get("question", row.get("prompt", "")))
    values.setdefault("answer", row.get("answer", ""))
    values["completion"] = completion
    return values


def fill_template(template: str, completion: str, item: Any) -> str:
    """The judge's prompt: ``template`` with the item's columns, ``{prompt}``, ``{completion}`` and
    ``{answer}``. A name the item lacks is a KeyError naming it."""
    values = _columns(completion, item)
    for _, name, _, _ in string.Formatter().parse(template):
        if name and name not in values:
            raise KeyError(
                f"the judge's template names {{{name}}}, which the item has not (columns: {sorted(values)})"
            )
    return template.format(**values)


def conversation(completion: str, item: Any) -> list[dict[str, str]]:
    """The conversation a reward model scores: the item's prompt (its messages, if it is a list
    of them, else one user turn of its prompt or question), then the completion as the
    assistant's turn."""
    prompt = _columns(completion, item)["prompt"]
    if isinstance(prompt, list) and all(isinstance(m, Mapping) and "role" in m for m in prompt):
        turns = [{"role": str(m["role"]), "content": str(m.get("content", ""))} for m in prompt]
    else:
        turns = [{"role": "user", "content": str(prompt)}]
    return [*turns, {"role": "assistant", "content": completion}]


class Scorer:
    """One scoring model's calls: a batcher in front of its servers, a cache of its scores, a
    timeout, and what a failure scores. What is sent, where, and how an answer becomes a score
    are its kind's (:class:`Judge`, :class:`RewardModel`)."""

    path = ""  # the route a batch is posted to

    def __init__(self, cfg: ScorerConfig, client: Any) -> None:
        self.cfg, self.client = cfg, client
        self._cache: OrderedDict[str, float] = OrderedDict()
        self._queue: list[tuple[Any, asyncio.Future[Any]]] = []
        self._flush: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._logged: set[str] = set()
        self._settings_key = repr(sorted(asdict(cfg).items()))

    # -- what a kind of scorer says -------------------------------------------------------------

    async def _input(self, completion: str, item: Any) -> Any:
        """What is sent for this completion (one entry of a batch)."""
        raise NotImplementedError

    def _body(self, entries: list[Any]) -> dict[str, Any]:
        """The body that scores ``entries`` in one call to :attr:`path`."""
        raise NotImplementedError

    def _value(self, answer: Any) -> float:
        """The reward in one entry's answer; JudgeParseError when it holds none."""
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------------

    def _key(self, entry: Any) -> str:
        text = entry if isinstance(entry, str) else ",".join(map(str, entry))
        return hashlib.sha256(f"{self._settings_key}\0{text}".encode()).hexdigest()

    async def score(self, completion: str, item: Any) -> float:
        """The completion's reward (see the module docstring)."""
        try:
            entry = await self._input(completion, item)
        except (ModelCallError, KeyError, ValueError, OSError) as e:
            return self._failed(e)
        key = self._key(entry)
        if key in self._cache:
            COUNTERS["judge_cache_hits"] += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        t0 = time.monotonic()
        try:
            answer = await wait_for(self._ask(entry), self.cfg.timeout_s)
            value = self._value(answer)
        except (TimeoutError, ModelCallError, JudgeParseError, KeyError, ValueError) as e:
            return self._failed(e)
        finally:
            COUNTERS["judged"] += 1
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

    async def _ask(self, entry: Any) -> Any:
        """The model's answer to ``entry``, sent with the others queued within ``batch_wait_s``."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((entry, fut))
        if len(self._queue) >= self.cfg.batch_size:
            self._send()
        elif self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self.cfg.batch_wait_s, self._send)
        return await fut

    def _send(self) -> None:
        """Post what is queued, ``batch_size`` entries a call."""
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        while self._queue:
            batch, self._queue = self._queue[: self.cfg.batch_size], self._queue[self.cfg.batch_size :]
            task = asyncio.get_running_loop().create_task(self._call(batch), name="judge-batch")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _call(self, batch: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        COUNTERS["judge_calls"] += 1
        try:
            answers = await self.client.post(self.path, self._body([e for e, _ in batch]), self.cfg.timeout_s)
            if not isinstance(answers, list) or len(answers) != len(batch):
                raise ModelCallError(
                    f"judge '{self.cfg.judge}': {len(batch)} prompts to {self.path}, answer {str(answers)[:200]}"
                )
        except BaseException as e:  # each waiting sample gets it (a cancellation too) or waits forever
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e if isinstance(e, Exception) else ModelCallError(str(e)))
            if not isinstance(e, Exception):
                raise
            return
        for (_, fut), answer in zip(batch, answers, strict=True):
            if not fut.done():
                fut.set_result(answer)


class Judge(Scorer):
    """An LLM judge: its template filled, sent to ``/generate``, its answer parsed."""

    path = "/generate"
    cfg: JudgeConfig

    async def _input(self, completion: str, item: Any) -> str:
        return fill_template(self.cfg.template, completion, item)

    def _body(self, entries: list[Any]) -> dict[str, Any]:
        params = {"max_new_tokens": self.cfg.max_new_tokens, "temperature": self.cfg.temperature}
        return {"text": entries, "sampling_params": params}

    def _value(self, answer: Any) -> float:
        text = str(answer.get("text", "")) if isinstance(answer, Mapping) else ""
        return parse_answer(text, self.cfg)


class RewardModel(Scorer):
    """A reward model: the conversation in its chat template (token ids) or a text template, sent
    to ``/classify``, its number transformed."""

    path = "/classify"
    cfg: RewardModelConfig

    def __init__(self, cfg: RewardModelConfig, client: Any) -> None:
        super().__init__(cfg, client)
        self._tokenizer: Any = None
        self._loading: asyncio.Lock | None = None

    async def _input(self, completion: str, item: Any) -> str | list[int]:
        if self.cfg.template:
            return fill_template(self.cfg.template, completion, item)
        tok = await self.tokenizer()
        try:
            text = tok.apply_chat_template(conversation(completion, item), tokenize=False)
        except Exception as e:  # a template's own error (jinja raises its kinds): a failure of this sample
            raise ValueError(f"reward model '{self.cfg.judge}': its chat template failed: {e}") from None
        # the template writes the special tokens it wants (a BOS, turn markers): none added again
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def _body(self, entries: list[Any]) -> dict[str, Any]:
        return {"text": entries} if isinstance(entries[0], str) else {"input_ids": entries}

    def _value(self, answer: Any) -> float:
        return transform_score(answer, self.cfg)

    async def tokenizer(self) -> Any:
        """The tokenizer whose chat template renders what is scored (``tokenizer``, or the one the
        model's servers report), loaded once; ValueError when there is none to load."""
        self._loading = self._loading or asyncio.Lock()
        async with self._loading:
            if self._tokenizer is None:
                path = self.cfg.tokenizer or await self._served_tokenizer()
                self._tokenizer = await asyncio.to_thread(self._load, path)
        return self._tokenizer

    def _load(self, path: str) -> Any:
        from transformers import AutoTokenizer

        where = (
            "reward.fn_args.tokenizer" if self.cfg.tokenizer else "its servers' /model_info tokenizer_path"
        )
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"reward model '{self.cfg.judge}': no tokenizer to load at {path!r} ({where}): set "
                f"reward.fn_args.tokenizer to a folder of it ({e})"
            ) from None
        if not getattr(tok, "chat_template", None):
            raise ValueError(
                f"reward model '{self.cfg.judge}': the tokenizer at {path!r} has no chat template: set "
                "reward.fn_args.template to a text template ({prompt}, {completion}, ...)"
            )
        return tok

    async def _served_tokenizer(self) -> str:
        """The tokenizer path one of the model's servers reports (SGLang and the reference server
        both answer it in ``/model_info``)."""
        urls = await self.client.refresh()
        keys = self.client.config.keys
        last = "no server"
        async with httpx.AsyncClient(timeout=self.cfg.timeout_s) as http:
            for url in urls:
                try:
                    r = await http.get(
                        f"{url}/model_info", headers=keys.headers("/model_info") if keys else {}
                    )
                    if r.status_code == 200 and (path := r.json().get("tokenizer_path")):
                        return str(path)
                    last = f"{url}/model_info answered {r.status_code}: {r.text[:200]}"
                except (httpx.HTTPError, ValueError) as e:
                    last = f"{url}/model_info: {e}"
        raise ModelCallError(
            f"reward model '{self.cfg.judge}': no server told its tokenizer ({last}); set "
            "reward.fn_args.tokenizer to a folder of it"
        )


_SCORERS: dict[str, Scorer] = {}


def _scorer_for(cfg: ScorerConfig) -> Scorer:
    """This process's scorer for ``cfg`` (a judge or a reward model); its client finds the model's
    servers at its first call (:func:`~nodes.rollout.models.model_servers`)."""
    key = f"{type(cfg).__name__}{sorted(asdict(cfg).items())!r}"
    if key not in _SCORERS:
        if not cfg.judge:
            raise ValueError("reward.fn_args.judge names no model: set it to a model of [models.<name>]")
        client = ModelClient(cfg.judge)
        _SCORERS[key] = RewardModel(cfg, client) if isinstance(cfg, RewardModelConfig) else Judge(cfg, client)
    return _SCORERS[key]


async def judge(completion: str, item: Any, settings: JudgeConfig) -> float:
    """The reward function: ``[reward] fn = "nodes.rollout.judge:judge"`` (see the module docstring)."""
    return await _scorer_for(settings).score(completion, item)


judge.config_class = JudgeConfig  # type: ignore[attr-defined]


async def reward_model(completion: str, item: Any, settings: RewardModelConfig) -> float:
    """The reward function: ``[reward] fn = "nodes.rollout.judge:reward_model"`` (see the module
    docstring)."""
    return await _scorer_for(settings).score(completion, item)


reward_model.config_class = RewardModelConfig  # type: ignore[attr-defined]

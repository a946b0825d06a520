"""Episode workflows: turn a dataset item into a TrajectoryGroup through an SGLang client.

A workflow is an object with ``async arun_episode(client, item, group_id=None) ->
TrajectoryGroup``. Two are provided, after AReaL's:

- :class:`RLVRWorkflow` — single turn: the prompt (chat template applied) is sampled
  ``n_samples`` times concurrently; each completion is scored by the reward function.
- :class:`MultiTurnWorkflow` — "retry until correct": after a wrong answer a feedback user
  turn is appended and the model answers again, up to ``max_turns``; the reward is
  discounted by the turn that got it right. Feedback tokens carry loss_mask 0.

Every sample of an episode reuses one request id per sample, so its later turns are routed
to the server that already holds its prefix in cache.

A workflow class is named by import path (``[rollout] workflow``); its ``config_class`` (a
dataclass) holds its settings. :class:`WorkflowSpec` says which workflow to build, with which
tokenizer, reward and settings; it travels to the rollout actors, which build the workflow in their
own process (:func:`build_workflow`). A new workflow is a class in any importable module whose
``__init__`` takes ``(tokenizer, reward: RewardRunner, config)``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import structlog

from nodes.common.plugins import resolve
from nodes.rollout.chat import ChatError, continuation_ids
from nodes.rollout.client import GenRequest, GenResult
from nodes.rollout.reward import RewardConfig, RewardFn, RewardRunner
from protocols.rl import IDS_DTYPE, LOGPROBS_DTYPE, MASK_DTYPE, VERSIONS_DTYPE, Trajectory, TrajectoryGroup
from protocols.runtime.codec import register
from rlactors.base.tomlconf import at_least, check_ranges, within

__all__ = [
    "ByteChatTokenizer",
    "MultiTurnConfig",
    "MultiTurnWorkflow",
    "RLVRConfig",
    "RLVRWorkflow",
    "Sample",
    "Workflow",
    "WorkflowSpec",
    "all_or_none",
    "build_workflow",
    "chat_ids",
]

log = structlog.get_logger(__name__)


class Generator(Protocol):
    """What a workflow needs from a client (SGLangClient satisfies it)."""

    async def agenerate(self, request: GenRequest) -> GenResult: ...


class Workflow(Protocol):
    """Builds one group of trajectories from one dataset item."""

    async def arun_episode(
        self, client: Generator, item: Any, group_id: str | None = None
    ) -> TrajectoryGroup: ...


def sample_rid(group_id: str, i: int, attempt: str) -> str:
    """Request id of sample ``i`` of one attempt at a group's episode. SGLang aborts by rid prefix, so
    no sample's rid may be a prefix of another's: it ends in ``/``. ``attempt`` is new for every run
    of an episode: a re-queued or resumed episode must not meet its earlier attempt's requests
    (still running on a server when their actor died, or while their abort is on its way), which
    SGLang would refuse as duplicate request ids."""
    return f"{group_id}/{attempt}/s{i}/"


def new_attempt() -> str:
    """A fresh attempt id for :func:`sample_rid`."""
    return uuid.uuid4().hex[:8]


async def all_or_none(aws: Any) -> list[Any]:
    """Await all; on the first failure cancel the rest (no orphan generations keep a server busy
    after the episode was abandoned) and raise it. Being cancelled cancels them all, as with gather."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()
    return [t.result() for t in tasks]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template (transformers 4 or 5)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


@register
@dataclass
class RLVRConfig:
    """Single-turn RL with verifiable rewards: ``n_samples`` completions of each prompt, sampled at
    ``temperature`` (the trainer's log-probs use the temperature each trajectory records)."""

    n_samples: int = field(default=4, metadata=at_least(1))  # completions per prompt: one GRPO group
    max_new_tokens: int = field(default=256, metadata=at_least(1))  # tokens one completion may generate
    temperature: float = field(default=1.0, metadata=at_least(0))  # the sampling temperature; 0 = greedy
    # any other SGLang sampling parameter (top_p, stop, ...); not max_new_tokens or temperature
    sampling_params: dict[str, Any] = field(default_factory=dict)
    prompt_key: str = "question"  # the item's field that holds the question
    # appended to each question, e.g. "\nPlease put your final answer within \\boxed{}."
    prompt_suffix: str = ""
    system_prompt: str | None = None  # the system message before each question; None or "": none

    def __post_init__(self) -> None:
        check_ranges(self)
        if twice := sorted({"max_new_tokens", "temperature"} & set(self.sampling_params)):
            raise ValueError(f"'sampling_params' must not set {twice}: they are settings of their own")

    def request_params(self) -> dict[str, Any]:
        """The SGLang sampling parameters of one request."""
        return {
            **self.sampling_params,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
        }


class Sample:
    """One growing sequence: ids with per-token mask, logprob and version, kept aligned; the model's
    outputs (mask 1) and the context between them (mask 0), sampled at ``temperature``.

    Started from a numpy array of prompt ids (as the built-in workflows start theirs), its four
    fields are numpy arrays of the trajectory's dtypes, grown by concatenation: the client's arrays
    go into the trajectory, and out through the codec, with no step per token. Started from a list
    (a user's workflow may), they are lists, for code that reads them as lists.
    """

    # numpy arrays or lists, as the prompt came
    ids: Any
    mask: Any
    logprobs: Any
    versions: Any

    def __init__(self, prompt_ids: Sequence[int] | np.ndarray, temperature: float) -> None:
        self.temperature = temperature
        n = len(prompt_ids)
        if isinstance(prompt_ids, np.ndarray):
            self.ids = np.array(prompt_ids, dtype=IDS_DTYPE)
            self.mask, self.logprobs, self.versions = _context(n)
        else:
            self.ids, self.mask, self.logprobs, self.versions = list(prompt_ids), [0] * n, [0.0] * n, [-1] * n
        self.meta: dict[str, Any] = {"cached_tokens": 0, "aborts": 0, "failovers": 0, "finish_reasons": []}

    def fork(self) -> Sample:
        """A copy to grow apart (another sample of the same prompt)."""
        twin = Sample([], self.temperature)
        twin.ids, twin.mask, twin.logprobs, twin.versions = (
            self.ids.copy(),
            self.mask.copy(),
            self.logprobs.copy(),
            self.versions.copy(),
        )
        twin.meta = {**self.meta, "finish_reasons": [*self.meta["finish_reasons"]]}
        twin.meta.pop("trace_id", None)  # its own, set when it generates
        return twin

    def add_output(self, res: GenResult) -> None:
        """Append the model's output (mask 1) from ``res``, with its log-probs and versions."""
        self._extend(res.ids, np.ones(len(res.ids), MASK_DTYPE), res.logprobs, res.versions)
        self.meta["cached_tokens"] += sum(res.cached_tokens)
        self.meta["aborts"] += res.aborts
        self.meta["failovers"] += res.failovers
        self.meta["finish_reasons"].append(res.finish_reason)

    def add_context(self, ids: Sequence[int]) -> None:
        """Append tokens the model did not generate (mask 0): a template's turn, a tool's result."""
        self._extend(ids, *_context(len(ids)))

    def _extend(
        self, ids: Sequence[int] | np.ndarray, mask: np.ndarray, logprobs: Any, versions: Any
    ) -> None:
        if isinstance(self.ids, list):
            self.ids += _as_list(ids)
            self.mask += mask.tolist()
            self.logprobs += _as_list(logprobs)
            self.versions += _as_list(versions)
        else:
            self.ids = np.concatenate((self.ids, ids), dtype=IDS_DTYPE)
            self.mask = np.concatenate((self.mask, mask), dtype=MASK_DTYPE)
            self.logprobs = np.concatenate((self.logprobs, logprobs), dtype=LOGPROBS_DTYPE)
            self.versions = np.concatenate((self.versions, versions), dtype=VERSIONS_DTYPE)

    def trajectory(self, reward: float, group_id: str, prompt_len: int) -> Trajectory:
        """The sequence as a validated trajectory, holding these fields as they are (no copy)."""
        t = Trajectory(
            self.ids,
            self.mask,
            self.logprobs,
            self.versions,
            reward,
            group_id,
            prompt_len,
            self.meta,
            self.temperature,
        )
        t.validate()
        return t


def _context(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask, log-probs and versions of ``n`` context tokens: 0, 0.0 and -1."""
    return np.zeros(n, MASK_DTYPE), np.zeros(n, LOGPROBS_DTYPE), np.full(n, -1, VERSIONS_DTYPE)


def _as_list(values: Sequence[Any] | np.ndarray) -> list[Any]:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


class RLVRWorkflow:
    """Single-turn RLVR: ``n_samples`` completions of one prompt form one group."""

    config_class: ClassVar[type] = RLVRConfig

    def __init__(
        self, tokenizer: Any, reward_fn: RewardFn | RewardRunner, config: RLVRConfig | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config or RLVRConfig()
        self.reward = reward_fn if isinstance(reward_fn, RewardRunner) else RewardRunner(reward_fn)

    def prompt_messages(self, item: Any) -> list[dict[str, str]]:
        """The chat messages for ``item``: its ``messages`` as written when it has them (a chat-format
        prompt, ``[data] messages_field``; the system prompt only added when they have none), else
        the system prompt and ``item[prompt_key]`` with the prompt suffix."""
        c = self.config
        msgs = [{"role": "system", "content": c.system_prompt}] if c.system_prompt else []
        if isinstance(item, dict) and item.get("messages"):
            given = list(item["messages"])
            return given if given[0]["role"] == "system" else [*msgs, *given]
        return [*msgs, {"role": "user", "content": str(item[c.prompt_key]) + c.prompt_suffix}]

    async def arun_episode(
        self, client: Generator, item: Any, group_id: str | None = None
    ) -> TrajectoryGroup:
        """Sample the prompt ``n_samples`` times concurrently and score each completion."""
        gid = group_id or uuid.uuid4().hex
        prompt = chat_ids(self.tokenizer, self.prompt_messages(item))
        attempt = new_attempt()
        results = await all_or_none(
            client.agenerate(
                GenRequest(
                    prompt,
                    self.config.request_params(),
                    rid=sample_rid(gid, i, attempt),
                    trace_id=f"{gid}/s{i}",
                )
            )
            for i in range(self.config.n_samples)
        )
        texts = [self.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in results]
        rewards = await asyncio.gather(*(self.reward(t, item) for t in texts))
        trajs = []
        prompt_ids = np.array(prompt, IDS_DTYPE)
        for i, (res, reward) in enumerate(zip(results, rewards, strict=True)):
            s = Sample(prompt_ids, self.config.temperature)
            s.add_output(res)
            s.meta.update(turns=1, trace_id=f"{gid}/s{i}")
            trajs.append(s.trajectory(reward, gid, len(prompt)))
        return TrajectoryGroup(gid, trajs)


@register
@dataclass
class MultiTurnConfig(RLVRConfig):
    """Retry-until-correct: up to ``max_turns`` answers, reward ``r * turn_discount**turn``."""

    max_turns: int = field(default=3, metadata=at_least(1))  # answers per episode, the first included
    # a correct answer at turn t (from 0) is rewarded r * turn_discount**t
    turn_discount: float = field(default=0.9, metadata=within(0, 1))
    # the user turn appended after a wrong answer
    feedback: str = "Your answer is incorrect. Please think again and put your final answer within \\boxed{}."


class MultiTurnWorkflow(RLVRWorkflow):
    """After a wrong answer, append a feedback user turn and generate again (AReaL's multi-turn example)."""

    # held-out accuracy is the first answer's: evaluated as single-turn RLVR
    eval_workflow: ClassVar[str] = "nodes.rollout.workflows:RLVRWorkflow"

    config: MultiTurnConfig
    config_class: ClassVar[type] = MultiTurnConfig

    def __init__(
        self, tokenizer: Any, reward_fn: RewardFn | RewardRunner, config: MultiTurnConfig | None = None
    ) -> None:
        super().__init__(tokenizer, reward_fn, config or MultiTurnConfig())

    async def arun_episode(
        self, client: Generator, item: Any, group_id: str | None = None
    ) -> TrajectoryGroup:
        """Run ``n_samples`` independent conversations concurrently; one group."""
        gid, attempt = group_id or uuid.uuid4().hex, new_attempt()
        trajs = await all_or_none(
            self._conversation(client, item, gid, i, attempt) for i in range(self.config.n_samples)
        )
        return TrajectoryGroup(gid, list(trajs))

    async def _conversation(self, client: Generator, item: Any, gid: str, i: int, attempt: str) -> Trajectory:
        c = self.config
        messages = self.prompt_messages(item)
        prompt = chat_ids(self.tokenizer, messages)
        s = Sample(np.array(prompt, IDS_DTYPE), c.temperature)
        s.meta["trace_id"] = f"{gid}/s{i}"
        reward = 0.0
        for turn in range(c.max_turns):
            # one rid for every turn: sticky routing sends the next turn to the server holding the prefix
            res = await client.agenerate(
                GenRequest(s.ids, c.request_params(), rid=sample_rid(gid, i, attempt), trace_id=f"{gid}/s{i}")
            )
            s.add_output(res)
            text = self.tokenizer.decode(res.output_ids, skip_special_tokens=True)
            score = await self.reward(text, item)
            s.meta["turns"] = turn + 1
            if score > 0:
                reward = score * c.turn_discount**turn
                break
            if turn + 1 < c.max_turns:
                messages = [*messages, {"role": "assistant", "content": text}]
                s.add_context(self._feedback_ids(messages, res))
                messages.append({"role": "user", "content": c.feedback})
        return s.trajectory(reward, gid, len(prompt))

    def _feedback_ids(self, messages: list[dict[str, str]], res: GenResult) -> list[int]:
        """Tokens that close the assistant turn (``messages[-1]``) as the template would and open
        the feedback turn; the generated ids stay as sampled (nodes/rollout/chat.py)."""
        feedback = [{"role": "user", "content": self.config.feedback}]
        try:
            return continuation_ids(
                self.tokenizer, messages[:-1], feedback, None, res.output_ids, res.finish_reason
            )
        except ChatError as e:
            raise ValueError(f"{e}; cannot add a feedback turn") from None


class ByteChatTokenizer:
    """A dependency-free stand-in tokenizer (UTF-8 bytes, ChatML-like text) for sim-server runs.

    Ids >= 256 (the sim backend samples from a larger vocabulary) decode modulo 256.
    """

    eos_token = "<eos>"
    eos_token_id = 2

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool = True, add_generation_prompt: bool = True
    ) -> Any:
        text = "".join(f"<{m['role']}>{m['content']}<eos>\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i % 256 for i in ids if not (skip_special_tokens and i == self.eos_token_id)).decode(
            errors="replace"
        )


def _load_tokenizer(spec: str) -> Any:
    """``"byte"`` for :class:`ByteChatTokenizer`, else a local HF tokenizer folder (no hub access)."""
    if spec == "byte":
        return ByteChatTokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec, local_files_only=True)


@register
@dataclass
class WorkflowSpec:
    """Everything a rollout actor needs to build its workflow in its own process."""

    workflow: str = "nodes.rollout.workflows:RLVRWorkflow"  # the class, by import path
    tokenizer: str = "byte"  # "byte" or a local Hugging Face tokenizer folder
    reward: RewardConfig = field(default_factory=RewardConfig)
    config: Any = None  # an instance of the workflow's config_class (None: its defaults)


def build_workflow(spec: WorkflowSpec) -> Workflow:
    """The workflow ``spec`` names, with its tokenizer, reward and settings."""
    cls = resolve(spec.workflow, "rollout.workflow")
    reward = RewardRunner(
        spec.reward.function(), spec.reward.timeout_s, name=spec.reward.fn
    )  # settings bound
    config = spec.config if spec.config is not None else cls.config_class()
    return cls(_load_tokenizer(spec.tokenizer), reward, config)

"""What the scheduler needs from a model backend, and the per-request state they share.

A backend computes KV and samples tokens; the scheduler owns queues, the prefix cache and
finishing rules. Invariant after every ``prefill``/``decode``: the backend holds KV for
``seq.ids[:-1]`` (the newest sampled token has not been fed yet), so ``release`` returns exactly
the KV SGLang would cache for a finished or aborted request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from nodes.inference.radix import KVOps
from protocols.http.sglang import SamplingParams


@dataclass(eq=False)
class Seq:
    """One generation request as the backend sees it."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_len: int = 0  # tokens of ids served by the prefix cache at the latest prefill
    cached_kv: Any = None  # their KV (backend format), consumed by prefill
    slot: Any = None  # backend-private state while the sequence holds KV
    # log-probs asked for beyond the sampled token's (SGLang's top_logprobs_num, token_ids_logprob,
    # logprob_start_len); the same distribution as the sampled token's, log_softmax(logits / T)
    top_logprobs: int = 0  # also the k likeliest tokens, at every position reported
    token_ids_logprob: list[int] | None = None  # also these tokens' log-probs, at every position reported
    logprob_start: int | None = None  # also the prompt's, from this position (the prefill computes them)
    input_logprobs: InputLogprobs | None = None  # set by the first prefill when logprob_start is set
    lora: Any = None  # the LoRA adapter this request uses (backends/lora.py Adapter), if any

    @property
    def ids(self) -> list[int]:
        """Prompt plus everything generated so far."""
        return self.input_ids + self.output_ids

    @property
    def wants_extras(self) -> bool:
        """Whether samples must carry top / token-id log-probs."""
        return self.top_logprobs > 0 or self.token_ids_logprob is not None

    @property
    def wants_input(self) -> bool:
        """Whether the next prefill must compute the prompt's log-probs."""
        return self.logprob_start is not None and self.input_logprobs is None


def adjusts_logits(seq: Seq) -> bool:
    """Whether SGLang would change this sequence's logits before sampling the next token: output
    penalties once there is output, a ``logit_bias``, or stop tokens barred by ``min_new_tokens``."""
    p = seq.params
    penalties = p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0
    return bool((penalties and seq.output_ids) or p.logit_bias or len(seq.output_ids) < p.min_new_tokens)


def penalize(params: SamplingParams, logit: float, count: int) -> float:
    """One token's logit after SGLang's output penalties (``penaltylib``), ``count`` being how
    often the sequence has output it (prompt tokens are not counted): the additive ones first
    (``frequency_penalty`` per occurrence, ``presence_penalty`` once), then
    ``repetition_penalty`` (a positive logit divided by it, a negative one multiplied)."""
    if count <= 0:
        return logit
    logit -= params.frequency_penalty * count + params.presence_penalty
    r = params.repetition_penalty
    return logit * r if logit < 0 else logit / r


@dataclass
class Sample:
    """One sampled token and its log-probability (log_softmax(logits / T), as SGLang reports);
    ``top`` / ``ids``: the extras its sequence asked for, from the same distribution."""

    token: int
    logprob: float
    top: list[tuple[float, int]] | None = None  # (logprob, token), likeliest first
    ids: list[float] | None = None  # log-probs of seq.token_ids_logprob, in its order


@dataclass
class InputLogprobs:
    """The prompt's log-probs from ``seq.logprob_start`` + 1 on: position ``i`` of each list is
    prompt token ``logprob_start + 1 + i`` given the tokens before it (SGLang reports position
    ``logprob_start`` itself as None). ``top`` / ``ids`` when the sequence asked for them."""

    lps: list[float]
    top: list[list[tuple[float, int]]] | None = None
    ids: list[list[float]] | None = None


class Backend(Protocol):
    """A model (or a simulation of one) that the scheduler drives step by step."""

    eos_token_ids: set[int]
    vocab_size: int
    weights_id: str

    @property
    def kv_ops(self) -> KVOps:
        """How the scheduler's KV cache reads and writes this backend's state (read-only, so an
        implementation may declare its own KVOps class)."""
        ...

    async def prefill(self, seqs: list[Seq]) -> list[Sample]:
        """Compute KV for ``seq.ids[seq.cached_len:]`` on top of ``seq.cached_kv``; sample one token each."""

    async def decode(self, seqs: list[Seq]) -> list[Sample]:
        """Feed each sequence's newest token and sample the next, all sequences in one step."""

    def release(self, seq: Seq) -> Any:
        """Drop the sequence's KV slot and return its KV for ``seq.ids[:-1]`` (for the cache)."""

    def tokenize(self, text: str) -> list[int]:
        """Text to token ids (no special tokens added)."""

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text."""

    async def load_from_disk(self, path: str) -> tuple[bool, str]:
        """Replace the weights from a safetensors folder; on failure leave them unchanged."""

    def named_tensor(self, name: str) -> Any:
        """The current tensor called ``name`` (for ``/get_weights_by_name``), or None."""

    def apply_tensors(self, named: list[tuple[str, Any]]) -> None:
        """Copy received tensors into the live weights."""

    @property
    def device(self) -> str:
        """Where tensors for ``apply_tensors`` should live ("cpu", "cuda:0")."""


class Classifier(Protocol):
    """A backend serving a sequence classifier (a reward model): ``is_generation`` false, and
    scores for ``/classify`` instead of tokens (nodes/inference/backends/hf.py)."""

    is_generation: bool
    architecture: str | None  # the config's *ForSequenceClassification architecture

    async def classify(self, prompts: list[list[int]]) -> list[list[float]]:
        """The classifier's outputs (one number per label) for each prompt."""

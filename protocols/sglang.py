"""SGLang 0.5.x native HTTP protocol: request bodies, sampling parameters, response pieces.

Pure data and validation, no I/O and no heavy imports, so the reference server, the rollout
client and tests share one definition of field names, defaults and error wording. Parsing
functions raise :class:`ProtocolError` (HTTP 400 in the server) on unknown or ill-typed fields,
the way SGLang 0.5.23 rejects them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")

ABORT_WAITING_MESSAGE = "Abort in waiting queue"
ABORT_RUNNING_MESSAGE = "Aborted"  # FINISH_ABORT's default message

# meta_info key of the reference server's per-token weight versions (an rlactors extension)
WEIGHT_VERSIONS = "weight_versions"  # meta_info key of the per-token version spans (SGLang 0.5.23)


class ProtocolError(ValueError):
    """A request body that SGLang would reject with HTTP 400."""


def error_body(message: str) -> dict[str, Any]:
    """SGLang's error shape for a rejected native request: ``{"error": {"message": ...}}``."""
    return {"error": {"message": message}}


T = TypeVar("T")


def _from_dict(cls: type[T], data: Any, what: str) -> T:
    """Build dataclass ``cls`` from a JSON object, rejecting unknown fields by name."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ProtocolError(f"unknown field(s) in {what}: {', '.join(unknown)}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ProtocolError(f"bad {what}: {e}") from None


class _Request:
    """A request body parsed by field name; ``_wire`` names SGLang's struct in error messages."""

    _wire: ClassVar[str] = ""

    @classmethod
    def from_json(cls, data: Any) -> Any:
        """Parse and validate."""
        return _from_dict(cls, data, cls._wire)


@dataclass
class SamplingParams:
    """The ``sampling_params`` object of ``/generate`` with SGLang's defaults."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    min_new_tokens: int = 0
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, data: Any) -> SamplingParams:
        """Parse and validate; unknown keys and out-of-range values raise :class:`ProtocolError`."""
        sp = _from_dict(cls, data, "sampling_params")
        sp.validate()
        return sp

    def validate(self) -> None:
        """Reject values SGLang's ``SamplingParams.verify`` rejects."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ProtocolError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.temperature < 0.0:
            raise ProtocolError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ProtocolError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or self.top_k == 0:
            raise ProtocolError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ProtocolError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.n < 1:
            raise ProtocolError(f"n must be at least 1, got {self.n}.")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise ProtocolError("min_new_tokens must be in [0, max_new_tokens].")

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` normalised to a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def greedy(self) -> bool:
        """SGLang treats temperature 0 (or top_k 1) as greedy decoding."""
        return self.temperature < 1e-6 or self.top_k == 1


@dataclass
class GenerateRequest:
    """The ``/generate`` body (the fields the reference server honours, plus accepted extras)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: bool = False
    lora_path: str | None = None
    custom_logit_processor: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    data_parallel_rank: int | None = None
    priority: int | None = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    input_embeds: Any = None
    session_params: Any = None
    modalities: Any = None
    routed_dp_rank: int | None = None
    extra_key: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> GenerateRequest:
        """Parse a ``/generate`` body; exactly one of ``text`` / ``input_ids`` must be given."""
        req = _from_dict(cls, data, "GenerateReqInput")
        if (req.text is None) == (req.input_ids is None):
            raise ProtocolError("Either text or input_ids should be provided.")
        return req

    @property
    def is_batch(self) -> bool:
        """True when the body carries a list of prompts (the response is then a list)."""
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)  # type: ignore[index]


@dataclass
class AbortRequest(_Request):
    """``/abort_request``: abort in-flight requests whose rid starts with ``rid``, or all."""

    rid: str = ""
    abort_all: bool = False
    finished_reason: Any = None
    abort_message: str | None = None

    _wire: ClassVar[str] = "AbortReq"


@dataclass
class PauseGenerationRequest:
    """``/pause_generation``: ``abort`` returns every request, ``retract`` requeues running ones,
    ``in_place`` freezes them with their KV. An empty body means ``abort`` (older SGLang)."""

    mode: str = "abort"

    @classmethod
    def from_json(cls, data: Any) -> PauseGenerationRequest:
        """Parse and validate the mode."""
        req = _from_dict(cls, data, "PauseGenerationReqInput")
        if req.mode not in PAUSE_MODES:
            raise ProtocolError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {req.mode!r}")
        return req


@dataclass
class UpdateWeightsFromDiskRequest(_Request):
    """``/update_weights_from_disk``: reload weights from a safetensors folder."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True

    _wire: ClassVar[str] = "UpdateWeightFromDiskReqInput"


@dataclass
class InitWeightsUpdateGroupRequest(_Request):
    """``/init_weights_update_group``: join the trainer's broadcast group (trainer is rank 0)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"

    _wire: ClassVar[str] = "InitWeightsUpdateGroupReqInput"


@dataclass
class UpdateWeightsFromDistributedRequest:
    """``/update_weights_from_distributed``: receive broadcasts of the named tensors from rank 0.

    With ``load_format == "flattened_bucket"`` the sender broadcasts one flat 1-D tensor of
    ``dtypes[0]`` holding all tensors back to back in the order of ``names``.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> UpdateWeightsFromDistributedRequest:
        """Parse and validate: the three lists must have equal lengths."""
        req = _from_dict(cls, data, "UpdateWeightsFromDistributedReqInput")
        if not (len(req.names) == len(req.dtypes) == len(req.shapes)):
            raise ProtocolError("names, dtypes and shapes must have the same length")
        if req.load_format not in (None, "flattened_bucket"):
            raise ProtocolError(f"unsupported load_format {req.load_format!r}")
        return req


@dataclass
class DestroyWeightsUpdateGroupRequest(_Request):
    """``/destroy_weights_update_group``."""

    group_name: str = "weight_update_group"

    _wire: ClassVar[str] = "DestroyWeightsUpdateGroupReqInput"


@dataclass
class BeginWeightUpdateRequest(_Request):
    """``/begin_weight_update`` (SGLang 0.5.23): open a weight-update session."""

    selector: str = "all"

    _wire: ClassVar[str] = "BeginWeightUpdateReqInput"


@dataclass
class EndWeightUpdateRequest(_Request):
    """``/end_weight_update`` (SGLang 0.5.23): close the weight-update session."""

    _wire: ClassVar[str] = "EndWeightUpdateReqInput"


# ---- response pieces -------------------------------------------------------------------


def finish_stop(matched: int | str | None) -> dict[str, Any]:
    """``finish_reason`` for an EOS / stop token (``matched`` is the id) or stop string."""
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict[str, Any]:
    """``finish_reason`` when ``max_new_tokens`` was reached."""
    return {"type": "length", "length": length}


def finish_abort(message: str, status_code: int | None = None, err_type: str | None = None) -> dict[str, Any]:
    """``finish_reason`` for an aborted request (HTTP 200 with the partial output)."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


@dataclass
class GenerateResult:
    """One finished (or aborted) generation, rendered by :meth:`to_json` as SGLang's response."""

    rid: str
    text: str
    output_ids: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    cached_tokens: int
    weight_version: str
    e2e_latency: float
    output_token_logprobs: list[float] | None = None
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    # the weight_version that sampled each output token, aligned with output_ids; sent as
    # SGLang 0.5.23 sends it, ``meta_info.weight_versions`` spans (see :func:`weight_version_spans`)
    output_token_weight_versions: list[str] | None = None
    extra_meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """``{"text", "output_ids", "meta_info": {...}}`` as SGLang 0.5.x returns it."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": self.weight_version,
            "e2e_latency": self.e2e_latency,
        }
        if self.output_token_logprobs is not None:
            meta["output_token_logprobs"] = [
                [lp, tid, None] for lp, tid in zip(self.output_token_logprobs, self.output_ids, strict=True)
            ]
            meta["input_token_logprobs"] = [list(x) for x in (self.input_token_logprobs or [])]
        if self.output_token_weight_versions is not None:
            meta[WEIGHT_VERSIONS] = weight_version_spans(self.output_token_weight_versions, self.weight_version)
        meta.update(self.extra_meta)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


def weight_version_spans(token_versions: list[str], current: str) -> list[dict[str, Any]]:
    """SGLang's ``meta_info.weight_versions``: ``[{"version", "start", "end"}, ...]``, one span per
    run of output tokens sampled by the same weights (``end`` exclusive). No tokens: one empty
    span of the current version, as SGLang sends it."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(token_versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]


def success_body(success: bool, message: str, **extra: Any) -> dict[str, Any]:
    """``{"success", "message", ...}``, the body of SGLang's weight endpoints."""
    return {"success": success, "message": message, **extra}


__all__ = [
    "ABORT_RUNNING_MESSAGE",
    "ABORT_WAITING_MESSAGE",
    "PAUSE_MODES",
    "WEIGHT_VERSIONS",
    "AbortRequest",
    "BeginWeightUpdateRequest",
    "DestroyWeightsUpdateGroupRequest",
    "EndWeightUpdateRequest",
    "GenerateRequest",
    "GenerateResult",
    "InitWeightsUpdateGroupRequest",
    "PauseGenerationRequest",
    "ProtocolError",
    "SamplingParams",
    "UpdateWeightsFromDiskRequest",
    "UpdateWeightsFromDistributedRequest",
    "error_body",
    "finish_abort",
    "finish_length",
    "finish_stop",
    "success_body",
    "weight_version_spans",
]

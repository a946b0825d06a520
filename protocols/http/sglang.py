"""SGLang 0.5.x native HTTP protocol: request bodies, sampling parameters, response pieces.

Pure data and validation (pydantic models), no I/O, so the reference server,
the rollout client and tests share one definition of field names, types, defaults and error
wording. ``from_json`` raises :class:`ProtocolError` (HTTP 400 in the server) on unknown or
ill-typed fields, naming the field, the way SGLang 0.5.23 rejects them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Self, TypedDict, TypeVar, Union

import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator
from pydantic_core import PydanticCustomError

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


# ---- schema machinery --------------------------------------------------------------------
#
# Every request body is a pydantic model. ``/generate`` and its sampling parameters are strict,
# as SGLang 0.5.23's JSON contract (``sglang.api.v1``) is: no coercion (``1.0`` is no int, ``true``
# no number, ``"2"`` no int), and NaN and infinities are refused (SGLang's ``verify`` does). The admin
# routes are lax, as FastAPI's pydantic parse of SGLang's ``io_struct`` classes is. A violation
# becomes one :class:`ProtocolError` naming the field (``sampling_params.stop[0]: ...``) in serde's
# wording, which SGLang's contract shares.

_TAG = "*"  # prefix of the union tags below; they are dropped from error locations


_Item = TypeVar("_Item")

# ``_one_or_list[X]``: ``X | list[X]`` as SGLang decodes it: a JSON array is the list form, anything
# else must be one ``X`` (so an error names one branch, not both)
_one_or_list = Annotated[
    Union[Annotated[_Item, Tag(_TAG + "one")], Annotated[list[_Item], Tag(_TAG + "list")]],
    Discriminator(lambda v: _TAG + ("list" if isinstance(v, list) else "one")),
]


def _carries_batch(text: Any, input_ids: Any) -> bool:
    """A body's prompts are a batch: a list of texts, else a list of token-id lists."""
    return isinstance(text, list) if text is not None else _is_batch_ids(input_ids)


def _is_batch_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and isinstance(v[0], list)


# ``input_ids``: one prompt ``[1, 2]`` or a batch ``[[1, 2], [3]]``, told apart by the first item
TokenIdsOrBatch = Annotated[
    Union[Annotated[list[int], Tag(_TAG + "ids")], Annotated[list[list[int]], Tag(_TAG + "batch")]],
    Discriminator(lambda v: _TAG + ("batch" if _is_batch_ids(v) else "ids")),
]

_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "list_type": "a sequence",
    "dict_type": "a map",
    "model_type": "a JSON object",
    "literal_error": None,
}


def _unexpected(v: Any) -> str:
    """serde's ``Unexpected`` text for a JSON value (as SGLang's contract errors print it)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        text = str(v) if abs(v) < 10**30 else f"{str(v)[:20]}..."
        return f"integer `{text}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"' if len(v) <= 40 else f'string "{v[:40]}..."'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _where(loc: tuple[int | str, ...], root: str) -> str:
    """``sampling_params.stop[0]`` from pydantic's location (union tags dropped)."""
    out = root
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(_TAG):
            out += f".{part}" if out else part
    return out


def _message(err: Any, root: str) -> str:
    """One pydantic error as a sentence that names the field."""
    where = _where(err["loc"], root)
    kind = err["type"]
    if kind in ("unknown_field", "invalid_value"):
        text = err["msg"]
    elif kind == "missing":
        text = "missing field"
    elif kind == "finite_number":
        text = f"invalid value: {_unexpected(err['input'])}, expected a finite number"
    elif _EXPECTED.get(kind):
        text = f"invalid type: {_unexpected(err['input'])}, expected {_EXPECTED[kind]}"
    else:
        text = err["msg"]
    return f"{where}: {text}" if where else text


class _Body(BaseModel):
    """A request body: unknown keys refused by name; :meth:`from_json` raises :class:`ProtocolError`.

    ``_wire`` names SGLang's struct in messages about the whole body; with ``_null_is_default`` a
    JSON ``null`` means the field's default (SGLang's ``/generate`` contract and
    ``SamplingParams.__post_init__``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_default=False)
    _wire: ClassVar[str] = ""
    _null_is_default: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise PydanticCustomError(
                "unknown_field", "invalid type: {got}, expected a JSON object", {"got": _unexpected(data)}
            )
        fields = cls.model_fields
        for key in data:
            if key not in fields:
                listed = ", ".join(f"`{f}`" for f in fields)
                raise PydanticCustomError(
                    "unknown_field",
                    "unknown field `{key}`, expected one of {listed}",
                    {"key": str(key), "listed": listed},
                )
        if cls._null_is_default:
            data = {k: v for k, v in data.items() if v is not None or fields[k].default is None}
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "") -> Self:
        """Parse and validate a decoded JSON value; the first violation raises :class:`ProtocolError`
        naming the field (``where`` prefixes its path, e.g. ``sampling_params``)."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            if not where and not err["loc"] and err["type"] != "invalid_value":
                where = cls._wire  # a fault of the whole body: name SGLang's struct
            raise ProtocolError(_message(err, where)) from None


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", "{reason}", {"reason": message})


# ---- request bodies ----------------------------------------------------------------------


class SamplingParams(_Body):
    """The ``sampling_params`` object of ``/generate`` with SGLang's defaults.

    ``max_new_tokens`` may be ``None`` (SGLang: up to the context length); the server resolves it
    before scheduling (:meth:`~nodes.inference.engine.Engine.check_length`)."""

    model_config = ConfigDict(strict=True)
    _wire: ClassVar[str] = "SamplingParams"
    _null_is_default: ClassVar[bool] = True

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: _one_or_list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: _one_or_list[str] | None = None
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
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _verify(self) -> Self:
        try:
            self.validate()
        except ProtocolError as e:
            raise _invalid(str(e)) from None
        return self

    def validate(self) -> None:  # type: ignore[override]
        """Reject values SGLang's ``SamplingParams.verify`` rejects (its wording)."""
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ProtocolError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.temperature < 0.0:
            raise ProtocolError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ProtocolError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or self.top_k == 0:
            raise ProtocolError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ProtocolError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.n < 1:
            raise ProtocolError(f"n must be at least 1, got {self.n}.")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ProtocolError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ProtocolError(
                f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {self.repetition_penalty}."
            )
        if self.min_new_tokens < 0 or (
            self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens
        ):
            raise ProtocolError("min_new_tokens must be in [0, max_new_tokens].")
        if self.sampling_seed is not None and not -(2**63) <= self.sampling_seed < 2**63:
            raise ProtocolError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {self.sampling_seed}.")
        grammars = (self.json_schema, self.regex, self.ebnf, self.structural_tag)
        if sum(bool(g) for g in grammars) > 1:  # SGLang: an empty grammar is no grammar
            raise ProtocolError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` normalised to a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stop_patterns(self) -> list[str]:
        """``stop_regex`` normalised to a list."""
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex)

    @property
    def greedy(self) -> bool:
        """SGLang treats temperature 0 (or top_k 1) as greedy decoding."""
        return self.temperature < 1e-6 or self.top_k == 1


_OptStrOrList = Union[str, list[Union[str, None]], None]
_OptIntOrList = Union[int, list[Union[int, None]], None]


class GenerateRequest(_Body):
    """The ``/generate`` body (the fields the reference server honours, plus accepted extras),
    typed as SGLang 0.5.23's contract types them."""

    model_config = ConfigDict(strict=True)
    _wire: ClassVar[str] = "GenerateReqInput"
    _null_is_default: ClassVar[bool] = True

    text: _one_or_list[str] | None = None
    input_ids: TokenIdsOrBatch | None = None
    sampling_params: _one_or_list[SamplingParams] | None = None
    rid: _one_or_list[str] | None = None
    return_logprob: _one_or_list[bool] = False
    logprob_start_len: _one_or_list[int] = -1
    top_logprobs_num: _one_or_list[int] = 0
    token_ids_logprob: TokenIdsOrBatch | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: _one_or_list[bool] = False
    lora_path: Annotated[_OptStrOrList, Field(union_mode="left_to_right")] = None
    custom_logit_processor: Annotated[_OptStrOrList, Field(union_mode="left_to_right")] = None
    bootstrap_host: Annotated[_OptStrOrList, Field(union_mode="left_to_right")] = None
    bootstrap_port: Annotated[_OptIntOrList, Field(union_mode="left_to_right")] = None
    bootstrap_room: Annotated[_OptIntOrList, Field(union_mode="left_to_right")] = None
    data_parallel_rank: int | None = None
    priority: int | None = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    input_embeds: Any = None
    session_params: Any = None
    modalities: list[str | None] | None = None
    routed_dp_rank: int | None = None
    extra_key: _one_or_list[str] | None = None

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> Self:
        if self.text is None and self.input_ids is None:
            raise _invalid("Either text or input_ids should be provided.")
        if self.input_ids is not None:  # SGLang 0.5.23 takes input_ids when both are given
            self.text = None
        return self

    @property
    def is_batch(self) -> bool:
        """True when the body carries a list of prompts (the response is then a list)."""
        return _carries_batch(self.text, self.input_ids)

    @property
    def prompt_count(self) -> int:
        """How many prompts the body carries."""
        prompts = self.text if self.text is not None else self.input_ids
        return len(prompts) if self.is_batch else 1  # type: ignore[arg-type]


class AbortRequest(_Body):
    """``/abort_request``: abort in-flight requests whose rid starts with ``rid``, or all."""

    _wire: ClassVar[str] = "AbortReq"

    rid: str = ""
    abort_all: bool = False
    finished_reason: Any = None
    abort_message: str | None = None


class PauseGenerationRequest(_Body):
    """``/pause_generation``: ``abort`` returns every request, ``retract`` requeues running ones,
    ``in_place`` freezes them with their KV. An empty body means ``abort`` (older SGLang)."""

    _wire: ClassVar[str] = "PauseGenerationReqInput"

    mode: str = "abort"

    @model_validator(mode="after")
    def _known_mode(self) -> Self:
        if self.mode not in PAUSE_MODES:
            raise _invalid(f"mode must be one of {', '.join(PAUSE_MODES)}, got {self.mode!r}")
        return self


class UpdateWeightVersionRequest(_Body):
    """``/update_weight_version``: relabel the served weights (SGLang aborts everything first by
    default; the reference server keeps requests unless ``abort_all_requests`` is true)."""

    _wire: ClassVar[str] = "UpdateWeightVersionReqInput"

    new_version: str
    abort_all_requests: bool = False


class GetWeightsByNameRequest(_Body):
    """``/get_weights_by_name``: the first ``truncate_size`` rows of a parameter."""

    _wire: ClassVar[str] = "GetWeightsByNameReqInput"

    name: str
    truncate_size: int = 100


class UpdateWeightsFromDiskRequest(_Body):
    """``/update_weights_from_disk``: reload weights from a safetensors folder."""

    _wire: ClassVar[str] = "UpdateWeightFromDiskReqInput"

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


class InitWeightsUpdateGroupRequest(_Body):
    """``/init_weights_update_group``: join the trainer's broadcast group (trainer is rank 0)."""

    _wire: ClassVar[str] = "InitWeightsUpdateGroupReqInput"

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(_Body):
    """``/update_weights_from_distributed``: receive broadcasts of the named tensors from rank 0.

    With ``load_format == "flattened_bucket"`` the sender broadcasts one flat 1-D tensor of
    ``dtypes[0]`` holding all tensors back to back in the order of ``names``.
    """

    _wire: ClassVar[str] = "UpdateWeightsFromDistributedReqInput"

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise _invalid("names, dtypes and shapes must have the same length")
        if self.load_format not in (None, "flattened_bucket"):
            raise _invalid(f"unsupported load_format {self.load_format!r}")
        return self


class UpdateWeightsFromTensorRequest(_Body):
    """``/update_weights_from_tensor``: tensors handed over by reference from a process on the
    server's host (CUDA IPC handles; shared-memory files for CPU tensors).

    ``serialized_named_tensors`` holds one payload per tensor-parallel rank, each a base64 string
    of ``[(name, tensor), ...]`` pickled by torch's ``ForkingPickler`` (SGLang's
    ``MultiprocessingSerializer``; see nodes/common/tensor_ipc.py). Every payload must be serialized on
    its own: CUDA IPC counts each rank's reference.
    """

    _wire: ClassVar[str] = "UpdateWeightsFromTensorReqInput"

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if not self.serialized_named_tensors:
            raise _invalid("serialized_named_tensors needs one payload per tensor-parallel rank")
        if self.load_format is not None:  # SGLang's flattened bucket pickles SGLang's own classes
            raise _invalid(f"unsupported load_format {self.load_format!r}: send (name, tensor) pairs")
        return self


class ClassifyRequest(_Body):
    """``/classify``: a reward model's (a sequence classifier's) scores of one text or a batch,
    SGLang 0.5.23's ``EmbeddingReqInput`` (which its ``/classify`` and ``/encode`` share). Lax, as
    FastAPI's parse of that dataclass is. ``sampling_params`` is accepted and ignored, as SGLang
    does ("dummy ... for compatibility"); its multimodal, cross-encoder and pooling fields are not
    served here, so naming one is an unknown field (400)."""

    _wire: ClassVar[str] = "EmbeddingReqInput"

    text: str | list[str] | None = None
    input_ids: TokenIdsOrBatch | None = None
    rid: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    log_metrics: bool = True
    priority: int | None = None

    @model_validator(mode="after")
    def _one_prompt_kind(self) -> Self:
        # SGLang's EmbeddingReqInput.normalize_batch_and_arguments, its wording
        if self.text is None and self.input_ids is None:
            raise _invalid("At least one of text, input_ids, image, video, or audio should be provided")
        if self.text is not None and self.input_ids is not None:
            raise _invalid("text and input_ids cannot be provided at the same time")
        return self

    @property
    def is_batch(self) -> bool:
        """True when the body carries a list of prompts (the response is then a list)."""
        return _carries_batch(self.text, self.input_ids)


class DestroyWeightsUpdateGroupRequest(_Body):
    """``/destroy_weights_update_group``."""

    _wire: ClassVar[str] = "DestroyWeightsUpdateGroupReqInput"

    group_name: str = "weight_update_group"


class BeginWeightUpdateRequest(_Body):
    """``/begin_weight_update`` (SGLang 0.5.23): open a weight-update session."""

    _wire: ClassVar[str] = "BeginWeightUpdateReqInput"

    selector: str = "all"


class EndWeightUpdateRequest(_Body):
    """``/end_weight_update`` (SGLang 0.5.23): close the weight-update session."""

    _wire: ClassVar[str] = "EndWeightUpdateReqInput"


class LoadLoRAAdapterRequest(_Body):
    """``/load_lora_adapter``: load the PEFT adapter folder ``lora_path`` (``adapter_config.json``
    and ``adapter_model.safetensors``) under ``lora_name``, which ``/generate``'s ``lora_path``
    then names. A name already loaded is refused (unload it first). Needs ``--enable-lora``."""

    _wire: ClassVar[str] = "LoadLoRAAdapterReqInput"

    lora_name: str
    lora_path: str
    pinned: bool = False  # never evicted by --max-loaded-loras
    lora_id: str | None = None  # SGLang fills it in itself


class UnloadLoRAAdapterRequest(_Body):
    """``/unload_lora_adapter``: forget ``lora_name``; in SGLang the call waits until the requests
    that use it have finished."""

    _wire: ClassVar[str] = "UnloadLoRAAdapterReqInput"

    lora_name: str
    lora_id: str | None = None


def lora_name(prefix: str, version: int) -> str | None:
    """The adapter name under which an rlactors trainer loads policy ``version`` (``policy-v3``);
    None for version 0, the base model (peft's adapters start at zero). Not SGLang's: the trainer
    and the rollout client agree on it."""
    return f"{prefix}-v{version}" if version else None


def lora_update_body(
    success: bool, loaded: dict[str, str] | None, error: str | None = None
) -> dict[str, Any]:
    """The answer of ``/load_lora_adapter`` and ``/unload_lora_adapter`` (SGLang's
    ``LoRAUpdateOutput``): ``success``, ``error_message``, and the adapters loaded now by name
    (their paths; None after a failure); HTTP 200 on success, else 400."""
    return {"success": success, "error_message": error, "loaded_adapters": loaded}


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


TopList = list[tuple[float, int]]  # (logprob, token id), likeliest first


@dataclass
class LogprobReport:
    """A ``return_logprob`` request's log-probabilities, rendered by :meth:`GenerateResult.to_json`
    into SGLang 0.5.23's ``meta_info`` fields.

    ``output`` is one log-prob per output token. The input fields cover the prompt from
    ``logprob_start_len`` on (``input_ids``), the first entry ``None`` as SGLang sends it (it does
    not compute the position it starts at); empty without ``logprob_start_len``. ``output_top`` /
    ``input_top`` (``top_logprobs_num`` > 0) and ``output_ids_lp`` / ``input_ids_lp``
    (``token_ids_logprob``) are present only when asked for, one entry per position."""

    output: list[float]
    input: list[float | None] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    output_top: list[TopList] | None = None
    input_top: list[TopList | None] | None = None
    token_ids: list[int] | None = None
    output_ids_lp: list[list[float]] | None = None
    input_ids_lp: list[list[float] | None] | None = None
    text: Any = None  # return_text_in_logprobs: token id -> its text (else each text is null)

    def meta(self, output_ids: list[int]) -> dict[str, Any]:
        """The ``meta_info`` entries, in SGLang's shape: ``[logprob, token_id, text | null]``."""
        text = self.text

        def row(pairs: Any) -> list[list[Any]]:
            if text is None:  # the usual case: no call per token
                return [[lp, t, None] for lp, t in pairs]
            return [[lp, t, text(t)] for lp, t in pairs]

        out: dict[str, Any] = {
            "input_token_logprobs": row(zip(self.input, self.input_ids, strict=True)),
            "output_token_logprobs": row(zip(self.output, output_ids, strict=True)),
            "output_token_logprobs_length": len(self.output),
        }
        if self.output_top is not None:
            out["input_top_logprobs"] = [None if e is None else row(e) for e in self.input_top or []]
            out["output_top_logprobs"] = [row(e) for e in self.output_top]
        if self.token_ids is not None:
            ids = self.token_ids
            out["input_token_ids_logprobs"] = [
                None if e is None else row(zip(e, ids, strict=True)) for e in self.input_ids_lp or []
            ]
            out["output_token_ids_logprobs"] = [
                row(zip(e, ids, strict=True)) for e in self.output_ids_lp or []
            ]
        return out


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
    logprobs: LogprobReport | None = None  # with return_logprob
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
        if self.logprobs is not None:
            meta.update(self.logprobs.meta(self.output_ids))
        if self.output_token_weight_versions is not None:
            meta[WEIGHT_VERSIONS] = weight_version_spans(
                self.output_token_weight_versions, self.weight_version
            )
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


def classify_result(
    rid: str, scores: list[float], prompt_tokens: int, version: str, latency_s: float
) -> dict[str, Any]:
    """One prompt's ``/classify`` answer as SGLang 0.5.23 sends it: ``embedding`` is the
    classifier's output (one number per label: ``[score]`` for a reward model), the finish reason
    that of a request of no new tokens."""
    meta = {
        "id": rid,
        "finish_reason": finish_length(0),
        "prompt_tokens": prompt_tokens,
        "weight_version": version,
        "num_retractions": 0,
        "e2e_latency": latency_s,
    }
    return {"embedding": scores, "meta_info": meta}


def success_body(success: bool, message: str, **extra: Any) -> dict[str, Any]:
    """``{"success", "message", ...}``, the body of SGLang's weight endpoints."""
    return {"success": success, "message": message, **extra}


# ---- bodies we send ----------------------------------------------------------------------
#
# The rollout client, the weight push and policy sync build every body they send from the types
# in this file, so client and server share one definition of the wire. An admin call (a few per
# weight push) builds the request model above, validated as the server validates it, and sends
# :func:`request_body`: a bad value fails at the caller, naming the field, not as a 400 from one
# server of many. ``/generate`` is posted for every chunk of every sample, so its body is a
# TypedDict: typed for the checker, a plain dict at run time that orjson encodes as it is.


class _GenerateBodyRequired(TypedDict):
    input_ids: Sequence[int] | npt.NDArray[Any]  # a list, or an int array (orjson writes both)
    sampling_params: dict[str, Any]
    rid: str
    return_logprob: bool


class GenerateBody(_GenerateBodyRequired, total=False):
    """The ``/generate`` body the rollout client posts: one prompt as token ids, its sampling
    parameters and a request id, log-probs on (:class:`GenerateRequest` is how a server reads it);
    the optional keys only when asked."""

    top_logprobs_num: int  # the most likely tokens at each output position
    lora_path: str  # the LoRA adapter (its name on the server) that generates
    stream: bool  # server-sent events as tokens are generated (nodes/rollout/chunks.py StreamedChunk)


class ContinueGenerationRequest(_Body):
    """``/continue_generation``: let a paused server run again (we send no fields)."""

    _wire: ClassVar[str] = "ContinueGenerationReqInput"


def request_body(request: BaseModel) -> dict[str, Any]:
    """The JSON body of ``request`` (one of the request models above): the fields the caller set,
    so the server applies its own defaults to the rest (SGLang's may differ from ours)."""
    return request.model_dump(mode="json", exclude_unset=True)


__all__ = [
    "ABORT_RUNNING_MESSAGE",
    "ABORT_WAITING_MESSAGE",
    "PAUSE_MODES",
    "WEIGHT_VERSIONS",
    "AbortRequest",
    "BeginWeightUpdateRequest",
    "ClassifyRequest",
    "ContinueGenerationRequest",
    "DestroyWeightsUpdateGroupRequest",
    "EndWeightUpdateRequest",
    "GenerateBody",
    "GenerateRequest",
    "GenerateResult",
    "GetWeightsByNameRequest",
    "InitWeightsUpdateGroupRequest",
    "LoadLoRAAdapterRequest",
    "LogprobReport",
    "PauseGenerationRequest",
    "ProtocolError",
    "SamplingParams",
    "UnloadLoRAAdapterRequest",
    "UpdateWeightVersionRequest",
    "UpdateWeightsFromDiskRequest",
    "UpdateWeightsFromDistributedRequest",
    "UpdateWeightsFromTensorRequest",
    "classify_result",
    "error_body",
    "finish_abort",
    "finish_length",
    "finish_stop",
    "lora_name",
    "lora_update_body",
    "request_body",
    "success_body",
    "weight_version_spans",
]

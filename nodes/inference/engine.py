"""The reference server's engine: backend construction, the prefix cache and scheduler, weight operations.

The HTTP layer (app.py) only parses and renders; everything that changes model state goes
through :class:`Engine`, which serialises it against decode steps with the scheduler's
``step_lock``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any, cast

import structlog

from nodes.common import tensor_ipc
from nodes.common.weight_group import gpu_uuid
from nodes.inference import weight_sync
from nodes.inference.backends.base import Backend, Classifier
from nodes.inference.radix import RadixCache
from nodes.inference.scheduler import Scheduler
from nodes.inference.settings import ServerArgs
from protocols.http.sglang import (
    InitWeightsUpdateGroupRequest,
    ProtocolError,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)

log = structlog.get_logger(__name__)

VERSION = "0.5.23-rlactors-reference"


def build_backend(args: ServerArgs) -> Backend:
    """Construct the backend the arguments name."""
    if args.backend == "sim":
        from nodes.inference.backends.sim import SimBackend

        return SimBackend(args.model_path or None, args.sim)
    if args.backend == "hf":
        from nodes.inference.backends.hf import HFBackend

        return HFBackend(
            args.model_path,
            tokenizer_path=args.tokenizer_path,
            dtype=args.dtype,
            device=args.device,
            seed=args.random_seed,
            num_threads=args.num_threads,
            enable_lora=args.enable_lora,
        )
    raise ValueError(f"unknown backend {args.backend!r}; use hf or sim")


def _model_context_length(model_path: str) -> int:
    """``max_position_embeddings`` from the model folder's config.json, else 32768."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        return int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return 32768


# A token covers at most this many characters of text in the tokenizers we serve; a longer text is
# over the context before it is tokenized (so a 10 MB prompt is refused at once, not after seconds)
MAX_CHARS_PER_TOKEN = 64


class Engine:
    """Backend + scheduler + prefix cache + weight-update groups of one server."""

    def __init__(self, args: ServerArgs, backend: Backend | None = None) -> None:
        self.args = args
        self.backend = backend or build_backend(args)
        self.cache = RadixCache(args.cache_tokens, self.backend.kv_ops)
        self.scheduler = Scheduler(
            self.backend, self.cache, args.max_running_requests, weight_version=args.weight_version
        )
        self.rng = random.Random(args.random_seed)
        self.groups: dict[str, weight_sync.UpdateGroup] = {}
        self.session_open = False
        # LoRA adapters by name, least recently used first (args.enable_lora)
        self.adapters: OrderedDict[str, Any] = OrderedDict()
        device = str(getattr(self.backend, "device", "cpu"))
        self.gpu_uuid = gpu_uuid(device) if device.startswith("cuda") else None
        self.context_len = args.context_length or _model_context_length(args.model_path)
        # a sequence classifier (a reward model) serves /classify and generates nothing, as in SGLang
        self.classifier = (
            cast(Classifier, self.backend) if not getattr(self.backend, "is_generation", True) else None
        )
        # one thread: tokenizers are not safe to share between threads, and a long text must not
        # stall the event loop
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Tokenize prompts off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizer_thread, lambda: [self.backend.tokenize(t) for t in texts]
        )

    @property
    def is_generation(self) -> bool:
        """Whether the model generates (``/generate``) rather than classifies (``/classify``)."""
        return self.classifier is None

    def refuse_generation(self) -> None:
        """400 for ``/generate`` on a classifier (SGLang's scheduler would fail the request later
        and less clearly)."""
        if self.classifier is not None:
            raise ProtocolError(
                f"This model ({self.classifier.architecture} at {self.args.model_path}) is a sequence "
                "classifier (a reward model): it does not generate. Post its prompts to /classify instead."
            )

    def refuse_classification(self) -> None:
        """400 for ``/classify`` on a model that generates (SGLang's check, TokenizerManager, told
        the way this server tells a classifier)."""
        if self.classifier is None:
            raise ProtocolError(
                f"This model ({self.args.model_path}) is not a sequence classifier: it generates "
                "(/generate). /classify needs a reward model, a checkpoint whose config.json names a "
                "*ForSequenceClassification architecture."
            )

    async def classify(self, prompts: list[list[int]]) -> list[list[float]]:
        """The classifier's outputs for each prompt (token ids), between weight updates."""
        self.refuse_classification()
        assert self.classifier is not None
        async with self.scheduler.step_lock:
            return await self.classifier.classify(prompts)

    def fit_text(self, text: str) -> str:
        """Refuse a text prompt that cannot fit in the context whatever it tokenizes to, before
        spending time tokenizing it (``check_length`` judges the rest after tokenizing); with
        ``allow_auto_truncate`` cut it to what can still matter instead."""
        limit = self.context_len * MAX_CHARS_PER_TOKEN
        if len(text) <= limit:
            return text
        if self.args.allow_auto_truncate:
            return text[:limit]
        raise ProtocolError(
            f"The input text ({len(text)} characters) is longer than the model's context length "
            f"({self.context_len} tokens) can hold."
        )

    def check_length(self, input_ids: list[int], sp: Any) -> None:
        """SGLang's length rules (``TokenizerManager``): a prompt must be shorter than the context
        and prompt + ``max_new_tokens`` must fit in it; with ``allow_auto_truncate`` the prompt and
        then ``max_new_tokens`` are cut instead (in place). ``max_new_tokens=None`` becomes what
        is left of the context, as in SGLang."""
        n, ctx = len(input_ids), self.context_len
        if n >= ctx:
            if not self.args.allow_auto_truncate:
                raise ProtocolError(
                    f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
                )
            del input_ids[ctx:]
            n = len(input_ids)
        if sp.max_new_tokens is None:
            sp.max_new_tokens = ctx - n
            return
        if sp.max_new_tokens + n > ctx:
            if self.args.allow_auto_truncate:
                sp.max_new_tokens = max(0, ctx - n)
                return
            raise ProtocolError(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {sp.max_new_tokens + n} tokens: {n} tokens from the input "
                f"messages and {sp.max_new_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )

    @property
    def weight_version(self) -> str:
        """The version string reported in responses and ``/get_model_info``."""
        return self.scheduler.weight_version

    def set_weight_version(self, version: str | None) -> None:
        """Adopt ``version`` if given."""
        if version is not None:
            self.scheduler.weight_version = str(version)

    async def update_from_disk(self, req: UpdateWeightsFromDiskRequest) -> tuple[bool, str]:
        """Load a safetensors folder between decode steps; failure leaves the model unchanged."""
        if req.abort_all_requests:
            self.scheduler.abort(abort_all=True)
        async with self.scheduler.step_lock:
            ok, message = await self.backend.load_from_disk(req.model_path)
            if ok:
                self.args.model_path = req.model_path
                # label and weights change together, before the next step samples
                self.set_weight_version(req.weight_version)
                ok, message = self._flush_after_update(req.flush_cache, ok, message)
        if ok and req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        log.info("weights_from_disk", ok=ok, path=req.model_path, weights_id=self.backend.weights_id)
        return ok, message

    async def init_group(self, req: InitWeightsUpdateGroupRequest) -> tuple[bool, str]:
        """Join the trainer's group; blocks (off the loop) until the trainer joins too."""
        if req.group_name in self.groups:
            return False, f"Group {req.group_name} already exists."
        backend = req.backend
        if backend == "nccl" and not str(self.backend.device).startswith("cuda"):
            log.warning("nccl_requested_on_cpu_using_gloo", group=req.group_name)
            backend = "gloo"
        try:
            group = await asyncio.to_thread(
                weight_sync.join_group,
                req.master_address,
                req.master_port,
                req.rank_offset,
                req.world_size,
                req.group_name,
                backend,
            )
        except Exception as e:  # the server answers as SGLang does: success false and the reason
            log.warning("weight_group_join_failed", error=str(e))
            return False, f"Failed to initialize custom process group: {e}."
        self.groups[req.group_name] = group
        return True, "Succeeded to initialize custom process group."

    async def update_from_distributed(self, req: UpdateWeightsFromDistributedRequest) -> tuple[bool, str]:
        """Receive the announced tensors from rank 0 and copy them into the live model."""
        group = self.groups.get(req.group_name)
        if group is None:
            return False, f"Group {req.group_name} not in the weight update groups."
        if self.args.strict_weight_update_session and not self.session_open:
            return False, "update_weights_from_distributed must be called within a weight update session."
        if req.abort_all_requests:
            self.scheduler.abort(abort_all=True)
        async with self.scheduler.step_lock:
            try:
                named = await asyncio.to_thread(
                    weight_sync.receive_tensors,
                    group,
                    req.names,
                    req.dtypes,
                    req.shapes,
                    self.backend.device,
                    req.load_format == "flattened_bucket",
                    getattr(self.backend, "receive_target", None),
                    getattr(self.backend, "bucket_target", None),
                )
                await asyncio.to_thread(self.backend.apply_tensors, named)
            except Exception as e:  # the server answers as SGLang does: success false and the reason
                log.warning("weights_from_distributed_failed", error=str(e))
                # as SGLang says it: tensors received straight into the model may be half written
                return False, (
                    f"Failed to update parameter online: {e}. The full weights of the ModelRunner are "
                    "partially updated. Please discard the whole weights."
                )
            self.set_weight_version(req.weight_version)  # with the weights, before the next step
            ok, message = self._flush_after_update(
                req.flush_cache, True, "Succeeded to update parameter online."
            )
        if ok and req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        return ok, message

    async def update_from_tensor(self, req: UpdateWeightsFromTensorRequest) -> tuple[bool, str]:
        """Copy tensors handed over by reference (nodes/common/tensor_ipc.py) into the live model. As in
        SGLang 0.5.23, only inside a weight-update session (with ``strict_weight_update_session``)."""
        if self.args.strict_weight_update_session and not self.session_open:
            return (
                False,
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            )
        if req.abort_all_requests:
            self.scheduler.abort(abort_all=True)
        payload = req.serialized_named_tensors[0]  # tensor-parallel rank 0: this server's only rank
        async with self.scheduler.step_lock:
            try:
                await asyncio.to_thread(self._load_payload, payload)
            except Exception as e:  # the server answers as SGLang does: success false and the reason
                log.warning("weights_from_tensor_failed", error=str(e))
                return False, f"Failed to update weights from tensor: {e}"
            self.set_weight_version(req.weight_version)  # with the weights, before the next step
            ok, message = self._flush_after_update(req.flush_cache, True, "Success")
        if ok and req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        return ok, message

    def _load_payload(self, payload: str) -> None:
        named = tensor_ipc.deserialize_named_tensors(payload, self.backend.device)
        self.backend.apply_tensors(named)
        del named  # the sender's memory is released with the last reference to it

    def lora_adapter(self, name: str | None) -> Any:
        """The loaded adapter a ``/generate`` names (None for none), as SGLang resolves it."""
        if not name:
            return None
        if not self.args.enable_lora:
            raise ProtocolError(
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server "
                "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ProtocolError(
                f"Got LoRA adapter that has never been loaded: {name}\n"
                f"All loaded adapters: {list(self.adapters)}."
            )
        self.adapters.move_to_end(name)
        return adapter

    def loaded_adapters(self) -> dict[str, str]:
        """Name -> folder of every loaded adapter (SGLang's ``loaded_adapters``)."""
        return {name: a.path for name, a in self.adapters.items()}

    async def load_lora(self, name: str, path: str) -> tuple[bool, str | None]:
        """Read the PEFT folder ``path`` (off the loop) and serve it as ``name``; SGLang's refusals:
        LoRA not enabled, the name taken, a rank or module the flags do not allow. Past
        ``max_loaded_loras`` the least recently used adapter is unloaded."""
        if not self.args.enable_lora:
            return False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        if name in self.adapters:
            return False, f"LoRA with name {name} already exists. Loaded LoRAs: {list(self.adapters)}"
        from nodes.inference.backends.lora import read_adapter

        model = getattr(self.backend, "model", None)
        if model is None:
            return False, f"LoRA adapters need the hf backend, not {self.args.backend}"
        targets = list(self.args.lora_target_modules)
        try:
            adapter = await asyncio.to_thread(
                read_adapter, name, path, model, self.args.max_lora_rank, targets
            )
        except (OSError, ValueError, KeyError) as e:
            return False, f"Failed to load LoRA adapter {name} from {path}: {e}"
        self.adapters[name] = adapter
        limit = self.args.max_loaded_loras
        while limit is not None and len(self.adapters) > limit:
            self.adapters.popitem(last=False)
        log.info("lora_loaded", name=name, path=path, rank=adapter.rank, layers=len(adapter.layers))
        return True, None

    def unload_lora(self, name: str) -> tuple[bool, str | None]:
        """Stop serving ``name``; requests already using it finish with it."""
        if not self.args.enable_lora:
            return False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        if self.adapters.pop(name, None) is None:
            return False, f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}"
        return True, None

    def _flush_after_update(self, flush: bool, ok: bool, message: str) -> tuple[bool, str]:
        """As SGLang: a flush refused because requests still run fails the update call (the
        weights stay updated)."""
        if flush and not self.scheduler.flush_cache():
            return False, (
                "Weights were updated, but the cache was not flushed because requests are still "
                "running or queued. Retract or finish them, then call /flush_cache."
            )
        return ok, message

    def destroy_group(self, name: str) -> tuple[bool, str]:
        """Leave a weight-update group."""
        group = self.groups.pop(name, None)
        if group is None:
            return False, f"Group {name} not in the weight update groups."
        weight_sync.destroy_group(group)
        return True, "Succeeded to destroy custom process group."

    def weights_by_name(self, name: str, truncate_size: int) -> Any:
        """The first ``truncate_size`` rows of a parameter, as nested lists (None if unknown)."""
        t = self.backend.named_tensor(name)
        if t is None:
            return None
        return t.detach().float().cpu()[:truncate_size].tolist()

    def server_info(self) -> dict[str, Any]:
        """``/server_info``: arguments, limits, scheduler state, version."""
        return {
            **dataclasses.asdict(self.args),
            "tp_size": 1,
            # ours, not SGLang's: a trainer on the same GPU must not join it over NCCL
            "gpu_uuid": self.gpu_uuid,
            "max_total_num_tokens": self.args.cache_tokens,
            "weights_id": self.backend.weights_id,
            "internal_states": [self.scheduler.stats()],
            "version": VERSION,
        }

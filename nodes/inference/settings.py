"""The reference server's settings, defined once: every field's type, default and meaning.

:class:`ServerArgs` is what ``python -m nodes.inference.server`` takes; its command line, its
``--help``, the launcher's command line (``ReferenceServerConfig``, which extends
:class:`ServerSettings`) and the config reference are all made from these classes by
:func:`add_flags` and :func:`to_argv`. A field ``name`` is the flag ``--name`` (underscores as
hyphens; SGLang's spelling where SGLang has the setting); a field of the nested simulator settings
is ``--sim-name``. A field's meaning is the ``#`` comment on or directly above it
(:func:`rlactors.base.tomlconf.field_docs`).

No torch, no web framework here: the launcher and the recipe's config import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from protocols.runtime.codec import register

__all__ = ["ServerArgs", "ServerSettings", "SimSettings"]


@register
@dataclass
class SimSettings:
    """The simulated model of backend "sim", a test and benchmark tool (not a model): no
    weights, deterministic tokens, and a latency model spent sleeping, so hundreds of requests cost
    almost no CPU."""

    prefill_s_per_token: float = 0.0  # seconds of prefill per uncached prompt token
    decode_s_base: float = 0.0  # seconds per decode step
    decode_s_per_seq: float = 0.0  # extra seconds per decode step for each running sequence
    eos_prob: float = 0.0  # chance that a sampled token is EOS
    vocab_size: int = 32000  # vocabulary size when the model folder has no tokenizer
    eos_token_id: int = 2  # the token id the simulator ends a sequence with


@register
@dataclass
class ServerSettings:
    """What a reference server serves and how (everything but where it listens)."""

    model_path: str = ""  # the model folder or Hugging Face id (sim: optional, for its tokenizer)
    tokenizer_path: str | None = None  # the tokenizer folder or id, if not the model's
    # hf: the model through transformers; sim: a simulated model for tests and benchmarks (sim.*)
    backend: Literal["hf", "sim"] = "hf"
    max_running_requests: int = 64  # sequences decoded at once; more requests wait in its queue
    cache_tokens: int = 65536  # prefix-cache (KV) budget, in tokens
    dtype: str = "auto"  # the model's dtype: auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    random_seed: int = 0  # the server's sampling seed
    weight_version: str = "default"  # the weight version reported before the first update
    # refuse distributed and tensor weight updates outside /begin_weight_update ... /end_weight_update,
    # as SGLang 0.5.23 always does (false: as SGLang before weight-update sessions)
    strict_weight_update_session: bool = True
    num_threads: int = 0  # torch intra-op threads (0: torch's default)
    # longest prompt + max_new_tokens, as SGLang's --context-length (0: the model config's
    # max_position_embeddings, else 32768); a longer request gets 400 unless allow_auto_truncate
    context_length: int = 0
    allow_auto_truncate: bool = False  # cut prompts past the context length instead of answering 400
    # Request limits (SGLang has none of these; they keep one request from stalling the server)

    max_request_bytes: int = 16 << 20  # a request body larger than this gets 413
    max_n: int = 64  # the largest n (samples per prompt) one request may ask for; more get 400
    max_batch_size: int = 256  # the most sequences (prompts x n) in one /generate; more get 400
    # the most log-prob entries one /generate may ask for (top_logprobs_num and token_ids_logprob
    # entries at every reported position, summed over its sequences); more get 400. About 40 bytes
    # of JSON each: the default bounds a response near 40 MB
    max_logprob_entries: int = 1 << 20
    # stream events carry only what is new since the previous one (output ids, text, output
    # log-probs) instead of everything so far, as SGLang's --incremental-streaming-output
    incremental_streaming_output: bool = False
    # LoRA adapters as SGLang's --enable-lora serves them (hf backend): /load_lora_adapter and
    # /unload_lora_adapter, and a lora_path per /generate naming the adapter that request uses
    enable_lora: bool = False
    max_lora_rank: int | None = None  # the largest adapter rank /load_lora_adapter accepts (None: any)
    # the modules an adapter may target, e.g. q_proj (empty: any linear layer); SGLang's flag of that name
    lora_target_modules: list[str] = field(default_factory=list)
    # adapters loaded at once; loading one more unloads the least recently used (None: no limit)
    max_loaded_loras: int | None = None
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = (
        "warning"  # how much it logs
    )
    sim: SimSettings = field(default_factory=SimSettings)  # the simulator's knobs (backend = "sim" only)


@dataclass
class ServerArgs(ServerSettings):
    """The command line of ``python -m nodes.inference.server``: the settings and where to listen
    (a launcher picks the address and port itself)."""

    host: str = "127.0.0.1"  # the address to listen on
    port: int = 30000  # the port to listen on

"""The trainer's configuration: what a rank trains with, the loss, and how weights reach the servers.

Torch-free and registered with the codec, so the recipe builds a :class:`TrainConfig` from its TOML
(``[trainer]``, ``[trainer.loss]``, ``[trainer.push]``) and the same object travels to every
:class:`~nodes.trainer.rank.TrainerRank`. Each class checks its own values when built (a bad value
is a ``ValueError`` naming the key and what is allowed; the recipe's loader adds the file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from protocols.codec import register
from protocols.sglang import PAUSE_MODES

__all__ = ["LossConfig", "PushConfig", "TrainConfig"]


def _require(ok: bool, key: str, allowed: str, value: object) -> None:
    if not ok:
        raise ValueError(f"'{key}' must be {allowed}, got {value!r}")


@register
@dataclass
class LossConfig:
    """The policy loss, by import path, and its knobs (defaults: AReaL's GSM8K GRPO recipe).

    ``fn`` is called with keyword arguments ``logp, prox_logp, behave_logp, advantages, loss_mask,
    cfg, entropy, ref_logp`` (token-aligned tensors; ``cfg`` is this object) and returns a
    :class:`nodes.trainer.loss.LossSums`: the loss as a token sum and its statistics, each in the
    table that says how it reduces over micro-batches and ranks. See :func:`decoupled_ppo_loss`.
    """

    fn: str = "nodes.trainer.loss:decoupled_ppo_loss"
    eps_clip: float = 0.4
    eps_clip_higher: float | None = None  # asymmetric upper clip (DAPO's clip-higher)
    c_clip: float | None = None  # dual clip for negative advantages; must be > 1
    behav_imp_weight_cap: float | None = 5.0
    # logits / T: must be the temperature the servers sampled with (the recipe sets it to
    # rollout.temperature; setting another value there is an error)
    temperature: float = 1.0
    kl_coef: float = 0.0  # k3 KL to a reference model, added to the loss

    def __post_init__(self) -> None:
        _require(":" in self.fn, "fn", "an import path 'module:function'", self.fn)
        _require(0 < self.eps_clip < 1, "eps_clip", "in (0, 1)", self.eps_clip)
        high = self.eps_clip_higher
        _require(high is None or high > 0, "eps_clip_higher", "> 0 or unset", high)
        _require(self.c_clip is None or self.c_clip > 1, "c_clip", "> 1 or unset", self.c_clip)
        cap = self.behav_imp_weight_cap
        _require(cap is None or cap > 0, "behav_imp_weight_cap", "> 0 or unset", cap)
        _require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(self.kl_coef >= 0, "kl_coef", ">= 0", self.kl_coef)


@register
@dataclass
class PushConfig:
    """How weights reach the servers."""

    method: Literal["distributed", "disk"] = "distributed"
    # per broadcast (distributed); AReaL's default. Rank 0 keeps up to two buckets between pushes.
    # Smaller buckets let the next gather overlap a broadcast, which needs idle cores or copy
    # engines: on 2 CPU cores 256 MiB buckets were 1.44x a raw broadcast, one bucket 1.36x.
    bucket_bytes: int = 1 << 30
    # one flat tensor per bucket: one collective per bucket instead of one per tensor (gloo: 0.2 s
    # vs 0.13 s for SmolLM2's 272 tensors). SGLang before flattened-bucket support: set False.
    flattened_bucket: bool = True
    dtype: str | None = None  # cast before sending, e.g. "bfloat16" (None: as trained)
    shared_memory: bool = True  # ranks on rank 0's host hand it their shards through /dev/shm
    pause_mode: Literal["abort", "retract", "in_place"] | None = "retract"  # None: between decode steps
    # Drop the servers' prefix cache (KV from the old weights) with the update. None: where SGLang
    # allows it, i.e. under abort and retract; under in_place or no pause requests still run, and
    # SGLang refuses to flush then (the update call fails), so those modes keep the cache.
    flush_cache: bool | None = None
    weight_update_session: bool = True  # wrap in /begin_weight_update ... /end_weight_update
    group_name: str = ""  # "" -> a fresh unique name per connect
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl for a CUDA model, else gloo
    master_address: str = "127.0.0.1"
    master_port: int = 0  # 0 -> a free port on this host
    disk_dir: str = ""  # where the disk path writes versions (the recipe: <run.out_dir>/weights)
    keep_disk_versions: int = 2
    http_timeout_s: float = 600.0
    group_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _require(self.method in ("distributed", "disk"), "method", "'distributed' or 'disk'", self.method)
        modes = " or ".join(repr(m) for m in PAUSE_MODES)
        pm = self.pause_mode
        _require(pm is None or pm in PAUSE_MODES, "pause_mode", f"{modes} or unset", pm)
        _require(
            self.backend in ("auto", "gloo", "nccl"), "backend", "'auto', 'gloo' or 'nccl'", self.backend
        )
        _require(self.bucket_bytes >= 1, "bucket_bytes", ">= 1", self.bucket_bytes)
        _require(self.keep_disk_versions >= 1, "keep_disk_versions", ">= 1", self.keep_disk_versions)
        _require(self.http_timeout_s > 0, "http_timeout_s", "> 0", self.http_timeout_s)
        _require(self.group_timeout_s > 0, "group_timeout_s", "> 0", self.group_timeout_s)


@register
@dataclass
class TrainConfig:
    """Everything a trainer rank needs; defaults are the CPU recipe's.

    ``model_path``, ``total_steps`` and ``seed`` are filled in by the recipe from ``[model]`` and
    ``[run]``; ``n_ranks`` and ``threads`` say how many rank actors it starts and how they run.
    """

    n_ranks: int = 2  # trainer rank actors, one torch.distributed world
    device: Literal["cpu", "cuda"] = "cpu"  # gloo or nccl
    threads: int = 1  # torch threads per rank (CPU)
    model_path: str = ""
    ref_model_path: str | None = None  # the KL term's reference (loss.kl_coef > 0); None: model_path
    bf16: bool = False  # MixedPrecisionPolicy(param bf16, reduce fp32)
    activation_checkpointing: bool = False
    lr: float = 2e-5
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_steps: int = 0  # optimizer steps of linear warm-up from 0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # after warm-up
    total_steps: int = 1000  # optimizer steps, for the decaying schedules
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # 0 = no clipping
    max_tokens_per_mb: int = 2048  # tokens per micro-batch (memory); sequences are packed by FFD
    n_minibatches: int = 1  # optimizer steps per train_step
    pad_id: int = 0
    seed: int = 0
    loss: LossConfig = field(default_factory=LossConfig)
    push: PushConfig = field(default_factory=PushConfig)

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))  # a list after msgpack or TOML
        _require(self.device in ("cpu", "cuda"), "device", "'cpu' or 'cuda'", self.device)
        sched = ("constant", "linear", "cosine")
        _require(
            self.lr_schedule in sched, "lr_schedule", "'constant' or 'linear' or 'cosine'", self.lr_schedule
        )
        for key, lo in (("n_ranks", 1), ("threads", 1), ("max_tokens_per_mb", 1), ("n_minibatches", 1)):
            _require(getattr(self, key) >= lo, key, f">= {lo}", getattr(self, key))
        for key in ("lr", "weight_decay", "warmup_steps", "grad_clip", "min_lr_ratio", "total_steps"):
            _require(getattr(self, key) >= 0, key, ">= 0", getattr(self, key))

"""The trainer's configuration: what a rank trains with, the loss, and how weights reach the servers.

Torch-free and registered with the codec, so the recipe builds a :class:`TrainConfig` from its TOML
(``[trainer]``, ``[trainer.loss]``, ``[trainer.push]``, ``[trainer.lora]``) and the same object travels to every
:class:`~nodes.trainer.rank.TrainerRank`. Each class checks its own values when built (a bad value
is a ``ValueError`` naming the key and what is allowed; the recipe's loader adds the file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from nodes.common.plugins import function_settings
from protocols.http.auth import ServerKeys
from protocols.runtime.codec import register
from rlactors.base.tomlconf import above, at_least, check_ranges, import_path, within

__all__ = [
    "DistillConfig",
    "LoraConfig",
    "LossConfig",
    "MismatchCorrections",
    "PushConfig",
    "TrainConfig",
    "loss_settings",
]

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


@register
@dataclass
class MismatchCorrections:
    """:func:`~nodes.trainer.loss.decoupled_ppo_loss`'s own settings (``[trainer.loss.fn_args]``):
    corrections for the train-inference mismatch, on top of decoupled PPO. All off by default and
    composable; the formulas and their sources are in the loss's docstring.

    The behaviour weight is ``w = pi_prox / pi_behave`` per token. Token MIS and IcePop are the same
    two-sided token mask on it (IcePop's published bounds: ``mis_low = 0.5``, ``mis_high = 5``).
    """

    tis_cap: float | None = field(default=None, metadata=above(0))  # token TIS: w -> min(w, C)
    mis_low: float | None = field(default=None, metadata=at_least(0))  # token MIS/IcePop: w < low masked
    mis_high: float | None = field(default=None, metadata=above(0))  # token MIS/IcePop: w > high masked
    # a sequence whose geometric-mean w (exp of its mean log w) is outside [low, high] is masked
    geo_low: float | None = field(default=None, metadata=at_least(0))
    geo_high: float | None = field(default=None, metadata=above(0))  # the upper bound of that mask
    # GSPO: the PPO ratio is the sequence's geometric-mean ratio, clipped per sequence
    seq_ratio: bool = False
    # GSPO's clip range [1 - seq_eps_clip, 1 + seq_eps_clip_higher]; the defaults are the paper's
    seq_eps_clip: float = field(default=3e-4, metadata=within(0, 1, open_=True))
    seq_eps_clip_higher: float = field(default=4e-4, metadata=above(0))  # GSPO's upper clip (above)

    def __post_init__(self) -> None:
        check_ranges(self)
        for lo, hi in (("mis_low", "mis_high"), ("geo_low", "geo_high")):
            a, b = getattr(self, lo), getattr(self, hi)
            if a is not None and b is not None and a > b:
                raise ValueError(f"'{lo}' must be <= {hi} ({b}), got {a}")


def loss_settings(path: str) -> type:
    """The settings class of the loss function at import path ``path`` (its ``config_class``)."""
    return function_settings(path, "trainer.loss.fn")


@register
@dataclass
class LossConfig:
    """The policy loss, by import path, and its knobs (defaults: AReaL's GSM8K GRPO recipe).

    ``fn`` is called with keyword arguments ``logp, prox_logp, behave_logp, advantages, loss_mask,
    cfg, entropy, ref_logp`` (token-aligned ``[sequences, tokens]`` tensors, one row per sequence;
    ``cfg`` is this object) and returns a :class:`nodes.trainer.loss.LossSums`: the loss as a sum
    the trainer divides by the global count of loss tokens or sequences, and its statistics, each in
    the table that says how it reduces over micro-batches and ranks. See :func:`decoupled_ppo_loss`.

    The function's own settings are ``cfg.fn_args``: an instance of its ``config_class`` from
    ``[trainer.loss.fn_args]`` (:class:`MismatchCorrections` for the default loss).
    ``agg`` says how token losses become the loss (every step exact over micro-batches and ranks):
    ``token-mean`` (sum over all loss tokens / their count), ``seq-mean-token-mean`` (each
    sequence's token mean, averaged over sequences), ``seq-mean-token-sum`` (each sequence's token
    sum / ``agg_norm``, averaged over sequences: Dr. GRPO with ``agg_norm`` = the max new tokens).
    """

    # the loss: fn(logp, prox_logp, behave_logp, advantages, loss_mask, cfg, entropy, ref_logp) -> LossSums
    fn: str = field(default="nodes.trainer.loss:decoupled_ppo_loss", metadata=import_path())
    # the PPO ratio is clipped to [1 - eps_clip, 1 + eps_clip]
    eps_clip: float = field(default=0.4, metadata=within(0, 1, open_=True))
    # asymmetric upper clip (DAPO's clip-higher); unset: eps_clip
    eps_clip_higher: float | None = field(default=None, metadata=above(0))
    c_clip: float | None = field(default=None, metadata=above(1))  # dual clip for negative advantages
    # decoupled PPO: tokens whose behaviour weight pi_prox / pi_behave exceeds this are masked; None: no cap
    behav_imp_weight_cap: float | None = field(default=5.0, metadata=above(0))
    kl_coef: float = field(default=0.0, metadata=at_least(0))  # k3 KL to a reference model, added to the loss
    # how token losses become the loss: over all tokens, or per sequence first (the class docstring)
    agg: Aggregation = "token-mean"
    agg_norm: float = field(default=1.0, metadata=above(0))  # seq-mean-token-sum's constant divisor
    # the function's own settings: an instance of its config_class, from [trainer.loss.fn_args]
    fn_args: Any = field(default_factory=MismatchCorrections, metadata={"settings_of": ("fn", loss_settings)})

    def __post_init__(self) -> None:
        check_ranges(self)


@register
@dataclass
class PushConfig:
    """How weights reach the servers."""

    # distributed: a weight-update group (NCCL between GPUs; gloo where a server shares rank 0's
    # GPU, or on CPU). tensor: /update_weights_from_tensor, buckets handed over by reference (CUDA
    # IPC; shared memory on CPU): for servers on rank 0's host, fastest on rank 0's own GPU
    # (bench/gpu_push.py, measured in bench/RESULTS.md). disk: safetensors.
    method: Literal["distributed", "tensor", "disk"] = "distributed"
    # bytes per bucket, one broadcast each (distributed); AReaL's default. Rank 0 keeps up to two
    # buckets between pushes. Smaller buckets let the next gather overlap a broadcast, which needs idle
    # cores or copy engines: on 2 CPU cores smaller buckets were slower than one (bench/RESULTS.md).
    bucket_bytes: int = field(default=1 << 30, metadata=at_least(1))
    # one flat tensor per bucket: one collective per bucket instead of one per tensor, which is
    # faster over gloo (bench/RESULTS.md). SGLang before flattened-bucket support: set False.
    flattened_bucket: bool = True
    dtype: str | None = None  # cast the weights to this before sending, e.g. "bfloat16" (None: as trained)
    shared_memory: bool = True  # ranks on rank 0's host hand it their shards through /dev/shm
    # how servers pause for the update (SGLang's /pause_generation mode); None: no pause, the
    # weights change between decode steps
    pause_mode: Literal["abort", "retract", "in_place"] | None = "retract"
    # Drop the servers' prefix cache (KV from the old weights) with the update. None: where SGLang
    # allows it, i.e. under abort and retract; under in_place or no pause requests still run, and
    # SGLang refuses to flush then (the update call fails), so those modes keep the cache.
    flush_cache: bool | None = None
    weight_update_session: bool = True  # wrap in /begin_weight_update ... /end_weight_update
    group_name: str = ""  # the weight-update group's name; "" -> a fresh unique name per connect
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl for a CUDA model, else gloo
    # where the weight-update group meets when the runtime gives no address (the recipe's does)
    master_address: str = "127.0.0.1"
    master_port: int = 0  # likewise its port; 0 -> a free port on this host
    disk_dir: str = ""  # where the disk path writes versions (the recipe: <run.out_dir>/weights)
    # versions kept on disk (disk method); older ones are removed
    keep_disk_versions: int = field(default=2, metadata=at_least(1))
    http_timeout_s: float = field(default=600.0, metadata=above(0))  # one call to a server during a push
    # forming the weight-update group, and each collective in it
    group_timeout_s: float = field(default=600.0, metadata=above(0))
    # the servers' --api-key/--admin-api-key (the recipe fills it in; the push's routes are admin ones)
    keys: ServerKeys = field(default_factory=ServerKeys, repr=False)

    def __post_init__(self) -> None:
        check_ranges(self)


@register
@dataclass
class LoraConfig:
    """LoRA through ``peft`` (nodes/trainer/lora.py): low-rank adapters on the policy's linear layers.

    Only the adapters are optimised and checkpointed (the base weights come from the model path on
    every start, resume included). ``push`` says what the servers get: ``merged`` weights under the
    base model's names (any server), or the ``adapter`` alone, which servers launched with LoRA
    enabled load with ``/load_lora_adapter`` and the rollout client names per request
    (nodes/trainer/lora.py says how).
    With ``loss.kl_coef`` and no ``ref_model_path``, the reference is the base model: the policy with
    its adapters switched off, no second copy. LoRA usually wants a higher ``lr`` than full
    fine-tuning (about 10x in Thinking Machines' "LoRA Without Regret").
    """

    enabled: bool = False  # train LoRA adapters instead of every weight
    rank: int = field(default=16, metadata=at_least(1))  # r: the adapters' inner dimension
    alpha: float = field(default=32.0, metadata=above(0))  # the update is scaled by alpha / rank
    # module names (peft's target_modules: exact names or suffixes), or "all-linear" (all but lm_head)
    target_modules: str | list[str] = "all-linear"
    dropout: float = field(default=0.0, metadata=within(0, 1))  # on the adapters' input, training only
    # what each push sends: "merged" (W + scale * B @ A under the base names: full weights, any
    # server) or "adapter" (the adapter alone, a PEFT folder loaded with /load_lora_adapter; the
    # servers need LoRA enabled, which the recipe does; requests name "<name>-v<version>")
    push: Literal["merged", "adapter"] = "merged"
    name: str = "policy"  # adapter pushes: the adapters' name on the servers, before "-v<version>"
    # adapter pushes: versions each server keeps loaded (and on disk). Rollout names the newest at
    # every post; an evaluation names the version it started at, so it fails if it outlasts this many pushes
    keep: int = field(default=4, metadata=at_least(2))

    def __post_init__(self) -> None:
        check_ranges(self)
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("'target_modules' must name at least one module, or be 'all-linear'")


@register
@dataclass
class DistillConfig:
    """On-policy distillation (``[distill]``): a teacher model scores every sampled token, and the
    loss's advantage per token becomes ``reward_coef * A + coef * (log pi_teacher - log pi)``, the
    negative reverse KL to the teacher as a dense reward (``pi``: the proximal policy, the weights
    at the start of the step), under the same clip and staleness corrections as the rest
    (nodes/trainer/loss.py, :func:`~nodes.trainer.loss.distill_advantages`)."""

    # the teacher: a model of [models.<name>] whose servers score the samples; "" = no distillation
    teacher: str = ""
    coef: float = field(default=1.0, metadata=at_least(0))  # weight of the reverse-KL advantage
    # weight of the reward's (group) advantage beside it; 0 = pure distillation
    reward_coef: float = field(default=1.0, metadata=at_least(0))

    def __post_init__(self) -> None:
        check_ranges(self)

    @property
    def enabled(self) -> bool:
        """Whether a teacher is named."""
        return bool(self.teacher)


@register
@dataclass
class TrainConfig:
    """Everything a trainer rank needs; defaults are the CPU recipe's.

    ``model_path`` and ``total_steps`` are filled in by the recipe from ``[model]`` and ``[run]``;
    ``n_ranks`` and ``threads`` say how many rank actors it starts and how they run.
    """

    n_ranks: int = field(default=2, metadata=at_least(1))  # trainer rank actors, one torch.distributed world
    device: Literal["cpu", "cuda"] = "cpu"  # where the ranks train: cpu (gloo) or cuda (nccl)
    threads: int = field(default=1, metadata=at_least(1))  # torch threads per rank (CPU)
    model_path: str = ""  # the policy's HF folder (the recipe sets it from [model])
    ref_model_path: str | None = None  # the KL term's reference (loss.kl_coef > 0); None: model_path
    bf16: bool = False  # train in bf16: MixedPrecisionPolicy(param bf16, reduce fp32)
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, more time
    lr: float = field(default=2e-5, metadata=at_least(0))  # AdamW's learning rate (the peak, with a schedule)
    weight_decay: float = field(default=0.01, metadata=at_least(0))  # AdamW's decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's moment decay rates
    adam_eps: float = 1e-8  # AdamW's epsilon
    warmup_steps: int = field(default=0, metadata=at_least(0))  # optimizer steps of linear warm-up from 0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # the learning rate after warm-up
    # optimizer steps, for the decaying schedules (the recipe: run.steps x n_minibatches)
    total_steps: int = field(default=1000, metadata=at_least(0))
    min_lr_ratio: float = field(default=0.0, metadata=at_least(0))  # where decay ends, as a fraction of lr
    grad_clip: float = field(default=1.0, metadata=at_least(0))  # max gradient norm; 0 = no clipping
    # tokens per micro-batch (memory); sequences are packed by FFD
    max_tokens_per_mb: int = field(default=2048, metadata=at_least(1))
    n_minibatches: int = field(default=1, metadata=at_least(1))  # optimizer steps per train_step
    pad_id: int = 0  # the token id that pads micro-batches (masked out: it never reaches the loss)
    seed: int = 0  # torch's seed on every rank
    # the policy loss by import path, its knobs and [trainer.loss.fn_args], the function's own settings
    loss: LossConfig = field(default_factory=LossConfig)
    push: PushConfig = field(default_factory=PushConfig)  # how new weights reach the servers after each step
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters instead of full fine-tuning
    # on-policy distillation's loss weights (the recipe sets it from [distill])
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))  # a list after msgpack or TOML
        check_ranges(self)

"""The FSDP2 training engine: one rank's model shard, optimizer, and the GRPO train step.

Every rank receives the whole batch and computes the same balancing plan (nodes/trainer/
balance.py), so the ranks agree on who trains what, on the global loss-token counts that make
the loss a token mean over the whole minibatch, and on the micro-batch count, without talking.
The default process group must exist before :class:`FSDPTrainer` is built (rank.py sets it up).

A non-finite loss or gradient stops the step with :class:`NonFiniteError` before the optimizer
applies it, rather than skipping the update: there is no fp16 loss scaling here (fp32 master
weights, fp32 gradient reduction), so inf/nan is never a routine overflow but a corrupt batch,
weight or optimizer state, and a run that kept skipping would look alive while learning nothing.
:meth:`FSDPTrainer.nonfinite` lets callers refuse to save or push weights that hold inf/nan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import structlog
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from nodes.common.plugins import resolve
from nodes.common.trace import TRACE
from nodes.trainer.balance import plan_batch, split_across_ranks
from nodes.trainer.config import TrainConfig
from nodes.trainer.loss import LossSums, distill_advantages, gather_logprobs, gather_logprobs_entropy
from nodes.trainer.microbatch import MicroBatch, build_microbatch

__all__ = [
    "FSDPTrainer",
    "NonFiniteError",
    "TrainConfig",
    "name_list",
]

log = structlog.get_logger(__name__)


@dataclass
class _StepTotals:
    """What a step's microbatches add up to on this rank: the loss's sums, maxima and minima (reduced
    over ranks by ``_reduce_stats``), and this rank's share of the objective."""

    objective: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)
    mins: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, out: LossSums, weight: float) -> None:
        """One microbatch's loss terms; ``weight`` turns its loss sum into its share of the objective."""
        self.objective += out.loss_sum.detach().double() * weight
        for key, v in out.sums.items():
            self.sums[key] = self.sums[key] + v.double() if key in self.sums else v.double()
        for key, v in out.maxes.items():
            self.maxes[key] = torch.maximum(self.maxes[key], v.double()) if key in self.maxes else v.double()
        for key, v in out.mins.items():
            self.mins[key] = torch.minimum(self.mins[key], v.double()) if key in self.mins else v.double()


class NonFiniteError(RuntimeError):
    """Weights, optimizer state, a loss or a gradient hold inf or nan; raised on every rank."""


def name_list(names: list[str], limit: int = 4) -> str:
    """``names`` for an error message: the first ``limit`` of them and how many more."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _lr_lambda(cfg: TrainConfig):
    """Multiplier of ``cfg.lr`` at an optimizer step: linear warm-up, then the chosen decay."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        span = max(1, cfg.total_steps - cfg.warmup_steps)
        p = min(1.0, (step - cfg.warmup_steps) / span)
        decay = 1.0 - p if cfg.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    if cfg.lr_schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_schedule must be constant, linear or cosine, got {cfg.lr_schedule!r}")
    return f


def _apply_fsdp(model: torch.nn.Module, mesh: Any, bf16: bool) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, head)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kw: dict[str, Any] = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp
    layers = model.get_decoder().layers  # type: ignore[operator]  # a transformers model's method; torch types Module attributes as Tensor | Module
    for i, layer in enumerate(layers):
        # the last layer's params are needed again at once by backward: keep them gathered
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **kw)
    fully_shard(model, **kw)
    return model


def _build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """AdamW over the parameters that train (all, or LoRA's adapters) plus a LambdaLR schedule
    stepped once per optimizer step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))


def _load_model(path: str, cfg: TrainConfig, mesh: Any, train: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if train and cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if train and cfg.lora.enabled:  # adapters before sharding: FSDP2 shards them with their layer
        from nodes.trainer.lora import apply_lora

        return _apply_fsdp(apply_lora(model, cfg.lora), mesh, cfg.bf16)
    return _apply_fsdp(model, mesh, cfg.bf16)


class FSDPTrainer:
    """One rank of the FSDP2 trainer. All public methods are collective: call them on every rank."""

    def __init__(self, cfg: TrainConfig, version: int = 0):
        if not dist.is_initialized():
            raise RuntimeError("FSDPTrainer needs the default process group: call init_process_group first")
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cfg.device == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        torch.manual_seed(cfg.seed)
        self.mesh = init_device_mesh(self.device.type, (self.world,))
        self.model = _load_model(cfg.model_path, cfg, self.mesh, train=True)
        self.ref_model = None
        # the reference defaults to the initial policy, as in AReaL; under LoRA that is the base
        # model, i.e. the policy with its adapters off (see _ref_logp), so no second copy is loaded
        self.ref_is_base = bool(cfg.loss.kl_coef) and cfg.lora.enabled and not cfg.ref_model_path
        if cfg.loss.kl_coef and not self.ref_is_base:
            self.ref_model = _load_model(
                cfg.ref_model_path or cfg.model_path, cfg, self.mesh, train=False
            ).eval()
        self.optimizer, self.scheduler = _build_optimizer(self.model, cfg)
        self.loss_fn = resolve(cfg.loss.fn, "trainer.loss.fn")
        self.version = version  # policy version the weights are at; +1 per train_step
        self.optim_steps = 0
        self.log = log.bind(rank=self.rank)

    # ---- forward helpers -------------------------------------------------------------------
    def _logits(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        return out.logits[:, :-1]

    @torch.no_grad()
    def _recompute(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        return gather_logprobs(self._logits(model, mb), mb.labels, mb.temperature)

    def _ref_logp(self, mb: MicroBatch) -> torch.Tensor | None:
        """The KL term's reference log-probs, or None without a KL term."""
        if self.ref_is_base:
            with self.model.disable_adapter():  # type: ignore[operator]  # peft's switch (the base weights alone); torch types Module attributes as Tensor | Module
                return self._recompute(self.model, mb)
        return self._recompute(self.ref_model, mb) if self.ref_model is not None else None

    # ---- the step ----------------------------------------------------------------------------
    def minibatches(self, batch: Any) -> list[list[int]]:
        """Group indices of each minibatch (optimizer step), balanced by tokens."""
        n_mini = max(1, min(self.cfg.n_minibatches, len(batch.groups)))
        return split_across_ranks([g.num_tokens for g in batch.groups], n_mini)

    def plan(self, batch: Any) -> list[list[list[int]]]:
        """This rank's micro-batches for each minibatch, as flat trajectory indices."""
        starts, n = [], 0
        for g in batch.groups:
            starts.append(n)
            n += len(g.trajectories)
        seq_tokens = [[t.num_tokens for t in g.trajectories] for g in batch.groups]
        out = []
        for groups in self.minibatches(batch):
            p = plan_batch([seq_tokens[g] for g in groups], self.world, self.cfg.max_tokens_per_mb)
            out.append([[starts[groups[gi]] + s for gi, s in mb] for mb in p.ranks[self.rank]])
        return out

    def train_step(self, batch: Any) -> dict[str, float]:
        """Recompute proximal log-probs, then one optimizer step per minibatch; return global stats,
        with ``version``: the policy version the weights are at after the step.

        ``batch.advantages`` has one value per trajectory of ``batch.trajectories``
        (nodes/driver/advantage.py), put on each of its loss tokens.
        """
        t0, wall0 = time.perf_counter(), time.time()
        plan, mbs = self._microbatches(batch)
        self._proximal_logps(mbs)
        t_prox = time.perf_counter() - t0
        TRACE.span("proximal log-probs", wall0, wall0 + t_prox)

        totals = _StepTotals(torch.zeros((), dtype=torch.float64, device=self.device))
        grad_norms: list[float] = []
        lr = 0.0
        for i, (groups, mini) in enumerate(zip(self.minibatches(batch), mbs, strict=True)):
            grad_norm, lr = self._optimizer_step(batch, groups, mini, totals, i, len(mbs))
            grad_norms.append(grad_norm)

        stats = self._step_stats(batch, totals, len(mbs))
        elapsed = time.perf_counter() - t0
        stats.update(
            {
                "grad_norm": float(sum(grad_norms) / len(grad_norms)) if grad_norms else 0.0,
                "lr": lr,
                "n_microbatches": float(sum(len(m) for m in plan)),
                "tokens_per_s": batch.num_tokens / elapsed if elapsed > 0 else 0.0,
                "prox_time_s": t_prox,
                "step_time_s": elapsed,
            }
        )
        self.version += 1
        stats["version"] = self.version
        trace_ids = [t.meta.get("trace_id") for t in batch.trajectories]
        TRACE.span("train step", wall0, time.time(), version=self.version, trace_ids=trace_ids)
        self.log.info(
            "train_step",
            version=self.version,
            loss=stats.get("loss"),
            grad_norm=stats["grad_norm"],
            tokens_per_s=round(stats["tokens_per_s"], 1),
        )
        return stats

    def _microbatches(self, batch: Any) -> tuple[list[list[list[int]]], list[list[MicroBatch]]]:
        """This rank's plan (:meth:`plan`) and its microbatches, per minibatch, on the device."""
        trajs = batch.trajectories
        if len(batch.advantages) != len(trajs):
            raise ValueError(
                f"{len(batch.advantages)} advantages for a batch of {len(trajs)} trajectories "
                "(set batch.advantages with nodes.driver.advantage.batch_advantages)"
            )
        adv = [float(a) for a in batch.advantages]
        plan = self.plan(batch)
        mbs = [
            [build_microbatch(seqs, trajs, adv, self.cfg.pad_id).to(self.device) for seqs in mini]
            for mini in plan
        ]
        return plan, mbs

    def _proximal_logps(self, mbs: list[list[MicroBatch]]) -> None:
        """Proximal (and reference) log-probs from the weights before any update of this step."""
        self.model.eval()
        for mini in mbs:
            for mb in mini:
                mb.prox_logp = self._recompute(self.model, mb)
                mb.ref_logp = self._ref_logp(mb)
        self.model.train()

    def _optimizer_step(
        self, batch: Any, groups: list[int], mini: list[MicroBatch], totals: _StepTotals, i: int, n: int
    ) -> tuple[float, float]:
        """Forward and backward over one minibatch's microbatches, then one optimizer step; the
        losses and statistics go to ``totals``. Minibatch ``i`` of ``n``; returns the gradient norm and
        the learning rate used."""
        # the loss divides by a count over the whole (multi-rank) minibatch: of loss tokens, or
        # of sequences with a loss token (the seq-mean aggregations)
        counts = {"tokens": 0, "sequences": 0}
        for t in (t for g in groups for t in batch.groups[g].trajectories):
            counts["tokens"] += t.loss_tokens
            counts["sequences"] += t.loss_tokens > 0
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for k, mb in enumerate(mini):
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(k == len(mini) - 1)
            with TRACE.phase("forward/backward", minibatch=i, microbatch=k):
                out = self._forward_loss(mb)
                # FSDP averages gradients over ranks: scale by world / the global count
                scale = self.world / max(1, counts[out.mean_over])
                (out.loss_sum * scale).backward()
            loss_sum += out.loss_sum.detach()
            totals.add(out, scale / self.world)
        opt_start = time.time()
        grad_norm = self._clip_grads()
        self._check_update(loss_sum, grad_norm, f"minibatch {i + 1} of {n}")
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step uses
        self.optimizer.step()
        self.scheduler.step()
        TRACE.span("optimizer", opt_start, time.time(), minibatch=i)
        self.optim_steps += 1
        return grad_norm, lr

    def _step_stats(self, batch: Any, totals: _StepTotals, n_minibatches: int) -> dict[str, float]:
        """The step's statistics over every rank: the loss's, the objective, staleness, sizes."""
        trajs = batch.trajectories
        loss_tokens = sum(t.loss_tokens for t in trajs)
        stats = self._reduce_stats(totals.sums, totals.maxes, totals.mins, loss_tokens)
        dist.all_reduce(totals.objective)
        stats["loss"] = (
            float(totals.objective) / n_minibatches
        )  # the objective, averaged over optimizer steps
        stats.update(self._staleness(trajs))
        stats["n_seqs"] = float(len(trajs))
        stats["n_tokens"] = float(batch.num_tokens)
        stats["n_loss_tokens"] = float(loss_tokens)
        return stats

    def _forward_loss(self, mb: MicroBatch) -> LossSums:
        logits = self._logits(self.model, mb)
        if mb.is_dummy:  # keep every rank in the collectives; contributes nothing
            zero = logits.sum() * 0.0
            return LossSums(loss_sum=zero, n_tokens=torch.zeros((), dtype=torch.long))
        logp, entropy = gather_logprobs_entropy(logits, mb.labels, mb.temperature)
        advantages, reverse_kl = mb.advantages, None
        if self.cfg.distill.enabled:  # on-policy distillation: the teacher's term joins the advantage
            if mb.teacher_logp is None or mb.prox_logp is None:
                raise ValueError(
                    f"[distill] teacher = {self.cfg.distill.teacher!r} but the batch's trajectories have "
                    "no teacher log-probs: the rollout actors were started without the teacher"
                )
            advantages, reverse_kl = distill_advantages(
                mb.advantages, mb.teacher_logp, mb.prox_logp, mb.loss_mask, self.cfg.distill
            )
        out = self.loss_fn(
            logp=logp,
            prox_logp=mb.prox_logp,
            behave_logp=mb.behave_logp,
            advantages=advantages,
            loss_mask=mb.loss_mask,
            cfg=self.cfg.loss,
            entropy=entropy,
            ref_logp=mb.ref_logp,
        )
        if reverse_kl is not None:  # per loss token, once reduced: the step's distill/reverse_kl
            out.sums["distill_reverse_kl"] = reverse_kl.sum()
        return out

    def _clip_grads(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(
            params, self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        )
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def _check_update(self, local_loss: torch.Tensor, grad_norm: float, where: str) -> None:
        """Raise NonFiniteError on every rank, before the optimizer step, if any rank's loss or the
        (global) gradient norm is not finite."""
        bad_loss = (~torch.isfinite(local_loss)).to(torch.float32)
        dist.all_reduce(bad_loss, op=dist.ReduceOp.MAX)
        if not bad_loss.item() and math.isfinite(grad_norm):
            return
        self.optimizer.zero_grad(set_to_none=True)
        what = "loss" if bad_loss.item() else f"gradient (norm {grad_norm})"
        weights = self.nonfinite()
        cause = f"the weights already hold inf/nan in {name_list(weights)}" if weights else "a bad batch"
        raise NonFiniteError(
            f"train step at policy version {self.version}, {where}: non-finite {what}, likely {cause}; "
            "the update was not applied. Resume from the last checkpoint (never saved with inf/nan)"
        )

    def nonfinite(self, optimizer: bool = False) -> list[str]:
        """Names of the parameters (and with ``optimizer``, optimizer states such as
        ``lm_head.weight:exp_avg``) holding inf or nan on any rank; collective, same on every rank."""
        names = {p: n for n, p in self.model.named_parameters()}
        tensors: list[tuple[str, torch.Tensor]] = [(n, p) for p, n in names.items()]
        if optimizer:
            for p, st in self.optimizer.state.items():
                tensors += [(f"{names[p]}:{k}", v) for k, v in st.items() if torch.is_tensor(v)]
        flags = [  # one device sync for all of them; AdamW keeps its step counts on the CPU
            torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all().logical_not().to(self.device)
            for _, t in tensors
        ]
        local = [n for (n, _), bad in zip(tensors, torch.stack(flags).tolist(), strict=True) if bad]
        any_bad = torch.tensor(float(bool(local)), device=self.device)
        dist.all_reduce(any_bad, op=dist.ReduceOp.MAX)
        if not any_bad.item():
            return []
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, local)
        return sorted({n for names_ in every for n in names_})

    def _reduce_stats(self, sums, maxes, mins, loss_tokens: int) -> dict[str, float]:
        """All-reduce the step's statistics once per table: sums by SUM (then per loss token),
        maxima by MAX, minima by MIN.

        The loss names its statistics; the ranks first agree on the names (a rank that ran only
        dummy micro-batches has none of its own) and join each reduction with neutral values.
        """
        local = [sorted(sums), sorted(maxes), sorted(mins)]
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, local)
        out: dict[str, float] = {}
        for i, (table, op, fill) in enumerate(
            (
                (sums, dist.ReduceOp.SUM, 0.0),
                (maxes, dist.ReduceOp.MAX, -math.inf),
                (mins, dist.ReduceOp.MIN, math.inf),
            )
        ):
            keys = sorted({k for rank_keys in every for k in rank_keys[i]})
            if not keys:
                continue
            vals = [
                table[k].double().reshape(()).to(self.device)
                if k in table
                else torch.tensor(fill, dtype=torch.float64, device=self.device)
                for k in keys
            ]
            vec = torch.stack(vals)
            dist.all_reduce(vec, op=op)
            scale = 1.0 / max(1, loss_tokens) if op == dist.ReduceOp.SUM else 1.0
            out.update({k: float(v) * scale for k, v in zip(keys, vec.tolist(), strict=True)})
        return out

    def _staleness(self, trajs: list) -> dict[str, float]:
        gen = [np.asarray(t.versions)[np.asarray(t.loss_mask) != 0] for t in trajs]  # per token: vectorised
        lags = self.version - np.concatenate(gen or [np.empty(0)]).astype(np.float64)
        if not lags.size:
            return {"staleness_mean": 0.0, "staleness_max": 0.0}
        return {"staleness_mean": float(lags.mean()), "staleness_max": float(lags.max())}

    # ---- weights -----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights as the servers get them: full fp32 tensors on rank 0 (CPU), ``{}`` elsewhere;
        under LoRA merged, under the base model's names (nodes/trainer/lora.py); collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from nodes.trainer.lora import merge_state_dict

        sd = cast(  # a model's state (no optimizer's): tensors only
            dict[str, torch.Tensor],
            get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            ),
        )
        return merge_state_dict(self.model, sd) if sd else sd

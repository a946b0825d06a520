"""The ``hf`` backend: a transformers causal LM with batched decode and real prefix-KV reuse.

KV lives in one of two places. A sequence that has just been prefilled owns its KV (per layer
``(k, v)`` of shape ``[heads, tokens, head_dim]``). Running sequences are decoded together from
one left-padded batch cache (a ``DynamicCache`` of ``[batch, heads, max_len, head_dim]`` plus an
attention mask and per-row positions), rebuilt only when the batch's membership changes. On
release a row's KV is cut out and handed to the radix cache; a later request that extends that
prefix starts from it and prefills only the rest.

Sampling: SGLang's penalties and ``logit_bias`` (:meth:`HFBackend._adjust`), then temperature,
top_k, top_p, min_p. The reported log-probability is
``log_softmax(logits / T)`` of the sampled token (``T = 1`` when greedy), SGLang's default since
its PR #2664, so a trainer recomputing log-probs at the same temperature gets the same numbers.

A folder whose config.json names a ``*ForSequenceClassification`` architecture (a reward model)
is loaded as that classifier instead: it generates nothing and scores prompts for ``/classify``
(:meth:`HFBackend.classify`), as SGLang serves such a checkpoint.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import structlog
import torch

from nodes.inference import weight_sync
from nodes.inference.backends.base import InputLogprobs, Sample, Seq, adjusts_logits
from nodes.inference.backends.lora import LoraHooks

log = structlog.get_logger(__name__)

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (k, v): [heads, tokens, head_dim]


class HFKVOps:
    """Radix-cache ops for per-layer ``(k, v)`` tuples, cut along the token axis."""

    def slice(self, kv: KV, start: int, end: int) -> KV:
        """Tokens ``[start, end)``, copied so the slice does not pin a larger tensor."""
        return tuple((k[:, start:end].clone(), v[:, start:end].clone()) for k, v in kv)

    def concat(self, parts: list[KV]) -> KV:
        """Join parts in token order."""
        if len(parts) == 1:
            return parts[0]
        return tuple(
            (torch.cat([p[i][0] for p in parts], dim=1), torch.cat([p[i][1] for p in parts], dim=1))
            for i in range(len(parts[0]))
        )


@dataclass
class _Slot:
    length: int  # tokens with KV (== len(seq.ids) - 1 between steps)
    kv: KV | None  # own KV while not in the batch cache


def classifier_architecture(model_path: str) -> str | None:
    """The ``*ForSequenceClassification`` architecture the folder's config.json names, if any
    (SGLang tells a reward model from a generator by the same field)."""
    try:
        archs = json.loads((Path(model_path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None  # no readable config here: transformers says what is wrong as it loads
    return next((a for a in archs if str(a).endswith("ForSequenceClassification")), None)


def _pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _pick_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
        "float": torch.float32,
    }[dtype]


class HFBackend:
    """See the module docstring."""

    kv_ops = HFKVOps()

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        num_threads: int = 0,
        enable_lora: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self._device = _pick_device(device)
        self.dtype = _pick_dtype(dtype, self._device)
        # a sequence classifier (a reward model) scores on /classify and never generates, as in SGLang
        self.architecture = classifier_architecture(model_path)
        self.is_generation = self.architecture is None
        auto = AutoModelForCausalLM if self.is_generation else AutoModelForSequenceClassification
        self.model = auto.from_pretrained(model_path, dtype=self.dtype).to(self._device)
        self.model.eval()
        if not self.is_generation and not isinstance(getattr(self.model, "score", None), torch.nn.Module):
            raise ValueError(
                f"{model_path}: {self.architecture} has no `score` head; the hf backend serves decoder "
                "classifiers (Llama, Qwen2, Qwen3, Mistral, Gemma2 ...ForSequenceClassification), which score "
                "the last token as SGLang does"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
        self.vocab_size = int(self.model.config.vocab_size)
        eos: set[int] = set()
        gen_eos = getattr(
            getattr(self.model, "generation_config", None), "eos_token_id", None
        )  # none: a classifier
        for e in gen_eos if isinstance(gen_eos, list) else [gen_eos, self.tokenizer.eos_token_id]:
            if e is not None:
                eos.add(int(e))
        self.eos_token_ids = eos
        self.weights_id = model_path
        self._rows: list[Seq] = []  # sequences in the batch cache, in row order
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._pads: list[int] = []
        self._params: dict[str, torch.Tensor] | None = None
        self._packed: weight_sync.PackedParams | None = None
        if self._device == "cpu":  # flattened weight buckets land straight in the live model
            try:
                self._packed = weight_sync.PackedParams(self.model)
            except ValueError as e:
                log.info("hf_params_not_packed", reason=str(e))
        # LoRA: adapters applied per batch row by forward hooks (backends/lora.py)
        self.lora = LoraHooks(self.model) if enable_lora else None
        log.info("hf_backend_ready", model=model_path, device=self._device, dtype=str(self.dtype))

    @property
    def device(self) -> str:
        """Where the model (and received tensors) live."""
        return self._device

    # ---- forward passes (run in a worker thread) ---------------------------------------

    async def prefill(self, seqs: list[Seq]) -> list[Sample]:
        """Prefill each new sequence on top of its cached prefix."""
        return await asyncio.to_thread(self._prefill, seqs)

    async def decode(self, seqs: list[Seq]) -> list[Sample]:
        """One batched decode step."""
        return await asyncio.to_thread(self._decode, seqs)

    @torch.inference_mode()
    def _prefill(self, seqs: list[Seq]) -> list[Sample]:
        from transformers import DynamicCache

        logits = []
        for seq in seqs:
            ids = seq.ids
            c = seq.cached_len
            if c:
                cache = DynamicCache(
                    ddp_cache_data=[(k.unsqueeze(0), v.unsqueeze(0)) for k, v in seq.cached_kv]
                )
            else:
                cache = DynamicCache()
            inp = torch.tensor([ids[c:]], device=self._device)
            self._lora_rows([seq])
            start = seq.logprob_start if seq.wants_input else None
            # the prompt's log-probs need the logits of positions start .. (the scheduler kept
            # the cached prefix within start); else only the last position's, to sample
            keep = 1 if start is None else min(len(ids) - c, len(ids) - start)
            out = self.model(
                input_ids=inp,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self._device),
                position_ids=torch.arange(c, len(ids), device=self._device).unsqueeze(0),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=keep,
            )
            layers = out.past_key_values.layers
            seq.slot = _Slot(length=len(ids), kv=tuple((ly.keys[0], ly.values[0]) for ly in layers))
            logits.append(out.logits[0, -1])
            if start is not None:
                seq.input_logprobs = self._input_logprobs(seq, out.logits[0, :-1], ids[len(ids) - keep + 1 :])
        return self._sample(seqs, torch.stack(logits))

    @torch.inference_mode()
    def _decode(self, seqs: list[Seq]) -> list[Sample]:
        if len(seqs) != len(self._rows) or any(a is not b for a, b in zip(seqs, self._rows, strict=False)):
            self._rebuild(seqs)
        assert self._mask is not None
        b = len(seqs)
        mask = torch.cat([self._mask, torch.ones(b, 1, dtype=torch.long, device=self._device)], dim=1)
        self._lora_rows(seqs)
        out = self.model(
            input_ids=torch.tensor([[s.ids[-1]] for s in seqs], device=self._device),
            attention_mask=mask,
            position_ids=torch.tensor([[s.slot.length] for s in seqs], device=self._device),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache, self._mask = out.past_key_values, mask
        for s in seqs:
            s.slot.length += 1
        return self._sample(seqs, out.logits[:, -1])

    def _lora_rows(self, seqs: list[Seq]) -> None:
        if self.lora is not None:
            self.lora.rows = [s.lora for s in seqs]

    def _rebuild(self, seqs: list[Seq]) -> None:
        """Lay the batch's KV out again, left-padded, when membership changed."""
        from transformers import DynamicCache

        for row, s in enumerate(self._rows):
            if s.slot is not None and s.slot.kv is None:
                s.slot.kv = self._row_kv(row, s.slot.length)
        lengths = [s.slot.length for s in seqs]
        width = max(lengths)
        layers = []
        for li in range(len(seqs[0].slot.kv)):
            ks, vs = [], []
            for s, n in zip(seqs, lengths, strict=True):
                k, v = s.slot.kv[li]
                pad = width - n
                if pad:
                    k = torch.nn.functional.pad(k, (0, 0, pad, 0))
                    v = torch.nn.functional.pad(v, (0, 0, pad, 0))
                ks.append(k)
                vs.append(v)
            layers.append((torch.stack(ks), torch.stack(vs)))
        self._cache = DynamicCache(ddp_cache_data=layers)
        self._pads = [width - n for n in lengths]
        mask = torch.ones(len(seqs), width, dtype=torch.long, device=self._device)
        for row, pad in enumerate(self._pads):
            mask[row, :pad] = 0
        self._mask = mask
        self._rows = list(seqs)
        for s in seqs:
            s.slot.kv = None

    def _row_kv(self, row: int, length: int) -> KV:
        """A row's KV cut out of the batch cache (the last ``length`` columns), copied."""
        return tuple(
            (ly.keys[row, :, -length:].clone(), ly.values[row, :, -length:].clone())
            for ly in self._cache.layers
        )

    def release(self, seq: Seq) -> KV | None:
        """Return the sequence's KV (for ``seq.ids[:-1]``) and forget it."""
        slot: _Slot | None = seq.slot
        seq.slot = None
        if slot is None:
            return None
        if slot.kv is not None:
            return slot.kv
        row = next(i for i, s in enumerate(self._rows) if s is seq)
        kv = self._row_kv(row, slot.length)
        self._rows[row] = _Released()  # type: ignore[call-overload]
        return kv

    # ---- a sequence classifier's scores (/classify) -----------------------------------

    async def classify(self, prompts: list[list[int]]) -> list[list[float]]:
        """A classifier's outputs (``num_labels`` numbers) for each prompt, in one forward pass."""
        return await asyncio.to_thread(self._classify, prompts)

    @torch.inference_mode()
    def _classify(self, prompts: list[list[int]]) -> list[list[float]]:
        # SGLang pools the last token of each prompt (Pooler LAST) whatever it is; transformers'
        # own pooling would skip trailing pad tokens, so the head is applied here to the hidden
        # state at each prompt's last position (right-padded: causal attention keeps pads unseen)
        lengths = torch.tensor([len(p) for p in prompts], device=self._device)
        ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=self._device)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = torch.tensor(p, device=self._device)
        mask = (torch.arange(ids.shape[1], device=self._device) < lengths.unsqueeze(1)).long()
        base = getattr(self.model, self.model.base_model_prefix)
        hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(prompts), device=self._device), lengths - 1]
        scores = self.model.score(last).float()
        return cast(list[list[float]], scores.tolist())

    # ---- sampling ----------------------------------------------------------------------

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> list[Sample]:
        logits = logits.float()
        out = []
        for row, seq in enumerate(seqs):
            p = seq.params
            x = logits[row]
            if adjusts_logits(seq):
                x = self._adjust(seq, x.clone())
            if p.greedy:
                logp = torch.log_softmax(x, dim=-1)
                token = int(torch.argmax(x))
            else:
                logp = torch.log_softmax(x / p.temperature, dim=-1)
                probs = _filter(logp.exp(), p.top_k, p.top_p, p.min_p)
                gen = torch.Generator(device=probs.device).manual_seed(
                    (seq.seed * 1000003 + len(seq.output_ids)) % (1 << 63)
                )
                token = int(torch.multinomial(probs, 1, generator=gen))
            sample = Sample(token=token, logprob=float(logp[token]))
            if seq.wants_extras:
                top, ids = _extras(seq, logp.unsqueeze(0))
                sample.top = top[0] if top is not None else None
                sample.ids = ids[0] if ids is not None else None
            out.append(sample)
        return out

    def _adjust(self, seq: Seq, x: torch.Tensor) -> torch.Tensor:
        """SGLang's changes to a row of logits before sampling, in its order: the output penalties
        (see :func:`~nodes.inference.backends.base.penalize`), stop tokens barred while fewer
        than ``min_new_tokens`` are out, then ``logit_bias`` added. The reported log-probs
        (sampled, top, token ids) come from the changed logits, as SGLang's do."""
        p, out = seq.params, seq.output_ids
        if out and (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0):
            counts = torch.bincount(torch.tensor(out, device=x.device), minlength=x.numel())[: x.numel()]
            seen = counts > 0
            x -= p.frequency_penalty * counts.to(x.dtype) + p.presence_penalty * seen.to(x.dtype)
            if p.repetition_penalty != 1.0:
                r = p.repetition_penalty
                x = torch.where(seen, torch.where(x < 0, x * r, x / r), x)
        if len(out) < p.min_new_tokens:
            stops = [t for t in self.eos_token_ids | set(p.stop_token_ids or ()) if 0 <= t < x.numel()]
            x[stops] = float("-inf")
        if p.logit_bias:
            bias = {int(k): v for k, v in p.logit_bias.items()}  # "1" and "01" are one token (the last wins)
            ids = torch.tensor(list(bias), dtype=torch.long, device=x.device)
            x[ids] += torch.tensor(list(bias.values()), dtype=x.dtype, device=x.device)
        return x

    @staticmethod
    def _input_logprobs(seq: Seq, logits: torch.Tensor, targets: list[int]) -> InputLogprobs:
        """The prompt's log-probs: row ``i`` of ``logits`` predicts ``targets[i]``, at the
        sampling temperature (1 when greedy), as the output's are."""
        t = 1.0 if seq.params.greedy else seq.params.temperature
        logp = torch.log_softmax(logits.float() / t, dim=-1)
        lps = logp.gather(1, torch.tensor(targets, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
        top, ids = _extras(seq, logp)
        return InputLogprobs(lps=lps, top=top, ids=ids)

    # ---- text and weights --------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """Tokenizer ids without special tokens."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Tokenizer decode."""
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))  # one sequence

    async def load_from_disk(self, path: str) -> tuple[bool, str]:
        """Load a safetensors folder into the live model; on any error the model is unchanged."""
        try:
            state = await asyncio.to_thread(weight_sync.read_safetensors_folder, path)
            await asyncio.to_thread(weight_sync.load_into_model, self.model, state, True)
        except Exception as e:  # the server answers as SGLang does: success false and the reason
            return False, f"Failed to update weights: {e}. Rolling back to the original weights."
        self.weights_id = path
        return True, "Succeeded to update model weights."

    def named_tensor(self, name: str) -> torch.Tensor | None:
        """A parameter by name."""
        return dict(self.model.named_parameters()).get(name)

    def receive_target(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The live parameter to broadcast into directly, when name, dtype and shape all match."""
        if self._params is None:
            self._params = dict(self.model.named_parameters(remove_duplicate=False))
        p = self._params.get(name)
        if p is None or p.dtype != dtype or tuple(p.shape) != shape or not p.is_contiguous():
            return None
        self.weights_id = f"{self.weights_id.split('+')[0]}+distributed"
        return p.data

    def bucket_target(
        self, names: list[str], dtype: torch.dtype, shapes: list[list[int]]
    ) -> torch.Tensor | None:
        """The live memory a flattened bucket of these parameters can be broadcast into, if any."""
        live = self._packed.bucket(names, dtype, shapes) if self._packed is not None else None
        if live is not None:
            self.weights_id = f"{self.weights_id.split('+')[0]}+distributed"
        return live

    def apply_tensors(self, named: list[tuple[str, Any]]) -> None:
        """Copy received tensors into the parameters they name."""
        weight_sync.load_into_model(self.model, named, strict=False)
        self.weights_id = f"{self.weights_id.split('+')[0]}+distributed"


class _Released:
    """Placeholder for a batch row whose sequence has left (forces a rebuild next step)."""

    slot = None


def _extras(
    seq: Seq, logp: torch.Tensor
) -> tuple[list[list[tuple[float, int]]] | None, list[list[float]] | None]:
    """Per row of ``logp`` ([positions, vocab]): its ``seq.top_logprobs`` likeliest tokens and the
    log-probs of ``seq.token_ids_logprob``, as the sequence asked."""
    top = ids = None
    if seq.top_logprobs > 0:
        vals, idx = torch.topk(logp, min(seq.top_logprobs, logp.shape[-1]), dim=-1)
        top = [list(zip(v, i, strict=True)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True)]
    if seq.token_ids_logprob is not None:
        ids = logp[:, torch.tensor(seq.token_ids_logprob, dtype=torch.long, device=logp.device)].tolist()
    return top, ids


def _filter(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Apply top-k, top-p and min-p to a probability vector (renormalisation is left to multinomial)."""
    if top_k > 0 and top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) > top_p * cum[-1]
        sorted_p = torch.where(drop, torch.zeros_like(sorted_p), sorted_p)
        probs = torch.zeros_like(probs).scatter(0, idx, sorted_p)
    if min_p > 0.0:
        probs = torch.where(probs < min_p * probs.max(), torch.zeros_like(probs), probs)
    return probs

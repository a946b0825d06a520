"""The ``sim`` backend: no model, deterministic tokens and a latency model.

Tokens are a hash of (all ids so far, position, weights id[, per-request seed when sampling
with temperature > 0]), so a greedy request resumed from its partial output continues exactly
as it would have, and a weight update changes outputs. The weights id is a fingerprint of the
checkpoint on disk (or of the tensors received over a weight-update group), so loading the same
weights back restores the same outputs, as with a real model. Latency: ``prefill_s_per_token``
per uncached prompt token, ``decode_s_base + decode_s_per_seq * batch`` per decode step, both
spent in ``asyncio.sleep`` so hundreds of requests cost almost nothing.

SGLang's penalties, ``logit_bias`` and ``min_new_tokens`` move tokens within the sim's order of
tokens at a position (:meth:`SimBackend._sample_adjusted`): a penalised token drops, a biased one
rises, greedy picks the best, and the reported log-probs are the moved values.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from nodes.inference.backends.base import InputLogprobs, Sample, Seq, adjusts_logits, penalize
from nodes.inference.radix import NoKV
from nodes.inference.settings import SimSettings

log = structlog.get_logger(__name__)

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread, process-independent hash step."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _roll(h: int, token: int) -> int:
    return _mix(h ^ (token & _MASK))


def fingerprint_folder(path: Path) -> str:
    """A content fingerprint of a checkpoint folder: names, sizes and sampled bytes of its weights."""
    digest = hashlib.sha256()
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for off in (0, size // 3, (2 * size) // 3, max(0, size - 65536)):
                fh.seek(off)
                digest.update(fh.read(65536))
    return digest.hexdigest()[:16]


def _fingerprint_if_checkpoint(folder: Path) -> str | None:
    if not folder.is_dir() or not (any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))):
        return None
    return fingerprint_folder(folder)


class SimBackend:
    """A stand-in model: see the module docstring."""

    kv_ops = NoKV()

    def __init__(self, model_path: str | None, config: SimSettings | None = None) -> None:
        self.config = config or SimSettings()
        self._tokenizer: Any = None
        self.vocab_size = self.config.vocab_size
        self.eos_token_ids = {self.config.eos_token_id}
        self.weights_id = "0"
        self._tensors: dict[str, Any] = {}
        folder = Path(model_path) if model_path else None
        if folder is not None and folder.is_dir():
            if (folder / "tokenizer.json").exists():
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(str(folder))
                self.vocab_size = len(self._tokenizer)
                if self._tokenizer.eos_token_id is not None:
                    self.eos_token_ids = {int(self._tokenizer.eos_token_id)}
            self.weights_id = fingerprint_folder(folder)

    @property
    def device(self) -> str:
        """Received tensors stay on the CPU."""
        return "cpu"

    def _seed(self) -> int:
        return int(zlib.crc32(self.weights_id.encode()))

    def _dist(self, prefix_hash: int, length: int) -> int:
        """The hash that stands for the model's distribution after ``length`` tokens hashing to ``prefix_hash``."""
        return _mix(prefix_hash ^ (length * 0x100000001B3) ^ self._seed())

    def _pick(self, h: int) -> tuple[int, float]:
        """The token a hash picks, and the log-prob reported for it."""
        eos = min(self.eos_token_ids)
        if self.config.eos_prob > 0 and (h & 0xFFFF) / 65536.0 < self.config.eos_prob:
            token = eos
        else:
            token = 3 + (h >> 16) % max(1, self.vocab_size - 3)
            if token in self.eos_token_ids:
                token += 1
        return token, -((h >> 40) % 4000) / 1000.0

    # The sim's "distribution" at a position, for top / token-id / prompt log-probs: the greedy
    # token first with its log-prob, then every other token in a fixed order, each 4 / vocab
    # lower. So the greedy token is the top one, with the log-prob a greedy sample reports; a
    # sampled (temperature > 0) token's reported log-prob does not come from this order.

    def _rank(self, g: int, t: int) -> int:
        """Token ``t``'s place in the order that starts with ``g``."""
        span = max(1, self.vocab_size - 3)
        if t == g:
            return 0
        if not 3 <= t < self.vocab_size:
            return self.vocab_size
        return (t - g) % span if 3 <= g < self.vocab_size else 1 + t - 3

    def _ranked(self, g: int, r: int) -> int:
        """The token at place ``r`` >= 1 of the order that starts with ``g``."""
        span = max(1, self.vocab_size - 3)
        return 3 + ((g - 3 + r) % span if 3 <= g < self.vocab_size else (r - 1) % span)

    def _extras(
        self, seq: Seq, g: int, lp: float
    ) -> tuple[list[tuple[float, int]] | None, list[float] | None]:
        """The top list and token-id log-probs of the order led by ``g`` (log-prob ``lp``)."""
        step = 4.0 / self.vocab_size
        top = None
        if seq.top_logprobs > 0:
            k = min(seq.top_logprobs, self.vocab_size)
            top = [(lp, g)] + [(lp - step * r, self._ranked(g, r)) for r in range(1, k)]
        ids = None
        if seq.token_ids_logprob is not None:
            ids = [lp - step * self._rank(g, t) for t in seq.token_ids_logprob]
        return top, ids

    def _adjusted(self, seq: Seq, g: int, lp: float) -> dict[int, float]:
        """The tokens whose value SGLang's logit changes move, with their new values: output
        penalties (:func:`~nodes.inference.backends.base.penalize`), stop tokens barred before
        ``min_new_tokens``, then ``logit_bias``. Every other token keeps its place in the order."""
        p, out, step = seq.params, seq.output_ids, 4.0 / self.vocab_size
        adj: dict[int, float] = {}
        if out and (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0):
            for t, count in collections.Counter(out).items():
                adj[t] = penalize(p, lp - step * self._rank(g, t), count)
        if len(out) < p.min_new_tokens:
            for t in self.eos_token_ids | set(p.stop_token_ids or ()):
                if 0 <= t < self.vocab_size:
                    adj[t] = -math.inf
        for key, bias in (p.logit_bias or {}).items():
            t = int(key)
            adj[t] = adj.get(t, lp - step * self._rank(g, t)) + bias
        return adj

    def _sample_adjusted(self, seq: Seq, h: int) -> Sample:
        """A sample from the order led by the unadjusted greedy token, with :meth:`_adjusted`'s
        values in place of the moved tokens': greedy takes the best; with temperature, the drawn
        token competes with the moved ones and the best unmoved one (Gumbel-max on the hash).
        Log-probs are the values."""
        g, lp = self._pick(h)
        step = 4.0 / self.vocab_size
        adj = self._adjusted(seq, g, lp)

        def value(t: int) -> float:
            return adj[t] if t in adj else lp - step * self._rank(g, t)

        def order() -> Iterator[int]:  # the unmoved tokens, best first
            r = 0
            while True:
                t = g if r == 0 else self._ranked(g, r)
                if t not in adj:
                    yield t
                r += 1

        p = seq.params
        if p.greedy:
            token = max([next(order()), *adj], key=lambda t: (value(t), -t))
        else:
            n_out = len(seq.output_ids)
            drawn, _ = self._pick(_mix(h ^ seq.seed ^ (n_out << 32)))

            def score(t: int) -> float:
                u = (_mix(h ^ seq.seed ^ t) >> 11) / float(1 << 53)
                return value(t) / p.temperature - math.log(-math.log(max(u, 1e-300)))

            token = max({drawn, next(order()), *adj}, key=score)  # the best unmoved one too: never all barred
        sample = Sample(token=token, logprob=value(token))
        if seq.top_logprobs > 0:
            k = min(seq.top_logprobs, self.vocab_size)
            free = [(value(t), t) for t in itertools.islice(order(), k)]
            sample.top = sorted([*free, *((v, t) for t, v in adj.items())], key=lambda e: -e[0])[:k]
        if seq.token_ids_logprob is not None:
            sample.ids = [value(t) for t in seq.token_ids_logprob]
        return sample

    def _sample(self, seq: Seq) -> Sample:
        n_out = len(seq.output_ids)
        h = self._dist(seq.slot, len(seq.input_ids) + n_out)  # (seq.ids would copy both lists)
        if adjusts_logits(seq):
            return self._sample_adjusted(seq, h)
        token, logprob = self._pick(h if seq.params.greedy else _mix(h ^ seq.seed ^ (n_out << 32)))
        sample = Sample(token=token, logprob=logprob)
        if seq.wants_extras:
            g, lp = (token, logprob) if seq.params.greedy else self._pick(h)
            sample.top, sample.ids = self._extras(seq, g, lp)
        return sample

    def _input_logprobs(self, seq: Seq, prefix_hashes: list[int]) -> InputLogprobs:
        """Prompt positions ``logprob_start + 1 ..``; ``prefix_hashes[p]`` hashes ``ids[:p]``."""
        ids = seq.input_ids
        step = 4.0 / self.vocab_size
        out = InputLogprobs(
            lps=[],
            top=[] if seq.top_logprobs > 0 else None,
            ids=[] if seq.token_ids_logprob is not None else None,
        )
        assert seq.logprob_start is not None
        for p in range(seq.logprob_start + 1, len(ids)):
            h = self._dist(prefix_hashes[p], p)
            g, lp = self._pick(h)
            out.lps.append(lp - step * self._rank(g, ids[p]))
            if seq.wants_extras:
                top, lps = self._extras(seq, g, lp)
                if out.top is not None and top is not None:
                    out.top.append(top)
                if out.ids is not None and lps is not None:
                    out.ids.append(lps)
        return out

    async def prefill(self, seqs: list[Seq]) -> list[Sample]:
        """Hash the prompt (the "KV") and sample; sleeps for the uncached tokens."""
        out = []
        new_tokens = 0
        for seq in seqs:
            h = 0
            hashes: list[int] | None = [] if seq.wants_input else None
            for t in seq.ids:
                if hashes is not None:
                    hashes.append(h)
                h = _roll(h, t)
            seq.slot = h
            if hashes is not None:
                seq.input_logprobs = self._input_logprobs(seq, hashes)
            new_tokens += len(seq.ids) - seq.cached_len
            sample = self._sample(seq)
            seq.slot = _roll(seq.slot, sample.token)
            out.append(sample)
        await self._sleep(self.config.prefill_s_per_token * new_tokens)
        return out

    async def decode(self, seqs: list[Seq]) -> list[Sample]:
        """One decode step for the whole batch."""
        out = []
        for seq in seqs:
            sample = self._sample(seq)
            seq.slot = _roll(seq.slot, sample.token)
            out.append(sample)
        await self._sleep(self.config.decode_s_base + self.config.decode_s_per_seq * len(seqs))
        return out

    @staticmethod
    async def _sleep(seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds)

    def release(self, seq: Seq) -> Any:
        """Nothing to hand back: the sim's KV is the prefix itself."""
        seq.slot = None
        return None

    def tokenize(self, text: str) -> list[int]:
        """The checkpoint's tokenizer when there is one, else UTF-8 bytes shifted past special ids."""
        if self._tokenizer is not None:
            return list(self._tokenizer.encode(text, add_special_tokens=False))
        return [b + 3 for b in text.encode()]

    def detokenize(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Inverse of :meth:`tokenize` (ids outside the byte range render as nothing)."""
        if self._tokenizer is not None:
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")

    async def load_from_disk(self, path: str) -> tuple[bool, str]:
        """Adopt the fingerprint of the folder's weights; a missing folder fails."""
        weights_id = await asyncio.to_thread(_fingerprint_if_checkpoint, Path(path))
        if weights_id is None:
            return False, f"Failed to load weights from {path}: no safetensors checkpoint there."
        self.weights_id = weights_id
        self._tensors.clear()
        return True, "Succeeded to update model weights."

    def named_tensor(self, name: str) -> Any:
        """Tensors received over a weight-update group (the sim keeps no others)."""
        return self._tensors.get(name)

    def apply_tensors(self, named: list[tuple[str, Any]]) -> None:
        """Keep the tensors and fold their bytes into the weights id."""
        digest = hashlib.sha256(self.weights_id.encode())
        for name, tensor in named:
            self._tensors[name] = tensor.detach().to("cpu").clone()
            digest.update(name.encode())
            digest.update(_tensor_bytes(self._tensors[name]))
        self.weights_id = digest.hexdigest()[:16]


def _tensor_bytes(t: Any) -> bytes:
    """Raw bytes of a CPU tensor (through uint8 view, valid for every dtype incl. bf16)."""
    import torch

    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()

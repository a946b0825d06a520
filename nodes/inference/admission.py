"""What a ``/generate`` (or ``/classify``) body asks of this server, checked against it: the sequences it expands to
(prompts x ``n``, each with its rid and seed) within the server's limits (``--max-n``,
``--max-batch-size``, ``--max-logprob-entries``), its context length and vocabulary, and the
features the server was launched with. The body itself is parsed and checked by
:class:`protocols.http.sglang.GenerateRequest`; what needs this server's state is checked here, in
SGLang's words where SGLang checks it. Every refusal is a :class:`ProtocolError` (HTTP 400).
"""

from __future__ import annotations

import re
import uuid
from typing import Any, cast

from nodes.inference.backends.base import Seq
from nodes.inference.engine import Engine
from nodes.inference.settings import ServerArgs
from protocols.http.sglang import ClassifyRequest, GenerateRequest, ProtocolError, SamplingParams

__all__ = ["ask_logprobs", "build_seqs", "classify_prompts", "per_prompt", "refuse_unlaunched_features"]


def per_prompt(value: Any, count: int, name: str, default: Any) -> list[Any]:
    """A batch field: a list must have one entry per prompt; a single value applies to all."""
    if not isinstance(value, list):
        return [default if value is None else value] * count
    if len(value) != count:
        raise ProtocolError(f"{name}: {len(value)} entries for {count} prompts; give one per prompt")
    return value


def _check_vocab(ids: list[int], vocab: int, where: str) -> None:
    """400 naming the first token id outside ``[0, vocab)``."""
    if min(ids) < 0 or max(ids) >= vocab:  # in C; the scan below only names the first bad id
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise ProtocolError(f"{where}: token id {bad} is outside the vocabulary [0, {vocab})")


async def build_seqs(engine: Engine, req: GenerateRequest) -> list[tuple[int, Seq]]:
    """Expand a (possibly batched, possibly n > 1) request into sequences, within the limits;
    each with the index of its prompt."""
    count, args = req.prompt_count, engine.args
    sps = per_prompt(req.sampling_params, count, "sampling_params", SamplingParams())
    rids = per_prompt(req.rid, count, "rid", None)
    for i, sp in enumerate(sps):
        if sp.n > args.max_n:
            where = f"sampling_params[{i}]" if isinstance(req.sampling_params, list) else "sampling_params"
            raise ProtocolError(f"{where}.n: {sp.n} is over this server's limit of {args.max_n} (--max-n)")
        _check_sampling(sp, engine.backend.vocab_size)
    total = sum(sp.n for sp in sps)
    if total > args.max_batch_size:
        raise ProtocolError(
            f"the request expands to {total} sequences (prompts x n), over this server's limit of "
            f"{args.max_batch_size} (--max-batch-size); split it into smaller requests"
        )
    if req.text is not None:
        texts = [engine.fit_text(t) for t in (req.text if isinstance(req.text, list) else [req.text])]
        prompts = await engine.tokenize(texts)
    else:
        # no text: input_ids is given (GenerateRequest checks one of them is), a batch or one prompt
        prompts = cast(list[list[int]], req.input_ids if req.is_batch else [req.input_ids])
    seqs = []
    for i, (ids, sp, rid) in enumerate(zip(prompts, sps, rids, strict=True)):
        field = "text" if req.text is not None else "input_ids"
        where = f"{field}[{i}]" if req.is_batch else field
        if not ids:
            raise ProtocolError(f"{where}: the prompt is empty")
        sp = sp.model_copy()  # check_length may cut max_new_tokens of this prompt only
        ids = list(ids)
        engine.check_length(ids, sp)
        _check_vocab(ids, engine.backend.vocab_size, where)
        for j in range(sp.n):
            if rid is None:
                this_rid = uuid.uuid4().hex
            elif sp.n > 1 or (req.is_batch and not isinstance(req.rid, list)):
                this_rid = f"{rid}_{i}_{j}" if req.is_batch else f"{rid}_{j}"
            else:
                this_rid = str(rid)
            seed = sp.sampling_seed if sp.sampling_seed is not None else engine.rng.getrandbits(63)
            seqs.append((i, Seq(rid=this_rid, input_ids=list(ids), params=sp, seed=seed + j)))
    return seqs


async def classify_prompts(engine: Engine, req: ClassifyRequest) -> tuple[list[list[int]], list[str]]:
    """A ``/classify`` body's prompts (token ids) and their rids, within the server's limits
    (``--max-batch-size``, the context length, the vocabulary)."""
    if req.text is not None:
        texts = req.text if isinstance(req.text, list) else [req.text]
        count = len(texts)
    else:
        count = len(req.input_ids) if req.is_batch else 1  # type: ignore[arg-type]
    if count == 0:
        raise ProtocolError(f"{'text' if req.text is not None else 'input_ids'}: the batch is empty")
    if count > engine.args.max_batch_size:
        raise ProtocolError(
            f"the request has {count} prompts, over this server's limit of {engine.args.max_batch_size} "
            "(--max-batch-size); split it into smaller requests"
        )
    if req.is_batch and isinstance(req.rid, str):  # SGLang asserts the same
        raise ProtocolError("rid: The rid should be a list (one per prompt of the batch).")
    rids = [r or uuid.uuid4().hex for r in per_prompt(req.rid, count, "rid", None)]
    if len(set(rids)) != len(rids):
        raise ProtocolError(f"Duplicate request IDs detected within the request: {sorted(rids)}")
    if req.text is not None:
        prompts = await engine.tokenize([engine.fit_text(t) for t in texts])
    else:
        prompts = [list(p) for p in cast(list[list[int]], req.input_ids if req.is_batch else [req.input_ids])]
    field = "text" if req.text is not None else "input_ids"
    for i, ids in enumerate(prompts):
        where = f"{field}[{i}]" if req.is_batch else field
        if not ids:
            raise ProtocolError(f"{where}: the prompt is empty")
        engine.check_length(ids, SamplingParams(max_new_tokens=0))  # cut in place if auto-truncating
        _check_vocab(ids, engine.backend.vocab_size, where)
    return prompts, rids


MAX_STOP_COUNT = 32  # SGLang's limits on stop strings and stop_regex patterns per request
MAX_STOP_REGEX_LEN = 256  # bytes
GRAMMAR_REFUSED = (
    "Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not supported when the "
    "server is launched with --grammar-backend none"
)


def _check_sampling(sp: SamplingParams, vocab: int) -> None:
    """What SGLang 0.5.23 checks once it knows the tokenizer and model, in its words: stop and
    stop_regex counts and sizes, logit_bias keys (token ids as strings), and no grammar (this
    server has no grammar backend: SGLang launched with ``--grammar-backend none`` refuses them
    so; an empty one is none). A stop_regex that does not compile is refused here; SGLang
    answers it with 500."""
    if len(sp.stop_strings) > MAX_STOP_COUNT:
        raise ProtocolError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(sp.stop_strings)}")
    patterns = sp.stop_patterns
    if len(patterns) > MAX_STOP_COUNT:
        raise ProtocolError(f"at most {MAX_STOP_COUNT} stop_regex patterns are allowed, got {len(patterns)}")
    for pattern in patterns:
        size = len(pattern.encode())
        if size > MAX_STOP_REGEX_LEN:
            raise ProtocolError(f"stop_regex is {size} bytes, over the {MAX_STOP_REGEX_LEN}-byte limit")
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as e:
            raise ProtocolError(f"invalid stop_regex {pattern!r}: {e}") from None
    for key in sp.logit_bias or {}:
        try:
            token = int(key)
        except ValueError as e:
            raise ProtocolError(str(e)) from None
        if not 0 <= token < vocab:
            raise ProtocolError(f"logit_bias must has keys in [0, {vocab - 1}], got {key}.")
    if sp.json_schema or sp.regex or sp.ebnf or sp.structural_tag:
        raise ProtocolError(GRAMMAR_REFUSED)


def refuse_unlaunched_features(req: GenerateRequest, lora: bool = False) -> None:
    """Fields that ask for what this server never serves get the 400 SGLang 0.5.23 gives when it
    was launched without the feature (its words): hidden states, a custom logit processor, a LoRA
    adapter (unless ``lora``: launched with --enable-lora), a data-parallel rank other than 0, a
    session. Without this they would be ignored."""

    def asked(value: Any) -> bool:
        return any(value) if isinstance(value, list) else bool(value)

    if asked(req.return_hidden_states):
        raise ProtocolError(
            "The server is not configured to return hidden states. Please set `--return-hidden-states-mode "
            "last`, `--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag."
        )
    if asked(req.custom_logit_processor):
        raise ProtocolError(
            "The server is not configured to enable custom logit processor. "
            "Please set `--enable-custom-logit-processor` to enable this feature."
        )
    if req.lora_path and not lora:  # SGLang tests the field itself: a list of nulls is "requested" too
        paths = req.lora_path
        first = paths if isinstance(paths, str) else next((a for a in paths if a), None)
        raise ProtocolError(
            f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server "
            "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
        )
    rank = req.routed_dp_rank if req.routed_dp_rank is not None else req.data_parallel_rank
    if rank is not None and rank != 0:  # one data-parallel rank
        raise ProtocolError(f"routed_dp_rank={rank} out of range [0, 1)")
    if isinstance(req.session_params, dict) and req.session_params.get("id") is not None:
        raise ProtocolError(f"Invalid request: session id {req.session_params['id']} does not exist")


def ask_logprobs(
    req: GenerateRequest, indexed: list[tuple[int, Seq]], flags: list[bool], args: ServerArgs, vocab: int
) -> None:
    """Hand each sequence of a ``return_logprob`` prompt the extra log-probs it asks for
    (``logprob_start_len``, ``top_logprobs_num``, ``token_ids_logprob``); SGLang ignores them
    without ``return_logprob``. A request whose extras add up past ``--max-logprob-entries`` is
    refused: its answer alone could stall the server and fill memory."""
    count = req.prompt_count
    starts = per_prompt(req.logprob_start_len, count, "logprob_start_len", -1)
    tops = per_prompt(req.top_logprobs_num, count, "top_logprobs_num", 0)
    ids = req.token_ids_logprob
    if ids is None or not ids or isinstance(ids[0], int):  # one list for every prompt
        per_ids: list[Any] = [ids] * count
    elif not req.is_batch:  # SGLang's words for [[...]] with one prompt
        raise ProtocolError("token_ids_logprob must be a flat list of integers.")
    else:
        per_ids = per_prompt(ids, count, "token_ids_logprob", None)
    per_ids = [want or None for want in per_ids]  # an empty list asks for none, as in SGLang
    for want in per_ids:
        if want:
            _check_vocab(want, vocab, "token_ids_logprob")
    entries = 0
    for i, seq in indexed:
        if not flags[i]:
            continue
        n, start = len(seq.input_ids), starts[i]
        if start > n:  # SGLang's words
            raise ProtocolError(
                f"req.logprob_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={n}. Please use a smaller logprob_start_len."
            )
        seq.logprob_start = start if 0 <= start < n else None  # -1 (or the prompt's end): none
        seq.top_logprobs = min(max(0, tops[i]), vocab)
        seq.token_ids_logprob = None if per_ids[i] is None else list(per_ids[i])
        positions = (seq.params.max_new_tokens or 0) + (
            0 if seq.logprob_start is None else n - seq.logprob_start
        )
        entries += positions * (seq.top_logprobs + len(seq.token_ids_logprob or ()))
    if entries > args.max_logprob_entries:
        raise ProtocolError(
            f"the request asks for {entries} log-prob entries (top_logprobs_num and token_ids_logprob "
            f"at each reported position, x n, x prompts), over this server's limit of "
            f"{args.max_logprob_entries} (--max-logprob-entries); ask for fewer top log-probs, "
            "tokens or sequences per request"
        )

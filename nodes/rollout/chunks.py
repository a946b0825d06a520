"""One ``/generate`` answer, read: its tokens and log-probs, the policy version of each token,
and the sampling parameters that resume it after an abort (nodes/rollout/client.py drives the
loop).

An answer's per-token data comes out as numpy arrays, each made in one C-level pass over the lists
the JSON parser built (int32 ids, float64 log-probs as the server sent them, int32 versions), so
nothing between the answer and the codec loops over tokens in Python.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from typing import Any

import numpy as np
import orjson

from protocols.http.sglang import WEIGHT_VERSIONS

__all__ = [
    "GenerationError",
    "StreamedChunk",
    "TokensCallback",
    "parse_chunk",
    "resume_params",
    "token_versions",
    "versions_from_spans",
]

# what a streamed request's new tokens are handed to, as they arrive: (ids, log-probs, top log-probs
# per token as [(logprob, token id), ...]; empty unless asked)
TokensCallback = Callable[[list[int], list[float], list[list[tuple[float, int]]]], None]


class GenerationError(RuntimeError):
    """The server rejected a request (4xx, or an abort that carries an error status)."""


def resume_params(sp: dict[str, Any], budget: int, done: int) -> dict[str, Any]:
    """Sampling params for a resume after ``done`` tokens: both token bounds count what is left."""
    out = {**sp, "max_new_tokens": budget - done}
    if sp.get("min_new_tokens"):
        out["min_new_tokens"] = max(0, int(sp["min_new_tokens"]) - done)
    return out


def parse_chunk(data: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Output ids (int32) and log-probs (float64; 0.0 where the server sent null) as arrays, from an
    SGLang 0.5.x (``output_ids``) or older response, and its ``meta_info``."""
    meta = data.get("meta_info") or {}
    entries = meta.get("output_token_logprobs") or []  # [[logprob, token id, text], ...]
    n = len(entries)
    if "output_ids" in data:
        ids = np.array(data["output_ids"], dtype=np.int32)
    else:
        ids = np.fromiter(map(itemgetter(1), entries), np.int32, n)
    if len(ids) != n:
        raise GenerationError(
            f"response has {len(ids)} output ids but {n} logprobs; was return_logprob honoured?"
        )
    lps = np.fromiter(map(itemgetter(0), entries), np.float64, n)  # a null reads as NaN: JSON has none
    if np.isnan(lps).any():
        lps[np.isnan(lps)] = 0.0
    return ids, lps, meta


class StreamedChunk:
    """A streamed ``/generate`` answer (``"stream": true``), read event by event into what the
    non-streamed answer would have been (:meth:`result`), each event's new tokens handed to
    ``on_tokens`` as they arrive.

    SGLang sends the whole output so far in every event, or with ``--incremental-streaming-output``
    only what is new; ``meta_info.completion_tokens`` (the tokens so far, in both) says which, so
    either server setting reads the same. An ``error`` event is kept in :attr:`error`."""

    def __init__(self, on_tokens: TokensCallback) -> None:
        self.on_tokens = on_tokens
        self.ids: list[int] = []
        self.entries: list[Any] = []  # meta_info.output_token_logprobs
        self.tops: list[Any] = []  # meta_info.output_top_logprobs, when asked
        self.text = ""
        self.meta: dict[str, Any] = {}
        self.error: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        """Whether the last event carried the finish reason (a stream cut short has none)."""
        return bool(self.meta.get("finish_reason"))

    def line(self, line: bytes) -> None:
        """Read one line of the event stream (``data: {...}``; others are ignored)."""
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            return
        event = orjson.loads(data)
        if "error" in event:
            self.error = (
                event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            )
            return
        meta = event.get("meta_info") or {}
        n = (
            len(event["output_ids"])
            if "output_ids" in event
            else len(meta.get("output_token_logprobs") or [])
        )
        total, have = meta.get("completion_tokens"), len(self.ids)
        whole = n == total if isinstance(total, int) and have else True  # the output so far
        if whole:
            self.text = event.get("text") or ""
            if have:  # read only what is new: an event of the whole output repeats every token before it
                new = {
                    k: meta[k][have:] for k in ("output_token_logprobs", "output_top_logprobs") if meta.get(k)
                }
                event = {**event, "meta_info": {**meta, **new}}
                if "output_ids" in event:
                    event["output_ids"] = event["output_ids"][have:]
        else:
            self.text += event.get("text") or ""
        ids_array, lps_array, part = parse_chunk(event)
        ids = ids_array.tolist()  # the callback's tokens, as lists: a stream is read token by token
        entries = part.get("output_token_logprobs") or []
        tops = part.get("output_top_logprobs") or []
        self.ids += ids
        self.entries += entries
        self.tops += tops
        self.meta = meta
        if ids:
            top = [[(float(t[0]), int(t[1])) for t in row or ()] for row in tops]
            self.on_tokens(ids, lps_array.tolist(), top)

    def result(self) -> dict[str, Any]:
        """The answer as a non-streamed ``/generate`` would have sent it; a stream cut short reads
        as an abort (the client resumes it from the tokens that came)."""
        meta = {**self.meta, "output_token_logprobs": self.entries}
        if self.tops:
            meta["output_top_logprobs"] = self.tops
        if not self.finished:
            meta["finish_reason"] = {"type": "abort", "message": "the stream ended early"}
        return {"output_ids": self.ids, "text": self.text, "meta_info": meta}


def _spans(spans: Any, n: int) -> list[tuple[int, Any]] | None:
    """SGLang's ``weight_versions`` spans as ``(length, label)`` in order, or None when they are
    absent or do not cover exactly ``n`` tokens (then nothing is labelled)."""
    if not isinstance(spans, list) or not spans:
        return None
    out: list[tuple[int, Any]] = []
    covered = 0
    try:
        for s in spans:
            start, end = int(s["start"]), int(s["end"])
            if start != covered or end < start:
                return None
            out.append((end - start, s["version"]))
            covered = end
    except (KeyError, TypeError, ValueError):
        return None
    return out if covered == n else None


def versions_from_spans(spans: Any, n: int) -> list[Any] | None:
    """One label per output token from SGLang's ``weight_versions`` spans, or None when they are
    absent or do not cover exactly ``n`` tokens (then nothing is labelled)."""
    runs = _spans(spans, n)
    if runs is None:
        return None
    labels: list[Any] = []
    for length, label in runs:
        labels += [label] * length
    return labels


def _version(label: Any) -> int | None:
    """A span's label as a version number, or None when it is not one (SGLang's "default")."""
    if not isinstance(label, (str, int)) or isinstance(label, bool):
        return None
    try:
        return int(label)
    except ValueError:
        return None


def token_versions(meta: dict[str, Any], n: int, posted_at: int) -> tuple[np.ndarray, int]:
    """The policy version of each of a chunk's ``n`` tokens, and how many the server labelled.

    Two rules bound these stamps. (1) Never newer than the weights that sampled the token:
    reporting a newer version under-reports staleness. (2) Never older than the episode's
    admission version (nodes/rollout/actor.py raises the client's version to the grant's before
    the episode posts): the governor's bound assumes it, and an older stamp gets a group dropped
    as stale for nothing.

    - A server label (SGLang 0.5.23's ``meta_info.weight_versions`` spans, which the reference
      server sends too; the version of the weights that sampled the token, set by the trainer
      with each push) is the
      truth for (1). It also satisfies (2) whenever the servers hold at least the admitted version,
      which holds because the governor's version is raised only after every server got the push.
      If a label is older than that anyway (a server restarted with old weights), the label wins:
      it is what the tokens are, and the buffer's staleness net should see it (a warning is logged).
    - Without a label (SGLang before 0.5.23; an unparseable label such as "default"), the version the
      client knew when it *posted* the chunk: it satisfies (2) (it is at least the admission
      version) and (1) (``set_version`` is called only after the servers hold that version, and a
      server's weights only move forward during the chunk). The version at *arrival* would break
      (1) for a chunk held across an update (``retract`` / ``in_place``): its early tokens came from
      the old weights. An aborted chunk never spans an update (the pause aborts it first), so for
      ``abort`` pauses the post-time version is exact.
    """
    runs = _spans(meta.get(WEIGHT_VERSIONS), n)
    if runs is None:
        # the request's own weight_version (at its end) is newer than some tokens after an
        # update mid-chunk, but when it is *older* than posted_at the server missed a push
        # (restarted with old weights): then it is the truth, as a label would be
        try:
            behind = int(meta.get("weight_version"))  # type: ignore[arg-type]
        except (TypeError, ValueError):  # SGLang's "default", or absent
            behind = posted_at
        return np.full(n, min(posted_at, behind), dtype=np.int32), 0
    versions = [_version(label) for _, label in runs]  # one per span: spans are few, tokens many
    lengths = [length for length, _ in runs]
    labelled = sum(length for length, v in zip(lengths, versions, strict=True) if v is not None)
    out = np.repeat(np.array([posted_at if v is None else v for v in versions], np.int32), lengths)
    return out, labelled

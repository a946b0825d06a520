"""Per-token data on its way from a rollout actor to a trainer rank: what it costs in CPU (issue 40).

Four measurements:

- ``answer``: the first hop, from the server's answers to the encoded group: the bytes of 4
  ``/generate`` answers as SGLang 0.5.23 sends them, at 328, 2,048 and 32,048 tokens per trajectory
  (128 of prompt), read as the client reads them (orjson, ``parse_chunk``, ``token_versions``, a
  ``GenResult``), grown into trajectories as ``RLVRWorkflow`` grows them (``Sample``, which
  validates) and encoded as the rollout actor sends the group; beside it the JSON parse alone.
  It runs on both sides of the change that made the client read arrays, for before and after.

The rest run on trajectories built from Python lists, as workflows built them before that change:

- ``group``: a group of 4 trajectories at 328, 2,048 and 32,048 tokens each: the codec's round
  trip and ``validate()`` on the first hop (as built, the rollout actor's put) and on the next
  (as received, the buffer's hand-out), beside a raw copy of the same four per-token arrays of
  each trajectory (``numpy.copy``) in the same run: the floor of moving them.
- ``buffer``: the buffer's CPU per group of 4 x 8,192 tokens: decode the put, ``put`` (validate,
  the staleness scan), and its share of encoding the batch it hands out.
- ``driver``: the driver's CPU per batch of 256 groups of 4 x 8,192 tokens, get_batch -> train_step:
  decode the batch, shape rewards, advantages, encode it for the trainer ranks; and beside it what a
  rank then spends before its first forward: decode and build every micro-batch's tensors.

    .venv/bin/python bench/arrays.py [--groups 256] [--tokens 8192] [--repeats 5] [--only answer|group|batch]

Prints one JSON line per measurement (milliseconds of process CPU, median of the repeats).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from nodes.rollout.chunks import parse_chunk, token_versions
from nodes.rollout.client import GenResult
from nodes.rollout.workflows import Sample
from protocols.rl import Batch, Trajectory, TrajectoryGroup
from protocols.runtime import codec

PROMPT = 128  # prompt tokens of each trajectory; the rest is generated
K = 4  # trajectories per group
PER_TOKEN = ("input_ids", "loss_mask", "logprobs", "versions")


def make_group(gid: str, tokens: int, rng: np.random.Generator) -> TrajectoryGroup:
    """A group as a workflow builds it: per-token fields as Python lists."""
    trajs = []
    for k in range(K):
        gen = tokens - PROMPT
        trajs.append(
            Trajectory(
                input_ids=rng.integers(0, 150_000, tokens).tolist(),
                loss_mask=[0] * PROMPT + [1] * gen,
                logprobs=[0.0] * PROMPT + (-rng.random(gen)).tolist(),
                versions=[-1] * PROMPT + [3] * gen,
                reward=float(k % 2),
                group_id=gid,
                prompt_len=PROMPT,
            )
        )
    return TrajectoryGroup(gid, trajs)


def cpu_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median process CPU of ``fn`` over ``repeats`` runs, in milliseconds."""
    out = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        out.append((time.process_time() - t0) * 1e3)
    return statistics.median(out)


def make_answer(tokens: int, rng: np.random.Generator) -> bytes:
    """The body of one ``/generate`` answer of ``tokens - PROMPT`` output tokens, with log-probs
    (``[logprob, token id, null]`` per token), as SGLang 0.5.23 sends it."""
    n = tokens - PROMPT
    ids, lps = rng.integers(0, 150_000, n).tolist(), (-rng.random(n)).tolist()
    meta = {
        "id": "r",
        "finish_reason": {"type": "length", "length": n},
        "prompt_tokens": PROMPT,
        "completion_tokens": n,
        "cached_tokens": 0,
        "weight_version": "3",
        "weight_versions": [{"start": 0, "end": n, "version": "3"}],
        "output_token_logprobs": [[lp, i, None] for lp, i in zip(lps, ids, strict=True)],
    }
    return orjson.dumps({"text": "abcd" * n, "output_ids": ids, "meta_info": meta})


# RLVRWorkflow starts its samples from an int32 array since the client reads answers into arrays,
# from a list before: so this bench runs at an older commit too, for the "before" figures
ARRAY_SAMPLES = "ids" in {f.name for f in dataclasses.fields(GenResult)}


def first_hop(answers: list[bytes], prompt: list[int]) -> list[Any]:
    """The rollout actor's CPU from ``answers`` (one per sample) to the group's frames."""
    results = []
    for body in answers:
        ids, lps, meta = parse_chunk(orjson.loads(body))
        versions, _ = token_versions(meta, len(ids), 3)
        results.append(GenResult("r", ids, lps, versions, "length", "", len(prompt), [0], "u"))
    start = np.array(prompt, np.int32) if ARRAY_SAMPLES else prompt
    trajectories = []
    for res in results:
        s = Sample(start, 1.0)
        s.add_output(res)
        trajectories.append(s.trajectory(0.0, "g", len(prompt)))
    return codec.encode(TrajectoryGroup("g", trajectories))


def bench_answer(tokens: int, repeats: int) -> dict[str, Any]:
    """The first hop of a group of K trajectories of ``tokens`` each, from the answers' bytes."""
    rng = np.random.default_rng(2)
    answers = [make_answer(tokens, rng) for _ in range(K)]
    prompt = rng.integers(0, 150_000, PROMPT).tolist()
    hop = cpu_ms(lambda: first_hop(answers, prompt), repeats)
    parse = cpu_ms(lambda: [orjson.loads(a) for a in answers], repeats)
    return {
        "bench": "answer",
        "tokens_per_trajectory": tokens,
        "arrays_from_the_answer": ARRAY_SAMPLES,
        "answers_to_frames_ms": hop,
        "json_parse_ms": parse,
        "beyond_the_json_parse_ms": hop - parse,
        "answer_bytes": sum(map(len, answers)),
    }


def bench_group(tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Encode + decode + validate of one group, on two hops: ``first`` sends the group as the
    workflow built it (lists; the rollout actor's put), ``next`` re-sends it as it was received
    (the buffer's hand-out, the driver's send to the ranks)."""
    rng = np.random.default_rng(0)
    built = make_group("g", tokens, rng)
    received = codec.decode(codec.encode(built))
    fields = [np.asarray(getattr(t, f)) for t in received.trajectories for f in PER_TOKEN]
    raw = cpu_ms(lambda: [np.copy(a) for a in fields], repeats * 4)
    rows = []
    for hop, group in (("first", built), ("next", received)):
        frames = codec.encode(group)
        enc = cpu_ms(lambda g=group: codec.encode(g), repeats)
        dec = cpu_ms(lambda f=frames: codec.decode(f), repeats)
        val = cpu_ms(codec.decode(frames).validate, repeats)
        rows.append(
            {
                "bench": "group",
                "hop": hop,
                "tokens_per_trajectory": tokens,
                "encode_ms": enc,
                "decode_ms": dec,
                "validate_ms": val,
                "round_trip_and_validate_ms": enc + dec + val,
                "raw_copy_ms": raw,
                "ratio_to_raw_copy": (enc + dec + val) / raw if raw else None,
                "bytes": sum(len(memoryview(f).cast("B")) for f in frames),
            }
        )
    return rows


def bench_buffer_and_driver(n_groups: int, tokens: int, repeats: int) -> list[dict[str, Any]]:
    from nodes.driver.advantage import AdvantageConfig, batch_advantages, shape_rewards
    from nodes.plane.buffer import TrajectoryBuffer

    rng = np.random.default_rng(1)
    groups = [make_group(f"g{i}", tokens, rng) for i in range(n_groups)]
    puts = [codec.encode(["holder", g, 3]) for g in groups]  # a put's arguments, as the actor sends them
    del groups
    cfg = AdvantageConfig()

    buffer_ms, encode_ms, driver_ms, rank_ms = [], [], [], []
    for _ in range(repeats):
        buf = TrajectoryBuffer()
        t0 = time.process_time()
        for frames in puts:
            holder, group, admit = codec.decode(frames)
            buf.put(holder, group, admit)
        t1 = time.process_time()
        batch = buf.try_get_batch(n_groups, 4)
        out = codec.encode(batch)
        t2 = time.process_time()
        buffer_ms.append((t1 - t0) * 1e3 / n_groups)
        encode_ms.append((t2 - t1) * 1e3 / n_groups)

        t0 = time.process_time()
        b = codec.decode(out)
        rewards = shape_rewards(b, cfg.shaping)
        b.advantages = batch_advantages(b, rewards, cfg)
        to_ranks = codec.encode(b)
        driver_ms.append((time.process_time() - t0) * 1e3)
        del out

        rank_ms.append(rank_cpu_ms(to_ranks))
        del b, to_ranks, batch, buf
    return [
        {
            "bench": "buffer",
            "groups": n_groups,
            "tokens_per_trajectory": tokens,
            "put_ms_per_group": statistics.median(buffer_ms),
            "hand_out_ms_per_group": statistics.median(encode_ms),
            "cpu_ms_per_group": statistics.median(buffer_ms) + statistics.median(encode_ms),
        },
        {
            "bench": "driver",
            "groups": n_groups,
            "tokens_per_trajectory": tokens,
            "cpu_ms_per_batch": statistics.median(driver_ms),
        },
        {
            "bench": "rank",
            "groups": n_groups,
            "tokens_per_trajectory": tokens,
            "decode_and_build_microbatches_ms": statistics.median(rank_ms),
        },
    ]


def rank_cpu_ms(frames: list[Any]) -> float:
    """What one rank (of one) spends from the batch's frames to every micro-batch's CPU tensors."""
    from nodes.trainer.balance import plan_batch
    from nodes.trainer.microbatch import build_microbatch

    t0 = time.process_time()
    batch: Batch = codec.decode(frames)
    trajs = batch.trajectories
    plan = plan_batch([[t.num_tokens for t in g.trajectories] for g in batch.groups], 1, 16_384)
    starts = np.cumsum([0] + [len(g.trajectories) for g in batch.groups])
    for mb in plan.ranks[0]:
        build_microbatch([int(starts[g]) + s for g, s in mb], trajs, batch.advantages)
    return (time.process_time() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=256, help="groups per batch (buffer, driver)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per trajectory (buffer, driver)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=("answer", "group", "batch"), default=None)
    args = ap.parse_args()
    if args.only in (None, "answer"):
        for tokens in (328, 2048, 32_048):
            print(json.dumps(bench_answer(tokens, args.repeats * 4)), flush=True)
    if args.only in (None, "group"):
        for tokens in (328, 2048, 32_048):
            for row in bench_group(tokens, args.repeats * 4):
                print(json.dumps(row), flush=True)
    if args.only in (None, "batch"):
        for row in bench_buffer_and_driver(args.groups, args.tokens, args.repeats):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Token balancing: which rank trains which prompt group, and how each rank cuts its micro-batches.

Training time on a rank grows with the tokens it holds, and every FSDP rank waits for the slowest
one at each collective, so a batch is split across ranks by token count rather than by sequence
count. GRPO normalises rewards within a prompt's group, so a group is the unit placed on a rank.

Every rank computes the same plan from the same batch (the functions here are deterministic), so
no communication is needed to agree on it, including the micro-batch count, which must be equal on
every rank because each micro-batch's forward/backward runs FSDP collectives.

Pure python: no torch, cheap to property-test.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BatchPlan",
    "imbalance",
    "pack_microbatches",
    "plan_batch",
    "round_robin",
    "split_across_ranks",
]


def imbalance(loads: Sequence[int | float]) -> float:
    """Max over mean of per-bin loads: 1.0 is perfect balance; the slowest rank sets the pace."""
    if not loads:
        return 1.0
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def _loads(bins: Sequence[Sequence[int]], sizes: Sequence[int]) -> list[int]:
    return [sum(sizes[i] for i in b) for b in bins]


def round_robin(sizes: Sequence[int], n_bins: int) -> list[list[int]]:
    """Baseline: item ``i`` goes to bin ``i % n_bins``, ignoring sizes."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    return [list(range(r, len(sizes), n_bins)) for r in range(n_bins)]


def _greedy_decreasing(sizes: Sequence[int], n_bins: int) -> list[list[int]]:
    """Largest item first, each into the currently lightest bin (ties: lowest bin index)."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    heap = [(0, r) for r in range(n_bins)]
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i in order:
        load, r = heapq.heappop(heap)
        bins[r].append(i)
        heapq.heappush(heap, (load + sizes[i], r))
    return bins


def _improve(bins: list[list[int]], sizes: Sequence[int], max_rounds: int = 64) -> None:
    """Local search: move or swap single items between the heaviest and lightest bins while it
    lowers the heavier of the two. Greedy alone leaves easy wins on small batches."""
    for _ in range(max_rounds):
        loads = _loads(bins, sizes)
        hi = max(range(len(bins)), key=lambda r: (loads[r], -r))
        lo = min(range(len(bins)), key=lambda r: (loads[r], r))
        gap = loads[hi] - loads[lo]
        if gap <= 0:
            return
        best: tuple[int, int, int | None] | None = None  # (new pair max, item in hi, item in lo)
        for a in bins[hi]:
            if 0 < sizes[a] < gap:  # move a: new pair max is max(hi - a, lo + a) < hi
                cand = max(loads[hi] - sizes[a], loads[lo] + sizes[a])
                if best is None or cand < best[0]:
                    best = (cand, a, None)
            for b in bins[lo]:
                d = sizes[a] - sizes[b]
                if 0 < d < gap:
                    cand = max(loads[hi] - d, loads[lo] + d)
                    if best is None or cand < best[0]:
                        best = (cand, a, b)
        if best is None:
            return
        _, a, swap = best
        bins[hi].remove(a)
        bins[lo].append(a)
        if swap is not None:
            bins[lo].remove(swap)
            bins[hi].append(swap)


def split_across_ranks(sizes: Sequence[int], n_ranks: int) -> list[list[int]]:
    """Assign items (prompt groups, sized in tokens) to ``n_ranks`` ranks, balancing tokens.

    Decreasing-size greedy into the lightest rank, then a move/swap local search. The round-robin
    assignment is kept as a candidate so the result is never less balanced than the baseline.
    Each rank's list is in ascending item order (stable, reproducible micro-batch contents).
    """
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    bins = _greedy_decreasing(sizes, n_ranks)
    _improve(bins, sizes)
    rr = round_robin(sizes, n_ranks)
    if max(_loads(rr, sizes), default=0) < max(_loads(bins, sizes), default=0):
        bins = rr
    return [sorted(b) for b in bins]


def pack_microbatches(sizes: Sequence[int], max_tokens: int, min_mbs: int = 1) -> list[list[int]]:
    """Cut items into micro-batches of at most ``max_tokens`` *padded* tokens by first-fit-decreasing.

    A micro-batch is padded to its longest sequence (microbatch.py), so what it costs in memory
    and compute is ``len(mb) * max(size)``, not the sum of its sizes: one long sequence among
    short ones would make every row as long. Items go largest first (so each micro-batch's first
    item is its longest) into the micro-batch with the lightest padded load that stays within
    ``max_tokens``; a new one opens when none does. ``min_mbs`` micro-batches are open from the
    start, so a rank can be made to run as many micro-batches as its peers (some may stay empty
    when it has fewer items). An item larger than ``max_tokens`` gets a micro-batch of its own.
    Each micro-batch lists items in ascending order.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    mbs: list[list[int]] = [[] for _ in range(max(min_mbs, 0))]
    longest = [0] * len(mbs)  # the first (largest) item of each micro-batch

    def padded(m: int, extra: int = 0) -> int:
        return (len(mbs[m]) + extra) * longest[m]

    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        fitting = [m for m in range(len(mbs)) if not mbs[m] or padded(m, 1) <= max_tokens]
        if fitting:
            m = min(fitting, key=lambda m: (padded(m), m))
        else:
            mbs.append([])
            longest.append(0)
            m = len(mbs) - 1
        mbs[m].append(i)
        longest[m] = max(longest[m], sizes[i])
    return [sorted(mb) for mb in mbs]


@dataclass(frozen=True)
class BatchPlan:
    """Where every sequence of a batch is trained.

    ``ranks[r][m]`` lists the ``(group_index, sequence_index)`` pairs of rank ``r``'s micro-batch
    ``m``; every rank has the same number of micro-batches (some possibly empty).
    """

    ranks: list[list[list[tuple[int, int]]]]
    rank_tokens: list[int]

    @property
    def n_microbatches(self) -> int:
        """Micro-batches per rank (equal on every rank)."""
        return len(self.ranks[0]) if self.ranks else 0

    @property
    def imbalance(self) -> float:
        """Max over mean tokens per rank."""
        return imbalance(self.rank_tokens)


def plan_batch(group_seq_tokens: Sequence[Sequence[int]], n_ranks: int, max_tokens_per_mb: int) -> BatchPlan:
    """Plan a batch given each group's per-sequence token counts.

    Groups are split across ranks by :func:`split_across_ranks`; each rank packs its sequences
    with :func:`pack_microbatches`; then the micro-batch count is synced to the maximum over ranks
    by re-packing the others with that minimum (repeating if a re-pack overshoots, which ends
    because a minimum at or above the item count gives every item its own micro-batch).
    """
    group_sizes = [sum(g) for g in group_seq_tokens]
    rank_groups = split_across_ranks(group_sizes, n_ranks)
    rank_items = [[(g, s) for g in groups for s in range(len(group_seq_tokens[g]))] for groups in rank_groups]
    rank_sizes = [[group_seq_tokens[g][s] for g, s in items] for items in rank_items]
    packs = [pack_microbatches(sizes, max_tokens_per_mb) for sizes in rank_sizes]
    target = max(len(p) for p in packs)
    while any(len(p) != target for p in packs):
        packs = [
            p if len(p) == target else pack_microbatches(s, max_tokens_per_mb, target)
            for p, s in zip(packs, rank_sizes, strict=True)
        ]
        target = max(len(p) for p in packs)
    ranks = [[[items[i] for i in mb] for mb in pack] for items, pack in zip(rank_items, packs, strict=True)]
    return BatchPlan(ranks=ranks, rank_tokens=[sum(s) for s in rank_sizes])

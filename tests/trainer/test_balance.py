"""Property tests for token balancing (nodes/trainer/balance.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodes.trainer.balance import (
    imbalance,
    pack_microbatches,
    plan_batch,
    round_robin,
    split_across_ranks,
)

sizes_st = st.lists(st.integers(min_value=1, max_value=2000), min_size=0, max_size=60)
groups_st = st.lists(
    st.lists(st.integers(min_value=1, max_value=600), min_size=1, max_size=6), min_size=0, max_size=24
)


def _max_load(bins, sizes):
    return max((sum(sizes[i] for i in b) for b in bins), default=0)


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, n=st.integers(min_value=1, max_value=8))
def test_split_places_every_item_once_and_never_worse_than_round_robin(sizes, n):
    bins = split_across_ranks(sizes, n)
    assert len(bins) == n
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert _max_load(bins, sizes) <= _max_load(round_robin(sizes, n), sizes)


@settings(max_examples=200, deadline=None)
@given(sizes=sizes_st, cap=st.integers(min_value=1, max_value=3000), min_mbs=st.integers(0, 10))
def test_microbatches_respect_cap_and_place_every_item_once(sizes, cap, min_mbs):
    mbs = pack_microbatches(sizes, cap, min_mbs)
    assert len(mbs) >= min_mbs
    assert sorted(i for mb in mbs for i in mb) == list(range(len(sizes)))
    for mb in mbs:
        # padded to its longest sequence, a micro-batch stays under the cap, or is one lone oversized sequence
        assert len(mb) * max((sizes[i] for i in mb), default=0) <= cap or len(mb) == 1


def test_a_long_sequence_does_not_make_short_ones_pay_its_padding():
    sizes = [4000, 3000] + [10] * 20
    mbs = pack_microbatches(sizes, 4096)
    padded = sum(len(mb) * max(sizes[i] for i in mb) for mb in mbs)
    assert padded == sum(sizes)  # 4000 | 3000 | 20 x 10: no row padded to 4000


@settings(max_examples=150, deadline=None)
@given(groups=groups_st, n=st.integers(1, 6), cap=st.integers(100, 2000))
def test_plan_keeps_groups_whole_and_syncs_microbatch_count(groups, n, cap):
    plan = plan_batch(groups, n, cap)
    assert len(plan.ranks) == n
    # same number of micro-batches on every rank
    assert len({len(r) for r in plan.ranks}) == 1
    placed = Counter(item for r in plan.ranks for mb in r for item in mb)
    expected = Counter((g, s) for g, seqs in enumerate(groups) for s in range(len(seqs)))
    assert placed == expected  # every sequence exactly once
    owner: dict[int, int] = {}
    for r, mbs in enumerate(plan.ranks):
        for mb in mbs:
            assert sum(groups[g][s] for g, s in mb) <= cap or len(mb) == 1
            for g, _ in mb:
                assert owner.setdefault(g, r) == r, f"group {g} split across ranks"
    rr = round_robin([sum(g) for g in groups], n)
    assert plan.imbalance <= imbalance([sum(sum(groups[g]) for g in b) for b in rr]) + 1e-12
    assert sum(plan.rank_tokens) == sum(map(sum, groups))


def test_skewed_groups_are_balanced_well():
    # a long-tailed mix: a few long groups, many short ones
    sizes = [4000, 3500, 3000] + [300 + 37 * (i % 11) for i in range(60)]
    bins = split_across_ranks(sizes, 4)
    loads = [sum(sizes[i] for i in b) for b in bins]
    assert imbalance(loads) <= 1.05
    assert imbalance(loads) < imbalance([sum(sizes[i] for i in b) for b in round_robin(sizes, 4)])


def test_plan_with_fewer_groups_than_ranks_gives_empty_microbatches():
    plan = plan_batch([[10, 10]], n_ranks=3, max_tokens_per_mb=15)
    assert plan.n_microbatches == 2
    assert [len(mb) for r in plan.ranks for mb in r].count(0) == 4


def test_oversized_sequence_gets_its_own_microbatch():
    assert pack_microbatches([50, 5, 5], max_tokens=10) == [[0], [1, 2]]


@pytest.mark.parametrize("bad", [0, -1])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError):
        split_across_ranks([1], bad)
    with pytest.raises(ValueError):
        pack_microbatches([1], bad)

"""The radix prefix cache: matching, node splits, KV slicing, token budget and LRU eviction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nodes.inference.backends.hf import HFKVOps
from nodes.inference.radix import RadixCache


def kv_for(ids: list[int]) -> tuple:
    """Fake one-layer KV whose values encode the token ids (so slices can be checked)."""
    t = torch.tensor(ids, dtype=torch.float32).view(1, -1, 1)
    return ((t.clone(), -t.clone()),)


def test_match_insert_split() -> None:
    c = RadixCache(1000, HFKVOps())
    assert c.match([1, 2, 3]).length == 0
    c.insert([1, 2, 3, 4], kv_for([1, 2, 3, 4]))
    m = c.match([1, 2, 3, 9])
    assert m.length == 3
    assert m.kv[0][0].view(-1).tolist() == [1, 2, 3]
    c.insert([1, 2, 7, 8], kv_for([1, 2, 7, 8]))  # splits the first node after [1, 2]
    assert c.total_tokens == 6
    assert c.match([1, 2, 7, 8, 9]).kv[0][1].view(-1).tolist() == [-1, -2, -7, -8]
    assert c.match([1, 2, 3, 4]).kv[0][0].view(-1).tolist() == [1, 2, 3, 4]


def test_lru_eviction_keeps_budget_and_recent_prefixes() -> None:
    c = RadixCache(10)
    c.insert([1, 2, 3, 4], None)
    c.insert([5, 6, 7, 8], None)
    c.match([1, 2, 3, 4])  # touch: [5..8] is now least recently used
    c.insert([9, 10, 11, 12], None)
    assert c.total_tokens <= 10
    assert c.match([1, 2, 3, 4]).length == 4
    assert c.match([5, 6, 7, 8]).length == 0
    assert c.match([9, 10, 11, 12]).length == 4


def test_sequence_longer_than_budget_is_not_cached() -> None:
    c = RadixCache(5)
    c.insert(list(range(10)), None)
    assert c.total_tokens == 0 and c.match(list(range(10))).length == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=8), min_size=1, max_size=12))
def test_matches_agree_with_a_naive_prefix_set(seqs: list[list[int]]) -> None:
    c = RadixCache(10_000, HFKVOps())
    for s in seqs:
        c.insert(s, kv_for(s))
    for q in seqs + [[*s[:-1], 9] for s in seqs]:
        want = max((n for s in seqs for n in range(len(s) + 1) if s[:n] == q[:n]), default=0)
        m = c.match(q)
        assert m.length == want
        if want:
            assert m.kv[0][0].view(-1).tolist() == [float(x) for x in q[:want]]
    assert c.total_tokens == len({tuple(s[:n]) for s in seqs for n in range(1, len(s) + 1)})


def test_a_full_cache_walks_the_tree_once_per_slack_not_once_per_insert(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eviction walks every node; a full cache that walked on each insert cost 20x per insert."""
    c = RadixCache(1600)
    walks = 0
    iter_nodes = c._iter_nodes

    def counted() -> list:
        nonlocal walks
        walks += 1
        return iter_nodes()

    monkeypatch.setattr(c, "_iter_nodes", counted)
    seqs = [[i, *range(1000 + 16 * i, 1000 + 16 * i + 15)] for i in range(200)]  # 16 tokens each, no sharing
    for s in seqs:
        c.insert(s, None)
        assert c.total_tokens <= 1600
    slack = int(1600 * RadixCache.SLACK)
    assert walks <= (200 * 16 - 1600) // slack + 1  # each walk frees at least the slack; 100 before
    assert all(c.match(s).length == 16 for s in seqs[-(1600 - slack) // 16 :])  # the newest are kept
    assert c.match(seqs[0]).length == 0

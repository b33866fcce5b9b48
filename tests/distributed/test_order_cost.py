"""Trie-order features equal those of the prefix tree actually built; the cost model fits and falls back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treerl.distributed import FEATURES, CostModel, TrieOrder, tree_features
from treerl.tree import PrefixTree, TokenSequence
from treerl.bench.workloads import AgentShape, agent_trees, grpo_groups, random_trees


def built_features(sequences: list[TokenSequence]) -> np.ndarray:
    """FEATURES straight from PrefixTree.build (the tree the engine walks)."""
    tree = PrefixTree.build(sequences)
    stats = tree.stats()
    attention = sum(n.length * (n.start + n.end + 1) / 2 for n in tree.nodes[1:])
    return np.array([1, stats.unique_tokens, attention, stats.leaves, stats.sequences, stats.flat_tokens], float)


def small_batch(seed: int, kind: int) -> list[TokenSequence]:
    if kind == 0:
        return random_trees(sequences=12, length=10, sharing=3.0, vocab=3, seed=seed)  # tiny vocab: many forks
    if kind == 1:
        return grpo_groups(prompts=3, group_size=3, prompt_len=5, response_len=4, jitter=0.9, seed=seed)
    return agent_trees(AgentShape(tasks=2, samples_per_task=2).scaled(0.01), seed=seed)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), kind=st.integers(0, 2), data=st.data())
def test_features_of_any_subset_equal_the_built_tree(seed, kind, data):
    sequences = small_batch(seed, kind)
    chosen = data.draw(st.sets(st.integers(0, len(sequences) - 1), min_size=1))
    order = TrieOrder(sequences)
    positions = np.sort(order.position[sorted(chosen)])
    np.testing.assert_allclose(order.features(positions), built_features([sequences[i] for i in sorted(chosen)]))


def test_degenerate_batches():
    a = TokenSequence([1, 2, 3, 4])
    cases = [[a], [a, TokenSequence([1, 2, 3, 4])], [a, TokenSequence([1, 2])], [TokenSequence([5]), TokenSequence([6, 7])]]
    for sequences in cases:  # one sequence, duplicates, a prefix of another, no sharing
        np.testing.assert_allclose(tree_features(sequences), built_features(sequences))


def test_unfitted_cost_is_unique_tokens():
    sequences = grpo_groups(prompts=2, group_size=4, prompt_len=20, response_len=7)
    assert not CostModel().fitted
    assert CostModel()(sequences) == PrefixTree.build(sequences).stats().unique_tokens


def test_fit_recovers_the_weights_that_produced_the_timings():
    truth = np.array([2e-3, 3e-5, 4e-8, 1e-3, 0.0, 2e-7])
    rng = np.random.default_rng(0)
    samples = []
    for seed in range(30):
        sequences = random_trees(sequences=int(rng.integers(1, 20)), length=int(rng.integers(8, 200)),
                                 sharing=float(rng.uniform(1, 6)), seed=seed)
        samples.append((PrefixTree.build(sequences), float(truth @ built_features(sequences))))
    model = CostModel.fit(samples)
    assert model.fitted and all(w >= 0 for w in model.weights)
    for tree, seconds in samples:
        assert model(tree) == pytest.approx(seconds, rel=1e-6)
    assert "unique_tokens" in model.describe()
    rows = [tree_features(tree) for tree, _ in samples]
    assert CostModel.from_features(rows, [t for _, t in samples]) == model  # what a trainer keeps: features only


def test_fit_keeps_weights_non_negative_on_noisy_timings():
    rng = np.random.default_rng(1)
    samples = [(s := random_trees(sequences=8, length=40, seed=i), float(tree_features(s)[1] * 1e-4 + rng.normal(0, 1e-3)))
               for i in range(10)]
    samples = [(batch, abs(t)) for batch, t in samples]
    assert all(w >= 0 for w in CostModel.fit(samples).weights)


def test_bad_weights_and_samples_are_rejected():
    with pytest.raises(ValueError, match="weights"):
        CostModel((1.0,))
    with pytest.raises(ValueError, match=">= 0"):
        CostModel(tuple(-1.0 for _ in FEATURES))
    with pytest.raises(ValueError, match="seconds"):
        CostModel.fit([([TokenSequence(torch.tensor([1, 2]))], float("nan"))])
    with pytest.raises(ValueError, match="at least one"):
        CostModel.fit([])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), kind=st.integers(0, 2), data=st.data())
def test_balancer_run_prices_equal_the_features(seed, kind, data):
    """The balancer's O(1) prefix-sum prices of a contiguous run equal weights . features of that run."""
    from treerl.distributed.assign import _Run

    sequences = small_batch(seed, kind)
    order = TrieOrder(sequences)
    weights = np.array(data.draw(st.lists(st.floats(0, 10), min_size=len(FEATURES), max_size=len(FEATURES))))
    run = _Run(order.length, order.lcp, weights)
    i = data.draw(st.integers(0, len(order) - 1))
    j = data.draw(st.integers(i + 1, len(order)))
    features = order.features(np.arange(i, j))
    assert run.cost(i, j) == pytest.approx(float(weights @ features), rel=1e-9, abs=1e-9)
    assert run.unique(i, j) == features[FEATURES.index("unique_tokens")]

"""The balancer and the baselines: valid assignments, budgets, kept trees, and never worse than a baseline."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treerl.distributed import CostModel, TrieOrder, balance, evaluate, first_fit, lpt, split_over_context
from treerl.tree import BatchError, PrefixTree, TokenSequence
from treerl.bench.workloads import AgentShape, agent_trees, grpo_groups, random_trees

FITTED = CostModel((2e-3, 2e-5, 4e-9, 1e-3, 5e-4, 1e-7))  # per call, token, attention pair, leaf, sequence, flat token


def workload(kind: int, seed: int, size: int) -> list[TokenSequence]:
    if kind == 0:
        return grpo_groups(prompts=size, group_size=1 + seed % 6, prompt_len=10 + seed % 50, response_len=8,
                           jitter=0.9, seed=seed)
    if kind == 1:
        return random_trees(sequences=2 + 3 * size, length=30, sharing=1 + seed % 5, seed=seed)
    return agent_trees(AgentShape(tasks=1 + seed % 3, samples_per_task=1 + size % 3).scaled(0.01), seed=seed)


def unique_tokens(sequences: list[TokenSequence]) -> int:
    return PrefixTree.build(sequences).stats().unique_tokens


@settings(max_examples=30, deadline=None)
@given(kind=st.integers(0, 2), seed=st.integers(0, 1000), size=st.integers(1, 8), ranks=st.integers(1, 8),
       budget_factor=st.sampled_from([None, 1, 2, 5]), fitted=st.booleans())
def test_assignments_are_valid_and_balancer_never_loses(kind, seed, size, ranks, budget_factor, fitted):
    sequences = workload(kind, seed, size)
    budget = None if budget_factor is None else budget_factor * max(len(s) for s in sequences)
    cost = FITTED if fitted else CostModel()
    makespans = {}
    for method in (balance, first_fit, lpt):
        assignment = method(sequences, ranks, budget, cost=cost) if method is balance else method(sequences, ranks, budget)
        assert len(assignment.ranks) == ranks
        everyone = sorted(i for r in range(ranks) for i in assignment.sequences(r))
        assert everyone == list(range(len(sequences))), f"{assignment.method}: each sequence exactly once"
        for rank in assignment.ranks:
            for batch in rank:
                assert batch, f"{assignment.method}: empty micro-batch"
                if budget is not None:
                    assert unique_tokens([sequences[i] for i in batch]) <= budget, assignment.method
        makespans[method] = evaluate(assignment, sequences, cost).makespan
    assert makespans[balance] <= min(makespans[first_fit], makespans[lpt]) * (1 + 1e-12)


def test_a_sequence_over_the_budget_is_a_clear_error():
    sequences = [TokenSequence([1, 2, 3]), TokenSequence(list(range(10)), name="long one")]
    for method in (balance, first_fit, lpt):
        with pytest.raises(BatchError, match=r"sequence 1 \('long one'\).*10 tokens.*micro_batch_tokens=5"):
            method(sequences, 2, micro_batch_tokens=5)
    with pytest.raises(ValueError, match="ranks"):
        balance(sequences, 0)


def test_trees_that_fit_stay_whole():
    sequences = grpo_groups(prompts=8, group_size=4, prompt_len=40, response_len=10)  # 8 equal groups
    for ranks in (2, 4, 8):
        assignment = balance(sequences, ranks)
        for r in range(ranks):
            prompts = {sequences[i].name.split("/")[0] for i in assignment.sequences(r)}
            assert len(prompts) == 8 // ranks, f"K={ranks}: a group was split"
        assert evaluate(assignment, sequences, CostModel()).compression_kept == 1.0


def test_a_tree_bigger_than_a_fair_share_is_split_along_its_subtrees():
    """One agent batch = one tree (shared system prompt): 2 ranks cut it at the task fork, not inside an episode."""
    sequences = agent_trees(AgentShape(tasks=2, samples_per_task=3).scaled(0.05))
    assignment = balance(sequences, 2)
    tasks = [{sequences[i].name.split("/")[0] for i in assignment.sequences(r)} for r in range(2)]
    assert tasks == [{"task0"}, {"task1"}] or tasks == [{"task1"}, {"task0"}]
    ours = evaluate(assignment, sequences, CostModel())
    system_prompt = TrieOrder(sequences).common_prefix()
    assert ours.computed_tokens == ours.unique_tokens + system_prompt  # only the system prompt is computed twice
    four = evaluate(balance(sequences, 4), sequences, CostModel())  # 2 tasks, 4 ranks: now the tasks must split
    assert four.makespan < 0.7 * evaluate(lpt(sequences, 4), sequences, CostModel()).makespan


def test_micro_batches_respect_the_budget_and_keep_groups():
    sequences = grpo_groups(prompts=6, group_size=4, prompt_len=30, response_len=10, jitter=0.5)
    group_tokens = max(unique_tokens(sequences[4 * p: 4 * p + 4]) for p in range(6))
    assignment = balance(sequences, 2, micro_batch_tokens=group_tokens)
    for r in range(2):
        for batch in assignment.micro_batches(r):
            assert unique_tokens([sequences[i] for i in batch]) <= group_tokens
            assert len({sequences[i].name.split("/")[0] for i in batch}) == 1  # one whole group per micro-batch


def test_more_ranks_than_sequences_and_determinism():
    sequences = random_trees(sequences=3, length=20, sharing=2.0)
    assignment = balance(sequences, 8)
    assert sum(1 for r in range(8) if assignment.sequences(r)) == 3
    big = agent_trees(AgentShape(tasks=3, samples_per_task=2).scaled(0.02), seed=3)
    first = balance(big, 4, micro_batch_tokens=400, cost=FITTED)
    assert all(balance(big, 4, micro_batch_tokens=400, cost=FITTED).ranks == first.ranks for _ in range(2))


def test_fitted_model_beats_lpt_on_agent_trees():
    sequences = agent_trees(AgentShape(tasks=2, samples_per_task=4).scaled(0.05))
    for ranks in (2, 4, 8):
        ours = evaluate(balance(sequences, ranks, cost=FITTED), sequences, FITTED)
        assert ours.makespan <= evaluate(lpt(sequences, ranks), sequences, FITTED).makespan
        assert ours.makespan <= evaluate(first_fit(sequences, ranks), sequences, FITTED).makespan
        if ranks > 2:
            assert ours.makespan < 0.9 * min(evaluate(m(sequences, ranks), sequences, FITTED).makespan for m in (lpt, first_fit))
    assert np.isfinite(ours.imbalance)


def test_context_parallel_ranks_split_the_long_sequences_and_train_the_rest_alone():
    """A group of 4 context-parallel ranks: sequences of `min_tokens` or more (and any too costly for one rank's even
    share) are split over all 4, the rest balanced over the ranks alone; every sequence of the share runs once."""
    sequences = grpo_groups(prompts=6, group_size=4, prompt_len=30, response_len=10, jitter=0.5)
    sequences += random_trees(sequences=2, length=400, sharing=1.0, seed=1)  # two long trajectories
    share = list(range(len(sequences)))
    split = split_over_context(sequences, share, 4, min_tokens=200, micro_batch_tokens=1000)
    together = sorted(i for batch in split.together for i in batch)
    assert together == [len(sequences) - 2, len(sequences) - 1]
    alone = [sorted(i for batch in rank for i in batch) for rank in split.alone]
    assert sorted(together + [i for rank in alone for i in rank]) == share
    costs = [CostModel()([sequences[i] for i in rank]) for rank in alone]
    assert all(rank for rank in alone) and max(costs) < 1.5 * min(costs)
    # no threshold: one sequence that is most of the group's cost is split all the same; 0 splits every one
    assert split_over_context(sequences, share, 4, min_tokens=10**6).together == split.together
    everything = split_over_context(sequences, share, 4, min_tokens=0)
    assert sorted(i for batch in everything.together for i in batch) == share
    assert everything.alone == [[], [], [], []]

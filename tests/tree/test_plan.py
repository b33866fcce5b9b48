"""The walk planner: every node runs once, in a unit below a node on the path, and the graphs held at once
stay within the budget; the cost model keeps a graph only where that is cheaper than recomputing it."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treerl.tree import ROOT, PrefixTree, TokenSequence
from treerl.tree.plan import PlanCost, WalkPlan

token_lists = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=10)


def _plan(lists: list[list[int]], chunk: int, capacity: int, unit_tokens: int, recompute: str,
          cost: PlanCost | None = None, rows: bool = False, row_tokens=None) -> WalkPlan:
    tree = PrefixTree.build([TokenSequence(torch.tensor(t)) for t in lists]).chunked(chunk)
    run = [n.length - (0 if n.children else 1) for n in tree.nodes]  # shifted: a leaf's last token predicts nothing
    run[ROOT] = 0
    return WalkPlan(tree, run, capacity, unit_tokens, recompute, cost or PlanCost(), rows,  # type: ignore[arg-type]
                    row_tokens)


def _ancestors(plan: WalkPlan, node: int) -> list[int]:
    out = []
    while node != ROOT:
        node = plan.tree.nodes[node].parent
        out.append(node)
    return out


@settings(max_examples=300, deadline=None)
@given(
    lists=token_lists,
    chunk=st.sampled_from([1, 2, 3, 100]),
    capacity=st.integers(0, 60),
    unit_tokens=st.sampled_from([0, 1, 4, 16, 8192]),
    recompute=st.sampled_from(["auto", "always", "never"]),
    call=st.sampled_from([0.0, 48.0, 1e6]),
)
def test_plan_runs_every_node_once_below_the_path_within_the_budget(lists, chunk, capacity, unit_tokens, recompute,
                                                                    call):
    plan = _plan(lists, chunk, capacity, unit_tokens, recompute, PlanCost(call=call, forward_call=call / 3))
    tree, run = plan.tree, plan.run
    seen: list[int] = []
    path: set[int] = {ROOT}
    for event, unit, node in plan.walk():
        if event == "enter":
            assert unit.parent in path and all(a in path for a in _ancestors(plan, unit.parent))
            assert unit.tokens == sum(run[n] for n in unit.nodes)
            assert unit.nodes == sorted(unit.nodes)  # preorder: an in-unit node's descendants follow it
            for n in unit.nodes:  # an upper part of the forest below `parent`
                assert tree.nodes[n].parent == unit.parent or tree.nodes[n].parent in unit.nodes
            assert unit.tokens <= max(min(plan.capacity, unit_tokens), max(run[n] for n in unit.nodes))
            assert set(unit.open) == {n for n in unit.nodes if any(c not in unit.nodes for c in tree.nodes[n].children)}
            seen += unit.nodes
        elif event == "push":
            path.update(plan.chain(unit, node))
        elif event == "pop":
            path.difference_update(plan.chain(unit, node))
    assert sorted(seen) == list(range(1, len(tree.nodes)))
    if recompute != "never":  # "never" keeps every graph whatever the budget: the caller's explicit choice
        assert plan.peak_graph_tokens() <= plan.capacity
    if recompute == "always":
        assert not any(u.keep for u in plan.all_units())
    if recompute == "never":
        assert all(u.keep for u in plan.all_units() if u.open)


@settings(max_examples=100, deadline=None)
@given(lists=token_lists)
def test_a_budget_that_holds_the_batch_packs_it_into_one_call(lists):
    plan = _plan(lists, chunk=100, capacity=10_000, unit_tokens=8192, recompute="auto")
    assert len(plan.units) == 1 and not plan.units[0].open


def test_grpo_group_packs_and_the_cost_model_picks_keep_or_recompute():
    group = [[0] * 20 + [1 + i] + [9] * 10 for i in range(8)]  # a 20-token prompt, 8 samples of 11 tokens
    whole = _plan(group, chunk=100, capacity=20 + 8 * 10, unit_tokens=8192, recompute="auto")
    assert len(whole.all_units()) == 1  # the budget holds the group: one call
    # Filling 40 rows takes the prompt and 2 samples; recomputing that unit would run the samples again too,
    # so the prompt goes alone (recomputed) and the samples four to a call below it.
    tight = _plan(group, chunk=100, capacity=40, unit_tokens=8192, recompute="auto")
    assert tight.units[0].nodes == [1] and not tight.units[0].keep
    assert tight.peak_graph_tokens() <= 40 and len(tight.all_units()) == 1 + 2
    # Calls of 30 rows. Keeping the prompt's graph (20) leaves room for one sample a call: 8 calls below;
    # recomputing it (one more forward of 20 rows) runs them 3 to a call.
    dear_calls = _plan(group, chunk=100, capacity=40, unit_tokens=30, recompute="auto", cost=PlanCost())
    assert dear_calls.units[0].nodes == [1] and not dear_calls.units[0].keep
    assert len(dear_calls.all_units()) == 1 + 3
    free_calls = _plan(group, chunk=100, capacity=40, unit_tokens=30, recompute="auto",
                       cost=PlanCost(call=0.0, forward_call=0.0, forward_token=0.33))
    assert free_calls.units[0].keep and len(free_calls.all_units()) == 1 + 7  # prompt + 1 sample, 1 a call below
    assert free_calls.peak_graph_tokens() <= 40


def test_keeping_needs_room_for_a_node_below():
    """A graph is kept only where a node below still fits beside it, whatever the cost model says."""
    cheap_calls = PlanCost(call=0.0, forward_call=1e9, forward_token=1e9)
    tight = _plan([[0] * 40 + [1] * 20, [0] * 40 + [2] * 20], chunk=100, capacity=49, unit_tokens=8192,
                  recompute="auto", cost=cheap_calls)
    assert not tight.units[0].keep and tight.peak_graph_tokens() <= 49  # 40 kept + 19 below > 49
    # With a 30-token prompt, prompt + one child fill the 49 but leave nothing: the prompt alone is kept.
    roomy = _plan([[0] * 30 + [1] * 20, [0] * 30 + [2] * 20], chunk=100, capacity=49, unit_tokens=8192,
                  recompute="auto", cost=cheap_calls)
    assert roomy.units[0].nodes == [1] and roomy.units[0].keep and roomy.peak_graph_tokens() <= 49


def test_unit_tokens_zero_is_one_node_per_call():
    lists = [[0, 1, 2, 3], [0, 1, 3, 3], [0, 2, 2, 2, 2]]
    plan = _plan(lists, chunk=100, capacity=100, unit_tokens=0, recompute="auto")
    assert all(sum(1 for n in u.nodes if plan.run[n]) <= 1 for u in plan.all_units())


@settings(max_examples=300, deadline=None)
@given(
    lists=token_lists,
    chunk=st.sampled_from([1, 2, 3, 100]),
    capacity=st.integers(0, 60),
    unit_tokens=st.sampled_from([0, 1, 4, 16, 8192]),
    recompute=st.sampled_from(["auto", "always", "never"]),
    layer_chunk=st.sampled_from([1, 4]),
)
def test_row_units_are_chains_from_the_parent_and_an_open_row_is_never_padded(lists, chunk, capacity, unit_tokens,
                                                                              recompute, layer_chunk):
    """Row units (a recurrent state): each row a chain hanging below the unit's parent, every row padded to the
    longest, a row that hands its state to calls below unpadded; every node once, within the budget, also when the
    layers pad each row to a chunk (`layer_chunk`: half of a token's graph is in the padded part)."""
    row_tokens = lambda w: -(-(w + -(-w // layer_chunk) * layer_chunk) // 2)  # noqa: E731
    plan = _plan(lists, chunk, capacity, unit_tokens, recompute, rows=True, row_tokens=row_tokens)
    tree, run = plan.tree, plan.run
    seen: list[int] = []
    for unit in plan.all_units():
        assert unit.rows is not None and unit.tokens == row_tokens(unit.width) * len(unit.rows)
        in_rows = {n for row in unit.rows for n in row}
        assert {n for n in unit.nodes if run[n]} == in_rows  # every node with rows is in a row; others have none
        for row in unit.rows:
            assert tree.nodes[row[0]].parent == unit.parent  # every row starts from the parent's state
            assert all(tree.nodes[b].parent == a for a, b in zip(row, row[1:]))
            assert all(n not in unit.open for n in row[:-1])  # only a row's last node hands its state on
            if row[-1] in unit.open:
                assert sum(run[n] for n in row) == unit.width  # no padding after the state it hands on
        if len(unit.rows) > 1:
            assert unit.tokens <= max(min(plan.capacity, unit_tokens), max(row_tokens(run[n]) for n in unit.nodes))
        seen += unit.nodes
    assert sorted(seen) == list(range(1, len(tree.nodes)))
    if recompute != "never":
        assert plan.peak_graph_tokens() <= plan.capacity


def test_row_units_batch_a_grpo_group_by_length():
    """A prompt, then its samples: rows of similar length share a call; one shorter by more than a call's cost
    (PlanCost.call: 48 rows) gets its own call rather than padding."""
    group = [[0] * 10 + [1 + i] + [9] * 60 for i in range(6)] + [[0] * 10 + [8, 9]]
    plan = _plan(group, chunk=100, capacity=1000, unit_tokens=8192, recompute="auto", rows=True)
    prompt, below = plan.units[0], plan.units[0].below[1]
    assert prompt.rows == [[1]] and prompt.width == 10
    assert [len(u.rows) for u in below] == [6, 1] and below[0].width == 60 and below[1].width == 1
    near = _plan([[0] * 10 + [1 + i] + [9] * 60 for i in range(6)] + [[0] * 10 + [8] + [9] * 40], chunk=100,
                 capacity=1000, unit_tokens=8192, recompute="auto", rows=True)
    assert [len(u.rows) for u in near.units[0].below[1]] == [7]  # 20 rows of padding cost less than a call

"""Held-out evaluation of treerl's own tasks: evaluation's items are never among the items training draws, are the
same for the same config (a resumed run evaluates on the same items), and are said (`held_out`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from treerl.rollout import RolloutConfig
from treerl.rollout.tasks import DatasetTask, build_task
from treerl.rollout.tasks.base import Prompt
from treerl.rollout.tasks.heldout import ItemSplit, content_key, split_rows

STEPS, PER_STEP, EVALUATED = 60, 16, 48  # training draws 960 items: every item of a small space, many times over


def zero(prompt, completion, answer):
    return 0.0


def shown_image(prompt: Prompt) -> bytes:
    """A shapes prompt's picture, as pixels."""
    return next(part["image"] for part in prompt.messages[-1]["content"] if part["type"] == "image").tobytes()


def assert_held_out(make: Callable[[], Any], identity: Callable[[Prompt], Any], steps: int = STEPS) -> set:
    """Training's items (`steps` steps) and evaluation's are disjoint; evaluation's set is the same for a task built
    again and a prefix of a longer one; the task says it holds items out. Returns evaluation's items."""
    task = make()
    trained = {identity(p) for step in range(steps) for p in task.prompts(step, PER_STEP)}
    evaluated = [identity(p) for p in task.held_out_prompts(EVALUATED)]
    assert evaluated and not trained & set(evaluated), sorted(map(str, trained & set(evaluated)))[:5]
    assert [identity(p) for p in make().held_out_prompts(EVALUATED)] == evaluated  # fixed: the same on resume
    assert [identity(p) for p in task.held_out_prompts(EVALUATED // 2)] == evaluated[: EVALUATED // 2]
    assert task.held_out.held_out, task.held_out
    return set(evaluated)


@pytest.mark.parametrize("task, options, identity", [
    ("arithmetic", {"max_operand": 4}, lambda p: p.text),
    ("arithmetic_chat", {"max_operand": 9}, lambda p: p.text),
    ("guess_number", {"max_number": 9}, lambda p: p.answer),
    ("shapes", {"max_shapes": 2}, shown_image),
    ("agent_tools", {}, lambda p: content_key(p.answer)),
], ids=["arithmetic", "arithmetic_chat", "guess_number", "shapes", "agent_tools"])
def test_a_generated_tasks_evaluation_items_are_never_trained_on(task, options, identity):
    config = RolloutConfig(task=task, seed=3, **options)
    held = assert_held_out(lambda: build_task(config), identity)
    if task == "arithmetic":  # 25 sums: round(0.1 x 25) = 2 held out, and the other 23 are all trained on
        built = build_task(config)
        assert len(held) == 2 and built.held_out.items == 2 and built.held_out.of == 25
        assert len({p.text for step in range(STEPS) for p in built.prompts(step, PER_STEP)}) == 23
    if task == "guess_number":  # one of the nine secrets
        assert len(held) == 1


def test_no_items_held_out_with_fraction_zero_or_a_single_item():
    """eval_fraction 0 (or a space of one item) holds nothing out, and says so: evaluation then asks training's items."""
    task = build_task(RolloutConfig(task="arithmetic", eval_fraction=0.0))
    assert not task.held_out.held_out and "rollout.eval_fraction=0" in task.held_out.how
    trained = {p.text for step in range(STEPS) for p in task.prompts(step, PER_STEP)}
    assert len(trained) == 25 and {p.text for p in task.held_out_prompts(8)} <= trained
    single = ItemSplit("one", 0, 0.5, size=1)
    assert not single.holds_out and not single.describe("sums").held_out and "only one sum" in single.describe("sums").how
    with pytest.raises(ValueError, match=r"rollout.eval_fraction=1 must be a number in \[0, 1\)"):
        RolloutConfig(eval_fraction=1).check()
    with pytest.raises(ValueError, match="rollout.eval_data_path is for rollout.task=dataset or agent"):
        RolloutConfig(eval_data_path="x.jsonl").check()


def test_a_listed_split_holds_out_the_share_at_least_one_never_all():
    for size, fraction, expected in ((25, 0.1, 2), (9, 0.1, 1), (2, 0.9, 1), (100, 0.25, 25), (3, 0.5, 2)):
        split = ItemSplit("t", 1, fraction, size)
        assert sum(split.held(k) for k in range(size)) == expected, (size, fraction)
    hashed = ItemSplit("t", 1, 0.2)
    share = sum(hashed.held(f"item{k}") for k in range(5000)) / 5000
    assert 0.17 < share < 0.23 and hashed.held("item7") == ItemSplit("t", 1, 0.2).held("item7")
    assert {ItemSplit("t", seed, 0.1, 25).listed for seed in range(5)} != {ItemSplit("t", 0, 0.1, 25).listed}


def test_rows_split_by_their_prompt_duplicates_on_one_side(tmp_path):
    """A dataset holds out a seeded share of its distinct prompts: a prompt written twice is on one side only."""
    rows = [{"prompt": f"q{k % 30}", "answer": k} for k in range(60)]  # 30 distinct prompts, each twice
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    make = lambda: DatasetTask.load(path, zero, seed=2, eval_fraction=0.2)
    held = assert_held_out(make, lambda p: p.text)
    task = make()
    assert len(held) == 6 and task.held_out.items == 6 and task.held_out.of == 30
    assert len(task.prompts_data) == 48 and len(task.held_out_data) == 12
    assert split_rows(["a", "a"], 0.5, 0, "x") == ([0, 1], [])  # one distinct prompt: nothing to hold out
    one = DatasetTask.load(path, zero, eval_fraction=0)
    assert not one.held_out.held_out and len(one.prompts_data) == 60


def test_eval_data_path_rows_less_those_training_has(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"q{k}"}) + "\n" for k in range(10)))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"prompt": f"q{k}"}) + "\n" for k in range(8, 14)))
    config = RolloutConfig(task="dataset", data_path=str(tmp_path / "train.jsonl"), reward_fn="x:y",
                           eval_data_path=str(tmp_path / "eval.jsonl"))
    task = build_task(config, zero)
    assert len(task.prompts_data) == 10  # every training row trained on
    assert {p.text for p in task.held_out_prompts(8)} == {f"q{k}" for k in range(10, 14)}
    assert task.held_out.items == 4 and "2 of its rows left out: training has their prompt" in task.held_out.how
    (tmp_path / "eval.jsonl").write_text(json.dumps({"prompt": "q1"}) + "\n")
    with pytest.raises(ValueError, match=r"eval_data_path=.*every one of its 1 rows asks a prompt that "
                                         "rollout.data_path also has"):
        build_task(config, zero)


def test_an_agents_tasks_are_split_by_the_whole_task(tmp_path):
    """rollout.task=agent: a task is its whole row (two rows with one shown prompt are two tasks)."""
    rows = [{"prompt": "same", "id": k} for k in range(20)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = RolloutConfig(task="agent", data_path=str(tmp_path / "tasks.jsonl"), agent="a.py:episode")
    held = assert_held_out(lambda: build_task(config), lambda p: p.answer["id"])
    assert len(held) == 2

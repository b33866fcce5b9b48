"""Built-in tasks and the loaders of a user's data."""

from __future__ import annotations

import json

import pytest

from treerl.errors import DataError
from treerl.rollout.tasks import Arithmetic, DatasetTask, GuessNumber
from treerl.rollout.tasks.arithmetic import reward as arithmetic_reward
from treerl.rollout.tasks.dataset import read_rows
from treerl.rollout.tasks.guess_number import FORMAT_CREDIT


def _zero(prompt, completion, answer):
    return 0.0


@pytest.mark.parametrize(
    "completion, expected",
    [("12", 1.0), ("13", 0.2), ("1a", 0.1), (" 12 ", 0.2 * 0.5 * 0.5), ("123456", 0.2 * 2 / 6), ("ab", 0.0), ("", 0.0)],
)
def test_arithmetic_reward_partial_credit(completion, expected):
    assert arithmetic_reward(prompt="5+7=", completion=completion, answer=12) == pytest.approx(expected)


def test_arithmetic_prompts_are_a_function_of_the_step():
    task = Arithmetic(max_operand=5, seed=1)
    a, b = task.prompts(3, 10), task.prompts(3, 10)
    assert [p.messages for p in a] == [p.messages for p in b]
    assert [p.messages for p in a] != [p.messages for p in task.prompts(4, 10)]
    for p in a:
        x, y = p.text.rstrip("=").split("+")
        assert 0 <= int(x) <= 5 and 0 <= int(y) <= 5 and p.answer == int(x) + int(y)
    assert task.max_new_tokens == 4  # "10" + stop + spare
    with pytest.raises(ValueError, match="max_operand"):
        Arithmetic(max_operand=0)


def test_guess_environment_feedback_and_rewards():
    task = GuessNumber(max_number=9, max_turns=3)
    env = task.environment(task.prompts(0, 1)[0])
    env.secret = 6
    first = env.step("3")
    assert first.messages == [{"role": "tool", "content": "higher"}] and not first.done
    assert first.reward == pytest.approx(FORMAT_CREDIT)
    second = env.step(" 8")  # a guess inside noise counts, without format credit
    assert second.messages[0]["content"] == "lower" and second.reward == 0.0
    win = env.step("6")
    assert win.done and win.messages[0]["content"] == "correct"
    assert win.reward == pytest.approx(FORMAT_CREDIT + 1.0 - 0.2)


def test_guess_environment_closeness_credit_at_the_last_turn():
    env = GuessNumber(max_number=9, max_turns=2).environment(GuessNumber().prompts(0, 1)[0])
    env.secret = 9
    assert env.step("no number").messages[0]["content"] == "1-9?"
    last = env.step("7")
    assert last.done and last.reward == pytest.approx(FORMAT_CREDIT + 0.5 * (1 - 2 / 9))


def test_jsonl_rows_with_string_or_chat_prompts(tmp_path):
    """rollout.system_prompt comes first in a string prompt and in chat messages alike; a row with a system message
    of its own is refused with it, naming the row (which would win is not treerl's to guess)."""
    path = tmp_path / "data.jsonl"
    rows = [{"q": "2+2?", "a": "4"}, {"q": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "?"},
                                            {"role": "user", "content": "3+3?"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = DatasetTask.load(path, _zero, prompt_key="q", answer_key="a", system_prompt="be brief", shuffle=False,
                            eval_fraction=0)
    first, second = task.prompts(0, 2)
    assert first.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert first.answer == "4" and first.text == "2+2?"
    assert second.messages == [{"role": "system", "content": "be brief"}, *rows[1]["q"]] and second.answer is None
    own = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    path.write_text(json.dumps({"q": own}) + "\n")
    assert DatasetTask.load(path, _zero, prompt_key="q", eval_fraction=0).prompts(0, 1)[0].messages == own
    with pytest.raises(DataError, match=r"data.jsonl:1: field 'q' has a system message of its own and "
                                        r"rollout.system_prompt is set: remove one of the two"):
        DatasetTask.load(path, _zero, prompt_key="q", system_prompt="be brief", eval_fraction=0)


def test_datasets_directory_and_parquet(tmp_path):
    import datasets

    data = datasets.Dataset.from_dict({"prompt": ["a", "b", "c"], "answer": [1, 2, 3]})
    data.save_to_disk(str(tmp_path / "saved"))
    data.to_parquet(str(tmp_path / "data.parquet"))
    assert read_rows(tmp_path / "saved") == read_rows(tmp_path / "data.parquet") == [
        {"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2}, {"prompt": "c", "answer": 3}
    ]
    datasets.DatasetDict({"test": data}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match="without a 'train' split"):
        read_rows(tmp_path / "dict")


def test_every_row_once_per_epoch_and_stateless_order(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": str(i), "answer": i}) + "\n" for i in range(10)))
    task = DatasetTask.load(path, _zero, seed=3, eval_fraction=0)
    epoch = [p.answer for step in range(5) for p in task.prompts(step, 2)]
    assert sorted(epoch) == list(range(10)) and epoch != list(range(10))
    fresh = DatasetTask.load(path, _zero, seed=3, eval_fraction=0)
    assert [p.answer for p in fresh.prompts(7, 2)] == [p.answer for p in task.prompts(7, 2)]
    assert len({p.id for p in task.prompts(4, 3)}) == 3  # ids unique within a step, across an epoch boundary


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a"}\nnot json\n', r"d.jsonl:2: not valid JSON"),
        ('{"text": "a"}\n', r"d.jsonl:1: no field 'prompt' \(fields: text\)"),
        ('{"prompt": 5}\n', "must be a string or a list of"),
        ('[1, 2]\n', "expected a JSON object"),
        ("\n", "no rows"),
    ],
)
def test_bad_data_is_a_clear_error(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        DatasetTask.load(tmp_path / "d.jsonl", _zero)


def test_missing_data_path_and_unknown_format(tmp_path):
    with pytest.raises(DataError, match="only reads local data"):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown data format"):
        read_rows(tmp_path / "d.txt")

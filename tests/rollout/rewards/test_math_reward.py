"""The built-in math reward: Hugging Face's math-verify decides, in a worker process where its own time limits work
(rewards run in a thread, where math-verify's signal-based limits cannot); a stuck worker is killed, not waited on."""

from __future__ import annotations

import os
import signal

import pytest

from treerl.rollout.rewards.functions import RewardFailure, UserCode, call_reward, load_reward_fn
from treerl.rollout.rewards.math_reward import MathVerify, math_verify


@pytest.fixture(scope="module")
def verifier():
    verifier = MathVerify()
    yield verifier
    verifier.stop()


@pytest.mark.parametrize(("answer", "completion", "expected"), [
    ("0.5", "The answer is \\boxed{\\frac{1}{2}}", 1.0),
    ("\\frac{1}{2}", "so x = 1/2", 1.0),
    ("2", "$\\sqrt{4}$", 1.0),
    ("12", "12", 1.0),
    ("1/2", "it is 3", 0.0),
    ("7", "no answer here", 0.0),
    ("\\frac{1}{2}", "$\\frac{1}{3}$", 0.0),
])
def test_equivalent_answers_are_accepted_and_wrong_ones_rejected(verifier, answer, completion, expected):
    assert verifier(prompt="", completion=completion, answer=answer) == expected


def test_the_path_configs_wrote_before_rollouts_rooms_still_loads():
    """`rollout.reward_fn=treerl.rollout.math_reward:math_verify`: the same function as its path in `rewards/`."""
    assert load_reward_fn("treerl.rollout.math_reward:math_verify") is math_verify


def test_it_is_a_reward_function_that_runs_in_a_worker_thread():
    fn = load_reward_fn("treerl.rollout.rewards.math_reward:math_verify")
    assert fn is math_verify
    try:  # call_reward runs it in treerl's user-code thread, where math-verify's own signal alarms would fail
        assert call_reward(lambda: fn(prompt="", completion="x = 0.25", answer="1/4"), UserCode(60)) == 1.0
        missing = call_reward(lambda: fn(prompt="", completion="1", answer=None), UserCode(60))
        assert isinstance(missing, RewardFailure) and "reference answer" in missing.message
    finally:
        math_verify.stop()


def test_a_worker_that_does_not_answer_in_time_is_killed_and_replaced(verifier, monkeypatch):
    assert verifier(prompt="", completion="3", answer="3") == 1.0
    stuck = verifier._worker
    os.kill(stuck.pid, signal.SIGSTOP)  # stuck where no signal of its own reaches it (as in C code)
    monkeypatch.setattr(MathVerify, "limit", property(lambda self: 0.3))
    with pytest.raises(TimeoutError, match="its worker was killed"):
        verifier(prompt="", completion="3", answer="3")
    assert stuck.poll() is not None and verifier._worker is None
    monkeypatch.undo()
    assert verifier(prompt="", completion="4", answer="4") == 1.0

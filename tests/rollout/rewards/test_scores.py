"""Evaluation scores: pass@k against a count of every k-subset of the samples, mean@n, standard errors and paired
differences worked out by hand, dropped samples counted as failing, a multi-turn trajectory counted once."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from treerl.rollout.rewards.scores import PromptScore, by_environment, paired, pass_at_k, prompt_scores, summarise
from treerl.tree import TokenSequence


def counted(n: int, c: int, k: int) -> Fraction:
    """pass@k by hand: of all k-subsets of n samples (the first c pass), the share holding a passing one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_the_share_of_k_subsets_that_pass(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(float(counted(n, c, k)), abs=1e-12)


def test_pass_at_k_by_hand_and_its_refusals():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4) and pass_at_k(5, 4, 2) == 1.0 and pass_at_k(5, 0, 5) == 0.0
    for n, c, k in ((4, 5, 1), (4, 1, 5), (4, 1, 0)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def seq(group: str, trajectory: str, reward: float, env: str | None = None, turn: int = 0, **metrics: float):
    info = {"group": group, "trajectory": trajectory, "reward": reward, "turn": turn, "env_metrics": metrics}
    if env is not None:
        info["env"] = env
    return TokenSequence(torch.tensor([1, 2, 3]), {"loss_mask": torch.tensor([0.0, 1.0, 1.0])}, info, trajectory)


def test_scores_by_hand_dropped_samples_fail_and_trajectories_count_once():
    sequences = [
        seq("a", "a/0", 1.0, answered=1.0), seq("a", "a/1", 0.5, answered=1.0), seq("a", "a/2", 1.0, answered=0.0),
        # prompt a: 3 of 4 kept (one dropped), 2 pass
        seq("b", "b/0", 0.0, turn=0), seq("b", "b/0", 0.0, turn=1), seq("b", "b/1", 1.0),  # b/0: two model calls
        seq("b", "b/2", 0.0), seq("b", "b/3", 1.0),
    ]
    scores = prompt_scores(sequences, samples=4, pass_reward=1.0, prompts=[("a", None), ("b", None), ("c", None)])
    a, b, c = scores
    assert (a.rewards, a.passed, b.rewards, b.passed, c.rewards) == ([1.0, 0.5, 1.0], 2, [0.0, 1.0, 0.0, 1.0], 2, [])
    assert math.isnan(c.reward_mean()) and c.mean_at_n() == 0.0 and c.pass_at(4) == 0.0  # every sample dropped
    table = summarise(scores, [1, 2])
    assert (table["prompts"], table["samples"], table["kept"]) == (3, 12, 7)
    assert table["reward_mean"] == pytest.approx((2.5 / 3 + 0.5) / 2)  # c has no kept sample
    assert table["reward_mean_se"] == pytest.approx(abs(2.5 / 3 - 0.5) / math.sqrt(2) / math.sqrt(2))
    assert table["mean@4"] == pytest.approx((0.5 + 0.5 + 0) / 3)
    assert table["pass@2"] == pytest.approx((1 - 1 / 6) * 2 / 3)  # a and b: 1 - C(2,2)/C(4,2); c: 0
    assert table["mean@4_se"] == pytest.approx(math.sqrt(((1 / 6) ** 2 * 2 + (1 / 3) ** 2) / 2) / math.sqrt(3))
    assert table["metrics"] == {"answered": pytest.approx(2 / 3)}
    with pytest.raises(ValueError, match="more than the 1 samples asked"):
        prompt_scores(sequences, samples=1, pass_reward=1.0)


def test_environments_and_paired_differences_by_hand():
    mine = prompt_scores([seq("p", "p/0", 1.0, "x"), seq("p", "p/1", 1.0, "x"), seq("q", "q/0", 0.0, "y"),
                          seq("q", "q/1", 1.0, "y")], samples=2, pass_reward=1.0)
    theirs = prompt_scores([seq("p", "p/0", 0.0, "x"), seq("p", "p/1", 1.0, "x"), seq("q", "q/0", 0.0, "y"),
                            seq("q", "q/1", 0.0, "y")], samples=2, pass_reward=1.0)
    envs = by_environment(mine, [1])
    assert set(envs) == {"x", "y"} and envs["x"]["reward_mean"] == 1.0 and math.isnan(envs["x"]["reward_mean_se"])
    diff = paired(mine, theirs, [1, 2])
    assert diff["reward_mean"] == {"a": 0.75, "b": 0.25, "diff": 0.5, "se": 0.0}  # differences 0.5 and 0.5
    assert diff["pass@2"]["diff"] == pytest.approx(0.5) and diff["pass@2"]["se"] == pytest.approx(0.5)  # 0 and 1
    with pytest.raises(ValueError, match="different prompts"):
        paired(mine, [PromptScore("r", None, 2)], [1])

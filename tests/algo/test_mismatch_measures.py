"""The mismatch measures against their formulas written out, on tokens chosen by mask and version."""

from __future__ import annotations

import math

import pytest
import torch

from treerl.algo import AlgoConfig, correct_rollout
from treerl.algo.mismatch import correction_metrics, measured_tokens, mismatch_metrics
from treerl.tree import TokenSequence


def sequence(behaviour: list[float], train: list[float], mask: list[float], versions: list[int]) -> TokenSequence:
    n = len(behaviour)
    return TokenSequence(torch.arange(n), {"old_logprobs": torch.tensor(behaviour, dtype=torch.float64),
                                           "prox_logprobs": torch.tensor(train, dtype=torch.float64),
                                           "loss_mask": torch.tensor(mask), "versions": torch.tensor(versions)})


def test_the_measures_are_their_formulas() -> None:
    """Two sequences sharing token 1 with their own behaviour log-probs; the stale token (version 2) is not measured."""
    log2 = math.log(2.0)
    a = sequence([0.0, -1.0, -2.0, -1.0], [0.0, -1.0 + 2 * log2, -2.0 - 0.1, -1.0], [0, 1, 1, 1], [-1, 3, 3, 2])
    b = sequence([0.0, -1.5, -0.5], [0.0, -1.0 + 2 * log2, -0.5], [0, 1, 1], [-1, 3, 3])
    measured = [measured_tokens(seq, version=3) for seq in (a, b)]
    assert [m.tolist() for m in measured] == [[False, True, True, False], [False, True, True]]
    got = mismatch_metrics([a.fields["prox_logprobs"], b.fields["prox_logprobs"]],
                           [a.fields["old_logprobs"], b.fields["old_logprobs"]], measured)
    d = [2 * log2, -0.1, 0.5 + 2 * log2, 0.0]  # log pi_train - log pi_behav on the four measured tokens
    r = [math.exp(x) for x in d]
    assert got["mismatch/tokens"] == 4
    assert got["mismatch/abs_logprob_diff_mean"] == pytest.approx(sum(abs(x) for x in d) / 4)
    assert got["mismatch/abs_logprob_diff_max"] == pytest.approx(0.5 + 2 * log2)
    assert got["mismatch/kl_k1"] == pytest.approx(-sum(d) / 4)
    assert got["mismatch/kl_k3"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 4)
    assert got["mismatch/ratio_outside_half_two"] == 0.5  # 4 and 6.6 lie above 2
    assert got["mismatch/ratio_min"] == pytest.approx(math.exp(-0.1)) and got["mismatch/ratio_max"] == pytest.approx(r[2])
    assert got["mismatch/ratio_p50"] == pytest.approx((1.0 + 4.0) / 2)  # linear interpolation of 0.905, 1, 4, 6.6
    geometric = [math.exp((2 * log2 - 0.1) / 2), math.exp((0.5 + 2 * log2) / 2)]
    assert got["mismatch/seq_geo_ratio_mean"] == pytest.approx(sum(geometric) / 2)
    assert got["mismatch/seq_geo_ratio_min"] == pytest.approx(geometric[0])
    assert measured_tokens(a, version=None).tolist() == [False, True, True, True]  # no version: every trained token


def test_a_ratio_below_one_half_is_outside_too() -> None:
    a = sequence([0.0, -1.0, -1.0], [0.0, -1.0 - math.log(3.0), -1.0 + math.log(1.9)], [0, 1, 1], [-1, 0, 0])
    got = mismatch_metrics([a.fields["prox_logprobs"]], [a.fields["old_logprobs"]], [measured_tokens(a, 0)])
    assert got["mismatch/ratio_outside_half_two"] == 0.5 and got["mismatch/kl_k1"] == pytest.approx(
        (math.log(3.0) - math.log(1.9)) / 2)


def test_nothing_measured_is_said_not_made_up() -> None:
    a = sequence([0.0, -1.0], [0.0, -1.0], [0, 1], [-1, 1])
    assert mismatch_metrics([a.fields["prox_logprobs"]], [a.fields["old_logprobs"]], [measured_tokens(a, 2)]) == {
        "mismatch/tokens": 0.0}


def test_what_a_preset_did() -> None:
    """decoupled_token_rs at R = 2 drops the token whose ratio is 4, keeps the one at 1.1; the mismatch is measured on
    both (verl's measures read the mask before its rejection)."""
    a = sequence([0.0, -2.0, -1.0], [0.0, -2.0 + math.log(4.0), -1.0 + math.log(1.1)], [0, 1, 1], [-1, 0, 0])
    correct_rollout(AlgoConfig(rollout_correction="decoupled_token_rs"), [a])
    assert a.fields["loss_mask"].tolist() == [0, 0, 1]
    assert correction_metrics([a]) == {"rollout_correction/weight_mean": 0.5, "rollout_correction/dropped": 0.5}
    assert measured_tokens(a, version=0).tolist() == [False, True, True]
    b = sequence([0.0, -2.0, -1.0], [0.0, -2.0 + math.log(1.5), -1.0 + math.log(1.1)], [0, 1, 1], [-1, 0, 0])
    correct_rollout(AlgoConfig(rollout_correction="decoupled_token_is"), [b])  # min(r, 2): nothing dropped
    assert correction_metrics([b]) == {"rollout_correction/weight_mean": pytest.approx(1.3),
                                       "rollout_correction/dropped": 0.0}

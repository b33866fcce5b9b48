"""Known answers for advantages: group normalisation, leave-one-out, GAE, returns, multi-turn and per-turn rewards."""

from __future__ import annotations

import pytest
import torch

from treerl.algo import (
    AlgoConfig,
    compute_advantages,
    gae,
    group_advantages,
    rloo_advantages,
    token_rewards,
    turn_returns,
)
from treerl.algo.advantages import step_discounts, turn_spans, whiten
from treerl.tree import BatchError, TokenSequence


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0, 5.0, 7.0])
    groups = ["a", "a", "a", "a", "b", "b", "c"]
    std_a = (4 * 0.25 / 3) ** 0.5  # unbiased std of [1, 0, 1, 0]
    got = group_advantages(rewards, groups, scale_std=True, eps=0.0)
    want = [0.5 / std_a, -0.5 / std_a, 0.5 / std_a, -0.5 / std_a, -1 / 2**0.5, 1 / 2**0.5, 0.0]
    assert got.tolist() == pytest.approx(want)
    # Dr. GRPO: centred only; a group of one has no baseline.
    assert group_advantages(rewards, groups, scale_std=False).tolist() == pytest.approx(
        [0.5, -0.5, 0.5, -0.5, -1, 1, 0]
    )


def test_group_of_equal_rewards_has_zero_advantage() -> None:
    assert group_advantages(torch.tensor([2.0, 2.0, 2.0]), [0, 0, 0]).tolist() == [0.0, 0.0, 0.0]


def test_rloo_by_hand() -> None:
    got = rloo_advantages(torch.tensor([1.0, 0.0, 2.0, 4.0, 6.0]), [0, 0, 0, 1, 1])
    assert got.tolist() == pytest.approx([1 - 1.0, 0 - 1.5, 2 - 0.5, 4 - 6, 6 - 4])
    with pytest.raises(ValueError, match="leave-one-out"):
        rloo_advantages(torch.tensor([1.0, 2.0]), [0, 1])


def reference_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """The textbook loop over one episode of actions, terminal at the end."""
    advantages, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        advantages[t] = last
    return advantages


def test_gae_matches_the_textbook_loop_and_skips_untrained_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1, 0, 1], dtype=torch.float64)
    rewards, values = (
        torch.randn(10, generator=gen, dtype=torch.float64),
        torch.randn(10, generator=gen, dtype=torch.float64),
    )
    rewards[mask == 0] = 0.0
    actions = mask.nonzero().flatten()
    for gamma, lam in [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)]:
        discounts = torch.where(mask > 0, gamma, 0.0)
        adv, returns = gae(rewards, values, mask, discounts, lam)
        want = reference_gae(rewards[actions].tolist(), values[actions].tolist(), gamma, lam)
        assert adv[actions].tolist() == pytest.approx(want)
        assert adv[mask == 0].tolist() == [0.0] * 4 and returns[mask == 0].tolist() == [0.0] * 4
        assert returns[actions].tolist() == pytest.approx((torch.tensor(want) + values[actions]).tolist())


def test_gae_small_numbers_by_hand() -> None:
    # actions at 1, 2 with V = 0.5, 0.25, reward 1 at the end, gamma 0.9, lambda 0.8:
    # delta_2 = 1 - 0.25 = 0.75; delta_1 = 0 + 0.9 * 0.25 - 0.5 = -0.275; A_1 = -0.275 + 0.72 * 0.75 = 0.265.
    mask = torch.tensor([0.0, 1.0, 1.0])
    adv, returns = gae(
        torch.tensor([0.0, 0.0, 1.0]), torch.tensor([9.0, 0.5, 0.25]), mask, step_discounts(mask, 0.9, 1.0), 0.8
    )
    assert adv.tolist() == pytest.approx([0.0, 0.265, 0.75])
    assert returns.tolist() == pytest.approx([0.0, 0.765, 1.0])


def test_turns_and_per_turn_rewards() -> None:
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1])
    assert turn_spans(mask) == [(1, 3), (5, 6), (7, 9)]
    assert token_rewards(mask, [1.0, 2.0, 3.0]).tolist() == [0, 0, 1, 0, 0, 2, 0, 0, 3]
    assert token_rewards(mask, 5.0).tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 5]
    assert token_rewards(torch.zeros(4), 5.0).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="2 per-turn rewards for 3 turns"):
        token_rewards(mask, [1.0, 2.0])
    assert turn_returns([1.0, 2.0, 3.0], 0.5) == pytest.approx([1 + 0.5 * (2 + 0.5 * 3), 2 + 0.5 * 3, 3])
    # gamma inside a turn, gamma * turn_discount from a turn's last token to the next turn.
    assert step_discounts(mask, 0.9, 0.5).tolist() == pytest.approx([0, 0.9, 0.45, 0, 0, 0.45, 0, 0.9, 0.45])


def multi_turn(reward) -> TokenSequence:
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.float32)
    return TokenSequence(torch.arange(9), {"loss_mask": mask}, {"reward": reward, "group": 0})


def test_returns_discount_across_turns() -> None:
    # gamma = 1, turn_discount = 0.5: every token of turn k gets G_k = r_k + 0.5 G_{k+1}.
    seq = multi_turn([1.0, 2.0, 3.0])
    compute_advantages(AlgoConfig(loss="reinforce_pp", whiten=False, turn_discount=0.5), [seq])
    g = turn_returns([1.0, 2.0, 3.0], 0.5)
    assert seq.fields["advantages"].tolist() == pytest.approx([0, g[0], g[0], 0, 0, g[1], 0, g[2], g[2]])


def test_reinforce_pp_whitens_over_the_whole_batch_with_kl_in_the_reward() -> None:
    a, b = multi_turn(1.0), multi_turn(0.0)
    for seq, shift in [(a, 0.1), (b, -0.2)]:
        seq.fields["old_logprobs"] = torch.full((9,), -1.0)
        seq.fields["ref_logprobs"] = torch.full((9,), -1.0 - shift)
    config = AlgoConfig(loss="reinforce_pp", kl_coef=0.5, kl_estimator="k1")
    compute_advantages(config, [a, b])
    # per token reward -0.5 * k1 = -0.5 * shift on each trained token, + outcome on the last; returns with gamma 1.
    raw = []
    for outcome, shift in [(1.0, 0.1), (0.0, -0.2)]:
        r = [-0.5 * shift] * 5
        r[-1] += outcome
        raw.append([sum(r[t:]) for t in range(5)])
    flat = torch.tensor(raw[0] + raw[1], dtype=torch.float64)
    want = ((flat - flat.mean()) / (flat.std() + 1e-6)).tolist()
    trained = a.fields["loss_mask"] > 0
    assert a.fields["advantages"][trained].tolist() + b.fields["advantages"][trained].tolist() == pytest.approx(
        want, rel=1e-5
    )


def test_compute_advantages_gae_writes_returns() -> None:
    seq = TokenSequence(
        torch.arange(3),
        {"loss_mask": torch.tensor([0.0, 1.0, 1.0]), "values": torch.tensor([0.0, 0.5, 0.25])},
        {"reward": 1.0},
    )
    compute_advantages(AlgoConfig(loss="ppo", whiten=False, gamma=0.9, lam=0.8), [seq])
    assert seq.fields["advantages"].tolist() == pytest.approx([0.0, 0.265, 0.75])
    assert seq.fields["returns"].tolist() == pytest.approx([0.0, 0.765, 1.0])


@pytest.mark.parametrize(
    "loss, per_sequence",
    [("grpo", [1 / 2**0.5, -1 / 2**0.5, 0.0]), ("dr_grpo", [0.5, -0.5, 0.0]), ("rloo", [1.0, -1.0, None])],
)
def test_compute_advantages_group_estimators(loss: str, per_sequence: list) -> None:
    batch = [
        TokenSequence(torch.arange(4), {"loss_mask": torch.tensor([0.0, 0.0, 1.0, 1.0])}, {"reward": r, "group": g})
        for r, g in [(1.0, "p"), (0.0, "p"), (3.0, "q")]
    ]
    if loss == "rloo":
        with pytest.raises(BatchError, match=r"sequence 2: field 'group' 'q' has no other member"):
            compute_advantages(AlgoConfig(loss=loss), batch)
        batch = batch[:2]
    compute_advantages(AlgoConfig(loss=loss, adv_eps=0.0), batch)
    for seq, a in zip(batch, per_sequence):
        assert seq.fields["advantages"].tolist() == pytest.approx([0.0, 0.0, a, a])


def test_whiten_uses_trained_tokens_only() -> None:
    values = [torch.tensor([9.0, 1.0, 2.0]), torch.tensor([9.0, 3.0])]
    masks = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0])]
    out = whiten(values, masks, eps=0.0)
    assert torch.cat(out).tolist() == pytest.approx([0.0, -1.0, 0.0, 0.0, 1.0])


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "rloo"])
def test_group_baseline_counts_each_multi_turn_trajectory_once(loss: str) -> None:
    """A trajectory of k model calls emits k sequences with its reward; the group's statistics see it once."""
    calls = {"t0": 3, "t1": 1, "t2": 1}  # t0 made three calls: counted per sequence it would drag the mean to 1
    rewards = {"t0": 1.0, "t1": 0.0, "t2": 0.0}
    batch = [
        TokenSequence(torch.arange(4), {"loss_mask": torch.tensor([0.0, 0.0, 1.0, 1.0])},
                 {"reward": rewards[t], "group": "episode", "trajectory": t}, name=f"{t}/turn{k}")
        for t, n in calls.items() for k in range(n)
    ]
    compute_advantages(AlgoConfig(loss=loss, adv_eps=0.0), batch)
    r = torch.tensor(list(rewards.values()), dtype=torch.float64)
    if loss == "grpo":
        want = group_advantages(r, ["episode"] * 3, eps=0.0)
    elif loss == "dr_grpo":
        want = group_advantages(r, ["episode"] * 3, scale_std=False)
    else:
        want = rloo_advantages(r, ["episode"] * 3)
    per_trajectory = dict(zip(calls, want.tolist()))
    for seq in batch:
        assert seq.fields["advantages"][2:].tolist() == pytest.approx([per_trajectory[seq.info["trajectory"]]] * 2)
    assert per_trajectory["t0"] == pytest.approx({"grpo": 2 / 3 / (1 / 3) ** 0.5, "dr_grpo": 2 / 3, "rloo": 1.0}[loss])


def test_sequences_of_one_trajectory_must_share_its_reward() -> None:
    batch = [
        TokenSequence(torch.arange(3), {"loss_mask": torch.tensor([0.0, 1.0, 1.0])},
                 {"reward": r, "group": "g", "trajectory": "t"}, name=f"call{k}")
        for k, r in enumerate([1.0, 0.5])
    ]
    with pytest.raises(BatchError, match=r"sequence 1 \('call1'\): field 'reward' is 0.5.*trajectory 't'"):
        compute_advantages(AlgoConfig(loss="grpo"), batch)


def turn_batch(trajectories: dict[str, dict[int, tuple[int | None, float]]], group: str = "g") -> list[TokenSequence]:
    """One sequence per turn: {trajectory: {turn: (parent, turn_reward)}}, each with two trained tokens."""
    return [
        TokenSequence(torch.arange(4), {"loss_mask": torch.tensor([0.0, 0.0, 1.0, 1.0])},
                      {"reward": 0.0, "group": group, "trajectory": t, "turn": k, "parent": parent,
                       "turn_reward": reward}, name=f"{t}/call{k}")
        for t, turns in trajectories.items() for k, (parent, reward) in turns.items()
    ]


def advantage_of(batch: list[TokenSequence]) -> dict[str, float]:
    """Each sequence's advantage (its two trained tokens share it)."""
    out = {}
    for seq in batch:
        first, second = seq.fields["advantages"][2:].tolist()
        assert first == pytest.approx(second) and seq.fields["advantages"][:2].tolist() == [0.0, 0.0]
        out[seq.name] = first
    return out


def test_per_turn_rewards_train_each_turn_on_the_rewards_from_it_on() -> None:
    """returns: G_k = r_k + turn_discount * mean of the G of the turns that continue k (turn 1 branched into two)."""
    batch = turn_batch({"t": {0: (None, 1.0), 1: (0, 0.0), 2: (1, 2.0), 3: (1, 0.0)}})
    compute_advantages(AlgoConfig(loss="reinforce_pp", whiten=False, kl_in_reward=False, turn_discount=0.5), batch)
    g1 = 0.0 + 0.5 * (2.0 + 0.0) / 2
    assert advantage_of(batch) == pytest.approx({"t/call0": 1.0 + 0.5 * g1, "t/call1": g1, "t/call2": 2.0,
                                                 "t/call3": 0.0})


@pytest.mark.parametrize("loss", ["dr_grpo", "grpo", "rloo"])
def test_per_turn_group_advantages_normalise_turn_rewards_over_the_group(loss: str) -> None:
    """Group estimators with per-turn rewards (process supervision): each turn reward is normalised against all the
    group's turn rewards, then a turn's advantage sums the normalised rewards from it on; a group without turn
    rewards in the same batch keeps trajectory rewards."""
    batch = turn_batch({"a": {0: (None, 0.5), 1: (0, 1.0)}, "b": {0: (None, 0.0), 1: (0, 1.0), 2: (0, 0.0)}})
    plain = [TokenSequence(torch.arange(3), {"loss_mask": torch.tensor([0.0, 1.0, 1.0])},
                           {"reward": r, "group": "h"}, name=f"h{i}") for i, r in enumerate([1.0, 3.0])]
    compute_advantages(AlgoConfig(loss=loss, adv_eps=0.0), batch + plain)
    rewards = torch.tensor([0.5, 1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    if loss == "rloo":
        a0, a1, b0, b1, b2 = rloo_advantages(rewards, ["g"] * 5).tolist()
    else:
        a0, a1, b0, b1, b2 = group_advantages(rewards, ["g"] * 5, scale_std=loss == "grpo", eps=0.0).tolist()
    assert advantage_of(batch) == pytest.approx(
        {"a/call0": a0 + a1, "a/call1": a1, "b/call0": b0 + (b1 + b2) / 2, "b/call1": b1, "b/call2": b2})
    if loss == "dr_grpo":  # by hand: mean 0.5
        assert advantage_of(batch)["b/call0"] == pytest.approx(-0.5 + (0.5 - 0.5) / 2)
        assert [s.fields["advantages"][2].item() for s in plain] == [-1.0, 1.0]


def test_per_turn_rewards_that_do_not_fit_are_errors_naming_the_field() -> None:
    mixed = turn_batch({"a": {0: (None, 1.0)}}) + [
        TokenSequence(torch.arange(3), {"loss_mask": torch.tensor([0.0, 1.0, 1.0])}, {"reward": 1.0, "group": "g"})]
    with pytest.raises(BatchError, match="group 'g' mixes sequences with and without info 'turn_reward'"):
        compute_advantages(AlgoConfig(loss="grpo"), mixed)
    orphan = turn_batch({"a": {0: (None, 1.0), 1: (7, 1.0)}})
    with pytest.raises(BatchError, match="turn 1 continues turn 7, which is not in the batch"):
        compute_advantages(AlgoConfig(loss="grpo"), orphan)
    loop = turn_batch({"a": {0: (1, 1.0), 1: (0, 1.0)}})
    with pytest.raises(BatchError, match="form a cycle"):
        compute_advantages(AlgoConfig(loss="reinforce_pp"), loop)
    bad = turn_batch({"a": {0: (None, float("nan"))}})
    with pytest.raises(BatchError, match=r"sequence 0 \('a/call0'\): field 'turn_reward' is nan"):
        compute_advantages(AlgoConfig(loss="grpo"), bad)

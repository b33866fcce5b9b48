"""Known answers: each loss on hand-made log-probs, with the numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from treerl.algo import AlgoConfig, LossNormalizer, build_loss
from treerl.algo.policy import kl_penalty
from treerl.engine.base import SequenceView, split_loss
from treerl.tree import TokenSequence

LN = math.log


def make_view(
    logprobs: list[float], entropy: list[float] | None = None, info: dict | None = None, **fields
) -> SequenceView:
    """A one-sequence view whose model outputs are leaves we can differentiate by."""
    n = len(logprobs)
    tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in fields.items()}
    tensors.setdefault("loss_mask", torch.tensor([0.0] + [1.0] * (n - 1), dtype=torch.float64))
    outputs = {
        "logprobs": torch.tensor(logprobs, dtype=torch.float64, requires_grad=True),
        "entropy": torch.tensor(entropy or [0.0] * n, dtype=torch.float64, requires_grad=True),
    }
    return SequenceView(0, TokenSequence(torch.arange(n), tensors, info or {}), outputs)


def evaluate(config: AlgoConfig, view: SequenceView, normalizer: LossNormalizer | None = None):
    """Loss value, d loss / d logprobs, d loss / d entropy, metrics."""
    normalizer = normalizer or LossNormalizer.from_sequences([view.sequence])
    loss, metrics = split_loss(build_loss(config, normalizer)(view))
    loss.backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (view.logprobs, view.entropy)]
    return float(loss.detach()), grads[0].tolist(), grads[1].tolist(), {k: float(v) for k, v in metrics.items()}


def ppo_view(ratios: list[float], advantages: list[float], **extra) -> SequenceView:
    """Token 0 untrained, then one trained token per ratio (old log-prob log 0.5)."""
    old = [0.0] + [LN(0.5)] * len(ratios)
    logp = [0.0] + [LN(0.5 * r) for r in ratios]
    return make_view(logp, old_logprobs=old, advantages=[0.0] + advantages, **extra)


PPO = AlgoConfig(loss="ppo", aggregation="token_mean")


def test_ppo_unclipped_is_the_importance_weighted_policy_gradient() -> None:
    # r = 1.1 with A = 1: -1.1; r = 0.9 with A = -1: +0.9. Mean over 2 tokens; d(-A r)/d log pi = -A r.
    loss, grad, _, metrics = evaluate(PPO, ppo_view([1.1, 0.9], [1.0, -1.0]))
    assert loss == pytest.approx((-1.1 + 0.9) / 2)
    assert grad == pytest.approx([0.0, -1.1 / 2, 0.9 / 2])
    assert metrics["clip_fraction"] == 0.0


def test_ppo_clipped_tokens_have_no_gradient() -> None:
    # r = 1.5, A = 1 -> max(-1.5, -1.2) = -1.2 (clipped); r = 0.5, A = -1 -> max(0.5, 0.8) = 0.8 (clipped).
    loss, grad, _, metrics = evaluate(PPO, ppo_view([1.5, 0.5], [1.0, -1.0]))
    assert loss == pytest.approx((-1.2 + 0.8) / 2)
    assert grad == pytest.approx([0.0, 0.0, 0.0])
    assert metrics["clip_fraction"] == pytest.approx(1.0)


def test_ppo_pessimism_keeps_the_unclipped_side() -> None:
    # r = 1.5, A = -1 -> max(1.5, 1.2) = 1.5 (not clipped, gradient 1.5); r = 0.5, A = 1 -> max(-0.5, -0.8) = -0.5.
    loss, grad, _, metrics = evaluate(PPO, ppo_view([1.5, 0.5], [-1.0, 1.0]))
    assert loss == pytest.approx((1.5 - 0.5) / 2)
    assert grad == pytest.approx([0.0, 1.5 / 2, -0.5 / 2])
    assert metrics["clip_fraction"] == 0.0


def test_clip_higher() -> None:
    # r = 1.25, A = 1: clipped at 1.2 with eps 0.2, inside [0.8, 1.28] with eps_high 0.28.
    assert evaluate(PPO, ppo_view([1.25], [1.0]))[:2] == (pytest.approx(-1.2), pytest.approx([0.0, 0.0]))
    loss, grad, _, _ = evaluate(AlgoConfig(loss="ppo", clip_eps_high=0.28), ppo_view([1.25], [1.0]))
    assert (loss, grad) == (pytest.approx(-1.25), pytest.approx([0.0, -1.25]))


def test_dual_clip_caps_negative_advantages() -> None:
    # A = -1: r = 5 -> max(5, 1.2) = 5 capped at c = 3 (no gradient); r = 2 -> 2 < 3 stays (gradient 2).
    # A = +2, r = 5 -> max(-10, -2.4) = -2.4 (ordinary clip; dual clip never touches A > 0).
    config = AlgoConfig(loss="ppo", dual_clip=3.0)
    loss, grad, _, metrics = evaluate(config, ppo_view([5.0, 2.0, 5.0], [-1.0, -1.0, 2.0]))
    assert loss == pytest.approx((3.0 + 2.0 - 2.4) / 3)
    assert grad == pytest.approx([0.0, 0.0, 2.0 / 3, 0.0])
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)


def decoupled_view(advantage: float = 1.0) -> SequenceView:
    # behaviour 0.4, proximal 0.5, current 0.55: ratio pi/pi_prox = 1.1 (inside the clip), weight 0.5/0.4 = 1.25.
    return make_view(
        [0.0, LN(0.55)], old_logprobs=[0.0, LN(0.4)], prox_logprobs=[0.0, LN(0.5)], advantages=[0.0, advantage]
    )


def test_decoupled_ppo_weights_by_proximal_over_behaviour() -> None:
    loss, grad, _, _ = evaluate(AlgoConfig(loss="decoupled_ppo"), decoupled_view())
    assert loss == pytest.approx(-1.25 * 1.1)
    assert grad == pytest.approx([0.0, -1.25 * 1.1])


def test_decoupled_ppo_clips_against_the_proximal_policy() -> None:
    # current 0.7: pi/pi_prox = 1.4 -> clipped at 1.2 (pi/pi_behav = 1.75 would mislead), weight 1.25.
    view = make_view([0.0, LN(0.7)], old_logprobs=[0.0, LN(0.4)], prox_logprobs=[0.0, LN(0.5)], advantages=[0.0, 1.0])
    loss, grad, _, _ = evaluate(AlgoConfig(loss="decoupled_ppo"), view)
    assert (loss, grad) == (pytest.approx(-1.25 * 1.2), pytest.approx([0.0, 0.0]))


def test_importance_weight_cap_drops_the_token_but_keeps_it_in_the_count() -> None:
    view = make_view(
        [0.0, LN(0.55), LN(0.55)],
        old_logprobs=[0.0, LN(0.4), LN(0.5)],
        prox_logprobs=[0.0, LN(0.5), LN(0.5)],
        advantages=[0.0, 1.0, 1.0],
    )
    # token 1: weight 1.25 > cap 1.2 -> dropped; token 2: weight 1.0, ratio 1.1. Mean over 2 tokens.
    loss, grad, _, _ = evaluate(AlgoConfig(loss="decoupled_ppo", behav_imp_weight_cap=1.2), view)
    assert (loss, grad) == (pytest.approx(-1.1 / 2), pytest.approx([0.0, 0.0, -1.1 / 2]))


def gspo_view() -> SequenceView:
    # per-token ratios 1.2 and 0.9: sequence ratio s = exp(mean log r) = sqrt(1.08).
    return make_view([0.0, LN(0.6), LN(0.45)], old_logprobs=[0.0, LN(0.5), LN(0.5)], advantages=[0.0, 1.0, 1.0])


def test_gspo_uses_the_sequence_ratio() -> None:
    s = math.sqrt(1.08)
    # inside a wide clip range: loss -A s, and d(-s)/d log pi_t = -s / 2 (the sequence-level gradient).
    loss, grad, _, _ = evaluate(AlgoConfig(loss="gspo", clip_eps=0.2, clip_eps_high=0.2), gspo_view())
    assert (loss, grad) == (pytest.approx(-s), pytest.approx([0.0, -s / 2, -s / 2]))
    # GSPO's own clip range [1 - 3e-4, 1 + 4e-4]: s = 1.039 is clipped for the whole sequence.
    loss, grad, _, metrics = evaluate(AlgoConfig(loss="gspo"), gspo_view())
    assert (loss, grad) == (pytest.approx(-(1 + 4e-4)), pytest.approx([0.0, 0.0, 0.0]))
    assert metrics["clip_fraction"] == pytest.approx(1.0)


def test_gspo_equals_the_sequence_level_objective_by_autograd() -> None:
    logp = torch.tensor([LN(0.6), LN(0.45), LN(0.3)], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([LN(0.5), LN(0.5), LN(0.35)], dtype=torch.float64)
    (-0.7 * torch.exp((logp - old).mean())).backward()
    view = make_view([0.0, *logp.tolist()], old_logprobs=[0.0, *old.tolist()], advantages=[0.0, 0.7, 0.7, 0.7])
    _, grad, _, _ = evaluate(AlgoConfig(loss="gspo", clip_eps=0.5, clip_eps_high=0.5), view)
    assert grad[1:] == pytest.approx(logp.grad.tolist())


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_group_and_reinforce_losses_are_the_clipped_surrogate(loss: str) -> None:
    # They differ from PPO in their advantages and default aggregation, not in the token loss.
    config = AlgoConfig(loss=loss, aggregation="token_mean")
    assert (
        evaluate(config, ppo_view([1.5, 0.9], [1.0, -1.0]))[:2] == evaluate(PPO, ppo_view([1.5, 0.9], [1.0, -1.0]))[:2]
    )


def test_kl_estimators_by_hand() -> None:
    d = LN(0.5 / 0.4)
    logp = torch.tensor([LN(0.5)], dtype=torch.float64, requires_grad=True)
    ref, mask = torch.tensor([LN(0.4)], dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    expected = {"k1": (d, 1.0), "k2": (d * d / 2, d), "k3": (0.8 - 1 + d, 1 - 0.8)}
    for estimator, (value, slope) in expected.items():
        logp.grad = None
        kl = kl_penalty(logp, ref, mask, estimator)
        kl.sum().backward()
        assert (float(kl.detach()), float(logp.grad)) == (pytest.approx(value), pytest.approx(slope)), estimator


def test_kl_and_entropy_terms_in_the_loss() -> None:
    config = AlgoConfig(loss="ppo", kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    view = ppo_view([1.0, 1.0], [0.0, 0.0], ref_logprobs=[0.0, LN(0.4), LN(0.5)])
    view.outputs["entropy"] = torch.tensor([0.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    loss, grad, grad_entropy, metrics = evaluate(config, view)
    kl = [LN(0.5 / 0.4), 0.0]
    assert loss == pytest.approx((0.5 * sum(kl) - 0.1 * 5.0) / 2)
    assert grad == pytest.approx([0.0, 0.5 / 2, 0.5 / 2])
    assert grad_entropy == pytest.approx([0.0, -0.1 / 2, -0.1 / 2])
    assert (metrics["kl"], metrics["entropy"]) == (pytest.approx(sum(kl) / 2), pytest.approx(2.5))


def test_kl_in_the_reward_is_not_in_the_loss_again() -> None:
    # REINFORCE++ puts -kl_coef * KL into the token rewards (compute_advantages); its loss is the surrogate alone.
    view = lambda: ppo_view([1.1, 0.9], [1.0, -1.0], ref_logprobs=[0.0, LN(0.4), LN(0.5)])
    loss, grad, _, metrics = evaluate(AlgoConfig(loss="reinforce_pp", kl_coef=0.5), view())
    assert (loss, grad) == evaluate(AlgoConfig(loss="reinforce_pp", kl_coef=0.0), view())[:2] and "kl" not in metrics


@pytest.mark.parametrize("config", [PPO, AlgoConfig(loss="gspo"), AlgoConfig(loss="decoupled_ppo"),
                                    AlgoConfig(loss="ppo", kl_coef=0.1, kl_estimator="k3")],
                         ids=["ppo", "gspo", "decoupled_ppo", "ppo-k3-kl"])
def test_an_untrained_token_far_from_its_old_logprob_leaves_loss_and_gradient_finite(config) -> None:
    # A token outside the loss mask (a tool's reply, a prompt token) may carry any old log-prob: its ratio
    # exp(0 + 1000) must not reach the loss or its gradient as inf or NaN.
    far = [0.0, LN(0.5), -1000.0, LN(0.5)]
    view = make_view([0.0, LN(0.5), 0.0, LN(0.5)], loss_mask=[0.0, 1.0, 0.0, 1.0], advantages=[0.0, 1.0, 0.0, 1.0],
                     old_logprobs=far, prox_logprobs=far, ref_logprobs=far)
    loss, grad, _, _ = evaluate(config, view)
    assert math.isfinite(loss) and all(math.isfinite(g) for g in grad)


def test_sft_is_the_masked_negative_log_likelihood() -> None:
    view = make_view([0.0, LN(0.5), LN(0.25), LN(0.1)], loss_mask=[0.0, 1.0, 0.0, 1.0])
    loss, grad, _, metrics = evaluate(AlgoConfig(loss="sft"), view)
    assert loss == pytest.approx(-(LN(0.5) + LN(0.1)) / 2)
    assert grad == pytest.approx([0.0, -0.5, 0.0, -0.5])
    assert metrics["nll"] == pytest.approx(loss)


def test_aggregations_by_hand() -> None:
    # Two sequences, the first with 2 trained tokens of loss 1 and 3, the second with 1 of loss 5
    # (SFT: token loss = -log pi). token_mean = 9/3; seq_mean_token_mean = (2 + 5)/2; seq_sum = (4 + 5)/(2 * 10).
    views = [make_view([0.0, -1.0, -3.0]), make_view([0.0, -5.0])]
    normalizer = LossNormalizer.from_sequences([v.sequence for v in views])
    assert normalizer == LossNormalizer(tokens=3.0, sequences=2)
    expected = {"token_mean": 9 / 3, "seq_mean_token_mean": 7 / 2, "seq_sum": 9 / 20}
    for aggregation, value in expected.items():
        config = AlgoConfig(loss="sft", aggregation=aggregation, seq_sum_scale=10.0)
        total = sum(evaluate(config, make_view(v.logprobs.tolist()), normalizer)[0] for v in views)
        assert total == pytest.approx(value), aggregation


def test_normalizers_add_across_parts() -> None:
    a = [make_view([0.0, -1.0, -3.0]).sequence, make_view([0.0, -1.0], loss_mask=[0.0, 0.0]).sequence]
    b = [make_view([0.0, -5.0]).sequence]
    assert LossNormalizer.from_sequences(a) + LossNormalizer.from_sequences(b) == LossNormalizer.from_sequences(a + b)
    assert LossNormalizer.from_sequences(a + b) == LossNormalizer(tokens=3.0, sequences=2)

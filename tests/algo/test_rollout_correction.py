"""algo.rollout_correction: each preset's weight against its formula written out, every policy loss under every
preset exact over trees (each sequence's own weight on shared tokens) against flat and against a direct per-sequence
computation, and the settings refused before any compute."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from algo_testing import assert_same_step, counted_by_hand, make_batch, train_step
from hypothesis import given, settings
from hypothesis import strategies as st
from test_exact import reference, split, step

from treerl.algo import AlgoConfig, build_loss, validate_batch
from treerl.algo.config import ROLLOUT_CORRECTIONS
from treerl.algo.policy import rollout_weight
from treerl.engine import DfsEngine
from treerl.tree import BatchError

POLICY_LOSSES = ("ppo", "decoupled_ppo", "grpo", "dr_grpo", "gspo", "rloo", "reinforce_pp")
DECOUPLED = tuple(p for p in ROLLOUT_CORRECTIONS if p.startswith("decoupled_"))


def direct_weight(preset: str, prox: list[float], behav: list[float], mask: list[float], c: float,
                  band: float) -> list[float]:
    """The preset's weight per trained token, from the ratios one by one (verl's definitions)."""
    trained = [t for t, m in enumerate(mask) if m > 0]
    ratio = {t: math.exp(prox[t] - behav[t]) for t in trained}
    product = math.prod(ratio.values())
    geometric = product ** (1 / len(trained)) if trained else 1.0

    def kept(value: float) -> float:
        return 1.0 if 1 / band <= value <= band else 0.0

    per_token = {
        "decoupled_token_is": lambda t: min(ratio[t], c),
        "decoupled_seq_is": lambda t: min(product, c),
        "decoupled_geo_is": lambda t: min(geometric, c),
        "decoupled_token_rs": lambda t: kept(ratio[t]),
        "decoupled_geo_rs": lambda t: kept(geometric),
        "decoupled_seq_is_rs": lambda t: min(product, c) * kept(product),
    }[preset]
    return [per_token(t) for t in trained]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), length=st.integers(1, 12))
def test_each_preset_weight_is_its_formula(seed, length) -> None:
    """Every preset, on small and large mismatches, tight and loose thresholds (a grid, not left to the draw)."""
    gen = torch.Generator().manual_seed(seed)
    behav = -torch.rand(length, generator=gen, dtype=torch.float64) * 3
    noise = torch.randn(length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(length, generator=gen) < 0.7).double()
    for spread, preset, c, band in itertools.product([1e-4, 0.01, 0.3, 2.0], DECOUPLED, [1.0, 1.5, 5.0],
                                                     [1.001, 1.05, 2.0]):
        prox = (behav + spread * noise).clamp(max=0.0)
        got = rollout_weight(preset, prox, behav, mask, c, band)[mask > 0].tolist()
        want = direct_weight(preset, prox.tolist(), behav.tolist(), mask.tolist(), c, band)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-300), (preset, spread, c, band)


def test_the_presets_weigh_and_drop_where_the_formulas_say() -> None:
    """Worked by hand: ratios 4, 1/4 and 1 (log 4 = 1.386...)."""
    log4 = math.log(4.0)
    behav = torch.tensor([0.0, -2.0, -1.0, -1.0], dtype=torch.float64)
    prox = behav + torch.tensor([0.0, log4, -log4, 0.0], dtype=torch.float64)
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)

    def weight(preset: str, band: float = 2.0) -> list[float]:
        return rollout_weight(preset, prox, behav, mask, 2.0, band)[1:].tolist()

    assert weight("decoupled_token_is") == pytest.approx([2.0, 0.25, 1.0])  # min(r, 2)
    assert weight("decoupled_token_rs") == [0.0, 0.0, 1.0]  # 4 and 1/4 lie outside [1/2, 2]
    assert weight("decoupled_seq_is") == pytest.approx([1.0] * 3)  # 4 * 1/4 * 1
    assert weight("decoupled_geo_rs", band=1.001) == [1.0] * 3
    prox[3] = behav[3] + log4  # product 4, geometric mean 4^(1/3) = 1.587
    assert weight("decoupled_seq_is") == pytest.approx([2.0] * 3)
    assert weight("decoupled_geo_is") == pytest.approx([4 ** (1 / 3)] * 3)
    assert weight("decoupled_seq_is_rs") == [0.0] * 3  # product 4 outside [1/2, 2]
    assert weight("decoupled_geo_rs", band=1.5) == [0.0] * 3  # 1.587 > 1.5
    assert weight("decoupled_geo_rs", band=1.6) == [1.0] * 3


def corrected(loss: str, preset: str, aggregation: str | None = None) -> AlgoConfig:
    """Every term of `loss` on (as test_exact's full_config, without decoupled PPO's cap), under `preset`."""
    return AlgoConfig(loss=loss, aggregation=aggregation, seq_sum_scale=7.0,
                      dual_clip=None if loss == "gspo" else 3.0, clip_eps_high=None if loss == "gspo" else 0.28,
                      kl_coef=0.1, kl_in_reward=False, entropy_coef=0.01, rollout_correction=preset,
                      rollout_rs_threshold=1.2 if preset == "decoupled_geo_rs" else None)


@pytest.mark.parametrize("preset", ROLLOUT_CORRECTIONS)
@pytest.mark.parametrize("loss", POLICY_LOSSES)
@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), sequences=st.integers(1, 6),
       length=st.integers(2, 14), sharing=st.sampled_from([1.0, 2.0, 4.0]), noise=st.sampled_from([0.05, 0.5]),
       aggregation=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_sum"]))
def test_every_loss_under_every_preset_matches_flat(policy, loss, preset, seed, sequences, length, sharing, noise,
                                                    aggregation) -> None:
    """Sequences sharing tokens carry different behaviour and proximal log-probs there (make_batch)."""
    batch = make_batch(policy, seed, sequences, length, sharing, noise)
    config = corrected(loss, preset, aggregation)
    want = reference(policy, config, batch)
    assert_same_step(step(DfsEngine(), policy, config, [batch]), want)
    assert_same_step(step(DfsEngine(recompute="always", chunk_tokens=3), policy, config, split(batch, seed)), want)


def direct_loss(policy, loss: str, preset: str, batch, c: float, band: float) -> tuple[float, dict[str, torch.Tensor]]:
    """The clipped surrogate against pi_prox times the preset's weight, each sequence run alone through the model and
    every term written out here: GRPO's token ratio over the batch's trained tokens, or GSPO-token's ratio (the value
    exp(mean log(pi / pi_prox)), the gradient of pi_t's) averaged per sequence; the loss and the gradients."""
    policy.zero_grad(set_to_none=True)
    counts = counted_by_hand(batch)
    eps_low, eps_high = (3e-4, 4e-4) if loss == "gspo" else (0.2, 0.2)
    total = torch.zeros((), dtype=torch.float64)
    for seq in batch:
        logits = policy(seq.tokens[None]).logits[0, :-1].log_softmax(-1)
        logp = torch.cat([torch.zeros(1, dtype=logits.dtype), logits.gather(1, seq.tokens[1:, None])[:, 0]])
        f = seq.fields
        trained = [t for t in range(len(seq)) if f["loss_mask"][t] > 0]
        weights = direct_weight(preset, f["prox_logprobs"].tolist(), f["old_logprobs"].tolist(),
                                f["loss_mask"].tolist(), c, band)
        log_ratio = torch.stack([logp[t] - f["prox_logprobs"][t] for t in trained]) if trained else None
        for k, (t, w) in enumerate(zip(trained, weights)):
            ratio = torch.exp(log_ratio[k])
            if loss == "gspo":  # GSPO-token (Zheng et al. 2025, eq. 13): sg[s] * pi_t / sg[pi_t]
                ratio = torch.exp(log_ratio.mean().detach()) * ratio / ratio.detach()
            adv = f["advantages"][t]
            term = w * torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
            total = total + (term / len(trained) / counts.sequences if loss == "gspo" else term / counts.tokens)
    total.backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    return float(total.detach()), grads


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
@pytest.mark.parametrize("preset", DECOUPLED)
@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), sharing=st.sampled_from([1.0, 3.0]))
def test_a_preset_on_the_tree_equals_each_sequence_computed_alone(policy, loss, preset, seed, sharing) -> None:
    """GSPO with one advantage per sequence (its sequence-level objective) and a small mismatch, so its tight clip
    range does not swallow the gradient."""
    batch = make_batch(policy, seed, sequences=5, length=10, sharing=sharing, noise=1e-4 if loss == "gspo" else 0.3)
    if loss == "gspo":
        for seq in batch:
            seq.fields["advantages"] = torch.full_like(seq.fields["advantages"], float(seq.fields["advantages"][0]))
    config = AlgoConfig(loss=loss, aggregation="seq_mean_token_mean" if loss == "gspo" else "token_mean",
                        rollout_correction=preset, rollout_rs_threshold=1.2 if preset == "decoupled_geo_rs" else None)
    want_loss, want_grads = direct_loss(policy, loss, preset, batch, *config.correction_thresholds())
    got_loss, _, got_grads = train_step(DfsEngine(), policy, [batch], build_loss(config, counted_by_hand(batch)))
    assert got_loss == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    norm = float(torch.sqrt(sum(grad.norm() ** 2 for grad in want_grads.values())))
    assert norm > 0
    for name, grad in want_grads.items():
        assert float((got_grads[name] - grad).norm()) <= 1e-9 * norm, name


def test_bypass_takes_the_behaviour_log_probs_as_the_old_policy(policy) -> None:
    """decoupled_ppo under bypass_ppo_clip is PPO against pi_behav: no prox_logprobs read, no weight."""
    batch = make_batch(policy, seed=5, sequences=4, length=10)
    for seq in batch:
        del seq.fields["prox_logprobs"]
    bypass = AlgoConfig(loss="decoupled_ppo", aggregation="token_mean", rollout_correction="bypass_ppo_clip")
    validate_batch(bypass, batch)
    plain = AlgoConfig(loss="ppo", aggregation="token_mean", advantage="group", whiten=False)
    assert_same_step(step(DfsEngine(), policy, bypass, [batch]), reference(policy, plain, batch))


def test_a_decoupled_preset_reads_the_proximal_log_probs(policy) -> None:
    """grpo under a decoupled preset needs prox_logprobs (the trainer's recomputation), named with the setting."""
    batch = make_batch(policy, seed=6, sequences=2, length=8)
    del batch[1].fields["prox_logprobs"]
    config = AlgoConfig(loss="grpo", rollout_correction="decoupled_token_is")
    with pytest.raises(BatchError, match=r"sequence 1 .*'prox_logprobs' is missing \(needed by algo.loss=grpo "
                                         r"algo.rollout_correction=decoupled_token_is\)"):
        validate_batch(config, batch)
    validate_batch(AlgoConfig(loss="grpo"), batch)  # without the preset grpo reads old_logprobs only


def test_a_preset_changes_the_gradient(policy) -> None:
    """The control: with a real mismatch each decoupled preset trains something else than the plain loss."""
    batch = make_batch(policy, seed=8, sequences=5, length=12, noise=0.5)
    plain = reference(policy, AlgoConfig(loss="decoupled_ppo"), batch)[2]["lm_head.weight"]
    for preset in DECOUPLED:
        grad = reference(policy, AlgoConfig(loss="decoupled_ppo", rollout_correction=preset), batch)[2]
        assert not torch.allclose(grad["lm_head.weight"], plain), preset


@pytest.mark.parametrize("settings_, message", [
    (dict(rollout_correction="token_tis"), r"algo.rollout_correction='token_tis' is not one of: none, bypass_ppo_clip"),
    (dict(loss="sft", rollout_correction="decoupled_token_is"),
     r"algo.rollout_correction=decoupled_token_is corrects behaviour log-probs, which algo.loss=sft has none of"),
    (dict(loss="decoupled_ppo", behav_imp_weight_cap=2.0, rollout_correction="decoupled_token_rs"),
     r"algo.rollout_correction=decoupled_token_rs and algo.behav_imp_weight_cap both weight"),
    (dict(rollout_correction="decoupled_token_is", rollout_is_threshold=0.5), r"rollout_is_threshold=0.5 must be >= 1"),
    (dict(rollout_correction="decoupled_geo_rs", rollout_rs_threshold=1.0), r"rollout_rs_threshold=1.0 must be > 1"),
    (dict(rollout_correction="decoupled_token_is", rollout_rs_threshold=2.0),
     r"algo.rollout_rs_threshold only applies to algo.rollout_correction=decoupled_token_rs \| decoupled_geo_rs"),
    (dict(rollout_correction="decoupled_geo_rs", rollout_is_threshold=3.0),
     r"algo.rollout_is_threshold only applies to .*not decoupled_geo_rs"),
    (dict(rollout_is_threshold=3.0), r"algo.rollout_is_threshold only applies to .*not none"),
])
def test_bad_settings_are_one_line_before_any_compute(settings_, message) -> None:
    with pytest.raises(ValueError, match=message) as error:
        AlgoConfig(**settings_)
    assert "\n" not in str(error.value)


def test_sft_with_no_correction_and_every_preset_on_a_policy_loss_are_accepted() -> None:
    AlgoConfig(loss="sft")
    for loss in POLICY_LOSSES:
        for preset in ROLLOUT_CORRECTIONS:
            AlgoConfig(loss=loss, rollout_correction=preset).resolved()

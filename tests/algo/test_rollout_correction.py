"""algo.rollout_correction: each preset's weight and rejection against verl's formulas written out, every policy loss
under every preset exact over trees (each sequence's own weight on shared tokens) against flat and against a direct
computation (the rejected tokens out of the policy, KL and entropy terms and their counts; a trajectory's calls
weighed together), and the settings refused before any compute."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from algo_testing import assert_same_step, counted_by_hand, make_batch, train_step
from hypothesis import given, settings
from hypothesis import strategies as st
from test_exact import reference, split, step

from treerl.algo import AlgoConfig, LossNormalizer, build_loss, correct_rollout, validate_batch
from treerl.algo.config import IMPORTANCE_WEIGHTED, REJECTING, REJECTION_DEFAULTS, ROLLOUT_CORRECTIONS
from treerl.engine import DfsEngine
from treerl.tree import BatchError, TokenSequence

POLICY_LOSSES = ("ppo", "decoupled_ppo", "grpo", "dr_grpo", "gspo", "rloo", "reinforce_pp")
DECOUPLED = tuple(p for p in ROLLOUT_CORRECTIONS if p.startswith("decoupled_"))


def verl_correction(preset: str, log_r: list[float], mask: list[float], c: float, band: float
                    ) -> tuple[list[float], list[bool]]:
    """The weight and whether it is kept, per trained token of ONE trajectory (its calls' tokens in a row), as verl's
    rollout_corr_helper computes them for one response (verl-project/verl 1dda039): log-ratios clamped to +-20
    (SAFETY_BOUND) before exp and in the K1 statistic -log r; masked_mean divides by (sum of the mask + 1e-8); a single
    threshold R gives the ratio bounds [1/R, R], compared as logs."""
    def safe(x: float) -> float:
        return min(max(x, -20.0), 20.0)

    trained = [(x, m) for x, m in zip(log_r, mask) if m > 0]
    total = sum(x * m for x, m in trained)  # masked_sum(log_ratio): the sequence IS weight's log
    count = sum(m for _, m in trained)
    k1_sum = sum(-safe(x) * m for x, m in trained)  # masked_sum(token_k1), token_k1 = -clamp(log r)
    lower, upper = math.log(1.0 / band), math.log(band)
    weight = {
        "decoupled_token_is": lambda x: min(math.exp(safe(x)), c),  # rollout_is="token"
        "decoupled_seq_is": lambda x: min(math.exp(safe(total)), c),  # rollout_is="sequence"
        "decoupled_geo_is": lambda x: min(math.exp(safe(total / (count + 1e-8))), c),  # treerl's own
        "decoupled_seq_is_rs": lambda x: min(math.exp(safe(total)), c),
    }.get(preset, lambda x: 1.0)
    kept = {
        "decoupled_token_rs": lambda x: lower <= -safe(x) <= upper,  # rollout_rs="token_k1"
        "decoupled_geo_rs": lambda x: lower <= k1_sum / (count + 1e-8) <= upper,  # rollout_rs="seq_mean_k1"
        "decoupled_seq_is_rs": lambda x: lower <= k1_sum <= upper,  # rollout_rs="seq_sum_k1"
    }.get(preset, lambda x: True)
    return [weight(x) for x, _ in trained], [kept(x) for x, _ in trained]


def thresholds(preset: str, c: float, band: float) -> AlgoConfig:
    """`preset` with C and R set where it reads them."""
    return AlgoConfig(rollout_correction=preset, rollout_is_threshold=c if preset in IMPORTANCE_WEIGHTED else None,
                      rollout_rs_threshold=band if preset in REJECTING else None)


def corrected_tokens(config: AlgoConfig, sequences: list[TokenSequence]) -> list[tuple[list[float], list[bool]]]:
    """correct_rollout's weight and kept flag on each sequence's tokens as sampled (trained before the rejection)."""
    correct_rollout(config, sequences)
    out = []
    for seq in sequences:
        sampled = seq.fields["sampled_loss_mask"] > 0
        out.append((seq.fields["rollout_weight"][sampled].tolist(), (seq.fields["loss_mask"][sampled] > 0).tolist()))
    return out


def log_ratio_sequence(log_r: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor) -> TokenSequence:
    """A sequence whose trainer log-probs are the sampler's plus `log_r`."""
    return TokenSequence(torch.arange(len(log_r)), {"loss_mask": mask, "old_logprobs": behav,
                                                    "prox_logprobs": behav + log_r})


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), length=st.integers(1, 12))
def test_each_preset_weight_is_its_formula(seed, length) -> None:
    """Every preset, on small and large mismatches, tight and loose thresholds (a grid, not left to the draw)."""
    gen = torch.Generator().manual_seed(seed)
    behav = -torch.rand(length, generator=gen, dtype=torch.float64) * 3 - 30 * (torch.rand(length, generator=gen) < 0.1)
    noise = torch.randn(length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(length, generator=gen) < 0.7).double()
    mask[0] = 0.0
    for spread, preset, c, band in itertools.product([1e-4, 0.01, 0.3, 2.0, 30.0], DECOUPLED, [1.0, 1.5, 5.0],
                                                     [1.001, 1.05, 2.0]):
        prox = (behav + spread * noise).clamp(max=0.0)
        seq = TokenSequence(torch.arange(length), {"loss_mask": mask, "old_logprobs": behav, "prox_logprobs": prox})
        [(weight, kept)] = corrected_tokens(thresholds(preset, c, band), [seq])
        want_weight, want_kept = verl_correction(preset, (prox - behav).tolist(), mask.tolist(), c, band)
        assert weight == pytest.approx(want_weight, rel=1e-12, abs=1e-300), (preset, spread, c, band)
        assert kept == want_kept, (preset, spread, c, band)


def test_the_presets_weigh_and_drop_where_the_formulas_say() -> None:
    """Worked by hand: ratios 4, 1/4 and 1 (log 4 = 1.386...); then log-ratios beyond verl's +-20 clamp."""
    log4 = math.log(4.0)
    behav = torch.tensor([0.0, -2.0, -1.0, -2.0], dtype=torch.float64)
    log_r = torch.tensor([0.0, log4, -log4, 0.0], dtype=torch.float64)
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)

    def corrected(preset: str, band: float = 2.0) -> list[float]:
        """The weight of each trained token, 0 where it is rejected."""
        [(weight, kept)] = corrected_tokens(thresholds(preset, 2.0, band), [log_ratio_sequence(log_r, behav, mask)])
        return [w if k else 0.0 for w, k in zip(weight, kept)]

    assert corrected("decoupled_token_is") == pytest.approx([2.0, 0.25, 1.0])  # min(r, 2)
    assert corrected("decoupled_token_rs") == [0.0, 0.0, 1.0]  # 4 and 1/4 lie outside [1/2, 2]
    assert corrected("decoupled_seq_is") == pytest.approx([1.0] * 3)  # 4 * 1/4 * 1
    assert corrected("decoupled_geo_rs", band=1.001) == [1.0] * 3
    log_r[3] = log4  # product 4, geometric mean 4^(1/3) = 1.587
    assert corrected("decoupled_seq_is") == pytest.approx([2.0] * 3)
    assert corrected("decoupled_geo_is") == pytest.approx([4 ** (1 / 3)] * 3)
    assert corrected("decoupled_seq_is_rs") == [0.0] * 3  # product 4 outside [1/2, 2]
    assert corrected("decoupled_geo_rs", band=1.5) == [0.0] * 3  # 1.587 > 1.5
    assert corrected("decoupled_geo_rs", band=1.6) == [1.0] * 3
    behav[1:] = torch.tensor([-26.0, -1.0, -1.0], dtype=torch.float64)
    log_r[1:] = torch.tensor([25.0, -30.0, 0.0], dtype=torch.float64)  # sum -5; clamped to +-20 per token: 0
    assert corrected("decoupled_token_is") == pytest.approx([2.0, math.exp(-20.0), 1.0])  # exp(clamp(-30)) = e^-20
    assert corrected("decoupled_seq_is_rs") == pytest.approx([math.exp(-5.0)] * 3)  # kept: seq_sum_k1 reads 20 - 20


def corrected(loss: str, preset: str, aggregation: str | None = None) -> AlgoConfig:
    """Every term of `loss` on (as test_exact's full_config, without decoupled PPO's cap), under `preset`."""
    return AlgoConfig(loss=loss, aggregation=aggregation, seq_sum_scale=7.0,
                      dual_clip=None if loss == "gspo" else 3.0, clip_eps_high=None if loss == "gspo" else 0.28,
                      kl_coef=0.1, kl_in_reward=False, entropy_coef=0.01, rollout_correction=preset,
                      rollout_rs_threshold=1.2 if preset == "decoupled_geo_rs" else None)


def with_trajectories(batch: list[TokenSequence]) -> list[TokenSequence]:
    """Sequences 0 and 2 (group 0) and 1 and 3 (group 1) become the calls of two multi-turn trajectories."""
    for i, seq in enumerate(batch[:4]):
        seq.info["trajectory"] = f"trajectory{i % 2}"
    return batch


@pytest.mark.parametrize("preset", ROLLOUT_CORRECTIONS)
@pytest.mark.parametrize("loss", POLICY_LOSSES)
@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), sequences=st.integers(1, 6),
       length=st.integers(2, 14), sharing=st.sampled_from([1.0, 2.0, 4.0]), noise=st.sampled_from([0.05, 0.5]),
       aggregation=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_sum"]))
def test_every_loss_under_every_preset_matches_flat(policy, loss, preset, seed, sequences, length, sharing, noise,
                                                    aggregation) -> None:
    """Sequences sharing tokens carry different behaviour and proximal log-probs there (make_batch); some are calls of
    one trajectory."""
    batch = with_trajectories(make_batch(policy, seed, sequences, length, sharing, noise))
    config = corrected(loss, preset, aggregation)
    correct_rollout(config, batch)
    want = reference(policy, config, batch)
    assert_same_step(step(DfsEngine(), policy, config, [batch]), want)
    assert_same_step(step(DfsEngine(recompute="always", chunk_tokens=3), policy, config, split(batch, seed)), want)


def direct_loss(policy, config: AlgoConfig, batch: list[TokenSequence]) -> tuple[float, dict[str, torch.Tensor]]:
    """verl's loss under `config`'s preset, each sequence run alone through the model and every term written out here
    from the batch as sampled: a trajectory's tokens weighed and rejected together (verl_correction); on the kept
    tokens only, the clipped surrogate against pi_prox times the weight (GRPO's token ratio, or GSPO-token's: the value
    exp(mean log(pi / pi_prox)), the gradient of pi_t's), plus kl_coef * k3 KL to pi_ref, minus entropy_coef * the
    entropy; token_mean over the batch's kept tokens, or seq_mean_token_mean over each sequence's kept tokens and
    every sequence with a sampled token (verl's global batch size); the loss and the gradients."""
    config = config.resolved()
    c, band = config.correction_thresholds()
    trajectories: dict[object, list[tuple[int, int]]] = {}  # (group, trajectory) -> its (sequence, token)s in a row
    for i, seq in enumerate(batch):
        key = (seq.info["group"], seq.info.get("trajectory", i))
        trajectories.setdefault(key, []).extend((i, t) for t in range(len(seq)) if seq.fields["loss_mask"][t] > 0)
    weight, kept = {}, set()
    for tokens in trajectories.values():
        log_r = [float(batch[i].fields["prox_logprobs"][t] - batch[i].fields["old_logprobs"][t]) for i, t in tokens]
        weights, keeps = verl_correction(config.rollout_correction, log_r, [1.0] * len(tokens), c, band)
        weight.update(zip(tokens, weights))
        kept.update(token for token, keep in zip(tokens, keeps) if keep)
    tokens = len(kept) or 1
    sequences = sum(1 for seq in batch if bool((seq.fields["loss_mask"] > 0).any()))
    eps_low, eps_high = (3e-4, 4e-4) if config.loss == "gspo" else (0.2, 0.2)
    policy.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for i, seq in enumerate(batch):
        logits = policy(seq.tokens[None]).logits[0, :-1].log_softmax(-1)
        logp = torch.cat([torch.zeros(1, dtype=logits.dtype), logits.gather(1, seq.tokens[1:, None])[:, 0]])
        entropy = torch.cat([torch.zeros(1, dtype=logits.dtype), -(logits.exp() * logits).sum(-1)])
        f = seq.fields
        mine = [t for t in range(len(seq)) if (i, t) in kept]
        log_ratio = torch.stack([logp[t] - f["prox_logprobs"][t] for t in mine]) if mine else None
        for k, t in enumerate(mine):
            ratio = torch.exp(log_ratio[k])
            if config.loss == "gspo":  # GSPO-token (Zheng et al. 2025, eq. 13): sg[s] * pi_t / sg[pi_t]
                ratio = torch.exp(log_ratio.mean().detach()) * ratio / ratio.detach()
            adv = f["advantages"][t]
            d = logp[t] - f["ref_logprobs"][t]
            term = (weight[(i, t)] * torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
                    + config.kl_coef * (torch.exp(-d) - 1 + d) - config.entropy_coef * entropy[t])
            total = total + (term / len(mine) / sequences if config.aggregation == "seq_mean_token_mean"
                             else term / tokens)
    if total.requires_grad:  # else every token was rejected: no gradient
        total.backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    return float(total.detach()), grads


@pytest.mark.parametrize("loss, aggregation", [("grpo", "token_mean"), ("grpo", "seq_mean_token_mean"),
                                               ("gspo", "seq_mean_token_mean")])
@pytest.mark.parametrize("preset", DECOUPLED)
@settings(max_examples=3, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), sharing=st.sampled_from([1.0, 3.0]))
def test_a_preset_on_the_tree_equals_verls_loss_written_out(policy, loss, aggregation, preset, seed, sharing) -> None:
    """Rejected tokens leave the policy, KL and entropy terms and their counts; the calls of a trajectory share its
    weight. GSPO with one advantage per sequence (its sequence-level objective) and a small mismatch, so its tight clip
    range does not swallow the gradient."""
    batch = with_trajectories(make_batch(policy, seed, sequences=5, length=10, sharing=sharing,
                                         noise=1e-4 if loss == "gspo" else 0.3))
    if loss == "gspo":
        for seq in batch:
            seq.fields["advantages"] = torch.full_like(seq.fields["advantages"], float(seq.fields["advantages"][0]))
    band = {"decoupled_geo_rs": 1.2, "decoupled_seq_is_rs": 5.0}.get(preset)  # some trajectories kept, some not
    config = AlgoConfig(loss=loss, aggregation=aggregation, rollout_correction=preset, kl_coef=0.1, entropy_coef=0.01,
                        rollout_rs_threshold=band)
    want_loss, want_grads = direct_loss(policy, config, batch)
    correct_rollout(config, batch)
    got_loss, _, got_grads = train_step(DfsEngine(), policy, [batch], build_loss(config, counted_by_hand(batch)))
    assert got_loss == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    if not want_grads:  # every token rejected
        assert all(not grad.any() for grad in got_grads.values())
        return
    norm = float(torch.sqrt(sum(grad.norm() ** 2 for grad in want_grads.values())))
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
        correct_rollout(config, batch)
    validate_batch(AlgoConfig(loss="grpo"), batch)  # without the preset grpo reads old_logprobs only


def test_a_loss_under_a_preset_refuses_a_batch_it_did_not_weigh(policy) -> None:
    """Without correct_rollout the weights and rejections are not there: the loss names the field and who writes it
    (it never trains the batch unweighed)."""
    batch = make_batch(policy, seed=6, sequences=2, length=8)
    config = AlgoConfig(loss="grpo", rollout_correction="decoupled_token_rs")
    with pytest.raises(BatchError, match=r"sequence 0 .*'rollout_weight' is missing \(needed by algo.loss=grpo "
                                         r"algo.rollout_correction=decoupled_token_rs; treerl.algo.correct_rollout"):
        validate_batch(config, batch)
    correct_rollout(config, batch)
    validate_batch(config, batch)


def test_applied_twice_it_starts_from_the_mask_as_sampled(policy) -> None:
    """A second correct_rollout (another preset, or the same) rejects from the sampled mask, not the rejected one."""
    batch = make_batch(policy, seed=9, sequences=4, length=12, noise=0.5)
    sampled = [seq.fields["loss_mask"].clone() for seq in batch]
    correct_rollout(AlgoConfig(rollout_correction="decoupled_token_rs", rollout_rs_threshold=1.05), batch)
    assert sum(int(seq.fields["loss_mask"].sum()) for seq in batch) < sum(int(m.sum()) for m in sampled)
    correct_rollout(AlgoConfig(rollout_correction="decoupled_token_is"), batch)
    assert all(torch.equal(seq.fields["loss_mask"], m) for seq, m in zip(batch, sampled))


def test_a_wholly_rejected_sequence_still_counts_in_the_sequence_means(policy) -> None:
    """verl divides a sequence mean by the minibatch's sequences (global_batch_size), rejected ones included; the
    tokens it rejects leave the token count."""
    batch = make_batch(policy, seed=10, sequences=4, length=12, noise=0.5)
    before = LossNormalizer.from_sequences(batch)
    correct_rollout(AlgoConfig(rollout_correction="decoupled_geo_rs", rollout_rs_threshold=1.01), batch)
    after = LossNormalizer.from_sequences(batch)
    assert any(not seq.fields["loss_mask"].any() for seq in batch)  # a whole sequence rejected
    assert after.sequences == before.sequences and after.tokens < before.tokens


def test_a_preset_changes_the_gradient(policy) -> None:
    """The control: with a real mismatch each decoupled preset trains something else than the plain loss."""
    batch = make_batch(policy, seed=8, sequences=5, length=12, noise=0.5)
    plain = reference(policy, AlgoConfig(loss="decoupled_ppo"), batch)[2]["lm_head.weight"]
    for preset in DECOUPLED:
        config = AlgoConfig(loss="decoupled_ppo", rollout_correction=preset)
        correct_rollout(config, batch)
        grad = reference(policy, config, batch)[2]
        assert not torch.allclose(grad["lm_head.weight"], plain), preset


def test_every_preset_has_a_level_and_every_rejection_a_usual_band() -> None:
    assert set(IMPORTANCE_WEIGHTED) | set(REJECTING) == set(DECOUPLED) and set(REJECTION_DEFAULTS) == set(REJECTING)


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

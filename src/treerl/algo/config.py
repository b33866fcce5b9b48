"""`AlgoConfig`: every choice of the RL/SFT objective, as the `algo` section of the trainer's YAML.

Beside the steps (docs/architecture.md): the choices steps 3 and 5 read.

Options left at None take the usual value of the chosen `loss` (the table `LOSS_DEFAULTS`), so
`algo.loss=dr_grpo` alone gives Dr. GRPO's advantages and aggregation, and any single key can
still be overridden (`algo.loss=grpo algo.aggregation=token_mean` is DAPO's token-level GRPO).
The config holds the Nones; `resolved()` fills them in when a loss or advantage is built.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

LOSSES = ("ppo", "decoupled_ppo", "grpo", "dr_grpo", "gspo", "rloo", "reinforce_pp", "sft")
ADVANTAGES = ("group", "group_mean", "rloo", "gae", "returns", "none")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
DECOUPLABLE = ("ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp")  # losses with a per-token ratio to the old policy
# algo.rollout_correction (named after verl's RolloutCorrectionConfig presets where they mean the same): how the
# mismatch between the sampler's log-probs and the trainer's own is corrected; docs/mismatch.md. Each decoupled
# preset weights or drops tokens by r = pi_prox / pi_behav, the trainer's recomputation over the sampler's.
ROLLOUT_CORRECTIONS = ("none", "bypass_ppo_clip", "decoupled_token_is", "decoupled_seq_is", "decoupled_geo_is",
                       "decoupled_token_rs", "decoupled_geo_rs", "decoupled_seq_is_rs")
# The log-ratio each preset's importance weight is the exp of, and the one its rejection reads (verl's rollout_is
# "token" / "sequence", rollout_rs "token_k1" / "seq_sum_k1" / "seq_mean_k1"): a token's own, or the sum or mean over
# its trajectory (treerl.algo.correction).
IMPORTANCE_LEVEL = {"decoupled_token_is": "token", "decoupled_seq_is": "sum", "decoupled_geo_is": "mean",
                    "decoupled_seq_is_rs": "sum"}
REJECTION_LEVEL = {"decoupled_token_rs": "token", "decoupled_geo_rs": "mean", "decoupled_seq_is_rs": "sum"}
IMPORTANCE_WEIGHTED = tuple(IMPORTANCE_LEVEL)
REJECTING = tuple(REJECTION_LEVEL)
REJECTION_DEFAULTS = {"decoupled_token_rs": 2.0, "decoupled_geo_rs": 1.001, "decoupled_seq_is_rs": 2.0}  # R

# The usual settings of each loss (AReaL, verl, TRL, OpenRLHF); a key set in the config wins.
LOSS_DEFAULTS: dict[str, dict[str, object]] = {
    "ppo": dict(advantage="gae", aggregation="token_mean", whiten=True),
    "decoupled_ppo": dict(advantage="group", aggregation="token_mean", whiten=False),
    "grpo": dict(advantage="group", aggregation="seq_mean_token_mean", whiten=False),
    "dr_grpo": dict(advantage="group_mean", aggregation="seq_sum", whiten=False),
    "gspo": dict(advantage="group", aggregation="seq_mean_token_mean", whiten=False, clip_eps=3e-4, clip_eps_high=4e-4),
    "rloo": dict(advantage="rloo", aggregation="token_mean", whiten=False),
    "reinforce_pp": dict(advantage="returns", aggregation="token_mean", whiten=True, kl_in_reward=True),
    "sft": dict(advantage="none", aggregation="token_mean", whiten=False),
}


@dataclass
class AlgoConfig:
    """The objective of one training run; see docs/algorithms.md for each formula."""

    # What is optimised.
    loss: str = "grpo"  # ppo | decoupled_ppo | grpo | dr_grpo | gspo | rloo | reinforce_pp | sft
    aggregation: str | None = None  # token_mean | seq_mean_token_mean | seq_sum (None: the loss's usual)
    seq_sum_scale: float = 1.0  # seq_sum divides each sequence's token sum by this (Dr. GRPO: max generation length)

    # Clipped surrogate (every policy loss).
    clip_eps: float | None = None  # ratio clipped to [1 - clip_eps, 1 + clip_eps_high] (None: 0.2; GSPO 3e-4)
    clip_eps_high: float | None = None  # upper clip (DAPO's clip-higher); None: clip_eps (GSPO 4e-4)
    dual_clip: float | None = None  # c > 1: for negative advantages the token loss is capped at c * |A|
    behav_imp_weight_cap: float | None = None  # decoupled_ppo: tokens with pi_prox/pi_behav above it are dropped

    # Training-inference mismatch (docs/mismatch.md): r = pi_prox / pi_behav, the trainer's log-probs at the rollout's weights over the sampler's.
    rollout_correction: str = "none"  # none | bypass_ppo_clip (the sampler's log-probs are the old policy) | decoupled_token_is (weight min(r, C)) | decoupled_seq_is (min(prod r, C)) | decoupled_geo_is (min(geometric mean of r, C)) | decoupled_token_rs (drop tokens with r outside [1/R, R]) | decoupled_geo_rs (drop trajectories whose geometric-mean r is outside [1/R, R]) | decoupled_seq_is_rs (seq_is, and drop trajectories whose prod r is outside [1/R, R]); products and means over a trajectory's calls, dropped tokens out of every term and token count
    rollout_is_threshold: float | None = None  # C >= 1: the importance weights of the *_is presets are truncated at it; null: 2
    rollout_rs_threshold: float | None = None  # R > 1: the *_rs presets keep [1/R, R]; null: the preset's usual (token_rs 2, geo_rs 1.001, seq_is_rs 2)

    # Regularisers.
    kl_coef: float = 0.0  # weight of the KL penalty to the reference policy (needs field ref_logprobs)
    kl_estimator: str = "k3"  # k1: d, k2: d^2/2, k3: exp(-d) - 1 + d, with d = log pi - log pi_ref
    kl_in_reward: bool | None = None  # True: -kl_coef * KL(behaviour) is added to token rewards, not the loss
    entropy_coef: float = 0.0  # entropy bonus: the loss gets -entropy_coef * entropy

    # Advantages (treerl.algo.advantages.compute_advantages).
    advantage: str | None = None  # group | group_mean | rloo | gae | returns | none (None: the loss's usual)
    whiten: bool | None = None  # normalise advantages to mean 0, std 1 over all trained tokens of the batch
    adv_eps: float = 1e-6  # added to a std before dividing by it
    gamma: float = 1.0  # discount from one trained token to the next (gae, returns)
    lam: float = 1.0  # GAE lambda
    turn_discount: float = 1.0  # extra discount from one turn to the next (multi-turn episodes; see turn_returns)

    # Critic (treerl.algo.critic.build_value_loss).
    value_clip: float | None = 0.2  # new values kept within +-value_clip of field `values`; None: no clipping

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Reject unknown choices and out-of-range numbers, naming the `algo.` key."""
        choices = dict(loss=LOSSES, aggregation=AGGREGATIONS, kl_estimator=KL_ESTIMATORS, advantage=ADVANTAGES)
        for key, allowed in choices.items():
            value = getattr(self, key)
            if value is not None and value not in allowed:
                raise ValueError(f"algo.{key}={value!r} is not one of: {', '.join(allowed)}")
        positive = ["seq_sum_scale", "clip_eps", "clip_eps_high", "behav_imp_weight_cap", "value_clip"]
        for key in positive:
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"algo.{key}={value} must be > 0")
        for key in ["kl_coef", "entropy_coef", "adv_eps"]:
            if not getattr(self, key) >= 0:
                raise ValueError(f"algo.{key}={getattr(self, key)} must be >= 0")
        for key in ["gamma", "lam", "turn_discount"]:
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"algo.{key}={getattr(self, key)} must be in [0, 1]")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"algo.dual_clip={self.dual_clip} must be > 1")
        if self.behav_imp_weight_cap is not None and self.loss != "decoupled_ppo":
            raise ValueError("algo.behav_imp_weight_cap only applies to algo.loss=decoupled_ppo")
        self.check_rollout_correction()

    def check_rollout_correction(self) -> None:
        """The preset exists, its thresholds are in range, and the loss has behaviour log-probs to correct."""
        preset = self.rollout_correction
        if preset not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"algo.rollout_correction={preset!r} is not one of: {', '.join(ROLLOUT_CORRECTIONS)}")
        if self.rollout_is_threshold is not None and not self.rollout_is_threshold >= 1:
            raise ValueError(f"algo.rollout_is_threshold={self.rollout_is_threshold} must be >= 1")
        if self.rollout_rs_threshold is not None and not self.rollout_rs_threshold > 1:
            raise ValueError(f"algo.rollout_rs_threshold={self.rollout_rs_threshold} must be > 1 (the band is "
                             "[1/R, R])")
        for key, applies in (("rollout_is_threshold", IMPORTANCE_WEIGHTED), ("rollout_rs_threshold", REJECTING)):
            if getattr(self, key) is not None and preset not in applies:
                raise ValueError(f"algo.{key} only applies to algo.rollout_correction={' | '.join(applies)}, "
                                 f"not {preset}")
        if preset == "none":
            return
        if self.loss == "sft":
            raise ValueError(f"algo.rollout_correction={preset} corrects behaviour log-probs, which algo.loss=sft "
                             "has none of (set algo.rollout_correction=none)")
        if self.behav_imp_weight_cap is not None:
            raise ValueError(f"algo.rollout_correction={preset} and algo.behav_imp_weight_cap both weight "
                             "pi_prox / pi_behav: set one of the two")

    def correction_thresholds(self) -> tuple[float, float]:
        """(C, R): the importance-weight truncation and the rejection band of the preset, its usual where unset."""
        usual = REJECTION_DEFAULTS.get(self.rollout_correction, 2.0)
        return self.rollout_is_threshold or 2.0, self.rollout_rs_threshold or usual

    def resolved(self) -> AlgoConfig:
        """A copy with every None replaced by the loss's usual value."""
        defaults = dict(clip_eps=0.2, kl_in_reward=False) | LOSS_DEFAULTS[self.loss]
        filled = {
            f.name: defaults[f.name] for f in fields(self) if getattr(self, f.name) is None and f.name in defaults
        }
        out = replace(self, **filled)
        if out.clip_eps_high is None:
            out.clip_eps_high = out.clip_eps
        if out.kl_in_reward and out.advantage not in ("gae", "returns"):
            raise ValueError(
                f"algo.kl_in_reward=True needs per-token rewards (algo.advantage=gae or returns), not {out.advantage}"
            )
        return out


def uses_proximal(algo: AlgoConfig) -> bool:
    """Whether the loss reads `prox_logprobs`: decoupled PPO, or any policy loss under a decoupled preset (bypass
    takes the behaviour log-probs as the old policy instead)."""
    if algo.rollout_correction == "bypass_ppo_clip":
        return False
    return algo.loss == "decoupled_ppo" or corrects_rollout(algo)


def corrects_rollout(algo: AlgoConfig) -> bool:
    """Whether a decoupled `rollout_correction` preset weighs or rejects tokens (`treerl.algo.correct_rollout`)."""
    return algo.rollout_correction.startswith("decoupled_")


def decoupled(algo: AlgoConfig) -> AlgoConfig:
    """The same objective with decoupled PPO's ratio: advantages, aggregation and clipping as the loss had them (a
    loss without a per-token ratio, GSPO or SFT, is returned as it is)."""
    if algo.loss not in DECOUPLABLE:
        return algo
    return replace(algo.resolved(), loss="decoupled_ppo")

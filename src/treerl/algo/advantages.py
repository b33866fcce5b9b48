"""Advantages from rewards: group-normalised (GRPO), leave-one-out (RLOO), GAE, whitened returns.

Step 3 (docs/architecture.md): the advantages of the whole batch, before any update.

Rewards live in `info["reward"]`: one number per sequence (the outcome), or, for a sequence that
holds a whole multi-turn episode, a list with one reward per turn, where a turn is a maximal run
of trained tokens (loss_mask > 0). Token-level estimators (gae, returns) put each turn's reward
on the turn's last trained token (an outcome reward on the last trained token) and discount
from one trained token to the next by `gamma`, times `turn_discount` across a turn boundary.
When every model call of an episode is its own sequence, give each call its own turn's reward in
`info["turn_reward"]` (with `turn` and `parent`): every estimator then uses the per-turn rewards
(`treerl.algo.turn_rewards`: reward to go, process-supervised group baselines).

Group estimators need `info["group"]` (sequences answering the same prompt share it); sequences
with the same `info["trajectory"]` in a group are one trajectory (the model calls of a multi-turn
episode), counted once in the group's baseline.
`compute_advantages` writes the per-token fields `advantages` (0 outside the loss mask) and,
for GAE, `returns` (the critic's targets); it must see the whole batch, as a group or a
whitening statistic spans it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

import torch

from treerl.algo.checks import check_mask_and_logprobs, check_reward, require_field
from treerl.algo.config import AlgoConfig
from treerl.algo.policy import kl_penalty
from treerl.algo.turn_rewards import has_turn_rewards, turn_group_advantages, turn_returns_per_sequence
from treerl.tree import BatchError, TokenSequence, validate_sequences


def _groups(groups: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    return members


def group_advantages(
    rewards: torch.Tensor, groups: Sequence[Hashable], scale_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: (r - mean of the group) / (std of the group + eps); Dr. GRPO: without the std (unbiased std, n - 1).

    A group of one has no baseline: its advantage is 0.
    """
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for members in _groups(groups).values():
        r = rewards[members].double()
        if len(members) == 1:
            continue
        centred = r - r.mean()
        out[members] = centred / (r.std() + eps) if scale_std else centred
    return out


def rloo_advantages(rewards: torch.Tensor, groups: Sequence[Hashable]) -> torch.Tensor:
    """RLOO: r_i minus the mean reward of the OTHER members of its group (groups need >= 2 members)."""
    out = torch.zeros_like(rewards, dtype=torch.float64)
    for group, members in _groups(groups).items():
        if len(members) < 2:
            raise ValueError(f"group {group!r} has one member; leave-one-out needs at least two")
        r = rewards[members].double()
        out[members] = r - (r.sum() - r) / (len(members) - 1)
    return out


def turn_spans(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The turns of a sequence: maximal runs [start, end) of trained tokens."""
    trained = (mask > 0).tolist()
    spans, start = [], None
    for t, on in enumerate(trained + [False]):
        if on and start is None:
            start = t
        elif not on and start is not None:
            spans.append((start, t))
            start = None
    return spans


def turn_returns(rewards: Sequence[float], discount: float) -> list[float]:
    """G_k = r_k + discount * G_{k+1}: the discounted return from each turn on."""
    returns, running = [], 0.0
    for r in reversed(rewards):
        running = r + discount * running
        returns.append(running)
    return returns[::-1]


def token_rewards(mask: torch.Tensor, reward: float | Sequence[float]) -> torch.Tensor:
    """Rewards per token: turn k's reward on its last trained token (a number: on the last trained token)."""
    spans = turn_spans(mask)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    per_turn = list(reward) if isinstance(reward, (list, tuple)) else None
    if per_turn is not None and len(per_turn) != len(spans):
        raise ValueError(f"{len(per_turn)} per-turn rewards for {len(spans)} turns (runs of loss_mask > 0)")
    if per_turn is None:
        if spans:
            out[spans[-1][1] - 1] = reward
        return out
    for (_, end), r in zip(spans, per_turn):
        out[end - 1] = r
    return out


def step_discounts(mask: torch.Tensor, gamma: float, turn_discount: float) -> torch.Tensor:
    """Discount from each trained token to the next trained one: gamma, times turn_discount across turns."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for start, end in turn_spans(mask):
        out[start:end] = gamma
        out[end - 1] = gamma * turn_discount
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, discounts: torch.Tensor, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the trained tokens only (others are skipped, not steps).

    values[t] = V(tokens[:t]), the value of the state in which token t was chosen; the state after
    the last trained token is terminal (value 0). delta_t = r_t + d_t V_next - V_t,
    A_t = delta_t + d_t lam A_next, returns_t = A_t + V_t, with d_t = `discounts[t]`.
    """
    r, v, d = rewards.tolist(), values.tolist(), discounts.tolist()
    advantages = [0.0] * len(r)
    next_value, next_advantage = 0.0, 0.0
    for t in reversed((mask > 0).nonzero().flatten().tolist()):
        delta = r[t] + d[t] * next_value - v[t]
        next_advantage = delta + d[t] * lam * next_advantage
        advantages[t] = next_advantage
        next_value = v[t]
    adv = torch.tensor(advantages, dtype=torch.float64)
    return adv, torch.where(mask > 0, adv + values.double(), 0.0)


def whiten(per_sequence: list[torch.Tensor], masks: list[torch.Tensor], eps: float) -> list[torch.Tensor]:
    """(a - mean) / (std + eps) over the trained tokens of the whole batch; 0 on untrained tokens."""
    trained = torch.cat([a[m > 0] for a, m in zip(per_sequence, masks)])
    if trained.numel() == 0:
        return per_sequence
    mean = trained.mean()
    std = trained.std() if trained.numel() > 1 else torch.zeros((), dtype=trained.dtype)
    return [torch.where(m > 0, (a - mean) / (std + eps), 0.0) for a, m in zip(per_sequence, masks)]


def compute_advantages(config: AlgoConfig, sequences: Sequence[TokenSequence]) -> None:
    """Fill fields `advantages` (and, for GAE, `returns`) of every sequence of the WHOLE batch, in place."""
    config = config.resolved()
    if config.advantage == "none":
        return
    validate_sequences(sequences)
    for i, seq in enumerate(sequences):
        check_mask_and_logprobs(seq, i)
    masks = [seq.fields["loss_mask"] for seq in sequences]
    rewards = [check_reward(seq, i) for i, seq in enumerate(sequences)]
    if config.advantage in ("group", "group_mean", "rloo"):
        advantages = _group_estimate_per_kind(config, sequences, rewards, masks)
    else:
        returns = turn_returns_per_sequence(sequences, config.turn_discount)  # per-turn rewards: each turn's return
        advantages = _token_estimate(config, sequences, [returns.get(i, r) for i, r in enumerate(rewards)], masks)
    if config.whiten:
        advantages = whiten(advantages, masks, config.adv_eps)
    dtype = torch.get_default_dtype()
    for seq, adv in zip(sequences, advantages):
        seq.fields["advantages"] = adv.to(dtype)


def _group_estimate_per_kind(
    config: AlgoConfig, sequences: Sequence[TokenSequence], rewards: list, masks: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Group advantages: trajectory rewards (`_group_estimate`), or per-turn rewards for the groups that give them
    (`treerl.algo.turn_rewards`); one group cannot mix the two."""
    per_turn = [i for i, seq in enumerate(sequences) if has_turn_rewards(seq)]
    if not per_turn:
        return _group_estimate(config, sequences, rewards, masks)
    rest = [i for i, seq in enumerate(sequences) if not has_turn_rewards(seq)]
    mixed = {sequences[i].info.get("group") for i in per_turn} & {sequences[i].info.get("group") for i in rest}
    if mixed:
        raise BatchError(f"group {min(mixed, key=repr)!r} mixes sequences with and without info 'turn_reward'; "
                         "give every trajectory of a group per-turn rewards, or none")
    out: list[torch.Tensor] = [torch.zeros(0)] * len(sequences)
    kept = _group_estimate(config, [sequences[i] for i in rest], [rewards[i] for i in rest], [masks[i] for i in rest])
    for i, advantages in zip(rest, kept):
        out[i] = advantages
    values = turn_group_advantages(sequences, per_turn, _turn_normaliser(config), config.turn_discount)
    for i in per_turn:
        out[i] = torch.where(masks[i] > 0, values[i], 0.0).double()
    return out


def _turn_normaliser(config: AlgoConfig):
    """How a group's turn rewards are normalised: the group estimator's formula, each turn a member."""
    def normalise(rewards: torch.Tensor, groups: list) -> torch.Tensor:
        if config.advantage != "rloo":
            return group_advantages(rewards, groups, scale_std=config.advantage == "group", eps=config.adv_eps)
        try:
            return rloo_advantages(rewards, groups)
        except ValueError as e:
            raise BatchError(f"algo.advantage=rloo with per-turn rewards: {e}") from None

    return normalise


def _group_estimate(
    config: AlgoConfig, sequences: Sequence[TokenSequence], rewards: list, masks: list[torch.Tensor]
) -> list[torch.Tensor]:
    """One advantage per trajectory from its group's trajectory rewards, on every trained token of its sequences.

    A multi-turn trajectory emits one sequence per model call, all carrying its reward and its
    `info["trajectory"]`: the group's mean and std are taken over its trajectories, each counted
    once, not over sequences (a trajectory with more calls must not weigh more in the baseline).
    A sequence without `trajectory` is a trajectory of its own.
    """
    keys: dict[tuple[Hashable, Hashable], int] = {}  # (group, trajectory) -> index of the trajectory
    of_sequence, trajectory_rewards, trajectory_groups = [], [], []
    for i, (seq, reward) in enumerate(zip(sequences, rewards)):
        if isinstance(reward, list):
            raise BatchError(
                f"{seq.label(i)}: field 'reward' is a list of per-turn rewards, but algo.advantage={config.advantage} "
                "needs one number per sequence (give each turn's sequence turn_returns(...)[k], or use gae/returns)"
            )
        if "group" not in seq.info:
            raise BatchError(
                f"{seq.label(i)}: field 'group' is missing from info (needed by algo.advantage={config.advantage})"
            )
        group = seq.info["group"]
        key = (group, seq.info.get("trajectory", ("sequence", i)))
        if key not in keys:
            keys[key] = len(trajectory_rewards)
            trajectory_rewards.append(reward)
            trajectory_groups.append(group)
        elif trajectory_rewards[keys[key]] != reward:
            raise BatchError(
                f"{seq.label(i)}: field 'reward' is {reward}, but an earlier sequence of trajectory {key[1]!r} "
                f"has {trajectory_rewards[keys[key]]}; the sequences of one trajectory share its reward"
            )
        of_sequence.append(keys[key])
    r = torch.tensor(trajectory_rewards, dtype=torch.float64)
    if config.advantage == "rloo":
        sizes = _groups(trajectory_groups)
        for i, t in enumerate(of_sequence):
            g = trajectory_groups[t]
            if len(sizes[g]) < 2:
                raise BatchError(
                    f"{sequences[i].label(i)}: field 'group' {g!r} has no other member; RLOO needs >= 2 trajectories"
                )
        scalar = rloo_advantages(r, trajectory_groups)
    else:
        scalar = group_advantages(r, trajectory_groups, scale_std=config.advantage == "group", eps=config.adv_eps)
    return [torch.where(m > 0, scalar[t], 0.0).double() for t, m in zip(of_sequence, masks)]


def _token_estimate(
    config: AlgoConfig, sequences: Sequence[TokenSequence], rewards: list, masks: list[torch.Tensor]
) -> list[torch.Tensor]:
    """GAE (with the critic's `values`) or discounted returns, from rewards placed on tokens."""
    out = []
    for i, (seq, reward, mask) in enumerate(zip(sequences, rewards, masks)):
        try:
            r = token_rewards(mask, reward)
        except ValueError as e:
            raise BatchError(f"{seq.label(i)}: field 'reward': {e}") from None
        if config.kl_in_reward and config.kl_coef > 0:
            purpose = "needed by algo.kl_in_reward"
            old = require_field(seq, i, "old_logprobs", purpose).double()
            ref = require_field(seq, i, "ref_logprobs", purpose).double()
            r = r - config.kl_coef * kl_penalty(old, ref, mask, config.kl_estimator)
        discounts = step_discounts(mask, config.gamma, config.turn_discount)
        if config.advantage == "gae":
            values = require_field(seq, i, "values", "the critic's values, needed by algo.advantage=gae")
            adv, returns = gae(r, values.double(), mask, discounts, config.lam)
            seq.fields["returns"] = returns.to(torch.get_default_dtype())
        else:
            adv, _ = gae(r, torch.zeros_like(r), mask, discounts, lam=1.0)
        out.append(adv)
    return out

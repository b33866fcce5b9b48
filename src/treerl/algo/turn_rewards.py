"""Per-turn rewards: every model call of a trajectory is its own sequence and carries the reward of its own turn.

Step 3 (docs/architecture.md): per-turn rewards turned into each turn's advantages.

A sequence that carries `info["turn_reward"]` trains one turn, the reply it ends with (the tree
node it ends), and that number is the turn's reward. Within its trajectory (`info["trajectory"]`,
else the sequence alone) `info["turn"]` names the turn and `info["parent"]` the turn it continues
(None or absent: a first turn). Turns form a tree: an agent may branch (n > 1 samples, retries),
and a turn with several continuations counts their mean. `info["reward"]` (the outcome) is then
only logged: put the outcome in the last turns' rewards.

- Token estimators (gae, returns): a turn's sequence is trained on the turn's return,
  G_k = r_k + turn_discount * mean over its continuations c of G_c, placed on its last trained token.
- Group estimators (group, group_mean, rloo), as DeepSeekMath's process supervision: each turn
  reward is normalised against every turn reward of its group (mean and std, the mean, or the
  mean of the others), then A_k = r~_k + turn_discount * mean over continuations of A_c.

A group holds trajectories with per-turn rewards or without, not both.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from treerl.tree import BatchError, TokenSequence

TURN_REWARD = "turn_reward"


@dataclass
class Turns:
    """The turns of one trajectory: each one's reward, the turns that continue it, and its sequences."""

    group: Hashable
    rewards: dict[Hashable, float] = field(default_factory=dict)
    children: dict[Hashable, list[Hashable]] = field(default_factory=dict)
    parents: dict[Hashable, Hashable] = field(default_factory=dict)
    sequences: dict[Hashable, list[int]] = field(default_factory=dict)  # turn -> batch indices


def has_turn_rewards(seq: TokenSequence) -> bool:
    return TURN_REWARD in seq.info


def trajectory_turns(sequences: Sequence[TokenSequence], indices: Sequence[int]) -> dict[Hashable, Turns]:
    """The turns of every trajectory among `sequences[indices]` (all carrying turn rewards), checked."""
    out: dict[Hashable, Turns] = {}
    for i in indices:
        seq = sequences[i]
        reward = _finite_turn_reward(seq, i)
        if "turn" not in seq.info:
            raise BatchError(f"{seq.label(i)}: field 'turn' is missing from info (needed with 'turn_reward')")
        key = seq.info.get("trajectory", ("sequence", i))
        turns = out.setdefault(key, Turns(seq.info.get("group")))
        turn = seq.info["turn"]
        if turn in turns.rewards and turns.rewards[turn] != reward:
            raise BatchError(f"{seq.label(i)}: field 'turn_reward' is {reward}, but an earlier sequence of turn "
                             f"{turn!r} of trajectory {key!r} has {turns.rewards[turn]}")
        turns.rewards[turn] = reward
        turns.sequences.setdefault(turn, []).append(i)
        if seq.info.get("parent") is not None:
            turns.parents[turn] = seq.info["parent"]
    for key, turns in out.items():
        for turn, parent in turns.parents.items():
            if parent not in turns.rewards:
                raise BatchError(f"trajectory {key!r}: turn {turn!r} continues turn {parent!r}, which is not in the "
                                 "batch (field 'parent')")
            turns.children.setdefault(parent, []).append(turn)
    return out


def turn_values(turns: Turns, rewards: dict[Hashable, float], discount: float) -> dict[Hashable, float]:
    """v_k = rewards[k] + discount * (mean of v over the turns that continue k), every turn of the trajectory."""
    values: dict[Hashable, float] = {}
    for turn in _children_first(turns):
        below = [values[c] for c in turns.children.get(turn, [])]
        values[turn] = rewards[turn] + (discount * sum(below) / len(below) if below else 0.0)
    return values


def turn_returns_per_sequence(sequences: Sequence[TokenSequence], discount: float) -> dict[int, float]:
    """For each sequence with a turn reward: the return of its turn (token estimators train on it)."""
    indices = [i for i, seq in enumerate(sequences) if has_turn_rewards(seq)]
    out: dict[int, float] = {}
    for turns in trajectory_turns(sequences, indices).values():
        for turn, value in turn_values(turns, turns.rewards, discount).items():
            out.update(dict.fromkeys(turns.sequences[turn], value))
    return out


def turn_group_advantages(sequences: Sequence[TokenSequence], indices: Sequence[int], normalise, discount: float,
                          ) -> dict[int, float]:
    """Process-supervised group advantages of `sequences[indices]`: `normalise(rewards, groups)` over each group's
    turn rewards (a group_advantages / rloo_advantages of `treerl.algo.advantages`), then summed over later turns."""
    trajectories = trajectory_turns(sequences, indices)
    members = [(turns, turn) for turns in trajectories.values() for turn in turns.rewards]
    for turns, _ in members:
        if turns.group is None:
            i = next(iter(turns.sequences.values()))[0]
            raise BatchError(f"{sequences[i].label(i)}: field 'group' is missing from info (needed by a group "
                             "advantage)")
    rewards = torch.tensor([turns.rewards[turn] for turns, turn in members], dtype=torch.float64)
    normalised = iter(normalise(rewards, [turns.group for turns, _ in members]).tolist())
    out: dict[int, float] = {}
    for turns in trajectories.values():  # the order of `members`
        scores = {turn: next(normalised) for turn in turns.rewards}
        for turn, value in turn_values(turns, scores, discount).items():
            out.update(dict.fromkeys(turns.sequences[turn], value))
    return out


def _children_first(turns: Turns) -> list[Hashable]:
    """Every turn after all the turns that continue it (a cycle of 'parent' links is an error)."""
    order: list[Hashable] = []
    state: dict[Hashable, int] = {}  # 1: being visited, 2: done
    for root in turns.rewards:
        stack = [(root, False)]
        while stack:
            turn, expanded = stack.pop()
            if expanded:
                state[turn] = 2
                order.append(turn)
                continue
            if state.get(turn) == 2:
                continue
            if state.get(turn) == 1:
                raise BatchError(f"turn {turn!r}: its 'parent' links form a cycle")
            state[turn] = 1
            stack.append((turn, True))
            stack.extend((child, False) for child in turns.children.get(turn, []) if state.get(child) != 2)
    return order


def _finite_turn_reward(seq: TokenSequence, index: int) -> float:
    """`info["turn_reward"]` as a float, or an error naming the sequence."""
    value = seq.info[TURN_REWARD]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise BatchError(f"{seq.label(index)}: field 'turn_reward' is {value!r}; it must be a finite number")
    return float(value)

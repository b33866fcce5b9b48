"""Rewards: a user's reward function loaded by import path and called without crashing a run (`functions.py`), the
built-in math-verify reward (`math_reward.py`), an evaluation's scores (`scores.py`).

Step 1 (docs/architecture.md): the reward of each sample; imports no other room of rollout. A user's reward
function imports `Scored` from here (`from treerl.rollout.rewards import Scored`).
"""

from treerl.rollout.rewards.functions import Scored

__all__ = ["Scored"]

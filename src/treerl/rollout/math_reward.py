"""The old path of `treerl.rollout.rewards.math_reward`: `rollout.reward_fn=treerl.rollout.math_reward:math_verify`
still loads.

Step 1 (docs/architecture.md): the math-verify reward, in rollout's `rewards` room.
"""

from treerl.rollout.rewards.math_reward import math_verify

__all__ = ["math_verify"]

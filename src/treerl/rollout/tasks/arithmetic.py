"""Built-in single-turn task: add two numbers, answer with digits.

Step 1 (docs/architecture.md): a built-in task's prompts and reward.

The reward gives format credit so a random-init policy scores above zero and has a gradient to
follow (answer with digits, then stop), and 1 for exactly the sum. The reply is read as written,
without its stop token: padding with spaces or special tokens does not pass for a short answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from treerl.rollout.tasks.base import Prompt
from treerl.rollout.tasks.heldout import EVAL_FRACTION, Generated, ItemSplit


def reward(prompt: str, completion: str, answer: int) -> float:
    """1 for exactly the sum's digits; else 0.2 x format: the share of digit characters, scaled down
    when the reply is longer than the sum (a reply that never stops, or pads with spaces, earns little).

    No credit for "close" numbers: it would pull the policy to one constant answer near the middle,
    while format credit is indifferent among digits and keeps them all in play until the sums are learnt.
    """
    if completion == str(answer):
        return 1.0
    length = max(len(completion), 1)
    return 0.2 * sum(c.isdigit() for c in completion) / length * min(1.0, len(str(answer)) / length)


@dataclass
class Arithmetic(Generated):
    """'a+b=' with 0 <= a, b <= max_operand; the reply is the sum. Evaluation asks the held-out pairs (a, b)."""

    max_operand: int = 4
    seed: int = 0
    name: str = "arithmetic"
    eval_fraction: float = EVAL_FRACTION  # share of the (max_operand + 1)^2 sums held out for evaluation
    reward_fn = staticmethod(reward)
    what = "sums"

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"arithmetic: max_operand must be >= 1, got {self.max_operand}")

    @property
    def max_new_tokens(self) -> int:
        """The digits of the largest sum, its stop token, and one spare."""
        return len(str(2 * self.max_operand)) + 2

    @property
    def split(self) -> ItemSplit:
        """The pairs (a, b), listed: a x (max_operand + 1) + b."""
        return ItemSplit(self.name, self.seed, self.eval_fraction, (self.max_operand + 1) ** 2)

    def item(self, rng) -> tuple[int, Prompt]:
        """One sum: its operands drawn from `rng`."""
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return a * (self.max_operand + 1) + b, Prompt("", [{"role": "user", "content": self.question(a, b)}], a + b)

    def question(self, a: int, b: int) -> str:
        """What the model is asked: the bare sum to complete."""
        return f"{a}+{b}="


def last_number_reward(prompt: str, completion: str, answer: int) -> float:
    """1 when the reply's last integer is the sum ("3 + 4 = 7", "The answer is 7."), else 0: a pretrained chat
    model's way of answering, read as math graders read a final answer."""
    numbers = re.findall(r"-?\d+", completion)
    return 1.0 if numbers and numbers[-1] == str(answer) else 0.0


@dataclass
class ArithmeticChat(Arithmetic):
    """The same sums asked as a chat model is asked ("What is 3 + 4? Answer with the number only."), for pretrained
    instruct checkpoints (configs/smollm2.yaml); the reward reads the reply's last number."""

    name: str = "arithmetic_chat"
    max_tokens: int = 16
    reward_fn = staticmethod(last_number_reward)

    @property
    def max_new_tokens(self) -> int:
        """Room for a short sentence around the number ("3 + 4 = 7.")."""
        return self.max_tokens

    def question(self, a: int, b: int) -> str:
        return f"What is {a} + {b}? Answer with the number only."

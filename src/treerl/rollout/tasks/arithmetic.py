"""Built-in single-turn task: add two numbers, answer with digits.

The reward gives partial credit so a random-init policy scores above zero and has a gradient to
follow: a share for answering with digits only, more for a number close to the sum, 1 for the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from treerl.rollout.tasks.base import Prompt, rng_for


def reward(prompt: str, completion: str, answer: int) -> float:
    """1 for the exact sum; else 0.2 x (share of digit characters) + 0.4 x closeness of a digits-only answer."""
    text = completion.strip()
    if text == str(answer):
        return 1.0
    score = 0.2 * sum(c.isdigit() for c in text) / max(len(text), 1)
    if text.isdigit():
        score += 0.4 * max(0.0, 1.0 - abs(int(text) - answer) / 10)
    return score


@dataclass
class Arithmetic:
    """'a+b=' with 0 <= a, b <= max_operand; the reply is the sum."""

    max_operand: int = 9
    seed: int = 0
    name: str = "arithmetic"
    reward_fn = staticmethod(reward)

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"arithmetic: max_operand must be >= 1, got {self.max_operand}")

    @property
    def max_new_tokens(self) -> int:
        """The digits of the largest sum, its stop token, and one spare."""
        return len(str(2 * self.max_operand)) + 2

    def prompts(self, step: int, count: int) -> list[Prompt]:
        out = []
        for i in range(count):
            rng = rng_for(self.name, self.seed, step, i)
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            out.append(Prompt(f"s{step}/p{i}", [{"role": "user", "content": f"{a}+{b}="}], answer=a + b))
        return out

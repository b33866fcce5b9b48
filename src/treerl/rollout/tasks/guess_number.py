"""Built-in multi-turn task: find a secret number; after each guess the environment says higher or lower.

Step 1 (docs/architecture.md): a built-in task's prompts and environment.

The first number in a reply is the guess. Rewards (a trajectory's reward is their sum): 0.05 per
turn whose reply is exactly that number (format); on a correct guess 1 - 0.1 x (turns used - 1),
ending the episode; after the last turn without success, 0.5 x closeness of the best guess. A
random policy often writes some digit, so it earns closeness credit; a policy that answers cleanly
and uses the feedback approaches 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from treerl.rollout.tasks.base import EnvReply, Prompt
from treerl.rollout.tasks.heldout import EVAL_FRACTION, Generated, ItemSplit

FORMAT_CREDIT = 0.05


@dataclass
class GuessEnv:
    """One game: the secret, the turns taken, and the closest guess so far."""

    secret: int
    max_number: int
    max_turns: int
    turn: int = 0
    best_distance: int | None = None

    def step(self, reply: str) -> EnvReply:
        self.turn += 1
        match = re.search(r"\d+", reply)
        guess = int(match.group()) if match else None
        reward = 0.0
        if guess is None or not 1 <= guess <= self.max_number:
            feedback = f"1-{self.max_number}?"  # not a guess in range
        else:
            if reply == str(guess):
                reward += FORMAT_CREDIT
            distance = abs(guess - self.secret)
            self.best_distance = distance if self.best_distance is None else min(distance, self.best_distance)
            if distance == 0:
                return EnvReply([{"role": "tool", "content": "correct"}], reward + 1.0 - 0.1 * (self.turn - 1), True)
            feedback = "higher" if guess < self.secret else "lower"
        done = self.turn >= self.max_turns
        if done and self.best_distance is not None:
            reward += 0.5 * (1.0 - self.best_distance / self.max_number)
        return EnvReply([{"role": "tool", "content": feedback}], reward, done)


@dataclass
class GuessNumber(Generated):
    """Guess a secret in [1, max_number] within max_turns replies; evaluation plays the held-out secrets."""

    max_number: int = 9
    max_turns: int = 4
    seed: int = 0
    name: str = "guess_number"
    eval_fraction: float = EVAL_FRACTION  # share of the max_number secrets held out for evaluation
    what = "secrets"

    def __post_init__(self) -> None:
        if self.max_number < 2:
            raise ValueError(f"guess_number: max_number must be >= 2, got {self.max_number}")
        if self.max_turns < 1:
            raise ValueError(f"guess_number: max_turns must be >= 1, got {self.max_turns}")

    @property
    def max_new_tokens(self) -> int:
        """The digits of the largest number, its stop token, and one spare."""
        return len(str(self.max_number)) + 2

    @property
    def split(self) -> ItemSplit:
        """The secrets, listed: secret - 1."""
        return ItemSplit(self.name, self.seed, self.eval_fraction, self.max_number)

    def item(self, rng) -> tuple[int, Prompt]:
        """One game: its secret drawn from `rng`."""
        secret = rng.randint(1, self.max_number)
        return secret - 1, Prompt("", [{"role": "user", "content": f"guess 1-{self.max_number}"}], answer=secret)

    def environment(self, prompt: Prompt) -> GuessEnv:
        return GuessEnv(secret=prompt.answer, max_number=self.max_number, max_turns=self.max_turns)

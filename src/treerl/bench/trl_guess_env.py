"""A TRL environment class both trainers drive: find a hidden number with a `guess` tool (the multi-turn head-to-head).

Step 1 (docs/architecture.md): the episodes of `treerl bench --against trl`'s multi-turn workload.

Written to TRL's `environment_factory` contract (reset(**row), public methods are the model's tools, get_reward()),
so TRL's GRPOTrainer runs it as it is and treerl runs it through its adapter (`rollout.env=trl:treerl.bench.
trl_guess_env:HiddenNumber`, treerl/rollout/environments/trl_env.py). It imports nothing: TRL's venv loads this file
by its path (treerl is not installed there).
"""

from __future__ import annotations

from typing import Any


class HiddenNumber:
    """One game: the row's `secret` in 1..5 is hidden; each `guess` answers higher, lower or correct."""

    def __init__(self) -> None:
        self.secret, self.found, self.guesses = 0, False, 0

    def reset(self, secret: int, **row: Any) -> None:
        """A new game; the prompt (the row's) already says what to do."""
        self.secret, self.found, self.guesses = int(secret), False, 0

    def guess(self, number: int) -> str:
        """Guess the hidden number.

        Args:
            number: your guess, a whole number from 1 to 5
        """
        self.guesses += 1
        if int(number) == self.secret:
            self.found = True
            return "correct"
        return "higher" if int(number) < self.secret else "lower"

    def get_reward(self) -> float:
        """1 for finding the number; 0.1 for a well-formed guess that missed (a gradient toward using the tool)."""
        return 1.0 if self.found else 0.1 if self.guesses else 0.0

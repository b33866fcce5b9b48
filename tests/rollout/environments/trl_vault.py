"""A TRL-style environment class (GRPOTrainer's environment_factory contract) written for the tests: open a vault.

reset(**row) takes the row's `code` and says it; the public method `check` is the model's tool; get_reward() scores
the episode. A row's `fail` breaks one part on purpose: "reset" raises, "reward" returns NaN, "slow" makes the tool
outlast rollout.env_timeout.
"""

from __future__ import annotations

import time


class Vault:
    def __init__(self, digits: int = 1):
        self.digits = digits
        self.code, self.opened, self.fail = None, False, None

    def reset(self, code: int, fail: str | None = None, **row) -> str:
        if fail == "reset":
            raise RuntimeError("the vault's reset broke")
        self.code, self.opened, self.fail = code, False, fail
        return f" The code is {code}."

    def check(self, guess: int) -> str:
        """Try a code on the vault.

        Args:
            guess: the code to try
        """
        if self.fail == "slow":
            time.sleep(3.0)
        self.opened = self.opened or guess == self.code
        return "open" if guess == self.code else "locked"

    def get_reward(self) -> float:
        return float("nan") if self.fail == "reward" else float(self.opened)

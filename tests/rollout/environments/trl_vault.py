"""A TRL-style environment class (GRPOTrainer's environment_factory contract) written for the tests: open a vault.

reset(**row) takes the row's `code` and says it; the public method `check` is the model's tool; get_reward() scores
the episode. A row's `fail` breaks one part on purpose: "reset" raises, "reward" returns NaN, "slow" makes the tool
outlast rollout.env_timeout, "hang" makes get_reward sleep far past it.

`Presser` (no get_reward) counts the presses of its one tool and says "done" after five: an episode longer than any
default bound, scored by a reward function as TRL's reward_funcs are (`pressed`, given the environments).
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
        if self.fail == "hang":
            time.sleep(30.0)
        return float("nan") if self.fail == "reward" else float(self.opened)


class Presser:
    PRESSES = 5

    def __init__(self):
        self.presses = 0

    def reset(self, **row) -> str:
        self.presses = 0
        return " Press the button until it says done."

    def press(self, times: int) -> str:
        """Press the button.

        Args:
            times: how many times to press it
        """
        self.presses += times
        return "done" if self.presses >= self.PRESSES else f"pressed {self.presses}"


def pressed(prompts, completions, environments, log_metric, **kwargs) -> list[float]:
    """A reward function as TRL calls its reward_funcs: the presses each episode's environment counted."""
    log_metric("messages", len(completions[0]))
    return [float(env.presses) for env in environments]


def opened_twice(environments, **kwargs) -> list[float]:
    """A second reward source beside get_reward: 2 for an opened vault."""
    return [2.0 * env.opened for env in environments]

"""An OpenEnv Environment written for the tests: say the number the observation asks for, twice.

Served by OpenEnv's own `create_app` + uvicorn (`python openenv_counting.py PORT [CLASS]`), or run in process.
Deterministic under its seed; `drift=True` makes every instance after the first answer differently (a replay then
diverges); `locked=True` holds a lock, so an instance cannot be deep-copied; `workdir=True` keeps its step count in a
file of a directory of its own, which a deep copy shares (it copies without an error, and a copy's steps count in
the original's too); `ignore_seed=True` picks its number whatever the seed (OpenEnv allows it). `CopyableCountingEnv`
says its copies are independent (SUPPORTS_DEEPCOPY); `UnseededCountingEnv` ignores the seed, served.
"""

from __future__ import annotations

import itertools
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

TURNS = 2
_INSTANCES = itertools.count()
_UNSEEDED = random.Random()  # an environment that ignores the seed draws from here


class SayAction(Action):
    message: str


class SayObservation(Observation):
    prompt: str = ""


class CountingEnv(Environment[SayAction, SayObservation, State]):
    """reset(seed) picks a number 1-9; each step asks for it again; reward 1.0 for a reply that is exactly it."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    resets = 0  # resets of every instance, counted to tell a copied branch (none) from a replayed one

    def __init__(self, drift: bool = False, locked: bool = False, fail_at: int | None = None, slow: float = 0.0,
                 workdir: bool = False, ignore_seed: bool = False):
        super().__init__()
        self.drift, self.fail_at, self.slow, self.ignore_seed = drift, fail_at, slow, ignore_seed
        self.lock = threading.Lock() if locked else None
        self.workdir = Path(tempfile.mkdtemp(prefix="counting-")) if workdir else None
        self.instance = next(_INSTANCES)
        self._state = State(step_count=0)
        self.target = 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> SayObservation:
        CountingEnv.resets += 1
        self.target = (_UNSEEDED if self.ignore_seed else random.Random(seed)).randint(1, 9)
        self._state = State(episode_id=episode_id, step_count=0)
        self.steps = 0
        game = f" (game {_UNSEEDED.randrange(10**6)})" if self.ignore_seed else ""  # two resets never look alike
        return SayObservation(prompt=f"say {self.target}{game}")

    @property
    def steps(self) -> int:
        return int((self.workdir / "steps").read_text()) if self.workdir else self._state.step_count

    @steps.setter
    def steps(self, value: int) -> None:
        if self.workdir:
            (self.workdir / "steps").write_text(str(value))
        self._state.step_count = value

    def step(self, action: SayAction, timeout_s=None, **kwargs) -> SayObservation:
        self.steps += 1
        time.sleep(self.slow)
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("the counting environment broke")
        said = action.message.strip()
        reward = (1.0 if said == str(self.target) else 0.0) - (0.5 if self.steps > TURNS else 0.0)  # a step past the
        # end (a copy's, counted in its original's file) costs
        shown = f"you said {said[:20]!r}; say {self.target}"
        if self.drift and self.instance > 0:
            shown += f" (instance {self.instance})"
        return SayObservation(prompt=shown, reward=reward, done=self.steps >= TURNS, metadata={"said_right": reward})

    @property
    def state(self) -> State:
        return self._state


class NoResetEnv(Environment[SayAction, SayObservation, State]):
    """An Environment without reset: abstract, so it cannot even be built."""

    def step(self, action: SayAction, timeout_s=None, **kwargs) -> SayObservation:
        return SayObservation(prompt="", done=True)

    @property
    def state(self) -> State:
        return State(step_count=0)


class CopyableCountingEnv(CountingEnv):
    SUPPORTS_DEEPCOPY = True


class UnseededCountingEnv(CountingEnv):
    def __init__(self):
        super().__init__(ignore_seed=True)


if __name__ == "__main__":  # python openenv_counting.py PORT [CLASS]: serve it with OpenEnv's own app
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    served = globals()[sys.argv[2]] if len(sys.argv) > 2 else CountingEnv
    app = create_app(served, SayAction, SayObservation, max_concurrent_envs=64)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")

"""An OpenEnv Environment written for the tests: say the number the observation asks for, twice.

Served by OpenEnv's own `create_app` + uvicorn (`python openenv_counting.py PORT`), or run in process. Deterministic
under its seed; `drift=True` makes every instance after the first answer differently (a replay then diverges);
`locked=True` holds a lock, so an instance cannot be deep-copied (a branch replays it).
"""

from __future__ import annotations

import itertools
import random
import sys
import threading
import time

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

TURNS = 2
_INSTANCES = itertools.count()


class SayAction(Action):
    message: str


class SayObservation(Observation):
    prompt: str = ""


class CountingEnv(Environment[SayAction, SayObservation, State]):
    """reset(seed) picks a number 1-9; each step asks for it again; reward 1.0 for a reply that is exactly it."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, drift: bool = False, locked: bool = False, fail_at: int | None = None, slow: float = 0.0):
        super().__init__()
        self.drift, self.fail_at, self.slow = drift, fail_at, slow
        self.lock = threading.Lock() if locked else None
        self.instance = next(_INSTANCES)
        self._state = State(step_count=0)
        self.target = 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> SayObservation:
        self.target = random.Random(seed).randint(1, 9)
        self._state = State(episode_id=episode_id, step_count=0)
        return SayObservation(prompt=f"say {self.target}")

    def step(self, action: SayAction, timeout_s=None, **kwargs) -> SayObservation:
        self._state.step_count += 1
        time.sleep(self.slow)
        if self.fail_at is not None and self._state.step_count >= self.fail_at:
            raise RuntimeError("the counting environment broke")
        said = action.message.strip()
        reward = 1.0 if said == str(self.target) else 0.0
        shown = f"you said {said[:20]!r}; say {self.target}"
        if self.drift and self.instance > 0:
            shown += f" (instance {self.instance})"
        return SayObservation(prompt=shown, reward=reward, done=self._state.step_count >= TURNS,
                              metadata={"said_right": reward})

    @property
    def state(self) -> State:
        return self._state


if __name__ == "__main__":  # python openenv_counting.py PORT: serve it with OpenEnv's own app
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    app = create_app(CountingEnv, SayAction, SayObservation, max_concurrent_envs=64)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")

"""verifiers 0.4 environments: `verifiers:TASKSET_ID`, each episode played by verifiers' own loop through the proxy.

Step 1 (docs/architecture.md): the episodes of an environment written for verifiers (prime-rl's environments).

verifiers 0.4 (`verifiers.v1`) builds an environment from a taskset id (an installed package, or a module on the
path, exporting a `Taskset`, optionally its `Env` and `Harness`); the trainer-facing call is
`env.run_episode(task, ModelContext(model, EvalClientConfig(base_url=...)))` inside `env.serving()`, which runs the
agent's harness program (the `null` chat loop, a PEP 723 script installed by uv) against verifiers' interception
server, and scores the trace with the task's `@vf.reward` / `@vf.metric` methods. verifiers pins openai<3 and
mcp==2.0.0, so it usually lives in a venv of its own (tools/verifiers-venv.sh): `verifiers_worker.py` runs there,
one process per environment, started here when the rollout is built, and plays each episode against this
episode's URL of treerl's recording proxy. So every model call of the episode is sampled and recorded by treerl
(token for token, behaviour log-probs included), and the reward is verifiers' own (the trace's weighted rewards
summed), its named rewards logged as `reward/<name>` and its metrics by name.

- env_args go to verifiers' config: a key the taskset's config has goes there, else one the environment's config
  has (e.g. `agent: {max_turns: 3}`); another key is refused before any sampling (verifiers' configs forbid
  extras). treerl's own keys: `python` (the interpreter that has verifiers; default: this one if it imports
  verifiers, else tools/verifiers-venv.sh's venv) and `tasks` (how many tasks of an endless taskset, default 1000).
- The agents run in verifiers' local subprocess runtime; a taskset that ships no harness is played by `null`, the
  tool-less chat loop (verifiers' own default, `bash`, would run the model's commands on this machine).
- rollout.env_timeout bounds verifiers' setup, finalize and scoring stages (its own deadlines); the whole episode is
  bounded by rollout.episode_timeout. An episode verifiers reports failed (a hook or the program raised, a deadline
  expired) is dropped (env_raised, env_timeout); so is a reward that is not a finite number (env_not_finite ...).

Not branched: verifiers' loop owns the conversation, so each of the group_size episodes of a task is played on its
own (rollout.branch_at does not apply to agent episodes), every model call a sequence of the group's prefix tree.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treerl.errors import UserError
from treerl.rollout.config import RolloutConfig
from treerl.rollout.environments.trl_env import EnvCallFailed
from treerl.rollout.rewards.functions import check_metrics, check_reward
from treerl.rollout.tasks.dataset import DatasetTask, FromRows

OWN_KEYS = ("python", "tasks")  # treerl's; the other env_args go to verifiers' config
WORKER = Path(__file__).with_name("verifiers_worker.py")
VENV_SCRIPT = "tools/verifiers-venv.sh"
VENV = Path.home() / ".cache" / "treerl" / "verifiers-0.4.0"
START_SECONDS = 300.0  # importing verifiers, building the taskset
MAX_TURNS = 8
MAX_NEW_TOKENS = 128


def default_python() -> str:
    """The interpreter that runs the worker: this one where verifiers imports, else tools/verifiers-venv.sh's."""
    if importlib.util.find_spec("verifiers") is not None:
        return sys.executable
    return str(Path(os.environ.get("TREERL_VERIFIERS_VENV", VENV)) / "bin" / "python")


class Worker:
    """One verifiers_worker.py process: episodes asked for by id, answered by a reader thread (any event loop)."""

    def __init__(self, python: str, spec: dict[str, Any], name: str):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix="treerl-verifiers-", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen([python, str(WORKER), json.dumps(spec)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1,
                                        start_new_session=True)
        atexit.register(self.close)
        self.pending: dict[int, Future] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.ready = self.first_line()
        threading.Thread(target=self.read, name="treerl-verifiers", daemon=True).start()

    def first_line(self) -> dict[str, Any]:
        """The worker's first answer (ready with the prompts, or why it could not build the environment)."""
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(START_SECONDS)
        line = box[0] if box else ""
        if not line:
            self.close()
            why = "did not start" if reader.is_alive() else "exited"
            raise UserError(f"rollout.env={self.name!r}: the verifiers worker {why}: {self.stderr_tail()}")
        message = json.loads(line)
        if "error" in message:
            self.close()
            raise UserError(f"rollout.env={self.name!r}: {message['error']}")
        return message

    def stderr_tail(self) -> str:
        """The last lines the worker wrote to stderr, on one line."""
        text = Path(self.log.name).read_text(errors="replace")
        return " | ".join(line.strip() for line in text.strip().splitlines()[-3:])[-800:] or "(no output)"

    def read(self) -> None:
        """Hand each answer to the episode that asked; when the worker ends, every open episode fails."""
        for line in self.process.stdout:  # type: ignore[union-attr]
            message = json.loads(line)
            with self.lock:
                future = self.pending.pop(message.pop("id"), None)
            if future is not None:
                future.set_result(message)
        with self.lock:
            pending, self.pending = self.pending, {}
        for future in pending.values():
            future.set_result({"error": f"the verifiers worker exited: {self.stderr_tail()}", "reason": "env_raised"})

    async def play(self, task: int, base_url: str) -> dict[str, Any]:
        """Task `task` played by verifiers against `base_url` (this episode's proxy URL): its result message."""
        future: Future = Future()
        with self.lock:
            if self.process.poll() is not None:
                return {"error": f"the verifiers worker exited: {self.stderr_tail()}", "reason": "env_raised"}
            key = next(self.ids)
            self.pending[key] = future
            self.process.stdin.write(json.dumps({"id": key, "task": task, "base_url": base_url}) + "\n")  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
        try:
            return await asyncio.wrap_future(future)
        finally:
            with self.lock:
                self.pending.pop(key, None)

    def close(self) -> None:
        """Stop the worker (its process group, by PID)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, 15)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, 9)


@dataclass
class VerifiersTask(FromRows):
    """Episodes of a verifiers environment, each played by its worker against the episode's proxy URL; its tasks held
    out as a dataset's rows are."""

    name: str
    worker: Worker
    rows: DatasetTask  # the taskset's tasks in a seeded order epoch after epoch; each answer {"task": index, "prompt"}
    max_turns: int = MAX_TURNS
    max_new_tokens: int = MAX_NEW_TOKENS

    async def agent(self, client: Any, row: dict[str, Any]) -> dict[str, Any]:
        """One episode as verifiers plays it; its reward and named rewards and metrics, or why it is dropped."""
        result = await self.worker.play(row["task"], str(client.base_url).rstrip("/"))
        if "error" in result:
            raise EnvCallFailed(f"verifiers: {result['error']}", result["reason"])
        reward = check_reward(result["reward"])
        if not isinstance(reward, float):
            raise EnvCallFailed(f"verifiers' reward {reward.message}", f"env_{reward.kind}")
        metrics = check_metrics({**{f"reward/{k}": v for k, v in result["rewards"].items()}, **result["metrics"]})
        if not isinstance(metrics, dict):
            raise EnvCallFailed(f"verifiers' {metrics.message}", f"env_{metrics.kind}")
        return {"reward": reward, "metrics": metrics}

    def close(self) -> None:
        """Stop the worker."""
        self.worker.close()


def build(target: str, env_args: dict[str, Any], config: RolloutConfig) -> VerifiersTask:
    """The task of `verifiers:TASKSET_ID`: its worker started and the environment built now, before any sampling."""
    spec = f"verifiers:{target}"
    own = {key: env_args.pop(key) for key in OWN_KEYS if key in env_args}
    python = str(own.get("python") or default_python())
    if not Path(python).exists():
        raise UserError(f"rollout.env={spec!r}: no verifiers here: run {VENV_SCRIPT} (verifiers 0.4.0 in a venv of "
                        f"its own, {VENV}), or pip install 'verifiers>=0.4,<0.5' (it needs openai<3), or set "
                        "env_args.python to an interpreter that has it")
    tasks = own.get("tasks", 1000)
    if not isinstance(tasks, int) or isinstance(tasks, bool) or tasks < 1:
        raise UserError(f"rollout.env={spec!r}: env_args.tasks must be a positive integer, got {tasks!r}")
    worker = Worker(python, {"target": target, "env_args": env_args, "timeout": config.env_timeout,
                             "tasks": tasks}, spec)
    shown = [([{"role": "user", "content": text}], {"task": k, "prompt": text})  # the prompt: in reports
             for k, text in enumerate(worker.ready["prompts"])]
    rows = DatasetTask.split(shown, None, config.eval_fraction, seed=config.seed,  # type: ignore[arg-type]
                             shuffle=config.shuffle, name=spec)
    return VerifiersTask(spec, worker, rows)

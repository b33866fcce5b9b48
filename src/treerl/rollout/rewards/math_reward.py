"""A built-in reward for math answers: the `math-verify` package decides whether a reply's answer equals the reference.

Step 1 (docs/architecture.md): the reward of each sample, for a dataset of math problems.

    rollout.task=dataset rollout.data_path=problems.jsonl rollout.reward_fn=treerl.rollout.rewards.math_reward:math_verify

1.0 when math-verify (Hugging Face's verifier, the one TRL's and verifiers' math rewards call) finds the reply's
answer equal to the row's `answer` (LaTeX or plain: `\\frac{1}{2}`, `0.5` and `1/2` are one answer; `\\boxed{}` is
read), else 0.0. math-verify bounds each parse and comparison with `signal.alarm`, which works only in a process's
main thread, and rewards run in a worker thread: so the checks run in a worker process of their own (started at the
first call), where its time limits work (a check that runs out scores 0.0, as in math-verify). A worker stuck past
those limits (in C code a signal cannot interrupt) is killed and the call raises: that sample is dropped and
counted (reward_raised), and the next call starts a fresh worker. Install: pip install 'treerl[math]'.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from typing import Any

from treerl.errors import UserError

CHECK_SECONDS = 5  # math-verify's limit on each parse and each comparison (its own default)
STARTUP_SECONDS = 120.0  # a fresh worker imports sympy and math-verify first
# The worker: a plain Python process (it imports math-verify, not treerl or torch) answering one JSON line per check.
WORKER = """
import json, sys
from math_verify import parse, verify
print("ready", flush=True)
for line in sys.stdin:
    answer, completion, seconds = json.loads(line)
    gold = parse(answer, parsing_timeout=seconds) or parse("$" + answer + "$", parsing_timeout=seconds)
    predicted = parse(completion, parsing_timeout=seconds) if gold else []
    print(json.dumps(float(bool(predicted) and verify(gold, predicted, timeout_seconds=seconds))), flush=True)
"""


class MathVerify:
    """The reward function: fn(prompt=..., completion=..., answer=...) -> 1.0 or 0.0, checked in a worker process."""

    def __init__(self, seconds: int = CHECK_SECONDS):
        self.seconds = seconds
        self._worker: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one check at a time (a call that timed out may still be waiting for its line)

    def __call__(self, prompt: str, completion: str, answer: Any) -> float:
        if answer is None:
            raise ValueError("math_verify needs the row's reference answer (rollout.answer_key), and this row has none")
        with self._lock:
            worker = self._started()
            worker.stdin.write(json.dumps([str(answer), completion, self.seconds]) + "\n")  # type: ignore[union-attr]
            worker.stdin.flush()  # type: ignore[union-attr]
            return float(self._line(worker, self.limit))

    @property
    def limit(self) -> float:
        """How long a call waits: a parse of each side and the comparisons, each bounded by `seconds`, and slack."""
        return 4.0 * self.seconds + 5.0

    def _started(self) -> subprocess.Popen:
        """The worker process, started (and its import waited for) at the first call or after a kill."""
        if self._worker is None or self._worker.poll() is not None:
            try:
                import math_verify  # noqa: F401
            except ImportError:
                raise UserError("rollout.reward_fn=...math_verify needs the math-verify package: pip install "
                                "'treerl[math]' (from a checkout: pip install -e '.[math]')") from None
            self._worker = subprocess.Popen([sys.executable, "-u", "-c", WORKER], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True)
            self._line(self._worker, STARTUP_SECONDS)
        return self._worker

    def _line(self, worker: subprocess.Popen, seconds: float) -> str:
        """The worker's next line; a worker that is silent for `seconds` (stuck) or exits is killed, and this raises."""
        readable, _, _ = select.select([worker.stdout], [], [], seconds)
        line = worker.stdout.readline() if readable else ""  # type: ignore[union-attr]
        if not line:
            self.stop()
            raise TimeoutError(f"math-verify did not answer within {seconds:g} s; its worker was killed (a fresh one "
                               "starts at the next call)" if not readable else "math-verify's worker exited")
        return line.strip()

    def stop(self) -> None:
        """Kill the worker (a stuck check cannot be cancelled); the next call starts a fresh one."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.kill()
            worker.wait()


math_verify = MathVerify()

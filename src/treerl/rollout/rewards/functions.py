"""Reward functions: loading a user's by import path, and calling any of them without crashing a run.

Step 1 (docs/architecture.md): the reward of each sample.

A reward function is called with keyword arguments `fn(prompt=..., completion=..., answer=...)`:
the prompt's text (its last user message), the model's reply as text (without its final stop token), and
the reference answer of the data row (None when there is none); it returns a number. A function
that raises (anything, `SystemExit` included), takes longer than `rollout.reward_timeout`, or
returns NaN/inf, a number beyond +-1e9 (`treerl.algo.checks.MAX_ABS_REWARD`) or something that is
not a number, does not stop training: the sample is dropped, counted under its reason and reported
with its prompt and completion (`RolloutStats.dropped`, `RolloutStats.dropped_samples`, and a
warning in the log).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treerl.algo.checks import MAX_ABS_REWARD
from treerl.errors import UserError

RewardFn = Callable[..., float]
SCORERS = {"reward": "reward function", "env": "environment"}  # a dropped sample's reason prefix -> what failed
REWARD_ARGUMENTS = {"prompt": "", "completion": "", "answer": None}


def load_reward_fn(spec: str) -> RewardFn:
    """The function named by `module:function` (or `path/to/file.py:function`), signature checked.

    The current directory is importable, so `my_rewards:exact_match` finds ./my_rewards.py.
    """
    fn = import_object(spec, "reward function", "my_rewards:exact_match")
    check_reward_fn(fn, spec)
    return fn


def import_object(spec: str, what: str, example: str) -> Any:
    """The object named by `module:attribute` or `path/to/file.py:attribute` (`what` names it in errors)."""
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise UserError(f"{what} {spec!r}: expected 'module:function', e.g. '{example}'")
    try:
        module = _import(module_name)
    except BaseException as e:  # any failure while importing the user's module (sys.exit too) is reported alike
        if isinstance(e, KeyboardInterrupt):
            raise
        raise UserError(f"{what} {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    obj = getattr(module, attribute, None)
    if obj is None:
        raise UserError(f"{what} {spec!r}: module {module_name!r} has no attribute {attribute!r}")
    return obj


def check_reward_fn(fn: Any, name: str) -> None:
    """A reward function must be callable as fn(prompt=..., completion=..., answer=...)."""
    if not callable(fn):
        raise UserError(f"reward function {name!r} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust them
    try:
        signature.bind(**REWARD_ARGUMENTS)
    except TypeError:
        raise UserError(
            f"reward function {name!r} has signature {signature}; it must accept keyword arguments "
            "(prompt, completion, answer), e.g. def reward(prompt, completion, answer) -> float"
        ) from None


class NamedFailure(Exception):
    """An error of treerl's own environment code that names the reason its sample is dropped (e.g. replay_diverged)."""

    reason = "raised"


@dataclass(frozen=True)
class RewardFailure:
    """Why a reward could not be used: `kind` is "raised", "timeout", "not_a_number", "not_finite" or "too_large"."""

    kind: str
    message: str


@dataclass
class UserCode:
    """Calls user code (a reward function, an environment's step) in a worker thread, with a time limit per call.

    Whatever the code raises, `SystemExit` and `KeyboardInterrupt` included, comes back as a
    RewardFailure ("raised"), as does a call still running after `timeout` seconds ("timeout"). A real
    Ctrl-C is not affected: Python delivers signals to the main thread, never to this one. A call that
    timed out cannot be killed (no Python thread can be): it is left to finish in its daemon thread, counted
    in `abandoned`, and later calls get a fresh thread.
    """

    timeout: float | None = None  # seconds; None: wait as long as the call takes
    timeout_option: str = "rollout.reward_timeout"  # the option that sets it, named when a call times out
    on_call: Callable[[], None] | None = None  # run before each call (an async rollout worker's heartbeat)
    abandoned: int = 0  # calls that timed out and may still be running
    _thread: _CallerThread | None = field(default=None, init=False, repr=False)

    def call(self, fn: Callable[[], Any]) -> Any:
        """`fn()`'s value, or a RewardFailure saying why there is none."""
        if self.on_call is not None:
            self.on_call()
        if self._thread is None:
            self._thread = _CallerThread()
        done, outcome = threading.Event(), []
        self._thread.calls.put((fn, done, outcome))
        if not done.wait(self.timeout):
            self._thread = None  # still busy with fn: abandoned
            self.abandoned += 1
            return RewardFailure("timeout", f"did not return within {self.timeout:g} s ({self.timeout_option})")
        kind, value = outcome[0]
        if kind == "raised":
            reason = value.reason if isinstance(value, NamedFailure) else "raised"
            return RewardFailure(reason, f"raised {type(value).__name__}: {value}")
        return value


class _CallerThread(threading.Thread):
    """A daemon thread that runs the calls put into its queue, one at a time."""

    def __init__(self) -> None:
        super().__init__(name="treerl-user-code", daemon=True)
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            fn, done, outcome = self.calls.get()
            try:
                outcome.append(("value", fn()))
            except BaseException as e:  # noqa: BLE001 (user code: sys.exit() or a stray KeyboardInterrupt too)
                outcome.append(("raised", e))
            done.set()


def call_reward(fn: Callable[[], Any], user_code: UserCode | None = None) -> float | RewardFailure:
    """The reward `fn()` returns as a float, or why it cannot be used (it raised, timed out, or is not a finite
    number); `user_code` runs it (with its timeout), by default without a time limit."""
    value = (user_code or UserCode()).call(fn)
    if isinstance(value, RewardFailure):
        return value
    return check_reward(value)


@dataclass(frozen=True)
class Scored:
    """A reward with named metrics beside it (an environment's rubric or episode info): the metrics are logged per
    environment (env/<name>/<metric>), never trained on. A reward function may return one instead of a number."""

    reward: Any
    metrics: dict[str, Any] = field(default_factory=dict)


def call_scored(fn: Callable[[], Any], user_code: UserCode | None = None) -> Scored | RewardFailure:
    """`call_reward` for a function that may return a Scored: the reward and its metrics checked (a metric that is
    not a finite number fails the sample like its reward would)."""
    value = (user_code or UserCode()).call(fn)
    return value if isinstance(value, RewardFailure) else check_scored(value)


def check_scored(value: Any) -> Scored | RewardFailure:
    """A number or a Scored as a Scored of a float reward and float metrics, or why it is not usable."""
    reward, metrics = (value.reward, value.metrics) if isinstance(value, Scored) else (value, {})
    checked = check_reward(reward)
    if isinstance(checked, RewardFailure):
        return checked
    numbers = check_metrics(metrics)
    return numbers if isinstance(numbers, RewardFailure) else Scored(checked, numbers)


def check_metrics(metrics: Any) -> dict[str, float] | RewardFailure:
    """Named metrics as {name: float}, or why they are not (not a mapping of names to finite numbers)."""
    if not isinstance(metrics, dict):
        return RewardFailure("not_a_number", f"returned metrics {str(metrics)[:200]}, not a mapping of names to numbers")
    out = {}
    for name, value in metrics.items():
        checked = check_reward(value)
        if isinstance(checked, RewardFailure):
            return RewardFailure(checked.kind, f"metric {name!r} {checked.message}")
        out[str(name)] = checked
    return out


def check_reward(value: Any) -> float | RewardFailure:
    """`value` as a float, or why it is not a usable reward."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        value = float(value)  # int, bool, float, numpy scalar, one-element tensor
    except Exception:  # anything float() refuses is "not a number"
        return RewardFailure("not_a_number", f"returned {value!r}, not a number")
    if not math.isfinite(value):
        return RewardFailure("not_finite", f"returned {value}")
    if abs(value) > MAX_ABS_REWARD:
        return RewardFailure("too_large", f"returned {value:g}; rewards must be within +-{MAX_ABS_REWARD:g} (rescale "
                                          "them: larger ones overflow the advantages and the loss)")
    return value


def _import(module_name: str) -> Any:
    """Import a module by dotted name (current directory included), or from a .py file path (its directory
    included, as `python path/to/file.py` would: the file may import modules next to it, when it loads or later)."""
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"no file {module_name}")
        _importable(str(path.resolve().parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module
    _importable(os.getcwd())
    return importlib.import_module(module_name)


def _importable(directory: str) -> None:
    """Put `directory` first on the import path, so the user's modules in it can be imported; one already on the
    path keeps its place (the order the user set up is not changed)."""
    if directory not in sys.path:
        sys.path.insert(0, directory)

"""Reward functions: loading a user's by import path, and calling any of them without crashing a run.

A reward function is called with keyword arguments `fn(prompt=..., completion=..., answer=...)`:
the prompt's text (its last user message), the model's reply as text (without its final stop token), and
the reference answer of the data row (None when there is none); it returns a number. A function
that raises, or returns NaN/inf or something that is not a number, does not stop training: the
sample is dropped, counted under its reason and reported with its prompt and completion
(`RolloutStats.dropped`, `RolloutStats.dropped_samples`, and a warning in the log).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RewardFn = Callable[..., float]
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
        raise ValueError(f"{what} {spec!r}: expected 'module:function', e.g. '{example}'")
    try:
        module = _import(module_name)
    except Exception as e:  # any failure while importing the user's module is reported the same way
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    obj = getattr(module, attribute, None)
    if obj is None:
        raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attribute!r}")
    return obj


def check_reward_fn(fn: Any, name: str) -> None:
    """A reward function must be callable as fn(prompt=..., completion=..., answer=...)."""
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust them
    try:
        signature.bind(**REWARD_ARGUMENTS)
    except TypeError:
        raise ValueError(
            f"reward function {name!r} has signature {signature}; it must accept keyword arguments "
            "(prompt, completion, answer), e.g. def reward(prompt, completion, answer) -> float"
        ) from None


@dataclass(frozen=True)
class RewardFailure:
    """Why a reward could not be used: `kind` is "raised", "not_a_number" or "not_finite"."""

    kind: str
    message: str


def call_reward(fn: Callable[[], Any]) -> float | RewardFailure:
    """The reward `fn()` returns as a float, or why it cannot be used (it raised, or is not a finite number)."""
    try:
        value = fn()
    except Exception as e:  # a user's reward code may raise anything; the sample is dropped and reported
        return RewardFailure("raised", f"raised {type(e).__name__}: {e}")
    return check_reward(value)


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
    return value


def _import(module_name: str) -> Any:
    """Import a module by dotted name (current directory included), or from a .py file path."""
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"no file {module_name}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(module_name)

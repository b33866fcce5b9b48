"""Reward functions by import path, and reward values that cannot be used."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch

from treerl.rollout import load_reward_fn
from treerl.rollout.rewards.functions import RewardFailure, UserCode, call_reward


def test_a_reward_function_imports_scored_from_the_rewards_room():
    """docs/environments.md's `from treerl.rollout.rewards import Scored` is the class the workflows check for."""
    from treerl.rollout.rewards import Scored
    from treerl.rollout.rewards.functions import Scored as scored

    assert Scored is scored


def test_load_by_module_path():
    fn = load_reward_fn("treerl.rollout.tasks.arithmetic:reward")
    assert fn(prompt="1+1=", completion="2", answer=2) == 1.0


def test_load_from_the_current_directory_and_from_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_for_test.py").write_text(
        "def exact(prompt, completion, answer):\n    return float(completion == answer)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert load_reward_fn("my_rewards_for_test:exact")(prompt="", completion="a", answer="a") == 1.0
    assert load_reward_fn(f"{tmp_path / 'my_rewards_for_test.py'}:exact")(prompt="", completion="a", answer="b") == 0.0


def test_a_files_directory_goes_first_on_the_import_path_unless_it_is_already_on_it(tmp_path, monkeypatch):
    """As docs/agents.md says: the directory of `file.py:function` is put first, so a module beside the file wins
    over one of the same name further down the path; a directory already on the path keeps its place."""
    beside, elsewhere = tmp_path / "beside", tmp_path / "elsewhere"
    for directory, value in ((beside, 1.0), (elsewhere, 2.0)):
        directory.mkdir()
        (directory / "helper_for_path_test.py").write_text(f"VALUE = {value}\n")
    (beside / "reward_for_path_test.py").write_text(
        "import helper_for_path_test\n\ndef r(prompt, completion, answer):\n    return helper_for_path_test.VALUE\n")
    spec = f"{beside / 'reward_for_path_test.py'}:r"
    found, rest = [], list(sys.path)
    for path in ([str(elsewhere)], [str(elsewhere), str(beside)]):
        monkeypatch.setattr(sys, "path", [*path, *rest])
        sys.modules.pop("helper_for_path_test", None)
        found.append((load_reward_fn(spec)(prompt="", completion="", answer=None), sys.path[:3]))
    sys.modules.pop("helper_for_path_test", None)
    assert found == [(1.0, [str(beside), str(elsewhere), rest[0]]), (2.0, [str(elsewhere), str(beside), rest[0]])]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon", "expected 'module:function'"),
        ("module_that_does_not_exist_xyz:fn", "cannot import 'module_that_does_not_exist_xyz'"),
        ("treerl.rollout.tasks.arithmetic:nope", "has no attribute 'nope'"),
        ("treerl.rollout.tasks.arithmetic:Arithmetic", "has signature"),  # a class taking other arguments
        ("treerl.rollout.tasks.guess_number:FORMAT_CREDIT", "not a function"),
        ("/no/such/file.py:fn", "cannot import"),
    ],
)
def test_bad_reward_specs_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(spec)


def test_a_module_that_fails_on_import_names_the_failure(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards_for_test.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="RuntimeError: boom at import"):
        load_reward_fn("broken_rewards_for_test:fn")


def test_wrong_signature_is_refused(tmp_path, monkeypatch):
    (tmp_path / "sig_rewards_for_test.py").write_text("def two(completion, answer):\n    return 0.0\n"
                                                      "def kw(**kwargs):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"must accept keyword arguments \(prompt, completion, answer\)"):
        load_reward_fn("sig_rewards_for_test:two")
    assert load_reward_fn("sig_rewards_for_test:kw")() == 1.0


def _raise():
    raise KeyError("missing")


@pytest.mark.parametrize(
    "fn, expected",
    [
        (lambda: 0.5, 0.5),
        (lambda: 1, 1.0),
        (lambda: True, 1.0),
        (lambda: np.float32(0.25), 0.25),
        (lambda: torch.tensor(0.75), 0.75),
        (_raise, RewardFailure("raised", "raised KeyError: 'missing'")),
        (lambda: float("nan"), RewardFailure("not_finite", "returned nan")),
        (lambda: -math.inf, RewardFailure("not_finite", "returned -inf")),
        (lambda: 1e308, RewardFailure("too_large", "returned 1e+308; rewards must be within +-1e+09 (rescale them: "
                                                   "larger ones overflow the advantages and the loss)")),
        (lambda: "1.0", RewardFailure("not_a_number", "returned '1.0', not a number")),
        (lambda: None, RewardFailure("not_a_number", "returned None, not a number")),
        (lambda: torch.ones(2), RewardFailure("not_a_number", "returned tensor([1., 1.]), not a number")),
    ],
)
def test_call_reward(fn, expected):
    assert call_reward(fn) == expected


def _exits():
    raise SystemExit("the reward called exit()")


def _interrupts():
    raise KeyboardInterrupt


@pytest.mark.parametrize("fn, message", [
    (_exits, "raised SystemExit: the reward called exit()"),
    (_interrupts, "raised KeyboardInterrupt: "),
])
def test_exit_and_interrupt_from_a_reward_are_dropped_samples(fn, message):
    assert call_reward(fn) == RewardFailure("raised", message)


def test_a_reward_past_its_time_limit_is_dropped_and_the_next_call_runs():
    user_code = UserCode(timeout=0.2)
    release = threading.Event()
    started = time.monotonic()
    failure = call_reward(lambda: release.wait(60) and 1.0, user_code)
    assert failure == RewardFailure("timeout", "did not return within 0.2 s (rollout.reward_timeout)")
    assert time.monotonic() - started < 30 and user_code.abandoned == 1  # not the 60 s the call would hang
    assert call_reward(lambda: 0.5, user_code) == 0.5  # a fresh thread: the hung call does not block it
    release.set()


def test_a_real_ctrl_c_still_stops_a_run_waiting_on_a_reward():
    """Python delivers SIGINT to the main thread, which only waits: the KeyboardInterrupt is not the reward's."""
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        call_reward(lambda: time.sleep(10) or 1.0)
    timer.join()

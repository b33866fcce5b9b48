"""What every training loop shares (treerl.trainer.core.run): the threads a run chooses."""

from __future__ import annotations

import os

import pytest
import torch

from treerl.trainer.core import run
from treerl.trainer.core.config import TrainerConfig


@pytest.fixture
def four_cores(monkeypatch):
    """4 cores, torch's default of 4 threads (put back after), and a load average the test sets."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield lambda load: monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    torch.set_num_threads(before)


@pytest.mark.parametrize("load, threads", [(0.0, 4), (1.2, 3), (2.6, 1), (9.0, 1)])
def test_the_default_threads_are_the_cores_free_when_the_run_starts_and_are_said(four_cores, load, threads):
    """Threads on busy cores wait on each other (a step 20 times slower on a loaded 2-core machine): the default takes
    the cores the load average leaves, at least one, and says so."""
    four_cores(load)
    _, said = run.set_threads(TrainerConfig(), torch.device("cpu"))
    assert torch.get_num_threads() == threads
    assert said == (f"torch threads: {threads} ({max(1, 4 - round(load))} of 4 cores free at the start, load average "
                    f"{load:.1f}; trainer.threads sets them)")


def test_trainer_threads_is_taken_as_it_is(four_cores):
    four_cores(3.5)
    _, said = run.set_threads(TrainerConfig(threads=3), torch.device("cpu"))
    assert torch.get_num_threads() == 3 and said is None  # the user's own setting is not said back

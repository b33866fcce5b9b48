"""SIGKILL at each chosen point of a checkpoint write (policy alone, and PPO with its critic): every checkpoint
directory on disk is whole, what the kill left is never read, and every resume starts from the newest whole one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_writer import Point, points_for

from treerl.trainer.core.checkpoint import latest_checkpoint, step_dirs, verify_checkpoint
from treerl.trainer.core.run import Run

pytestmark = pytest.mark.slow  # a kill and a resume per point (9 or 10) per loss: ~20 s on 2 cores

WRITER = Path(__file__).with_name("checkpoint_writer.py")


def writer(out: Path, loss: str) -> subprocess.Popen:
    src = Path(__file__).parents[2] / "src"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, str(WRITER), str(out), loss], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout.readline().strip() == "ready"
    return process


def kill_at(process: subprocess.Popen, first: int, point: Point) -> None:
    """Have the writer save checkpoint `first` whole, then stop at `point` of the next write, and SIGKILL it there."""
    process.stdin.write(f"go {first} {point.name}\n")
    process.stdin.flush()
    replies = [process.stdout.readline().strip() for _ in range(3)]
    assert replies == [f"saved {first}", f"stopped {point.name}", f"killed {point.name}"], replies


def check_what_the_kill_left(out: Path, first: int, point: Point) -> None:
    """The kill landed inside the write (what it leaves is there); every final-named checkpoint is whole."""
    leftovers = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".trash-"))]
    if point.leaves:
        assert any(name.startswith(point.leaves) for name in leftovers), (point.name, leftovers)
    found = step_dirs(out)
    for _, path in found:  # whole or absent: no final-named checkpoint is incomplete or corrupt
        verify_checkpoint(path)
    assert latest_checkpoint(out) == found[-1][1]
    steps = [step for step, _ in found]
    if point.again:  # the kill came between the old copy's rename away and the new one's rename in: neither is there
        assert first not in steps, (point.name, steps)
    else:
        assert first in steps and (first + 1 in steps) == point.published, (point.name, steps)


@pytest.mark.parametrize("loss", ["dr_grpo", "ppo"])
def test_a_kill_at_each_point_of_a_checkpoint_write_leaves_it_whole_or_absent_and_resume_takes_the_newest(
        tiny_config, tmp_path, loss):
    out = tmp_path / "run"
    process = writer(out, loss)
    newest = 0
    try:
        for point in points_for(loss):
            first = newest + 1
            kill_at(process, first, point)
            check_what_the_kill_left(out, first, point)
            run = Run.start(tiny_config("trainer.resume=auto", "trainer.steps=1000000", f"algo.loss={loss}",
                                        "algo.kl_coef=0.0", "trainer.threads=1"))
            try:
                assert run.start_step == (first + 1 if point.published else first), point.name
                assert (run.critic is not None) == (loss == "ppo")
            finally:
                run.finish()
            leftovers = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".trash-"))]
            assert not leftovers  # what the kill left was cleared (or put back) by the resume
            verify_checkpoint(latest_checkpoint(out))
            newest = run.start_step
    finally:
        process.kill()
        process.wait()

"""SIGKILL at random moments while checkpoints are written (policy alone, and PPO with its critic): every
checkpoint directory on disk is whole, and every resume starts from the newest one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from treerl.trainer.core.checkpoint import latest_checkpoint, step_dirs, verify_checkpoint
from treerl.trainer.core.run import Run

pytestmark = pytest.mark.slow  # 20 kills and 20 resumes per loss: ~30 s on 2 cores

ROUNDS = 20
WRITER = Path(__file__).with_name("checkpoint_writer.py")


def writer(out: Path, loss: str) -> subprocess.Popen:
    src = Path(__file__).parents[2] / "src"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, str(WRITER), str(out), loss, "0"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout.readline().strip() == "ready"
    return process


@pytest.mark.parametrize("loss", ["dr_grpo", "ppo"])
def test_a_kill_while_writing_never_leaves_a_broken_checkpoint_and_resume_takes_the_newest(tiny_config, tmp_path, loss):
    out = tmp_path / "run"
    process = writer(out, loss)
    kills_during_a_save, next_step = 0, 1
    try:
        for _ in range(ROUNDS):
            process.stdin.write(f"go {next_step}\n")
            process.stdin.flush()
            saved = []
            while (line := process.stdout.readline()).startswith("saved"):
                saved.append(int(line.split()[1]))
            assert line.startswith("killed"), line
            kills_during_a_save += bool(list(out.glob("checkpoints/.tmp-*")) or list(out.glob("checkpoints/.trash-*")))
            found = step_dirs(out)
            for _, path in found:  # whole or absent: no final-named checkpoint is incomplete or corrupt
                verify_checkpoint(path)
            newest = latest_checkpoint(out)
            assert newest == (found[-1][1] if found else None)
            if saved:
                assert found[-1][0] >= saved[-1]
            run = Run.start(tiny_config("trainer.resume=auto", "trainer.steps=1000000", f"algo.loss={loss}",
                                        "algo.kl_coef=0.0", "trainer.threads=1"))
            try:
                assert run.start_step == (found[-1][0] if found else 0)
                assert (run.critic is not None) == (loss == "ppo")
            finally:
                run.finish()
            assert not list(out.glob("checkpoints/.tmp-*"))  # what the kill left was cleared by the resume
            next_step = run.start_step + 1
    finally:
        process.kill()
        process.wait()
    assert next_step > ROUNDS // 2  # most rounds finished a checkpoint before the kill
    assert kills_during_a_save >= 3  # and kills landed in the middle of writing one (4-10 of 20 seen: timing varies)

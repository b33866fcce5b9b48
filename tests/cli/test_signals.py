"""SIGINT / SIGTERM while `treerl train` starts, before its first step: exit code 130 / 143 and one line, nothing
written (it was a traceback and -2 / -15). Each signal is sent once the run is known to be in the phase tested (a
file the blocked code writes), never after a guessed delay. Ctrl-C during training: tests/trainer/test_stopping.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treerl.cli.signals import message

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["train", "trainer.steps=2", "trainer.progress=false", "trainer.eval_prompts=0", "rollout.prompts_per_step=2",
         "rollout.group_size=2", "trainer.output_dir=out"]

# Blocks `python -m treerl.cli.main` while it imports its commands (the seconds torch and transformers take).
BLOCKED_IMPORT = """
import pathlib, sys, time

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "treerl.cli.bench_cmd":
            pathlib.Path("BLOCKED").touch()
            time.sleep(600)
        return None

sys.meta_path.insert(0, Block())
"""

# A reward module whose import (while the run builds its rollout, after the model is loaded) blocks.
BLOCKED_REWARD = """
import pathlib, time
pathlib.Path("BLOCKED").touch()
time.sleep(600)

def one(prompt, completion, answer):
    return 1.0
"""


def run_until_blocked(tmp_path: Path, args: list[str], sig: signal.Signals, prelude: str = "") -> tuple[int, str]:
    """Start `treerl ARGS` (as `python -m treerl.cli.main`, after `prelude`), send `sig` once the file BLOCKED
    appears; its exit code and stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    code = prelude + "\nimport runpy\nrunpy.run_module('treerl.cli.main', run_name='__main__')\n"
    process = subprocess.Popen([sys.executable, "-c", code, *args], cwd=tmp_path, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "BLOCKED").exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the run never reached the blocked code"
            time.sleep(0.05)
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    return process.returncode, stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_commands_import_is_one_line(tmp_path, sig):
    code, stderr = run_until_blocked(tmp_path, TRAIN, sig, prelude=BLOCKED_IMPORT)
    assert code == 128 + sig and stderr.strip() == message(sig), stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_run_sets_up_is_one_line_and_writes_nothing(tmp_path, sig):
    (tmp_path / "blocked_rewards.py").write_text(BLOCKED_REWARD)
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    args = [*TRAIN, "rollout.task=dataset", "rollout.data_path=data.jsonl", "rollout.reward_fn=blocked_rewards:one"]
    code, stderr = run_until_blocked(tmp_path, args, sig)
    assert code == 128 + sig and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == message(sig), stderr
    assert not (tmp_path / "out").exists()


# A reward that blocks once both training steps are in metrics.jsonl: in the final evaluation.
BLOCKED_FINAL_EVALUATION = """
import pathlib, time

def one(prompt, completion, answer):
    metrics = pathlib.Path("out/metrics.jsonl")
    if metrics.exists() and metrics.read_text().count('"train/loss"') >= 2:
        pathlib.Path("BLOCKED").touch()
        time.sleep(600)
    return 1.0
"""


@pytest.mark.slow
def test_a_signal_in_the_final_evaluation_stops_at_once(tmp_path):
    """After the last step the trainer's handlers are gone: a Ctrl-C in the final evaluation stops it at once (it was
    ignored, and the run ended with exit 0); the final checkpoint is there, summary.json is not."""
    (tmp_path / "final_rewards.py").write_text(BLOCKED_FINAL_EVALUATION)
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    args = [*TRAIN, "trainer.eval_prompts=1", "rollout.task=dataset", "rollout.data_path=data.jsonl",
            "rollout.reward_fn=final_rewards:one", "trainer.tensorboard=false"]
    code, stderr = run_until_blocked(tmp_path, args, signal.SIGINT)
    assert code == 130 and "Traceback" not in stderr and stderr.strip().splitlines()[-1] == message(signal.SIGINT)
    assert (tmp_path / "out" / "checkpoints" / "step_000002").is_dir() and not (tmp_path / "out" / "summary.json").exists()

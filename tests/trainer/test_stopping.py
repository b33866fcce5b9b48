"""SIGINT / SIGTERM during training: the current step finishes, a checkpoint and summary.json are written, the exit
code says which signal; the checkpoint resumes. A second Ctrl-C aborts at once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from treerl.cli.main import app
from treerl.trainer import train
from treerl.trainer.core.checkpoint import latest_checkpoint, step_dirs, verify_checkpoint
from treerl.trainer.core.stopping import StopSignals

TRAIN = ["trainer.steps=1000", "trainer.eval_prompts=0", "rollout.prompts_per_step=2", "rollout.group_size=2",
         "trainer.progress=false", "trainer.tensorboard=false", "trainer.warmup_steps=0"]


def steps_logged(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum('"train/loss"' in line for line in path.read_text().splitlines())


def signal_after(output_dir: Path, steps: int, *signals: signal.Signals, delay: float = 0.0) -> threading.Thread:
    """A thread that sends `signals` to this process (0.05 s apart) `delay` s after `steps` steps are in
    metrics.jsonl."""

    def wait_and_send() -> None:
        deadline = time.monotonic() + 120
        while steps_logged(output_dir) < steps and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(delay)
        for sig in signals:
            os.kill(os.getpid(), sig)
            time.sleep(0.05)

    thread = threading.Thread(target=wait_and_send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_run_after_the_step_with_a_checkpoint_and_a_summary(tiny_config, tmp_path, sig, code):
    out = tmp_path / "out"
    handler = signal.getsignal(sig)
    thread = signal_after(out, 2, sig)
    result = CliRunner().invoke(app, ["train", *TRAIN, f"trainer.output_dir={out}"])
    thread.join()
    assert result.exit_code == code, result.output
    assert signal.getsignal(sig) is handler  # the run put the handler back
    summary = json.loads((out / "summary.json").read_text())
    done = summary["steps"]
    assert summary["stopped_by"] == sig.name and 2 <= done < 1000 and steps_logged(out) == done
    newest = latest_checkpoint(out)
    assert newest is not None and verify_checkpoint(newest)["step"] == done
    assert f"{sig.name}: stopped after step {done} of 1000" in result.output
    resumed = train(tiny_config(f"trainer.steps={done + 1}", "trainer.resume=auto", name="out"))
    assert resumed.steps == done + 1 and resumed.stopped_by is None


def test_a_second_ctrl_c_aborts_at_once(tmp_path, monkeypatch):
    """Two Ctrl-C 0.05 s apart inside one slow step (its reward takes 0.3 s a sample): no checkpoint, no summary, and
    a line saying so (it was click's silent exit 130)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "slow_rewards_for_stop_test.py").write_text(
        "import time\n\ndef slow(prompt, completion, answer):\n    time.sleep(0.3)\n    return 1.0\n")
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    out = tmp_path / "out"
    thread = signal_after(out, 1, signal.SIGINT, signal.SIGINT, delay=0.5)  # while step 1 waits on rewards
    result = CliRunner().invoke(app, ["train", *TRAIN, "trainer.save_every=1", f"trainer.output_dir={out}",
                                      "rollout.task=dataset", f"rollout.data_path={tmp_path / 'data.jsonl'}",
                                      "rollout.reward_fn=slow_rewards_for_stop_test:slow"])
    thread.join()
    assert result.exit_code == 130 and "stopped after step" not in result.output, result.output
    assert "SIGINT received twice: stopped without a checkpoint" in result.output  # one line, no traceback
    assert not (out / "summary.json").exists()
    assert [s for s, _ in step_dirs(out)] == [1]  # the first step's checkpoint, nothing after the signals


def test_one_process_agrees_with_itself():
    stop = StopSignals()
    assert stop.agreed() is None
    stop.received = signal.SIGTERM
    assert stop.agreed() == "SIGTERM"


EXITING_AGENT = '''
import itertools
import sys

episodes = itertools.count()


async def episode(client, task):
    """Every other episode calls sys.exit(0) (once a step, KeyboardInterrupt instead) after its model call."""
    number = next(episodes)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["question"]}],
                                         max_tokens=4)
    if number % 4 == 1:
        sys.exit(0)
    if number % 4 == 3:
        raise KeyboardInterrupt("in the agent")
    return 1.0
'''


def test_an_agent_that_exits_loses_its_episode_and_a_real_ctrl_c_still_stops_the_run(tmp_path):
    """sys.exit(0) / KeyboardInterrupt in agent episodes are dropped episodes (the run goes on, it used to end with
    exit 0 and no message); a real SIGINT to the run still finishes the step, checkpoints and exits 130."""
    (tmp_path / "exiting_agent.py").write_text(EXITING_AGENT)
    out = tmp_path / "out"
    thread = signal_after(out, 2, signal.SIGINT)
    result = CliRunner().invoke(app, ["train", "agent_tools", *TRAIN, f"trainer.output_dir={out}",
                                      f"rollout.agent={tmp_path / 'exiting_agent.py'}:episode"])
    thread.join()
    assert result.exit_code == 130 and "SIGINT: stopped after step" in result.output, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and summary["steps"] >= 2
    assert summary["dropped_samples"] == 2 * summary["steps"]  # 2 of the 4 episodes of every step
    assert verify_checkpoint(latest_checkpoint(out))["step"] == summary["steps"]
    dropped = (out / "dropped.jsonl").read_text()
    assert "raised SystemExit: 0" in dropped and "raised KeyboardInterrupt: in the agent" in dropped

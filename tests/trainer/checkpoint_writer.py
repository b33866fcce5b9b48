"""The process test_kill.py kills: it builds a run once, then for each "go FIRST POINT" line on stdin forks a child
that writes checkpoint FIRST whole, then starts the next one (FIRST + 1, or FIRST again for a point that replaces a
step) and stops itself (SIGSTOP) at POINT, a chosen moment inside that write; this process then SIGKILLs it.

    python checkpoint_writer.py OUTPUT_DIR ALGO_LOSS
    stdin  "go 7 sealed-no-manifest"     fork a writer: checkpoint 7 whole, then checkpoint 8 up to that point
    stdout "saved 7"                     (from the child: the checkpoint it finished)
           "stopped sealed-no-manifest"  (from the child: it reached the point and stops there)
           "killed sealed-no-manifest"   (from this process: the stopped child was SIGKILLed)
           "missed sealed-no-manifest"   (the write finished without reaching the point: the test fails)

Where a kill lands is chosen, not timed: every run checks every point, however busy the machine. The pause is
injected here, in the child only, by wrapping the functions of `treerl.trainer.core.checkpoint` (and `os.replace`,
`shutil.rmtree`) that the write calls; the code under test is unchanged. Forking keeps each round to a fraction of
a second (no new Python, torch or model per kill); the run is built with one thread, so the fork copies no thread pool.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treerl.trainer import load_config
from treerl.trainer.core import checkpoint
from treerl.trainer.core.run import Run

SETTINGS = ["trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_prompts=0", "trainer.threads=1",
            "trainer.steps=1000000", "trainer.keep_checkpoints=2", "trainer.resume=auto", "algo.kl_coef=0.0"]


def named(prefix: str) -> Callable[[tuple[Any, ...]], bool]:
    """A call on a directory that exists and whose name starts with `prefix`."""
    return lambda args: Path(args[0]).name.startswith(prefix) and Path(args[0]).is_dir()


def renamed_away(args: tuple[Any, ...]) -> bool:
    """os.replace(checkpoint, trash): a checkpoint renamed away before it is deleted or replaced."""
    return Path(args[1]).name.startswith(".trash-")


def delete_one_file(args: tuple[Any, ...]) -> None:
    """What shutil.rmtree has done when it is killed early: one file of the directory is gone."""
    next(p for p in sorted(Path(args[0]).rglob("*")) if p.is_file()).unlink()


@dataclass(frozen=True)
class Point:
    """A moment inside a checkpoint write where the writer is stopped, then killed; and what that leaves."""

    name: str
    function: str  # what the write calls there: a function of the checkpoint module, os.replace or shutil.rmtree
    before: bool  # stop when the call starts (else: when it has returned)
    nth: int = 1  # at the nth call (of those `matches` accepts) of the write
    matches: Callable[[tuple[Any, ...]], bool] = lambda args: True
    action: Callable[[tuple[Any, ...]], None] | None = None  # done before stopping
    again: bool = False  # the write replaces the checkpoint just saved (the same step) instead of writing the next
    published: bool = False  # the new checkpoint has its final name at the kill: resume starts from it
    leaves: str = ""  # the prefix (.tmp- or .trash-) of a directory the kill leaves in checkpoints/
    critic: bool = False  # only when there is a critic (algo.loss=ppo)


# In the order the write reaches them (treerl.trainer.core.checkpoint.save_checkpoint, then Run.save's pruning).
POINTS = [
    Point("policy-written", "write_pretrained", before=False, leaves=".tmp-"),
    Point("critic-written", "write_pretrained", before=False, nth=2, leaves=".tmp-", critic=True),
    Point("files-written-none-sealed", "_seal", before=True, leaves=".tmp-"),
    Point("half-sealed", "_sha256", before=True, nth=3, leaves=".tmp-"),
    Point("sealed-no-manifest", "_write_synced", before=True, leaves=".tmp-"),
    Point("manifest-written-not-renamed", "_publish", before=True, leaves=".tmp-"),
    Point("renamed-not-synced", "_fsync_dir", before=True, matches=named("checkpoints"), published=True),
    Point("replacing-old-copy-renamed-away", "os.replace", before=False, matches=renamed_away,
          again=True, leaves=".trash-"),
    Point("pruning-renamed-away", "shutil.rmtree", before=True, matches=named(".trash-"), published=True,
          leaves=".trash-"),
    Point("pruning-half-deleted", "shutil.rmtree", before=True, matches=named(".trash-"), action=delete_one_file,
          published=True, leaves=".trash-"),
]


def points_for(loss: str) -> list[Point]:
    """The points a write of this run reaches (the critic's only with PPO)."""
    return [p for p in POINTS if not p.critic or loss == "ppo"]


TARGETS = {"os.replace": (os, "replace"), "shutil.rmtree": (shutil, "rmtree")}  # else: (checkpoint, the name)


def stop_at(point: Point) -> None:
    """Wrap the function `point` names so that this process stops itself at the point's call."""
    owner, name = TARGETS.get(point.function, (checkpoint, point.function))
    original = getattr(owner, name)
    calls = 0

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += point.matches(args)
        here = point.matches(args) and calls == point.nth
        if here and point.before:
            stop(point, args)
        result = original(*args, **kwargs)
        if here and not point.before:
            stop(point, args)
        return result

    setattr(owner, name, wrapped)


def stop(point: Point, args: tuple[Any, ...]) -> None:
    """Say so, then freeze (SIGSTOP) with the files as they are, until the parent kills this process."""
    if point.action is not None:
        point.action(args)
    os.write(1, f"stopped {point.name}\n".encode())
    os.kill(os.getpid(), signal.SIGSTOP)


def write_until_stopped(run: Run, first: int, point: Point) -> None:
    """The child: checkpoint `first` whole, then the next write up to `point`."""
    run.save(first)
    os.write(1, f"saved {first}\n".encode())  # one write: a kill cannot cut the line
    stop_at(point)
    run.save(first if point.again else first + 1)
    os.write(1, f"missed {point.name}\n".encode())


def main() -> None:
    out, loss = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    run = Run.start(load_config(None, [*SETTINGS, f"trainer.output_dir={out}", f"algo.loss={loss}"]))
    points = {p.name: p for p in POINTS}
    sys.stdout.flush()
    os.write(1, b"ready\n")
    for line in sys.stdin:
        _, first, name = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                write_until_stopped(run, int(first), points[name])
            except BaseException:  # noqa: BLE001 (printed; the parent reports a child that ended, not stopped)
                traceback.print_exc()
            os._exit(1)  # never back into the parent's loop
        _, status = os.waitpid(pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            os.write(1, f"ended {name} (status {status})\n".encode())
            continue
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.write(1, f"killed {name}\n".encode())


if __name__ == "__main__":
    main()

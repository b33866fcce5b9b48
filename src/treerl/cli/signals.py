"""SIGINT / SIGTERM outside the training steps: one line and exit code 130 / 143, never a traceback.

Beside the steps (docs/architecture.md): the command line, before and after the training steps.

Training has its own handlers (`treerl.trainer.core.stopping`: finish the step, write a checkpoint). Before
they are installed (the imports, loading the model, building the rollout) and after they are removed, these
apply, so a Ctrl-C while a run starts is as clean as one while it trains:

    with stop_on_signals():     # a signal raises Interrupted here: `finally` blocks run, `reported` prints the line
        command()

While the commands' own modules import (the top of `treerl.cli.main`, seconds for torch and transformers)
nothing has started and nothing can be written, so the handler `exit_at_once` ends the process at once with the
same line.
Only the main thread can install handlers; elsewhere both do nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from treerl.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def message(signum: int) -> str:
    """What the CLI prints for a signal outside the training steps."""
    return f"{signal.Signals(signum).name} received: stopped (no training step was running, so none was cut short)"


def raise_interrupted(signum: int, frame: FrameType | None) -> None:
    """The handler of `stop_on_signals`: unwind the command (its `finally` blocks close what it opened)."""
    raise Interrupted(signum, message(signum))


def exit_at_once(signum: int, frame: FrameType | None) -> None:
    """The handler while modules import: nothing to clean up, so leave at once (os.write: no lock is taken)."""
    os.write(2, f"{message(signum)}\n".encode())
    os._exit(128 + signum)


def install(handler: Callable[[int, FrameType | None], Any]) -> dict[int, Any]:
    """`handler` for SIGINT and SIGTERM; returns the handlers it replaced (none outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in SIGNALS}


def restore(previous: dict[int, Any]) -> None:
    """Put back the handlers `install` replaced."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block a SIGINT or SIGTERM raises `Interrupted` (training replaces this with its own handlers)."""
    previous = install(raise_interrupted)
    try:
        yield
    finally:
        restore(previous)

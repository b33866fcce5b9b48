"""SIGINT (Ctrl-C) and SIGTERM during training: finish the current step, write a checkpoint and summary.json, exit.

Between steps (docs/architecture.md): a signal ends the run after step 6, with a checkpoint.

    stop = StopSignals()
    stop.install()                   # in the main thread; the previous handlers come back with restore()
    for step in steps:
        ...one step...
        if stop.agreed():            # every rank stops after the same step (one tiny all-reduce under torchrun)
            break

A second signal aborts at once (`treerl.errors.Interrupted`, a KeyboardInterrupt), with no checkpoint: the last
complete one stays the newest (checkpoints are written atomically). Under torchrun, the launcher passes the signal to
every rank; `agreed` makes the ranks leave after the same step even if it reached them between steps.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

from treerl.distributed import global_sum
from treerl.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Turns SIGINT / SIGTERM into a request to stop after the current step."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal's number
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Handle the signals from now on (only the main thread can; elsewhere this does nothing)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put back the handlers there were before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def agreed(self) -> str | None:
        """The signal's name if any rank received one (every rank must call this after the same step), else None."""
        anyone = global_sum(1.0 if self.received is not None else 0.0) > 0
        if not anyone:
            return None
        return signal.Signals(self.received or signal.SIGTERM).name

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            self.restore()
            raise Interrupted(signum, f"{signal.Signals(signum).name} received twice: stopped without a checkpoint")
        self.received = signum
        name = signal.Signals(signum).name
        # os.write, not logging: a handler may run while the logging lock is held
        os.write(2, f"\n{name}: finishing this step, then writing a checkpoint and summary.json "
                    f"({'Ctrl-C' if signum == signal.SIGINT else name} again stops at once)\n".encode())

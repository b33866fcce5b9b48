"""Peak memory of a piece of work, measured the same way for every engine.

Beside the steps (docs/architecture.md): step 5's peak memory, for the benchmark.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from itertools import accumulate

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (C++ logging) for the duration of the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak bytes allocated while `fn` runs, above what was allocated before it.

    CUDA: the caching allocator's peak counter. CPU: the allocation and free events that
    torch's profiler records for every tensor (slower, so use it on a separate, untimed run).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the profiler's C++ side prints a line at every start and stop
        prof.start()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    return max(accumulate(nbytes for _, nbytes in events), default=0)

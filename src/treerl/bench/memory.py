"""Peak memory of a piece of work, measured the same way for every engine."""

from __future__ import annotations

from itertools import accumulate
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


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
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    return max(accumulate(nbytes for _, nbytes in events), default=0)

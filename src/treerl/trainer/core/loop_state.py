"""`LoopState`: what a run counts and learns as it trains, beside its weights; saved with every checkpoint.

Around steps 1 to 6 (docs/architecture.md): the loop's counters and the balancer's measured times, resumed with it.

    state = LoopState(lora_base=fingerprint)     # shared by the run, its balancer and its non-finite guard
    save_checkpoint(..., state, ...)             # written as a plain dict under trainer_state.pt's "loop"
    step, saved = load_checkpoint(path, parts)   # LoopState.from_dict of what was written
    state.update(saved)                          # in place: the balancer and the guard see the resumed values

On disk it is the dict of its fields, as before this class existed, so older checkpoints resume: a field they
lack keeps its default, a key this version does not know is ignored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class LoopState:
    """The run's own state beyond weights, optimizer and RNGs: counters, measured costs, the LoRA base."""

    skipped_steps: int = 0  # steps whose every sample was dropped (no update was made)
    nonfinite_skipped: int = 0  # optimizer steps skipped for a NaN/inf loss or gradient norm (trainer.nonfinite=skip)
    cost_samples: list[tuple[list[float], float]] = field(default_factory=list)  # (tree features, seconds) of the
    # latest measured micro-batches (at most balancer.COST_WINDOW): the balancer's cost model is fitted on them
    lora_base: list[float] | None = None  # fingerprint of a LoRA run's frozen base (treerl.models.base_fingerprint)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so a checkpoint loads with `torch.load(weights_only=True)`."""
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> LoopState:
        """A checkpoint's loop state; a field it lacks (an older treerl) keeps its default, an unknown key is
        ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in saved.items() if key in known})

    def update(self, saved: LoopState) -> None:
        """Take every value of `saved` (the resumed checkpoint's) in place: the balancer and guard hold this object."""
        for f in fields(self):
            setattr(self, f.name, getattr(saved, f.name))

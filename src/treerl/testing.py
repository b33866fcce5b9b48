"""Check that engines agree: the same outputs, loss and parameter gradients on the same batch.

Used by the test suite, and useful to anyone writing a custom loss: run it once on a small
batch to see that the tree engines train it exactly like the flat reference.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treerl.engine.base import Engine, LossFn
from treerl.tree import Sequence


@dataclass
class EngineRun:
    """Everything an engine produced on one batch."""

    outputs: list[dict[str, torch.Tensor]]
    loss: float
    grads: dict[str, torch.Tensor]


def run_engine(engine: Engine, model: PreTrainedModel, sequences: Seq[Sequence], loss_fn: LossFn) -> EngineRun:
    """No-grad outputs, then one forward_backward from zeroed gradients."""
    outputs = engine.forward(model, sequences)
    model.zero_grad(set_to_none=True)
    stats = engine.forward_backward(model, sequences, loss_fn)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return EngineRun(outputs, stats.loss, grads)


def relative_error(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-7) -> float:
    """||a - b|| / ||b||; absolute below `floor`, where a gradient is zero up to rounding."""
    diff = (a.double() - b.double()).norm().item()
    return diff / max(b.double().norm().item(), floor)


def compare_runs(run: EngineRun, reference: EngineRun) -> dict[str, float]:
    """Relative errors of outputs, loss (absolute below 1) and every parameter gradient."""
    errors: dict[str, float] = {}
    for i, (out, ref) in enumerate(zip(run.outputs, reference.outputs, strict=True)):
        for name in ref:
            errors[f"seq{i}.{name}"] = relative_error(out[name], ref[name])
    errors["loss"] = abs(run.loss - reference.loss) / max(abs(reference.loss), 1.0)
    for name in set(run.grads) | set(reference.grads):  # no .grad at all == a zero gradient
        ours, ref = run.grads.get(name), reference.grads.get(name)
        ours = torch.zeros_like(ref) if ours is None else ours
        ref = torch.zeros_like(ours) if ref is None else ref
        errors[f"grad.{name}"] = relative_error(ours, ref)
    return errors


def assert_engines_agree(
    model: PreTrainedModel,
    sequences: Seq[Sequence],
    loss_fn: LossFn,
    engine: Engine,
    reference: Engine,
    tol: float = 1e-6,
) -> dict[str, float]:
    """Raise if `engine` differs from `reference` by more than `tol` (relative) anywhere."""
    errors = compare_runs(run_engine(engine, model, sequences, loss_fn), run_engine(reference, model, sequences, loss_fn))
    worst = max(errors, key=errors.__getitem__)
    if errors[worst] > tol:
        raise AssertionError(f"{type(engine).__name__} vs {type(reference).__name__}: {worst} off by {errors[worst]:.3g}")
    return errors

"""Check that engines agree: the same outputs, loss and parameter gradients on the same batch.

Beside the steps (docs/architecture.md): checks step 5 (forward + backward) for a user's loss.

Used by the test suite, and useful to anyone writing a custom loss: run it once on a small
batch to see that the tree engines train it exactly like the flat reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treerl.engine.base import Engine, LossFn
from treerl.engine.images import own_forward_inputs
from treerl.engine.recurrent import earliest_index_ties
from treerl.engine.support import dict_outputs
from treerl.tree import TokenSequence


@dataclass
class EngineRun:
    """Everything an engine produced on one batch."""

    outputs: list[dict[str, torch.Tensor]]
    loss: float
    grads: dict[str, torch.Tensor]


def run_engine(engine: Engine, model: PreTrainedModel, sequences: Sequence[TokenSequence], loss_fn: LossFn) -> EngineRun:
    """No-grad outputs, then one forward_backward from zeroed gradients."""
    outputs = engine.forward(model, sequences)
    model.zero_grad(set_to_none=True)
    stats = engine.forward_backward(model, sequences, loss_fn)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return EngineRun(outputs, stats.loss, grads)


@torch.no_grad()
def model_outputs(model: PreTrainedModel, sequence: TokenSequence, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """The model's own log-probs and entropy for one sequence alone: `log_softmax(model(tokens).logits)`.

    What every engine must reproduce (position 0 predicts nothing and holds 0, as in the engines), keys tied at a
    DeepSeek-sparse-attention indexer's k-th score going to the earliest, as in every engine
    (treerl.engine.recurrent.earliest_index_ties: on CPU the model's own top-k picks among them by the call's width).
    """
    tokens = sequence.tokens.to(model.get_input_embeddings().weight.device)
    if len(tokens) == 1:
        zero = torch.zeros(1, dtype=torch.float64, device=tokens.device)
        return {"logprobs": zero, "entropy": zero.clone()}
    images = own_forward_inputs(model, sequence, tokens[None, :-1])  # as the processor hands them over
    with dict_outputs(model), earliest_index_ties(model):
        output = model(input_ids=tokens[None, :-1], use_cache=False, **images)
    logits = (output.logits if hasattr(output, "logits") else output[0])[0].double() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    zero = logp.new_zeros(1)
    return {
        "logprobs": torch.cat([zero, logp.gather(1, tokens[1:, None])[:, 0]]),
        "entropy": torch.cat([zero, -(logp.exp() * logp).sum(-1)]),
    }


def assert_matches_model(
    model: PreTrainedModel, sequences: Sequence[TokenSequence], outputs: list[dict[str, torch.Tensor]], tol: float = 1e-6
) -> float:
    """Raise if an engine's outputs differ from the model's own forward on each sequence alone; return the worst error."""
    worst = 0.0
    for i, (sequence, out) in enumerate(zip(sequences, outputs, strict=True)):
        for name, expected in model_outputs(model, sequence).items():
            error = relative_error(out[name], expected)
            if error > tol:
                raise AssertionError(f"sequence {i}: {name} differs from the model's own forward by {error:.3g}")
            worst = max(worst, error)
    return worst


def relative_error(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-7) -> float:
    """||a - b|| / ||b||; absolute below `floor`, where a gradient is zero up to rounding."""
    diff = (a.double() - b.double()).norm().item()
    return diff / max(b.double().norm().item(), floor)


def compare_runs(run: EngineRun, reference: EngineRun) -> dict[str, float]:
    """Relative errors of outputs, loss (absolute below 1), every parameter's gradient and the whole gradient."""
    errors: dict[str, float] = {}
    for i, (out, ref) in enumerate(zip(run.outputs, reference.outputs, strict=True)):
        for name in ref:
            errors[f"seq{i}.{name}"] = relative_error(out[name], ref[name])
    errors["loss"] = abs(run.loss - reference.loss) / max(abs(reference.loss), 1.0)
    pairs = []
    for name in sorted(set(run.grads) | set(reference.grads)):  # no .grad at all == a zero gradient
        ours, ref = run.grads.get(name), reference.grads.get(name)
        ours = torch.zeros_like(ref) if ours is None else ours
        ref = torch.zeros_like(ours) if ref is None else ref
        pairs.append((name, ours.flatten(), ref.flatten()))
    if pairs:  # the whole gradient as one vector
        whole = torch.cat([ref for _, _, ref in pairs])
        errors["gradient"] = relative_error(torch.cat([ours for _, ours, _ in pairs]), whole)
        # A parameter's gradient that is zero up to rounding (all keys alike: softmax's gradient cancels) carries
        # the rounding of the whole gradient's terms, so its floor scales with the whole gradient.
        floor = 1e-7 * max(whole.double().norm().item(), 1.0)
        for name, ours, ref in pairs:
            errors[f"grad.{name}"] = relative_error(ours, ref, floor)
    return errors


def assert_engines_agree(
    model: PreTrainedModel,
    sequences: Sequence[TokenSequence],
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

"""Helpers of the algo tests: batches with algorithm fields, training steps, exact comparison."""

from __future__ import annotations

import random

import torch

from treerl.algo import LossNormalizer, fill_fields
from treerl.engine import FlatEngine
from treerl.engine.head import ValueHead
from treerl.testing import relative_error
from treerl.tree import TokenSequence
from treerl.bench.workloads import random_trees

VOCAB = 64
RTOL = 1e-10  # the policy's RMSNorm runs in float64 (tests/support.py): engines agree to ~1e-15
STOCK_RTOL = 1e-6  # a stock float64 model (float32 RMSNorm): the project's standard


def make_batch(
    model: torch.nn.Module,
    seed: int,
    sequences: int = 5,
    length: int = 10,
    sharing: float = 3.0,
    noise: float = 0.3,
    zero_masks: bool = False,
) -> list[TokenSequence]:
    """A random tree whose sequences carry their own mask, advantages, rewards and log-probs.

    Sequences that share tokens still get different field values there. Behaviour, proximal and
    reference log-probs are the model's own plus `noise`, so ratios sit both inside and outside
    the clip range; `zero_masks` gives some sequences an all-zero loss mask.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = random_trees(sequences=sequences, length=length, sharing=sharing, vocab=VOCAB, seed=seed)
    current = [out["logprobs"] for out in FlatEngine().forward(model, batch)]
    for i, (seq, logp) in enumerate(zip(batch, current)):
        n = len(seq)
        mask = (torch.rand(n, generator=gen) < rng.choice([0.5, 0.9, 1.0])).double()
        mask[0] = 0.0
        if zero_masks and rng.random() < 0.4:
            mask.zero_()

        old, prox, ref = ((logp + noise * torch.randn(n, generator=gen)).clamp(max=0.0) for _ in range(3))
        advantages = torch.randn(n, generator=gen, dtype=torch.float64)
        seq.fields = {
            "loss_mask": mask,
            "advantages": advantages,
            "old_logprobs": old,
            "prox_logprobs": prox,
            "ref_logprobs": ref,
        }
        seq.info = {"reward": float(rng.randint(0, 3)), "group": i % 2}
    return batch


def add_critic_fields(critic: torch.nn.Module, batch: list[TokenSequence], seed: int) -> None:
    """Old values (the critic's own, perturbed) and returns, for the value loss."""
    gen = torch.Generator().manual_seed(seed)
    fill_fields(FlatEngine(head=ValueHead()), critic, batch, {"values": "values"})
    for seq in batch:
        n = len(seq)
        seq.fields["values"] = seq.fields["values"] + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)
        seq.fields["returns"] = torch.randn(n, generator=gen, dtype=torch.float64)


def counted_by_hand(batch: list[TokenSequence]) -> LossNormalizer:
    """The flat reference's normaliser, counted here from the masks (not by `LossNormalizer.from_sequences`): the
    trained tokens, and the sequences that had one before a rollout-correction preset rejected any (verl's count)."""
    masks = [seq.fields["loss_mask"] for seq in batch]
    sampled = [seq.fields.get("sampled_loss_mask", seq.fields["loss_mask"]) for seq in batch]
    return LossNormalizer(tokens=float(sum(int(torch.count_nonzero(m)) for m in masks)),
                          sequences=sum(1 for m in sampled if bool(m.any())))


def counted_per_part(parts: list[list[TokenSequence]]) -> LossNormalizer:
    """What a tree engine's caller uses: each part (micro-batch, rank) counted on its own, then added."""
    total = LossNormalizer.from_sequences(parts[0])
    for part in parts[1:]:
        total = total + LossNormalizer.from_sequences(part)
    return total


def train_step(
    engine, model, parts: list[list[TokenSequence]], loss_fn
) -> tuple[float, dict[str, float], dict[str, torch.Tensor]]:
    """Zero the gradients, run forward_backward on each part; the summed loss, metrics and gradients.

    The loss is the float64 sum of what `loss_fn` returned for each sequence (StepStats.loss of
    DfsEngine is accumulated in float32, so it only agrees to ~1e-7 of the per-sequence terms).
    """
    model.zero_grad(set_to_none=True)
    per_sequence: list[torch.Tensor] = []

    def recorded(view):
        result = loss_fn(view)
        per_sequence.append((result[0] if isinstance(result, tuple) else result).detach())
        return result

    metrics: dict[str, float] = {}
    for part in parts:
        stats = engine.forward_backward(model, part, recorded)
        for k, v in stats.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + v
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)  # shared test models are left as found
    return float(torch.stack(per_sequence).sum()), metrics, grads


def assert_same_step(got, want, rtol: float = RTOL) -> None:
    """Loss, metrics and every parameter gradient agree to `rtol` (relative, per tensor).

    A gradient that is zero analytically (e.g. the queries when every sequence has two tokens)
    is rounding noise on both sides: a tensor's error is measured against at least 1e-4 of the
    total gradient norm.
    """
    (loss, metrics, grads), (loss_ref, metrics_ref, grads_ref) = got, want
    assert abs(loss - loss_ref) <= rtol * abs(loss_ref) + 1e-12, (loss, loss_ref)
    assert metrics.keys() == metrics_ref.keys()
    for k in metrics:
        assert abs(metrics[k] - metrics_ref[k]) <= rtol * abs(metrics_ref[k]) + 1e-12, (k, metrics[k], metrics_ref[k])
    assert grads.keys() == grads_ref.keys()
    floor = max(1e-4 * float(torch.sqrt(sum(g.norm() ** 2 for g in grads_ref.values()))), 1e-12)
    for name in grads:
        err = relative_error(grads[name], grads_ref[name], floor=floor)
        assert err <= rtol, f"{name}: relative error {err:.3e}"

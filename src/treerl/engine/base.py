"""What every engine shares: the loss interface, step statistics and input checks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from treerl.engine.support import check_known_model, check_rope_lengths, check_tree_model, decoder_module, last_hidden
from treerl.tree import Node, PrefixTree, Sequence, validate_sequences


@dataclass
class SequenceView:
    """What a loss sees of one sequence: its data, and the model's differentiable outputs on it.

    Every output is aligned with `tokens`: `logprobs[j]` is log p(token j | tokens < j) and
    `entropy[j]` the entropy of that distribution; position 0 has no prediction and holds 0.
    """

    index: int
    sequence: Sequence
    outputs: dict[str, torch.Tensor]

    @property
    def tokens(self) -> torch.Tensor:
        return self.sequence.tokens

    @property
    def fields(self) -> dict[str, torch.Tensor]:
        return self.sequence.fields

    @property
    def info(self) -> dict[str, Any]:
        return self.sequence.info

    @property
    def logprobs(self) -> torch.Tensor:
        return self.outputs["logprobs"]

    @property
    def entropy(self) -> torch.Tensor:
        return self.outputs["entropy"]

    @property
    def values(self) -> torch.Tensor:
        return self.outputs["values"]


LossResult = torch.Tensor | tuple[torch.Tensor, dict[str, float | torch.Tensor]]
LossFn = Callable[[SequenceView], LossResult]


@dataclass
class StepStats:
    """What one forward_backward did: summed loss and metrics, token counts, time."""

    loss: float = 0.0
    sequences: int = 0
    flat_tokens: int = 0  # T: sum of sequence lengths
    model_tokens: int = 0  # tokens run through the model, recomputation included
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    def add_metrics(self, metrics: dict[str, float | torch.Tensor]) -> None:
        for key, value in metrics.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + float(value)


class Head(Protocol):
    """Turns final hidden states into per-token outputs (see engine.head.PolicyHead)."""

    outputs: tuple[str, ...]
    shifted: bool

    def check(self, model: PreTrainedModel) -> None: ...

    def __call__(self, model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]: ...


class Engine(Protocol):
    """One interface for every engine: same inputs, same outputs, same gradients."""

    def forward(self, model: PreTrainedModel, sequences: Seq[Sequence]) -> list[dict[str, torch.Tensor]]:
        """Per-sequence outputs aligned with tokens, without gradients."""
        ...

    def forward_backward(self, model: PreTrainedModel, sequences: Seq[Sequence], loss_fn: LossFn) -> StepStats:
        """Accumulate into `.grad` the gradient of sum_s loss_fn(s), each sequence as if on its own."""
        ...


def run_length(node: Node, shifted: bool) -> int:
    """Tokens of `node` the model must run: a leaf's last token predicts nothing and feeds no one."""
    return node.length - (1 if shifted and not node.children else 0)


def head_rows(tree: PrefixTree, node: Node, shifted: bool, base: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden-state rows of `node`'s outputs (its first token at row `base`) and the tokens they predict.

    Shifted heads: row j predicts the node's token j + 1, and its last row, once per child,
    predicts that child's first token (fork logits); a node's own first token comes from its
    parent's fork row. Unshifted heads: row j gives token j.
    """
    if not shifted:
        return torch.arange(base, base + node.length), node.tokens
    rows = torch.arange(base, base + node.length - 1)
    targets = node.tokens[1:]
    if node.children:
        rows = torch.cat([rows, torch.full((len(node.children),), base + node.length - 1)])
        targets = torch.cat([targets, torch.stack([tree.nodes[c].tokens[0] for c in node.children])])
    return rows, targets


def empty_outputs(model: PreTrainedModel, head: Head) -> dict[str, torch.Tensor]:
    """Outputs of a call with nothing to run (one-token leaves: their only output is a fork row)."""
    param = next(model.parameters())
    dtype = torch.promote_types(param.dtype, torch.float32)
    return {name: torch.zeros(0, dtype=dtype, device=param.device) for name in head.outputs}


def check_batch(model: PreTrainedModel, head: Head, sequences: Seq[Sequence], tree: bool) -> None:
    """Every check that can fail, before any compute: the batch, then the model and its settings.

    `tree`: the engine computes shared prefixes once (DFS, packed), which needs more of the model
    than the flat reference does (see treerl.engine.support).
    """
    config = model.config.get_text_config()
    check_known_model(model)
    validate_sequences(
        sequences,
        vocab_size=model.get_input_embeddings().num_embeddings,
        max_positions=getattr(config, "max_position_embeddings", None),
    )
    check_model(model, head, tree, max(len(s) for s in sequences))


def check_model(model: PreTrainedModel, head: Head, tree: bool, longest: int) -> None:
    """The model and its settings, for sequences of up to `longest` tokens: a run checks this once at start."""
    check_known_model(model)
    if tree:
        check_tree_model(model)
    check_rope_lengths(model, longest)
    head.check(model)


def final_hidden(model: PreTrainedModel, **inputs) -> torch.Tensor:
    """The body's final hidden states `[B, L, d]`, whatever output class (or tuple) the model returns."""
    return last_hidden(decoder_module(model)(**inputs, use_cache=False, return_dict=True))


def sum_losses(
    views: Iterable[tuple[int, Sequence, dict[str, torch.Tensor]]], loss_fn: LossFn, stats: StepStats
) -> torch.Tensor:
    """Sum of loss_fn over (index, sequence, outputs) triples; their metrics are added to `stats`."""
    losses = []
    for index, sequence, outputs in views:
        outputs = {name: out.clone() for name, out in outputs.items()}  # the loss may edit its copy in place
        loss, metrics = split_loss(loss_fn(SequenceView(index, sequence, outputs)))
        losses.append(loss)
        stats.add_metrics(metrics)
    return torch.stack(losses).sum()


def split_loss(result: LossResult) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """A loss function returns a scalar, or a scalar and a dict of metrics to sum over sequences."""
    if isinstance(result, tuple):
        loss, metrics = result
    else:
        loss, metrics = result, {}
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    return loss.reshape(()), {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}

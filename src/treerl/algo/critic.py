"""The critic: a value model that the same tree engines run, and PPO's clipped value loss.

Steps 3 and 5 (docs/architecture.md): PPO's critic gives GAE its values (3) and trains on the same tree (5).

A critic is a transformers `*ForTokenClassification` model with one label on a causal LM body
(verl's choice): `model.base_model` is the decoder the engines drive, `model.score` the value
layer that `treerl.engine.head.ValueHead` applies. A vision-language policy's critic is its own model
class (tower and all: the values read the images too) with `score` in place of the LM head. Run it with `DfsEngine(head=ValueHead())`:
`forward` gives per-token values (values[t] = V(tokens[:t]), aligned with logprobs[t]) and
`forward_backward(critic, batch, build_value_loss(config, normalizer))` trains them.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForTokenClassification, PreTrainedModel

from treerl.algo.checks import check_sequence
from treerl.algo.config import AlgoConfig
from treerl.algo.loss import field
from treerl.algo.normalizer import LossNormalizer
from treerl.engine.base import LossFn, LossResult, SequenceView
from treerl.engine.images import vision_family
from treerl.models import build_model, policy_config


def build_critic(
    path: str | None = None,
    shape: str = "tiny-qwen3",
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A value model: the body of a local causal LM checkpoint (or shape `shape`, random) plus a fresh value layer; of
    a vision-language one, its whole model (the critic sees the images too) with the value layer in its LM head's
    place."""
    if vision_family(policy_config(path, shape, vocab_size, trust_remote_code)) is not None:
        model = build_model(path, shape, vocab_size, dtype, device, seed, attn_implementation,
                            trust_remote_code=trust_remote_code)
        return with_value_layer(model, seed)
    return build_model(
        path, shape, vocab_size, dtype, device, seed, attn_implementation,
        auto_class=AutoModelForTokenClassification, overrides=dict(num_labels=1, classifier_dropout=0.0),
        trust_remote_code=trust_remote_code,
    )


def with_value_layer(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """A vision-language model (no token-classification class in transformers) as a critic: `model.score`, a fresh
    one-output layer initialised as transformers initialises a classifier, and no LM head (a vocabulary-wide matrix
    the critic never reads)."""
    text = model.config.get_text_config()
    weight = model.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed)
    score = torch.nn.Linear(text.hidden_size, 1, bias=False)
    with torch.no_grad():
        score.weight.copy_(torch.randn(1, text.hidden_size, generator=generator) * text.initializer_range)
    model.score = score.to(device=weight.device, dtype=weight.dtype)
    model.lm_head = None
    return model


def build_value_loss(config: AlgoConfig, normalizer: LossNormalizer) -> LossFn:
    """0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-value_clip) - R)^2), aggregated like the policy loss.

    Reads fields `returns` (R) and, when clipping, `values` (V_old, the critic's values when the
    batch was made); `normalizer` must count the whole batch.
    """
    config = config.resolved()

    def loss_fn(view: SequenceView) -> LossResult:
        check_sequence(config, view.sequence, view.index, critic=True)
        values = view.values
        mask = field(view, "loss_mask", values)
        returns = field(view, "returns", values)
        error = (values - returns) ** 2
        clipped = torch.zeros_like(error, dtype=torch.bool)
        if config.value_clip is not None:
            old = field(view, "values", values)
            clipped_error = (old + (values - old).clamp(-config.value_clip, config.value_clip) - returns) ** 2
            clipped = clipped_error > error
            error = torch.maximum(error, clipped_error)

        def aggregate(x: torch.Tensor) -> torch.Tensor:
            return normalizer.aggregate(x, mask, config.aggregation, config.seq_sum_scale)

        loss = aggregate(0.5 * error)
        return loss, {"value_loss": loss.detach(), "value_clip_fraction": aggregate(clipped.to(values.dtype))}

    return loss_fn

"""Exact or refused: what every engine checks about a model and its settings before any compute.

An engine either equals the flat reference, and the flat reference equals the model's own
forward on each sequence alone, or it raises `UnsupportedModel` here with what is wrong and what
to do. What cannot be read off the model statically (an attention argument treerl does not know,
a layer that bypasses transformers' attention interface) is refused by the attention dispatcher
at the first layer of the first call, before any output or gradient exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import torch
from transformers import PreTrainedModel

from treerl.attention import UnsupportedModel, all_configs, check_layer_types
from treerl.tree import Sequence

# Config keys of dropout probabilities a model applies in training mode (hidden, attention, embeddings...).
_DROPOUT_WORDS = ("dropout", "pdrop")
_DROPOUT_IGNORED = {"classifier_dropout", "summary_first_dropout", "summary_last_dropout"}  # heads treerl never runs

# Token mixers that carry state across tokens outside attention: a tree node cannot inherit it from its parent.
_RECURRENT_WORDS = ("Mamba", "RWKV", "Recurrent", "LinearAttention", "GatedDeltaNet", "ShortConv", "xLSTM", "Mixer")


def model_name(model: PreTrainedModel) -> str:
    return f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"


def check_tree_model(model: PreTrainedModel) -> None:
    """What the tree engines (DFS, packed) need beyond the flat reference: attention is the only token mixer."""
    name = model_name(model)
    try:
        check_layer_types(model)
    except UnsupportedModel as error:
        raise UnsupportedModel(f"{name}: {error}") from None
    for path, module in model.named_modules():
        kind = type(module).__name__
        if any(word in kind for word in _RECURRENT_WORDS):
            raise UnsupportedModel(
                f"{name}: {path} ({kind}) carries state across tokens outside attention; the tree engines "
                "cannot hand it from a node to its children (use FlatEngine)"
            )
        if kind.endswith("Attention") and not hasattr(module, "layer_idx"):
            raise UnsupportedModel(f"{name}: attention module {path} has no layer_idx; cannot route tree attention")
    if model.training:
        check_no_dropout(model)


def check_no_dropout(model: PreTrainedModel) -> None:
    """Dropout draws different masks for a shared prefix computed once than for each sequence alone."""
    name = model_name(model)
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0 and module.training:
            raise UnsupportedModel(
                f"{name}: dropout p={module.p} at {path} in training mode; the tree engines need dropout off "
                "(set the model's dropout config to 0, or call model.eval())"
            )
    for config in all_configs(model.config):
        for key, value in vars(config).items():
            if (
                any(word in key for word in _DROPOUT_WORDS)
                and key not in _DROPOUT_IGNORED
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and value > 0
            ):
                raise UnsupportedModel(
                    f"{name}: config.{key}={value} applies dropout in training mode; the tree engines need it 0 "
                    "(or call model.eval())"
                )


def check_rope_lengths(model: PreTrainedModel, sequences: Seq[Sequence]) -> None:
    """RoPE whose frequencies depend on the call's length gives a token different embeddings in different calls."""
    longest = max(len(s) for s in sequences)
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if rope_type is None:
            continue
        kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        for kind in kinds:
            if "dynamic" not in kind and kind != "longrope":
                continue
            limit = _original_length(module)
            if limit is None or longest >= limit:
                raise UnsupportedModel(
                    f"{model_name(model)}: RoPE type {kind!r} changes its frequencies with the length of each call "
                    f"(beyond {limit} tokens), so a token's embedding would depend on how the batch is split; "
                    f"the longest sequence has {longest} tokens. Keep sequences under {limit} tokens or use a "
                    "RoPE type without length dependence"
                )


def _original_length(rotary: torch.nn.Module) -> int | None:
    """The length below which a dynamic / long RoPE uses its original frequencies."""
    params = getattr(getattr(rotary, "config", None), "rope_parameters", None) or {}
    lengths = [params.get("original_max_position_embeddings")] if isinstance(params, dict) else []
    lengths += [p.get("original_max_position_embeddings") for p in params.values() if isinstance(p, dict)]
    lengths.append(getattr(rotary, "original_max_seq_len", None))
    lengths = [n for n in lengths if isinstance(n, int)]
    return min(lengths) if lengths else None


def check_all_layers_routed(model: PreTrainedModel, called: set[int]) -> None:
    """Every attention layer must have run treerl's attention: one that did not saw no ancestors."""
    layers = model.config.get_text_config().num_hidden_layers
    if called != set(range(layers)):
        raise UnsupportedModel(
            f"{model_name(model)}: only layers {sorted(called)} of {layers} ran treerl's attention; the others "
            "do not dispatch through transformers' AttentionInterface (use FlatEngine)"
        )


@contextlib.contextmanager
def dict_outputs(model: PreTrainedModel) -> Iterator[None]:
    """Run the model's own forward with `return_dict=True` (transformers' causal LMs fail on tuples)."""
    configs = [c for c in all_configs(model.config) if getattr(c, "return_dict", True) is False]
    for config in configs:
        config.return_dict = True
    try:
        yield
    finally:
        for config in configs:
            config.return_dict = False

"""FLOP counts from the model config: what flat and tree training must compute at the least.

Beside the steps (docs/architecture.md): the FLOP ideal step 5 is measured against.

Forward FLOPs of one token = 2 x (weights it multiplies: every linear layer of the body and the LM head,
counted on a meta-device build of the config, so recurrent mixers' projections count too)
+ a hybrid's token mixers' own work on their state (`state_flops`: the least any algorithm does per token)
+ 4 x heads x head_dim x (keys it attends to) per softmax-attention layer (a hybrid's recurrent layers
attend to no keys). Backward costs a fixed multiple of forward for all three, so the ratio flat/tree is the
FLOP-ideal speedup of prefix sharing. Mixture-of-experts models count every expert's weights: an
over-estimate of the per-token share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from treerl.engine.base import final_hidden
from treerl.engine.parallel_scan import LINEAR_SCANS, scan_of
from treerl.engine.recurrent import StateKey, find_mixers, mixer_kind
from treerl.engine.state_passing import passed_mixers
from treerl.engine.support import attention_layers, decoder_module
from treerl.models import model_geometry
from treerl.tree import PrefixTree


def meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """A model of `config` on the meta device (no memory): its causal LM, or a vision-language model's own class."""
    with torch.device("meta"):
        if hasattr(config, "vision_config") and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return AutoModelForImageTextToText.from_config(config)
        return AutoModelForCausalLM.from_config(config)


def _linear_weights(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def flop_rates(config: PretrainedConfig) -> tuple[int, int]:
    """(2 x multiply-adds of every weight matrix a token passes through, q.k and p.v FLOPs of one query-key pair
    summed over the softmax-attention layers), read off a meta-device model of `config` (a vision-language model's
    text body and head: its vision tower is `vision_rates`)."""
    model = meta_model(config)
    linear = _linear_weights(decoder_module(model))
    head = model.get_output_embeddings()
    if head is not None:
        linear += head.weight.numel()
    g = model_geometry(config)
    layers = len(attention_layers(model, find_mixers(model).mixer_classes))
    return 2 * linear + state_flops(model), 4 * g.heads * g.head_dim * layers


# Forward FLOPs per token for each element of a state a token mixer carries: a recurrent state (the delta rule's,
# Mamba2's SSM, lightning attention's K^T V) is decayed, given a rank-1 update and read out (three multiply-adds
# an element); a convolution window is read once (one multiply-add an element). DeepSeek-V4's compressed entries and
# open windows count nothing here: they are keys a query reads, not a state each token updates.
STATE_FLOPS = {"recurrent": 6, "linear": 6, "conv": 2}


def state_flops(model: torch.nn.Module) -> int:
    """Forward FLOPs per token of a hybrid's token mixers on their states (0 for attention-only models), from the
    states' sizes: the ones a two-token call hands on, read off a meta-device model (no memory, no compute)."""
    return sum(STATE_FLOPS.get(kind, 0) * state.numel() for (_, kind, _), state in handed_states(model).items())


def handed_states(model: torch.nn.Module) -> dict[StateKey, torch.Tensor]:
    """The states a two-token call of a meta-device model hands on, by key (none for attention-only models)."""
    mixers = find_mixers(model)
    if not mixers:
        return {}
    cache = mixers.new_cache(None, 1, 0)
    ids = torch.zeros(1, 2, dtype=torch.long, device="meta")
    with torch.no_grad():
        final_hidden(model, input_ids=ids, **{mixers.cache_kwarg: cache, "use_cache": True})
    cache.finish()
    return cache.final


@dataclass(frozen=True)
class MixerRates:
    """A hybrid's token mixer layers, for the context-parallel step model (treerl.bench.context_parallel): what one
    costs a token, what running its pieces side by side adds on a rank after the first, and what a layer's pieces
    share then."""

    per_layer: float  # forward FLOPs a token of one mixer layer (its projections and its state work; the mean)
    transfer_per_layer: float  # forward FLOPs the transfer columns add a token of one (treerl.engine.parallel_scan)
    shared_bytes: float  # float32 bytes one mixer layer's piece shares a row side by side: final state and transfer
    passed_bytes: float  # bytes one mixer layer's piece passes the next rank in turn: its final states
    runs: tuple[int, ...]  # the lengths of the runs of consecutive mixer layers (attention layers between them)


def mixer_rates(config: PretrainedConfig) -> MixerRates | None:
    """`MixerRates` read off a meta-device model of `config` (None: no token mixers): each mixer layer's linear
    weights, and its states (from a two-token call, as `state_flops` reads them) with the transfer beside each
    recurrent one: K x K a head for the delta rule's [K, V] state, N x N for Mamba2's [P, N], one decay an entry for
    Mamba's selective scan (its transfer pass repeats the state's work)."""
    model = meta_model(config)
    mixers = passed_mixers(model)
    if not mixers:
        return None
    states = handed_states(model)
    flops = transfer = shared = passed = 0.0
    for module in mixers:
        layer, side = module.layer_idx, mixer_kind(module).side_by_side
        scan = LINEAR_SCANS.get(scan_of(module)) if side == "scan" else None
        flops += 2 * _linear_weights(module)
        for (index, kind, _), state in states.items():
            if index != layer:
                continue
            flops += STATE_FLOPS.get(kind, 0) * state.numel()
            passed += state.numel() * state.element_size()
            if kind != "recurrent" or side not in ("scan", "selective"):
                continue
            ratio = 1.0 if scan is None else state.shape[-2] / state.shape[-1] if scan.layout == "columns" \
                else state.shape[-1] / state.shape[-2]  # K/V columns (K x K beside [K, V]) or N/P rows
            transfer += STATE_FLOPS[kind] * state.numel() * ratio
            shared += 4 * state.numel() * (1 + ratio)
    kinds = [find_mixers(model).layers.get(i) for i in range(model_geometry(config).layers)]
    runs = tuple(len(run) for run in "".join("m" if k is not None and not k.in_attention else " "
                                             for k in kinds).split())
    count = len(mixers)
    return MixerRates(flops / count, transfer / count, shared / count, passed / count, runs)


def tree_flops(tree: PrefixTree, config: PretrainedConfig) -> tuple[int, int]:
    """(flat, tree) forward FLOPs: every sequence on its own vs every unique token once."""
    per_token, per_key = flop_rates(config)

    def causal(start: int, end: int) -> int:  # sum of (position + 1) over positions [start, end)
        return (end * (end + 1) - start * (start + 1)) // 2

    flat = sum(len(s) * per_token + causal(0, len(s)) * per_key for s in tree.sequences)
    unique = sum(n.length * per_token + causal(n.start, n.end) * per_key for n in tree.nodes[1:])
    return flat, unique


def vision_rates(config: PretrainedConfig) -> tuple[int, int]:
    """(forward FLOPs of one patch through a Qwen-VL vision tower's blocks, of one placeholder token through its
    merger): 2 x the weights each multiplies, off a meta-device model. Its attention over an image's own patches is
    left out (a few % at the bench's sizes)."""
    visual = meta_model(config).model.visual
    merger = _linear_weights(visual.merger)
    return 2 * (_linear_weights(visual) - merger), 2 * merger


def image_flops(tree: PrefixTree, config: PretrainedConfig) -> tuple[int, int]:
    """(flat, tree) forward FLOPs of the vision tower: every sequence's images on their own vs each distinct image
    once (0, 0 for a batch without images)."""
    shown = [image for sequence in tree.sequences for image in sequence.images]
    if not shown:
        return 0, 0
    per_patch, per_token = vision_rates(config)
    cost = lambda image: int(image.grid_thw.prod()) * per_patch + image.length * per_token
    return sum(map(cost, shown)), sum(map(cost, {image.digest: image for image in shown}.values()))

"""What every engine shares: the loss interface, step statistics and input checks.

Step 5 (docs/architecture.md): the interface, statistics and checks every engine shares.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from treerl.attention import (
    CALL_KWARG,
    PathKV,
    Segment,
    TreeCall,
    UnitKV,
    UnitLayout,
    UnsupportedModel,
    engine_attention,
    routed_call,
)
from treerl.engine.images import check_images
from treerl.engine.recurrent import Mixers, check_checkpointing, compressed_entries, find_mixers
from treerl.engine.support import (
    attention_layers,
    check_all_layers_routed,
    check_known_model,
    check_layer_indices,
    check_positions,
    check_rope_lengths,
    check_tree_model,
    decoder_module,
    idle_modules_that_run,
    last_hidden,
    model_name,
    placed_at,
)
from treerl.tree import BatchError, Node, PrefixTree, TokenSequence, validate_sequences


@dataclass
class SequenceView:
    """What a loss sees of one sequence: its data, and the model's differentiable outputs on it.

    Every output is aligned with `tokens`: `logprobs[j]` is log p(token j | tokens < j) and
    `entropy[j]` the entropy of that distribution; position 0 has no prediction and holds 0.
    """

    index: int
    sequence: TokenSequence
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
        """Sum metrics over sequences; tensors stay on their device until `settle` (no sync per sequence)."""
        for key, value in metrics.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + value

    def settle(self) -> None:
        """Read the summed metrics as numbers: once per step, after the last sequence."""
        self.metrics = {key: float(value) for key, value in self.metrics.items()}


class Head(Protocol):
    """Turns final hidden states into per-token outputs (see engine.head.PolicyHead)."""

    outputs: tuple[str, ...]
    shifted: bool

    def check(self, model: PreTrainedModel) -> None: ...

    def __call__(self, model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def replay(self, model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor,
               known: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The same outputs with their graph when their values are `known` (activation recomputation)."""
        ...


class Engine(Protocol):
    """One interface for every engine: same inputs, same outputs, same gradients."""

    def forward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> list[dict[str, torch.Tensor]]:
        """Per-sequence outputs aligned with tokens, without gradients."""
        ...

    def forward_backward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence], loss_fn: LossFn) -> StepStats:
        """Accumulate into `.grad` the gradient of sum_s loss_fn(s), each sequence as if on its own."""
        ...


def run_length(node: Node, shifted: bool) -> int:
    """Tokens of `node` the model must run: a leaf's last token predicts nothing and feeds no one."""
    return node.length - (1 if shifted and not node.children else 0)


class OutputSlots:
    """The one home of the fork-row output layout: which hidden-state row computes which token's outputs, and
    where each output lands in a flat per-tree buffer (its "slot") from which every sequence reads its own.

    Slots: token j of node n has slot `base[n] + j` (the tree's tokens in node order). Shifted heads
    (causal LMs): row j of a node predicts its token j + 1, and its last row, once per child, predicts
    that child's first token (the fork row), so a node's first token is written by its parent; a
    sequence's very first token is predicted by nothing and its slot stays 0. Unshifted heads (a
    critic's values): row j gives token j.

    `head_rows` (the engines' option): the name of a per-token field whose nonzero positions are the only ones any
    consumer reads (`loss_mask`); a slot is read if any sequence through it reads it, and only read slots get a row.
    """

    def __init__(self, tree: PrefixTree, shifted: bool, head_rows: str | None = None) -> None:
        self.tree, self.shifted = tree, shifted
        self.base = [0] * len(tree.nodes)
        total = 0
        for node in tree.nodes:
            self.base[node.index] = total
            total += node.length
        self.total = total
        self.read = None if head_rows is None else self._read_slots(head_rows)

    def _read_slots(self, head_rows: str) -> torch.Tensor:
        """Which slots some sequence reads: a slot shared by several sequences is read if any of them reads it."""
        read = torch.zeros(self.total, dtype=torch.bool)
        for s, sequence in enumerate(self.tree.sequences):
            read[self.sequence(s)[read_positions(sequence, head_rows)]] = True
        return read

    def node_rows(self, node: Node, first_row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, targets, slots) of `node`'s outputs when its first token's hidden state is row `first_row`; with
        `head_rows`, only those whose slot some sequence reads (the other slots stay 0)."""
        base = self.base[node.index]
        if not self.shifted:
            rows, targets, slots = (torch.arange(first_row, first_row + node.length), node.tokens,
                                    torch.arange(base, base + node.length))
        else:
            children = node.children
            rows = torch.cat([torch.arange(first_row, first_row + node.length - 1),
                              torch.full((len(children),), first_row + node.length - 1)])
            targets = torch.cat([node.tokens[1:], torch.stack([self.tree.nodes[c].tokens[0] for c in children])
                                 if children else torch.zeros(0, dtype=torch.long)])
            slots = torch.cat([torch.arange(base + 1, base + node.length),
                               torch.tensor([self.base[c] for c in children], dtype=torch.long)])
        if self.read is None:
            return rows, targets, slots
        keep = self.read[slots]
        return rows[keep], targets[keep], slots[keep]

    def sequence(self, s: int) -> torch.Tensor:
        """Slot of each token of sequence `s` (its first token's slot holds 0 under a shifted head)."""
        pieces = [torch.arange(self.base[i], self.base[i] + self.tree.nodes[i].length) for i in self.tree.path(s)]
        return torch.cat(pieces)[: len(self.tree.sequences[s])]


def read_positions(sequence: TokenSequence, head_rows: str) -> torch.Tensor:
    """The positions of `sequence` whose outputs a consumer reads: where its field `head_rows` is nonzero (host)."""
    return (sequence.fields[head_rows] != 0).cpu()


def check_head_rows(sequences: Sequence[TokenSequence], head_rows: str | None) -> None:
    """The engine's `head_rows` names a field every sequence has (None: every position is computed)."""
    if head_rows is None:
        return
    if not isinstance(head_rows, str):
        raise TypeError(f"head_rows must be a field name or None, got {type(head_rows).__name__}")
    for i, sequence in enumerate(sequences):
        if head_rows not in sequence.fields:
            raise BatchError(f"{sequence.label(i)}: no field {head_rows!r}, which the engine's head_rows names as "
                             "the positions to compute (set head_rows=None to compute every position)")


def output_dtype(model: PreTrainedModel) -> torch.dtype:
    """What every engine returns outputs in: the parameters' dtype, at least float32 (the head computes in it)."""
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


def empty_outputs(model: PreTrainedModel, head: Head) -> dict[str, torch.Tensor]:
    """Outputs of a call with nothing to run (one-token leaves: their only output is a fork row)."""
    device = next(model.parameters()).device
    return {name: torch.zeros(0, dtype=output_dtype(model), device=device) for name in head.outputs}


def check_batch(model: PreTrainedModel, head: Head, sequences: Sequence[TokenSequence], tree: bool,
                carries_state: bool = False, head_rows: str | None = None) -> None:
    """Every check that can fail, before any compute: the batch, then the model and its settings.

    `tree`: the engine computes shared prefixes once (DFS, packed), which needs more of the model
    than the flat reference does (see treerl.engine.support); `carries_state`: it hands a recurrent
    state from each node to its children (DFS, see treerl.engine.recurrent); `head_rows`: the field the
    engine's head reads its rows from (`check_head_rows`).
    """
    config = model.config.get_text_config()
    check_known_model(model)
    validate_sequences(
        sequences,
        vocab_size=model.get_input_embeddings().num_embeddings,
        max_positions=getattr(config, "max_position_embeddings", None),
    )
    check_head_rows(sequences, head_rows)
    check_images(model, sequences)
    check_model(model, head, tree, max(len(s) for s in sequences), carries_state)
    if tree and not carries_state and any(s.images for s in sequences):
        raise UnsupportedModel(f"{model_name(model)}: this engine packs nodes into rows and does not feed images yet; "
                               "DfsEngine and FlatEngine do")


def check_model(model: PreTrainedModel, head: Head, tree: bool, longest: int, carries_state: bool = False) -> None:
    """The model and its settings, for sequences of up to `longest` tokens: a run checks this once at start."""
    check_known_model(model)
    if tree:
        check_tree_engine(model, carries_state)
    check_rope_lengths(model, longest)
    head.check(model)


def check_tree_engine(model: PreTrainedModel, carries_state: bool) -> Mixers:
    """What an engine that computes shared prefixes once needs of a model; returns its stateful token mixers.

    An engine that lays tokens of several nodes or sequences one after another in one row (PackedEngine,
    FlatEngine's packed rows) cannot serve a recurrent layer: the state would run on across them."""
    mixers = find_mixers(model)
    check_tree_model(model)
    check_routed(model, mixers)  # before positions: MPT (ALiBi) computes attention in its own code
    check_layer_indices(model)
    own_code = attends_in_own_code(model)  # positions from the cache's length, every row of a call at the path's end
    attention_free = bool(mixers) and not attention_layers(model, mixers.mixer_classes)
    check_positions(model, attention_free=own_code or attention_free)
    if own_code and not carries_state:
        raise UnsupportedModel(
            f"{model_name(model)}: its layers attend over the K/V their cache returns under a causal mask they build "
            "themselves (attention in the model's own code, or a mask outside transformers' mask interface), and "
            "this engine packs several nodes or sequences into one row, which that mask would run one into the next; "
            "DfsEngine runs each row from the path's end (or use FlatEngine)"
        )
    if mixers and carries_state:
        check_checkpointing(model)
    if mixers and not carries_state:
        kinds = ", ".join(sorted({kind.name for kind in mixers.layers.values()}))
        raise UnsupportedModel(
            f"{model_name(model)}: its {kinds} layers read each row as one sequence (a recurrent state carried "
            "along it, an indexer scoring every earlier key, or entries compressed from its earlier windows), and "
            "this engine packs several nodes or sequences "
            "into one row, which would run one into the next; DfsEngine hands each node's state (and keys) to its "
            "children (or use FlatEngine's layout='sequences')"
        )
    return mixers


_ROUTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> None, or why it is not routed


def check_routed(model: PreTrainedModel, mixers: Mixers) -> None:
    """Every attention layer runs treerl's attention, or (`attends_in_own_code`) every one takes its K/V from the
    cache's `update`: one two-token probe per model, without gradients.

    A model that computes attention in its own module code (Falcon) never calls the attention interface,
    and may fail on the mask treerl withholds before the first call could say so."""
    if model not in _ROUTED:
        _ROUTED[model] = _probe(model, mixers)
    if _ROUTED[model] is not None:
        raise UnsupportedModel(_ROUTED[model])


def attends_in_own_code(model: PreTrainedModel) -> bool:
    """Whether the model's layers compute attention in their own code over the K/V that the cache's `update` returns
    (Bloom, MVP, TrOCR), or under a mask they build themselves (Doge's dynamic mask), as the routing probe found:
    DfsEngine hands them [path | own] K/V through the cache and runs every row of a call from the path's end, so that
    their own causal mask is the sequence's."""
    return _OWN_CODE.get(model, False)


def runs_in_rows(model: PreTrainedModel) -> bool:
    """Whether DfsEngine's calls are rows that each start at the path's end (a recurrent state handed from the
    parent, or attention the model computes in its own code over [path | row]), not nodes packed into one row."""
    return bool(find_mixers(model)) or attends_in_own_code(model)


_OWN_CODE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> True: attention in its own code


def attention_slots(model: PreTrainedModel) -> int | None:
    """The K/V slots a forward of `model` fills on the path (its attention calls: a layer may attend more than once),
    as the routing probe counted them; None before the probe ran."""
    return _SLOTS.get(model)


_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> attention calls of one forward


def _probe(model: PreTrainedModel, mixers: Mixers) -> str | None:
    device = model.get_input_embeddings().weight.device
    positions = torch.arange(2, device=device)
    call = TreeCall(None, UnitKV(), UnitLayout([Segment(0, 2, 0)], [], positions, 0), wants_mask=mixers.indexed)
    inputs = {"input_ids": torch.zeros(1, 2, dtype=torch.long, device=device), "position_ids": positions[None],
              CALL_KWARG: call}
    if mixers:
        cache = mixers.new_cache(None, 1, 0)
        inputs.update({mixers.cache_kwarg: cache, "use_cache": True})
        call.appended = cache.appended
    try:
        with torch.no_grad(), engine_attention(model), idle_modules_that_run(model) as idle_ran, \
                compressed_entries(model):
            final_hidden(model, **inputs)
            check_all_layers_routed(model, call.layers_called, attention_layers(model, mixers.mixer_classes))
        _SLOTS[model] = sum(call.calls.values())
        if idle_ran:
            return (f"{model_name(model)}: {idle_ran[0]} ran on a text-only batch, which treerl takes for idle there "
                    "and leaves unrouted (use FlatEngine)")
    except UnsupportedModel as refusal:
        return _probe_own_code(model, mixers, str(refusal)) if not call.layers_called else str(refusal)
    except Exception as error:  # noqa: BLE001 - any failure of the probe is a refusal, with its cause
        return _probe_own_code(model, mixers, _probe_failure(model, call, error)) if not call.layers_called \
            else _probe_failure(model, call, error)
    return None


def _probe_own_code(model: PreTrainedModel, mixers: Mixers, refusal: str) -> str | None:
    """No layer ran treerl's attention: the model's own attention, probed with a cache that returns the path's K/V
    (`attends_in_own_code`). Three tokens, as a tree runs them: two from the root, then the third below them over
    their K/V (and state), which must equal the model's own forward on all three (a body that reads the cache some
    other way, XLM slicing its input by the cache's length, does not). None if every attention layer took its K/V
    from the cache and the third token is the model's, else the interface probe's `refusal`, or why not."""
    device = model.get_input_embeddings().weight.device
    ids = (torch.arange(3, device=device) + 3) % model.get_input_embeddings().num_embeddings
    positions = torch.arange(3, device=device)
    first = TreeCall(None, UnitKV(), UnitLayout([Segment(0, 2, 0)], [], positions[:2], 0))
    try:
        with torch.no_grad(), idle_modules_that_run(model) as idle_ran:
            whole = final_hidden(model, input_ids=ids[None], position_ids=positions[None])
            cache = mixers.new_cache(None, 1, 0, device=device, attention=first)
            head = final_hidden(model, input_ids=ids[None, :2], position_ids=positions[None, :2],
                                **{mixers.cache_kwarg: cache, "use_cache": True})
            if idle_ran or not first.layers_called:
                return refusal
            check_all_layers_routed(model, first.layers_called, attention_layers(model, mixers.mixer_classes))
    except UnsupportedModel as own:
        return refusal if not first.layers_called else str(own)
    except Exception as error:  # noqa: BLE001 - as in `_probe`
        return refusal if not first.layers_called else _probe_failure(model, first, error)
    cache.finish()
    path = PathKV(3, with_grads=False)
    path.push(first.unit, [Segment(0, 2, 0)])
    below = TreeCall(path, UnitKV(), UnitLayout([Segment(0, 1, 2)], [], positions[2:], 2))
    cache = mixers.new_cache(cache.row_states(0) or None, 1, 2, device=device, attention=below)
    wrong = (f"{model_name(model)}: its layers compute attention in their own module code over the K/V their cache "
             "returns, but a token run over its prefix's K/V from the cache")
    try:
        with torch.no_grad():
            tail = final_hidden(model, input_ids=ids[None, 2:], position_ids=positions[None, 2:],
                                **{mixers.cache_kwarg: cache, "use_cache": True})
    except Exception as error:  # noqa: BLE001 - the body reads the cache some other way
        return (f"{wrong} failed ({type(error).__name__}: {error}): the body reads the cache some other way "
                "(use FlatEngine)")
    off = (torch.cat([head, tail], dim=1) - whole).abs().max() / whole.abs().max().clamp_min(1e-30)
    if tail.shape[1] != 1 or not off <= 1e-2:
        return (f"{wrong} is not the token of the model's own forward (off by {float(off):.2g} of the hidden state's "
                "scale): the body reads the cache some other way (use FlatEngine)")
    _OWN_CODE[model] = True
    _SLOTS[model] = sum(first.calls.values())
    return None


def _probe_failure(model: PreTrainedModel, call: TreeCall, error: Exception) -> str:
    """Why a probe that raised refuses the model: where no layer had reached treerl's attention, the model computes
    attention in its own code (MPT, Falcon) and failed on the mask treerl withholds."""
    failed = f"{type(error).__name__}: {error}"
    if not call.layers_called:
        return (f"{model_name(model)}: its attention is computed in its own module code, not through transformers' "
                f"AttentionInterface (a two-token probe failed before any layer called it: {failed}) (use FlatEngine)")
    return (f"{model_name(model)}: its layers do not run through transformers' attention interface (a two-token "
            f"probe through treerl's attention failed: {failed}) (use FlatEngine)")


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without stalling the host: pinned and non-blocking on CUDA."""
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)


def final_hidden(model: PreTrainedModel, **inputs) -> torch.Tensor:
    """The body's final hidden states `[B, L, d]`, whatever output class (or tuple) the model returns.

    No cache unless the inputs bring one (a recurrent model's state, treerl.engine.recurrent). A treerl call
    in the inputs is also the running call, for layers that do not pass attention kwargs on. `position_ids` reach the
    body however it reads positions (`placed_at`)."""
    call = inputs.get(CALL_KWARG)
    body = decoder_module(model)
    with routed_call(call, gradient_checkpointing(model)) if call is not None else contextlib.nullcontext(), \
            placed_at(body, inputs.pop("position_ids", None)) as positions:
        return last_hidden(body(**{"use_cache": False, **inputs, **positions}, return_dict=True))


def gradient_checkpointing(model: PreTrainedModel) -> bool:
    """Whether transformers will recompute the model's layers in backward (checkpointing on, training mode)."""
    return model.training and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def sum_losses(
    views: Iterable[tuple[int, TokenSequence, dict[str, torch.Tensor]]], loss_fn: LossFn, stats: StepStats
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

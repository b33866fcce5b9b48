"""Rollout routing replay (R3): an MoE model's routers take the experts the sampler routed each token to.

Step 5 (docs/architecture.md), for MoE policies: the routing the engines replay.

    with routing_replay(model):                   # the routers read each call's recorded experts
        engine.forward_backward(model, batch, loss_fn)
    with recording_routes(model) as record:       # a sampler's forward: the experts each router picked
        model(...); routes = record.take()        # [rows, layers, top_k], -1 where a layer routes nothing

A sequence carries its routes as the field `routed_experts`, `[tokens, decoder layers, top_k]` (vLLM's layout:
every decoder layer, the dense ones' entries unread; -1 where the sampler routed nothing, as on the last sampled
token, which no sampler runs). Replayed, a router keeps its own scores (softmax, sigmoid ...) and its own arithmetic
after the choice (normalising the top-k, scaling) and only the choice changes: the top-k call that picks the experts
returns the recorded indices and the scores gathered there, so gradients flow through the router's weights of the
replayed experts, as R3, NeMo-RL and slime do.

One mechanism for every family: the router module's forward runs under a `TorchFunctionMode` that catches its
expert-choosing `torch.topk` (the one over `[tokens, experts]`; the group-limited steps before it run as they are and
no longer matter). `find_routers` finds, with one three-token probe, which module of each decoder layer calls it.

A tree computes a shared prefix once, so a node gets one routing: the first sequence's (in batch order) that has one
there. Every engine replays that choice (the flat reference too), so they stay equal; the sequences whose own routes
differ on a shared token are counted (`routing/disagree_tokens`, of `routing/routed_tokens`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from transformers import PreTrainedModel

from treerl.attention import UnsupportedModel
from treerl.engine.base import Engine, LossFn, StepStats, final_hidden, gradient_checkpointing
from treerl.engine.support import decoder_module, model_name
from treerl.tree import BatchError, PrefixTree, TokenSequence
from treerl.tree.sequence import ROUTED_EXPERTS

_TOPK = (torch.topk, torch.Tensor.topk)
PROBE_TOKENS = 3


@dataclass(frozen=True)
class Routers:
    """Where a model picks experts: the module of each MoE decoder layer whose top-k chooses, and the routes' shape."""

    modules: dict[torch.nn.Module, int]  # the module calling the expert-choosing top-k -> its decoder layer
    layers: int  # decoder layers: the routes' second axis (vLLM's layout)
    experts: int  # the top-k's width (routed experts, LongCat's zero-computation ones included)
    top_k: int

    @property
    def routed_layers(self) -> list[int]:
        """The decoder layers that route, in order: the columns of the routes the routers read."""
        return sorted(self.modules.values())


_ROUTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Routers, or why it is refused


def find_routers(model: PreTrainedModel) -> Routers:
    """The model's routers (one probe per model); UnsupportedModel in one line where it routes otherwise."""
    if model not in _ROUTERS:
        _ROUTERS[model] = _probe(model)
    found = _ROUTERS[model]
    if isinstance(found, str):
        raise UnsupportedModel(f"{model_name(model)}: {found}")
    return found


def _decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList | None:
    """The body's list of decoder layers (the longest ModuleList directly under it)."""
    lists = [m for m in decoder_module(model).children() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len) if lists else None


def _probe(model: PreTrainedModel) -> Routers | str:
    """Run three tokens and watch every top-k call: inside each MoE block (a module with `experts`), the one over
    `[tokens, experts]` (the widest such, if several) picks the experts. Why not, as a string, where that fails."""
    layers = _decoder_layers(model)
    blocks = [m for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)]
    if not blocks or layers is None:
        return "has no MoE layers (no module with experts in its decoder layers): routing replay is for MoE models"
    layer_of = {m: i for i, layer in enumerate(layers) for m in layer.modules()}
    stack: list[torch.nn.Module] = []
    calls: list[tuple[torch.nn.Module, torch.nn.Module, int, tuple[int, ...]]] = []  # (block, caller, k, shape)
    block_set = set(blocks)

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in _TOPK and stack:  # outside every MoE block too: a router treerl would not replay
                block = next((m for m in reversed(stack) if m in block_set), None)
                calls.append((block, stack[-1], _topk_k(args, kwargs), tuple(args[0].shape)))
            return func(*args, **kwargs)

    hooks = []
    for module in model.modules():
        hooks.append(module.register_forward_pre_hook(lambda m, a: stack.append(m)))
        hooks.append(module.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1]))
    device = model.get_input_embeddings().weight.device
    ids = (torch.arange(PROBE_TOKENS, device=device) + 3) % model.get_input_embeddings().num_embeddings
    try:
        with torch.no_grad(), Watch():
            final_hidden(model, input_ids=ids[None], position_ids=torch.arange(PROBE_TOKENS, device=device)[None])
    except Exception as error:  # noqa: BLE001 - the probe's failure is the refusal, with its cause
        return f"a three-token probe of its routers failed ({type(error).__name__}: {error})"
    finally:
        for hook in hooks:
            hook.remove()
    return _routers_from(blocks, calls, layer_of, len(layers))


def _routers_from(blocks: list[torch.nn.Module], calls: list, layer_of: dict, layers: int) -> Routers | str:
    """The Routers the probe's top-k calls show, or why they show none that replay can serve."""
    by_block: dict[torch.nn.Module, list] = {}
    for block, caller, k, shape in calls:
        by_block.setdefault(block, []).append((caller, k, shape))
    modules, widths, ks, seen_layers = {}, set(), set(), set()
    for block in blocks:
        if block not in layer_of:
            continue
        choosing = [c for c in by_block.get(block, []) if len(c[2]) == 2 and c[2][0] == PROBE_TOKENS]
        if not choosing:
            return (f"its MoE block {type(block).__name__} picks experts without a top-k over [tokens, experts] "
                    "(a sparse mixer, hash routing, or a 3-D score), which routing replay cannot replace")
        widest = max(c[2][1] for c in choosing)
        top = [c for c in choosing if c[2][1] == widest]
        if len(top) != 1 or len({c[0] for c in top}) != 1:
            return (f"its MoE block {type(block).__name__} calls the top-k over all experts {len(top)} times a forward "
                    "(looped layers, or more than one choice a token), so one routing a layer cannot be replayed")
        layer = layer_of[block]
        if layer in seen_layers:
            return (f"its decoder layer {layer} has more than one MoE block (e.g. mixture-of-attention heads beside "
                    "the MLP's experts), and the routes hold one routing a layer (vLLM's layout)")
        seen_layers.add(layer)
        caller, k, shape = top[0]
        modules[caller] = layer
        widths.add(shape[1])
        ks.add(k)
    if not modules:
        return "has no MoE layers that ran on a text-only probe: routing replay is for MoE models"
    if len(widths) != 1 or len(ks) != 1:
        return f"its MoE layers differ in experts {sorted(widths)} or experts per token {sorted(ks)}"
    width, k = widths.pop(), ks.pop()
    unreplayed = [caller for _, caller, kk, shape in calls if caller not in modules and kk == k
                  and shape == (PROBE_TOKENS, width)]
    if unreplayed:
        return (f"{type(unreplayed[0]).__name__} also picks {k} of {width} with a top-k, outside the MoE blocks "
                "whose routing is replayed (a second router in a layer), so part of the routing would not be replayed")
    return Routers(modules, layers, width, k)


def _topk_k(args: tuple, kwargs: dict) -> int:
    return int(args[1] if len(args) > 1 else kwargs["k"])


# --------------------------------------------------------------------------------------------------------------
# The tap: one per model while replaying or recording; the routers' forwards read it.


class _Tap:
    """What the patched routers do in a call: replay `routes` (`[rows, routed layers, top_k]`), or record."""

    def __init__(self, routers: Routers):
        self.routers = routers
        self.column = {layer: c for c, layer in enumerate(routers.routed_layers)}
        self.users = 0
        self.routes: torch.Tensor | None = None  # this call's routes; None: the routers choose (and may record)
        self.recorded: dict[int, list[torch.Tensor]] | None = None

    def topk(self, layer: int, func, args: tuple, kwargs: dict):
        """The expert-choosing top-k of `layer`: the replayed experts with their scores, or the router's own."""
        if self.routes is None:
            out = func(*args, **kwargs)
            if self.recorded is not None:
                self.recorded.setdefault(layer, []).append(out.indices.detach())
            return out
        scores, chosen = args[0], self.routes[:, self.column[layer]]
        if chosen.shape[0] != scores.shape[0]:
            raise RuntimeError(f"routing replay: the router of layer {layer} scored {scores.shape[0]} tokens but the "
                               f"call's routes hold {chosen.shape[0]} (an engine fed the wrong routes)")
        return torch.return_types.topk((scores.gather(-1, chosen), chosen))

    def router_forward(self, layer: int, original):
        """`original` (a router's forward) with its expert-choosing top-k going through this tap."""
        tap, width, k = self, self.routers.experts, self.routers.top_k

        class Choice(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in _TOPK and args[0].dim() == 2 and args[0].shape[1] == width and _topk_k(args, kwargs) == k:
                    return tap.topk(layer, func, args, kwargs)
                return func(*args, **kwargs)

        @functools.wraps(original)
        def forward(*args, **kwargs):
            with Choice():
                return original(*args, **kwargs)

        return forward


_TAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Tap while a replay or recording is open


@contextlib.contextmanager
def _tapped(model: PreTrainedModel) -> Iterator[_Tap]:
    """The model's routers patched to go through its tap (nested uses share it; the last one out restores them)."""
    tap = _TAPS.get(model)
    if tap is None:
        tap = _TAPS[model] = _Tap(find_routers(model))
        for module, layer in tap.routers.modules.items():
            module.forward = tap.router_forward(layer, module.forward)
    tap.users += 1
    try:
        yield tap
    finally:
        tap.users -= 1
        if tap.users == 0:
            for module in tap.routers.modules:
                del module.forward  # the instance attribute: the class's forward again
            del _TAPS[model]


@contextlib.contextmanager
def routing_replay(model: PreTrainedModel) -> Iterator[None]:
    """Engines inside this block replay each sequence's `routed_experts` in the model's routers (checked first)."""
    find_routers(model)
    if gradient_checkpointing(model):
        raise UnsupportedModel(f"{model_name(model)}: routing replay with gradient checkpointing is not supported (the "
                               "layers recomputed in backward would route on their own); turn one of them off")
    with _tapped(model):
        yield


def replaying(model: PreTrainedModel) -> bool:
    """Whether the model's engine calls replay recorded routes now (inside `routing_replay`)."""
    return model in _TAPS and _TAPS[model].recorded is None


class RouteRecord:
    """The experts each router picked in the calls made while recording, read call by call with `take`."""

    def __init__(self, tap: _Tap):
        self.tap = tap

    @property
    def shape(self) -> tuple[int, int]:
        """A token's routes: (decoder layers, experts per token)."""
        return self.tap.routers.layers, self.tap.routers.top_k

    def take(self, rows: int) -> torch.Tensor:
        """The last call's routes `[rows, decoder layers, top_k]` on the host (-1 on layers that do not route)."""
        routers = self.tap.routers
        out = torch.full((rows, routers.layers, routers.top_k), -1, dtype=torch.int16)
        for layer, picks in self.tap.recorded.items():
            if len(picks) != 1 or picks[0].shape[0] != rows:
                raise RuntimeError(f"recording routes: layer {layer} routed {[p.shape[0] for p in picks]} token rows "
                                   f"in one call of {rows}")
            out[:, layer] = picks[0].to("cpu", torch.int16)
        self.tap.recorded = {}
        return out


@contextlib.contextmanager
def recording_routes(model: PreTrainedModel) -> Iterator[RouteRecord]:
    """Record the experts the model's routers pick (a sampler's forwards); not inside a replay."""
    with _tapped(model) as tap:
        if tap.routes is not None or tap.users > 1:
            raise RuntimeError("recording routes inside a routing replay")
        tap.recorded = {}
        try:
            yield RouteRecord(tap)
        finally:
            tap.recorded = None


# --------------------------------------------------------------------------------------------------------------
# The routes of a batch: checked, one routing per tree node, and each engine call's rows.


def check_routes(model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> Routers:
    """Every sequence's `routed_experts` fits the model (layers, top-k, experts that exist): a BatchError naming the
    sequence otherwise, before any compute. (Its token count is `validate_sequences`'s.)"""
    routers = find_routers(model)
    routed = routers.routed_layers
    for i, seq in enumerate(sequences):
        who = seq.label(i)
        routes = seq.fields.get(ROUTED_EXPERTS)
        if routes is None:
            raise BatchError(f"{who}: no field {ROUTED_EXPERTS!r}: routing replay needs each token's experts from the "
                             "sampler (rollout.return_routed_experts=true)")
        if routes.dim() != 3 or tuple(routes.shape[1:]) != (routers.layers, routers.top_k) \
                or routes.is_floating_point():
            raise BatchError(f"{who}: field {ROUTED_EXPERTS!r} is {routes.dtype} of shape {tuple(routes.shape)}, but "
                             f"{model_name(model)} routes integer [tokens, {routers.layers} decoder layers, "
                             f"{routers.top_k} experts per token]")
        used = routes[:, routed]
        bad = (used >= routers.experts) | (used < -1)
        if bool(bad.any()):
            token, column, _ = (int(x) for x in bad.nonzero()[0])
            raise BatchError(f"{who}: field {ROUTED_EXPERTS!r} names expert {int(used[bad][0])} at token {token}, "
                             f"layer {routed[column]}, but the model has experts 0..{routers.experts - 1}")
        unset = used < 0
        partial = unset.flatten(1).any(1) & ~unset.flatten(1).all(1)
        if bool(partial.any()):
            token = int(partial.nonzero()[0])
            raise BatchError(f"{who}: field {ROUTED_EXPERTS!r} routes token {token} in some MoE layers and not in "
                             "others (-1): a token has a routing in every MoE layer or in none")
    return routers


class TreeRoutes:
    """One routing per node of `tree` (the first sequence's, in batch order, that has one there), as a table in the
    tree's node order (`OutputSlots`' token order), and how many sequence tokens disagreed with it."""

    def __init__(self, model: PreTrainedModel, tree: PrefixTree, shifted: bool):
        routers = check_routes(model, tree.sequences)
        self.tap, self.tree = _TAPS[model], tree
        routed = routers.routed_layers
        self.base = [0] * len(tree.nodes)
        total = 0
        for node in tree.nodes:
            self.base[node.index] = total
            total += node.length
        self.table = torch.full((total, len(routed), routers.top_k), -1, dtype=torch.long)
        self.disagree = self.routed = 0
        through: dict[int, list[int]] = {}
        for s in range(len(tree.sequences)):
            for n in tree.path(s):
                through.setdefault(n, []).append(s)
        for n, sequences in through.items():
            self._choose(tree, n, sequences, routed, shifted)

    def _choose(self, tree: PrefixTree, n: int, sequences: list[int], routed: list[int], shifted: bool) -> None:
        """Node `n`'s routing from the sequences through it, in order; the tokens it runs must have one."""
        node = tree.nodes[n]
        chosen = self.table[self.base[n] : self.base[n] + node.length]
        for s in sequences:
            own = tree.sequences[s].fields[ROUTED_EXPERTS][node.start : node.end][:, routed].long()
            here = chosen[: len(own)]
            has, known = (own >= 0).flatten(1).all(1), (here >= 0).flatten(1).all(1)
            self.routed += int(has.sum())
            self.disagree += int((has & known & (own != here).flatten(1).any(1)).sum())
            here[has & ~known] = own[has & ~known]
        runs = node.length - (1 if shifted and not node.children else 0)
        missing = (chosen[:runs] < 0).flatten(1).any(1)
        if bool(missing.any()):
            token = node.start + int(missing.nonzero()[0])
            raise BatchError(f"{tree.sequences[sequences[0]].label(sequences[0])}: field {ROUTED_EXPERTS!r} has no "
                             f"routing (-1) at token {token}, which the model runs, in this sequence or any other that "
                             "shares it")

    def metrics(self) -> dict[str, float]:
        """Sequence tokens whose recorded experts differ from their node's replayed ones, of those with a routing."""
        return {"routing/disagree_tokens": float(self.disagree), "routing/routed_tokens": float(self.routed)}

    def sequence_rows(self, s: int, length: int) -> torch.Tensor:
        """Table rows of sequence `s`'s first `length` tokens."""
        pieces = [torch.arange(self.base[n], self.base[n] + self.tree.nodes[n].length) for n in self.tree.path(s)]
        return torch.cat(pieces)[:length]

    def node_rows(self, n: int, length: int) -> torch.Tensor:
        """Table rows of node `n`'s first `length` tokens."""
        return torch.arange(self.base[n], self.base[n] + length)

    @contextlib.contextmanager
    def call(self, rows: torch.Tensor, device: torch.device) -> Iterator[None]:
        """One model call whose token rows are the table's `rows`, in order: its routers replay them."""
        self.tap.routes = self.table[rows].to(device)
        try:
            yield
        finally:
            self.tap.routes = None


def tree_routes(model: PreTrainedModel, tree: PrefixTree | Sequence[TokenSequence], shifted: bool) -> TreeRoutes | None:
    """The routes of a tree (or of a batch, merged into one) when the engine replays routing (inside
    `routing_replay`), checked; else None."""
    if not replaying(model):
        return None
    return TreeRoutes(model, tree if isinstance(tree, PrefixTree) else PrefixTree.build(tree), shifted)


def replayed(routes: TreeRoutes | None, rows: Callable[[], torch.Tensor], device: torch.device,
             ) -> contextlib.AbstractContextManager:
    """A model call replaying the table's `rows()` (built only when replaying); nothing when `routes` is None."""
    return contextlib.nullcontext() if routes is None else routes.call(rows(), device)


def sequences_rows(routes: TreeRoutes, indices: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """Table rows of a call that runs sequences `indices` one after another, their first `lengths` tokens each."""
    return torch.cat([routes.sequence_rows(s, n) for s, n in zip(indices, lengths)])


def unit_rows(routes: TreeRoutes, segments: dict, rows: int, width: int | None) -> torch.Tensor:
    """Table rows of a DFS unit's call: each node's segment, and (a row unit, `width` tokens a row) the padding at a
    row's end repeating its last token, as the unit's ids do."""
    out = torch.full((rows,), -1, dtype=torch.long)
    for n, segment in segments.items():
        out[segment.row : segment.end] = routes.node_rows(n, segment.length)
    if width is not None:
        for start in range(0, rows, width):
            row = out[start : start + width]
            filled = int((row >= 0).sum())
            row[filled:] = row[filled - 1]
    return out


@dataclass
class RoutingReplayEngine:
    """`engine` with every call replaying the batch's recorded routes (trainer.routing_replay): the update, and the
    no-grad passes that fill old, proximal and reference log-probs, route as the sampler did."""

    engine: Engine

    def forward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> list[dict[str, torch.Tensor]]:
        with routing_replay(model):
            return self.engine.forward(model, sequences)

    def forward_backward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence], loss_fn: LossFn) -> StepStats:
        with routing_replay(model):
            return self.engine.forward_backward(model, sequences, loss_fn)

"""DfsEngine's memory contract: how many tokens of autograd graph a walk may hold at once.

Step 5 (docs/architecture.md): the budget the plan of each DFS walk keeps to.

The contract users already know from flat training: `memory="micro-batch"` (the default) holds at most
as much as FlatEngine's packed micro-batch of `max_tokens` tokens (the knob flat training sets; one value
for both engines): the largest micro-batch flat forms on the same sequences (one sequence for a model whose
layers carry a state, which flat cannot pack), or 1.5x the one-path walk when one path alone needs more (a node longer than the
micro-batch). `memory="one-path"`: 1.5x the one-path walk (one node's graph at a time, the published
design's peak), for runs at the edge of memory. An explicit `memory_budget_bytes` replaces either;
`memory_budget_tokens` counts graph tokens directly (tests, experiments).

Bytes come from the model, not from a token estimate: a probe forward records what autograd saves per
token (`graph_bytes`), and the path's K/V store with its gradients (`path_bytes_per_token`) is taken out of
the budget before it is turned into graph tokens. A hybrid's chunked mixers (the delta rule, the Mamba2 scan)
pad every row of a call to a multiple of their chunk on their torch path, so a row of a few tokens saves
nearly a whole chunk: a second probe of one token measures that share, and a row's graph tokens count it
(`GraphBytes.row_tokens`). Under context parallelism a hybrid's mixers may run side by side: a rank after the first
scans its piece with transfer columns beside (treerl.engine.parallel_scan), a larger graph, which a probe of such a
rank measures (`graph_bytes(model, side_by_side)`) and the per-rank budget counts.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedModel

from treerl.engine.base import attention_slots, final_hidden
from treerl.engine.parallel_scan import LaterPiece, split_scans
from treerl.engine.recurrent import find_mixers
from treerl.engine.selective_scan import continued_scans
from treerl.engine.support import attention_layers
from treerl.models import model_geometry

MemoryMode = Literal["micro-batch", "one-path"]
MEMORY_MODES = ("micro-batch", "one-path")

ONE_PATH_SLACK = 1.5
"""The one-path floor: this many times the largest node's rows. The one-path walk (one node per call, every
graph recomputed) holds one node's graph at a time, so a budget of this factor stays within 1.5x its peak."""

PROBE_TOKENS = 64
_probed: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple, GraphBytes]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class GraphBytes:
    """What autograd saves for one row of a call: `token` bytes for each of its tokens, and `padded` bytes for
    each token of the row rounded up to a multiple of `chunk` (a chunked recurrent mixer pads every row)."""

    token: int
    padded: int = 0
    chunk: int = 1

    @property
    def per_token(self) -> int:
        """Bytes of one graph token: a token of a row that needs no padding."""
        return self.token + self.padded

    def row_tokens(self, width: int) -> int:
        """Graph tokens (of `per_token` bytes) that one row of `width` tokens holds, its padding included."""
        if not self.padded:
            return width
        padded_width = -(-width // self.chunk) * self.chunk
        return -(-(self.token * width + self.padded * padded_width) // self.per_token)


def check_memory_settings(memory: str, max_tokens: int, budget_tokens: int | None, budget_bytes: int | None,
                          prefix: str = "") -> None:
    """Refuse a memory setting the engine cannot honour, naming it (`prefix`: "engine." in a config)."""
    if memory not in MEMORY_MODES:
        raise ValueError(f"{prefix}memory must be 'micro-batch' or 'one-path', got {memory!r}")
    if not max_tokens > 0:
        raise ValueError(f"{prefix}max_tokens must be > 0, got {max_tokens}")
    if budget_tokens is not None and budget_bytes is not None:
        raise ValueError(f"set one memory budget, not {prefix}memory_budget_tokens and {prefix}memory_budget_bytes")
    for name, value in (("memory_budget_tokens", budget_tokens), ("memory_budget_bytes", budget_bytes)):
        if value is not None and not value > 0:
            raise ValueError(f"{prefix}{name} must be > 0, got {value}")


def flat_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """FlatEngine's packed micro-batches: sequences in order, a row growing while it stays within `max_tokens`
    tokens (a longer sequence gets a row of its own). `lengths`: each sequence's rows."""
    batches: list[list[int]] = []
    size = 0
    for i, n in enumerate(lengths):
        if batches and size + n <= max_tokens:
            batches[-1].append(i)
            size += n
        else:
            batches.append([i])
            size = n
    return batches


def micro_batch_tokens(lengths: list[int], max_tokens: int) -> int:
    """Rows of the largest micro-batch FlatEngine forms on these sequences: what the default contract allows."""
    return max((sum(lengths[i] for i in batch) for batch in flat_micro_batches(lengths, max_tokens)), default=0)


def graph_budget_tokens(model: PreTrainedModel, largest_node: int, longest_path: int, memory: str,
                        micro_batch: int, budget_tokens: int | None = None, budget_bytes: int | None = None,
                        ranks: int = 1, path_ranks: int = 1,
                        side_by_side: frozenset[tuple[str, str]] | None = None) -> int:
    """Graph tokens a walk may hold at once: the contract of `memory` (or an explicit budget) for this model.

    `largest_node`: graph tokens of the tree's largest node (the one-path walk holds one node's graph);
    `longest_path`: tokens of its longest sequence (what the path's K/V store may hold);
    `micro_batch`: graph tokens of flat's largest micro-batch on the same sequences (`micro_batch_tokens`);
    `ranks`: context-parallel ranks that split every call, each holding its share of a token's graph and of the path's
    K/V but the call's gathered K/V whole: the budget, per rank, then holds nearly that many times more of the walk's
    tokens; `path_ranks`: ranks the path's K/V store is sharded over (1: each holds it whole); `side_by_side`: the
    scans a hybrid's ranks split (treerl.engine.state_passing.side_by_side_scans), whose pieces hold more graph a
    token on a rank after the first (None: the mixers run in turn, or none)."""
    one_path = int(ONE_PATH_SLACK * largest_node)
    if budget_tokens is not None:
        return budget_tokens
    if budget_bytes is None and memory == "one-path":
        return one_path
    per_token = graph_bytes(model).per_token
    budget = budget_bytes if budget_bytes is not None else micro_batch * per_token  # what flat holds
    if ranks > 1:  # a rank's share of a token's graph (as a later piece holds it) and the call's gathered K and V
        per_rank = per_token if side_by_side is None else max(per_token, graph_bytes(model, side_by_side).per_token)
        held = per_rank / ranks + path_bytes_per_token(model) / 2  # K and V, no gradients
    else:  # a token's graph, and its unit's K/V gradient buffers
        held = per_token + unit_grad_bytes_per_token(model)
    tokens = (budget - -(-longest_path // path_ranks) * path_bytes_per_token(model)) // held
    return int(tokens) if budget_bytes is not None else max(int(tokens), one_path)


def graph_bytes(model: PreTrainedModel, side_by_side: frozenset[tuple[str, str]] | None = None) -> GraphBytes:
    """What autograd saves per token in a forward of `model` as configured now (dtype, autocast, checkpointing,
    adapters), measured once by probe forwards and cached per model and autocast state; `side_by_side`: as a
    context-parallel rank after the first runs its mixers' pieces (these scans split, `LaterPiece`).

    A model whose mixers pad rows to a chunk of C tokens is probed with C tokens (no padding) and with one (C - 1
    of padding): bytes(C) = C * (token + padded), bytes(1) = token + C * padded."""
    device = model.get_input_embeddings().weight.device
    key = _probe_key(model, side_by_side)
    cache = _probed.setdefault(model, {})
    if key not in cache:
        chunk = find_mixers(model).chunk
        whole = _probe(model, device, PROBE_TOKENS if chunk == 1 else chunk, side_by_side)
        if not whole:
            cache[key] = GraphBytes(_estimate(model))
        elif chunk == 1:
            cache[key] = GraphBytes(math.ceil(whole / PROBE_TOKENS))
        else:
            one = _probe(model, device, 1, side_by_side)
            token = max(0.0, (whole - one) / (chunk - 1))
            padded = max(0.0, (one - token) / chunk)
            cache[key] = GraphBytes(math.ceil(token), math.ceil(padded), chunk)
    return cache[key]


def agree_graph_bytes(model: PreTrainedModel, largest: Callable[[list[int]], list[int]],
                      side_by_side: frozenset[tuple[str, str]] | None = None) -> None:
    """Hold `graph_bytes` (and, for mixers side by side, a later piece's) to the largest that any of several processes
    measured (`largest`: a max over them), so that processes that must walk the same plan (context-parallel ranks)
    plan with the same numbers: a probe's bytes can differ by a few storages from process to process."""
    for scans in (None, side_by_side) if side_by_side is not None else (None,):
        measured = graph_bytes(model, scans)
        token, padded = largest([measured.token, measured.padded])
        _probed[model][_probe_key(model, scans)] = GraphBytes(token, padded, measured.chunk)


def _probe_key(model: PreTrainedModel, side_by_side: frozenset[tuple[str, str]] | None = None) -> tuple:
    """What a probe's bytes depend on besides the model: autocast and its dtype, the trainable parameters, and
    whether its mixers run as a later piece."""
    device = model.get_input_embeddings().weight.device
    autocast = torch.is_autocast_enabled(device.type)
    return (autocast, torch.get_autocast_dtype(device.type) if autocast else None, _trainable(model),
            side_by_side is not None)


def path_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes one path token costs in the K/V store: keys and values of every attention call of a forward, and their
    gradients."""
    return 2 * _kv_elements(model) * _compute_dtype(model).itemsize


def unit_grad_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes of a unit token's K/V gradient buffers (float32 at least), where its descendants' gradients add up: held
    beside the unit's graph, which flat's micro-batch does not hold."""
    return _kv_elements(model) * max(_compute_dtype(model).itemsize, 4)


def _kv_elements(model: PreTrainedModel) -> int:
    """Key and value elements of one token over every attention call of a forward (a layer may attend more than once:
    a slot each, `attention_slots`)."""
    g = model_geometry(model.config)
    layers = attention_slots(model) or len(attention_layers(model, find_mixers(model).mixer_classes)) or g.layers or 1
    return 2 * layers * g.kv_heads * g.head_dim


def _probe(model: PreTrainedModel, device: torch.device, tokens: int,
           side_by_side: frozenset[tuple[str, str]] | None = None) -> int:
    """Bytes of the tensors autograd saves in a forward of `tokens` tokens (weights excluded; 0: no graph); with
    `side_by_side`, as a context-parallel rank after the first runs it: through a call's cache, its scans split."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if not (base.requires_grad and base.is_leaf):  # a weight (also FSDP2's gathered copy) is no activation
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    vocab = model.get_input_embeddings().num_embeddings
    inputs = {"input_ids": torch.arange(tokens, device=device)[None] % vocab}
    pieces = contextlib.ExitStack()
    if side_by_side is not None:
        mixers = find_mixers(model)
        inputs.update({mixers.cache_kwarg: mixers.new_cache(None, 1, 0, device=device), "use_cache": True})
        pieces.enter_context(continued_scans(mixers.scans))
        pieces.enter_context(split_scans(LaterPiece(), side_by_side))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), pieces:
            hidden = final_hidden(model, **inputs)
    except Exception:  # noqa: BLE001 - a model whose forward needs more than ids: the geometric estimate instead
        return 0
    if not hidden.requires_grad:  # nothing trainable: no graph, so no bytes to measure
        return 0
    return sum(saved.values()) + hidden.nbytes


def _estimate(model: PreTrainedModel) -> int:
    """A geometric estimate of the probe's figure, for a model with nothing trainable or that the probe cannot run."""
    g = model_geometry(model.config)
    per_layer = 3 * g.hidden + 5 * g.heads * g.head_dim + 4 * g.kv_heads * g.head_dim + 4 * g.ffn
    return ((g.layers or 1) * per_layer + 2 * g.hidden) * _compute_dtype(model).itemsize


def _compute_dtype(model: PreTrainedModel) -> torch.dtype:
    """The dtype activations have: autocast's where it is on, else the parameters'."""
    device = model.get_input_embeddings().weight.device
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(model.parameters()).dtype


def _trainable(model: PreTrainedModel) -> int:
    """How many parameter tensors are trainable (adapters added, a base frozen: another probe)."""
    return sum(p.requires_grad for p in model.parameters())

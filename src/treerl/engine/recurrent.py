"""How a recurrent state travels through the tree, for models whose token mixers are not all attention.

Step 5 (docs/architecture.md): a hybrid model's recurrent state, handed from each node to its children.

Hybrid models (Qwen3.5 / Qwen3-Next's Gated DeltaNet, Kimi Linear's KDA, the Mamba2 hybrids, Mamba / Jamba / Zamba's
selective scan, LFM2's short convolutions, MiniMax's lightning attention) carry a fixed-size state along the sequence
beside attention's growing K/V. In the tree a node starts from its parent's final state and hands its own final state
to each of its children, exactly as its K/V are what they attend to; on the way back up it receives the sum of its
children's gradients with respect to that state and returns the gradient with respect to its own initial
state. The state enters a call as a detached leaf with `requires_grad`, like the path's K/V.

treerl does not re-write the layers: each reads and writes its state through transformers' cache interface
(`get_conv_state` / `update_conv_state`, `get_recurrent_state` / `update_recurrent_state`,
`get_linear_cache` / `set_linear_cache`), and `TreeStateCache` answers those calls for one model call of
the DFS walk: it hands out the parent's final state and keeps each layer's final state *by reference*, so
autograd connects them (transformers' own caches copy states in place, which breaks backward through
them). A layer's one-token step writes its state in place (`state.copy_(new)`); the state treerl hands
it records that write instead of doing it (`_HandedState`). A Mamba layer's scan starts from zero whatever the cache
holds: its state goes to the scan, which treerl continues from it (treerl.engine.selective_scan). DeepSeek-V4's
compressed attention keeps its compressed entries, open window and overlap slice in per-layer cache layers: a node
hands them on as states too (`CompressionState`), and its attention reads the entries appended to its keys
(`compressed_entries`).

`MIXERS` is the one table of token mixers treerl knows: how each one's state is read, handed on and given
its gradient, or why it is refused. A mixer the table does not know is refused before compute, naming
the layer.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer

from treerl.attention import TreeCall, UnsupportedModel
from treerl.engine import selective_scan
from treerl.engine.selective_scan import ScanStart
from treerl.engine.support import decoder_module, model_name, text_modules

StateKey = tuple[int, str, int]  # (layer index, "conv" | "recurrent" | "linear", state index)


@dataclass(frozen=True)
class MixerKind:
    """One kind of token mixer with a state: what it carries and how it reads and hands it on."""

    name: str
    classes: tuple[str, ...]  # transformers module classes of this kind
    state: str  # what travels from a node to its children
    entry: str  # the layer's own entry points the state goes through
    refused: str | None = None  # why the tree engines cannot reproduce it (None: exact)
    cache_class: str | None = None  # a cache class the model insists on (its module's attribute name)
    in_attention: bool = False  # inside an attention layer (an indexer, ZAYA's convolutions): its attention is routed
    indexer: bool = False  # keeps each token's indexer keys on the path (`update_indexer`) and reads the causal mask
    chunk: int | str = 1  # its torch path pads each row to a multiple of this (or of the module attribute it names)
    scan: str | None = None  # its module's function that scans every multi-token call from a zero state: continued
    # from the parent's state by treerl (treerl.engine.selective_scan)
    compressor: bool = False  # appends compressed entries of the path to its attention's keys (`CompressionState`)
    side_by_side: str | None = None  # under context parallelism its pieces can run on every rank at once: its
    # convolution window goes to the next rank when its inputs are projected ("window": all it keeps), and its scan
    # is corrected by the earlier pieces' states after: one of treerl.engine.parallel_scan.LINEAR_SCANS ("scan") or
    # the selective scan treerl continues ("selective", treerl.engine.selective_scan)


# DeepSeek sparse attention's indexer (DeepSeek-V3.2) and the models that ship it under their own class names: GLM-DSA,
# A.X K2, dots3-note, HY-V4. Each ranks the call's whole key row (see WHOLE_ROW_TOPK_INDEXERS).
_DSA_INDEXERS = ("DeepseekV32Indexer", "GlmMoeDsaIndexer", "AXK2Indexer", "Dots3NoteTextIndexer", "HYV4Indexer")
_CACHE = "cache `get_conv_state` / `update_conv_state` and `get_recurrent_state` / `update_recurrent_state`"
MIXERS: tuple[MixerKind, ...] = (
    MixerKind("Gated DeltaNet", ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                                 "Qwen4ExpTextGatedDeltaNet", "OlmoHybridGatedDeltaNet", "BailingHybridDeltaAttention",
                                 "LaraMiniGatedDeltaNet"),
              "the short-convolution window and the delta-rule state", _CACHE, chunk=64, side_by_side="scan"),
    MixerKind("KDA (Kimi delta attention)", ("KimiLinearDeltaAttention",),
              "the short-convolution window and the delta-rule state (transformers keeps it in float32)", _CACHE,
              chunk=64, side_by_side="scan"),
    MixerKind("Mamba2", ("Mamba2Mixer", "NemotronHMamba2Mixer", "BambaMixer", "FalconH1Mixer", "Zamba2MambaMixer",
                         "GraniteMoeHybridMambaLayer"),
              "the convolution window and the SSM state", _CACHE, chunk="chunk_size", side_by_side="scan"),
    MixerKind("short convolution", ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv", "InklingShortConvolution",
                                    "Inkling2ShortConvolution", "Inkling2DynamicShortConvolution",
                                    "Inkling2LoopShortConvolution", "Inkling2LoopDynamicShortConvolution"),
              "the convolution window", "cache `get_conv_state` / `update_conv_state`", side_by_side="window"),
    MixerKind("lightning attention", ("MiniMaxLightningAttention",), "the decayed K^T V state",
              "cache `get_linear_cache` / `set_linear_cache`", cache_class="MiniMaxCache"),
    MixerKind("sparse-attention indexer", (*_DSA_INDEXERS, "Qwen4ExpTextQSAIndexer"),
              "the indexer keys of every earlier token (one per token, kept on the path like K/V; no gradient: the "
              "indexer runs without one), so a query's keys are chosen among its own ancestors",
              "cache `update_indexer`, and the causal mask over [path | row] it chooses under", in_attention=True,
              indexer=True),
    MixerKind("convolutional attention projection", ("ZayaCCAProjection",),
              "the queries' and keys' convolution window and the previous token's delayed value projection", _CACHE,
              in_attention=True),
    MixerKind("compressed attention", ("DeepseekV4HCACompressor", "DeepseekV4CSACompressor"),
              "the path's compressed entries (one per complete window of m tokens, with a gradient, like K/V), the "
              "unfinished window's raw K/V and gates, the previous window's overlap slice (CSA) and the indexer's "
              "compressed keys, kept alike",
              "the cache layer's `store_compression_weights` / `update_overlap_state` / `update_compressor_states` "
              "(transformers' V4 cache layers), and the entries appended to its attention's keys", in_attention=True,
              compressor=True),
    MixerKind("Mamba (selective scan)", ("MambaMixer", "FalconMambaMixer", "ZambaMambaMixer", "JambaMambaMixer"),
              "the convolution window and the SSM state (the scan, which starts from zero, continued from it)",
              "cache `get_conv_state` / `update_conv_state`, `get_recurrent_state` / `update_recurrent_state`, and the "
              "module's `mamba_selective_scan`", scan="mamba_selective_scan", side_by_side="selective"),
    MixerKind("RWKV time and channel mixing", ("RwkvSelfAttention", "RwkvFeedForward"),
              "the token shift and the WKV numerator, denominator and maximum", "RwkvModel's `state` list",
              refused="RWKV keeps its state (the token shift, the WKV numerator, denominator and maximum) in the "
                      "`state` list RwkvModel takes and returns, written in place, not in transformers' cache "
                      "interface, through which treerl hands a tree node's state to its children (use FlatEngine)"),
    MixerKind("mLSTM", ("xLSTMLayer",), "the matrix memory, normaliser and stabiliser", "xLSTMCache's `rnn_state`",
              refused="the mLSTM keeps its state (matrix memory, normaliser, stabiliser) in xLSTMCache's `rnn_state`, "
                      "copied in place, not in transformers' cache interface, through which treerl hands a tree "
                      "node's state to its children (use FlatEngine)"),
    MixerKind("RG-LRU (recurrent block)", ("RecurrentGemmaRecurrentBlock",), "the convolution window and the RG-LRU "
              "state", "module attributes `conv1d_state`, `rg_lru.recurrent_states`",
              refused="the recurrent block keeps its convolution window and RG-LRU state in module attributes, not in "
                      "transformers' cache interface, and a multi-token call convolves from zeros whatever they hold, "
                      "so a tree node cannot continue its parent's state (use FlatEngine)"),
)
_BY_CLASS = {cls: kind for kind in MIXERS for cls in kind.classes}


def mixer_kind(module: torch.nn.Module) -> MixerKind | None:
    """The table's entry for a module (None: not a mixer it knows)."""
    return _BY_CLASS.get(type(module).__name__)


# Indexers whose top-k ranks the call's whole key row (DeepSeek sparse attention: a query's earlier keys, then -inf up
# to the call's width; DeepSeek-V4's, the call's compressed entries), so which of several keys tied at the k-th score
# torch.topk returns depends on that width on CPU; every engine takes the earliest (`EarliestTies`: DfsEngine through
# the keys it hands the indexer, FlatEngine through `earliest_index_ties`). Qwen4-Exp's ranks only the query's own
# complete key blocks: the same row in the tree as in one flat call, so its choice is the flat one already.
WHOLE_ROW_TOPK_INDEXERS = (*_DSA_INDEXERS, "DeepseekV4Indexer")  # V4's ranks the call's compressed entries
# Attention modules whose own code keeps each query's top keys by a learned per-key score over the whole key row, and
# the method (and its score argument) that ranks them: Doge's dynamic mask (keep_window_size keys; repeated tokens tie
# at its first layer). Held to the earliest of tied keys in every engine, like the indexers (`earliest_mask_ties`).
TOPK_MASK_METHODS = {"DogeAttention": ("prepare_dynamic_mask", "dt_states")}

# Class-name words of modules that carry state along the sequence outside attention, in any case (RWKV's are "Rwkv...").
_STATEFUL = re.compile(r"Mamba|RWKV|Recurrent|DeltaNet|DeltaAttention|ShortConv|xLSTM|Mixer|Lightning|Rglru",
                       re.IGNORECASE)
_NORM = re.compile(r"Norm(Gated)?$")  # Mamba2RMSNorm: a norm named after its model, no state
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


@dataclass(frozen=True)
class Mixers:
    """The stateful token mixers of a model's text body: layer index -> kind, and the cache class it needs."""

    layers: dict[int, MixerKind]
    cache_class: type[Cache]
    cache_kwarg: str  # the body's name for its cache (`cache_kwarg`)
    mixer_classes: frozenset[str] = frozenset()  # the token mixers' classes (their layers run no attention)
    indexed: bool = False  # an attention layer picks its keys with an indexer (it reads a causal mask)
    chunk: int = 1  # the largest multiple a mixer's torch path pads each row to (1: none pads)
    whole_row_topk: frozenset[int] = frozenset()  # layers whose indexer ranks the call's whole key row (ties: earliest)
    scan_layers: frozenset[int] = frozenset()  # layers whose zero-start scan treerl continues (MixerKind.scan)
    scans: frozenset[tuple[str, str]] = frozenset()  # (module, function) of those scans
    compression: dict[int, int] = field(default_factory=dict)  # compressed-attention layer -> its compress rate m

    def __bool__(self) -> bool:
        return bool(self.layers)

    def new_cache(self, initial: dict[StateKey, torch.Tensor] | None, rows: int, past: int,
                  index_path: PathIndexKeys | None = None, device: torch.device | str = "cpu",
                  attention: TreeCall | None = None) -> TreeStateCache:
        """A call's TreeStateCache for this model: its class, the scans it continues, its compressed attention, and
        (`attention`) the call whose path K/V it returns to layers that attend in their own code."""
        return self.cache_class(initial, rows, past, index_path, device, self.scan_layers, self.compression, attention)


def find_mixers(model: PreTrainedModel) -> Mixers:
    """The model's stateful token mixers; refuses one the table does not know or cannot reproduce, naming it."""
    body = decoder_module(model)
    layers: dict[int, MixerKind] = {}
    known: list[str] = []  # module paths of known mixers (what is inside one is part of it)
    classes: set[str] = set()
    indexed = False
    whole_row_topk: set[int] = set()
    scan_layers: set[int] = set()
    scans: set[tuple[str, str]] = set()
    chunk = 1
    compression: dict[int, int] = {}
    base: type[Cache] = DynamicCache
    modules = text_modules(model)
    for path, module in modules:
        kind = _BY_CLASS.get(type(module).__name__)
        if kind is None:
            continue
        if kind.refused is not None:
            raise UnsupportedModel(f"{model_name(model)}: {path} ({type(module).__name__}, {kind.name}): {kind.refused}")
        index = _layer_index(modules, path, module) if kind.in_attention else getattr(module, "layer_idx", None)
        if not isinstance(index, int):
            raise UnsupportedModel(f"{model_name(model)}: {path} ({type(module).__name__}) has no layer_idx; treerl "
                                   "cannot tell which layer's state it reads")
        layers.setdefault(index, kind)
        if kind.indexer:
            indexed = True
            if type(module).__name__ in WHOLE_ROW_TOPK_INDEXERS:
                whole_row_topk.add(index)
            continue
        layers[index] = kind  # a layer's token mixer names it
        if not kind.in_attention:  # its layer runs no attention
            classes.add(type(module).__name__)
        known.append(path + ".")
        chunk = max(chunk, int(getattr(module, kind.chunk, 1) if isinstance(kind.chunk, str) else kind.chunk))
        if kind.cache_class is not None:
            base = getattr(sys.modules[type(module).__module__], kind.cache_class)
        if kind.scan is not None:
            scan_layers.add(index)
            scans.add((type(module).__module__, kind.scan))
        if kind.compressor:
            compression[index] = int(module.compress_rate)
    _refuse_unknown_mixers(model, known, set(layers), indexed)
    return Mixers(layers, _cache_class(base), cache_kwarg(body), frozenset(classes), indexed, chunk,
                  whole_row_topk=frozenset(whole_row_topk), scan_layers=frozenset(scan_layers), scans=frozenset(scans),
                  compression=compression)


def _layer_index(modules: list[tuple[str, torch.nn.Module]], path: str, module: torch.nn.Module) -> int | None:
    """A mixer's layer: its own layer_idx, else that of the innermost module around it that has one (DeepSeek-V4's
    compressor is told its layer by the attention that holds it)."""
    by_path = dict(modules)
    while True:
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) or not path:
            return index
        path = path.rpartition(".")[0]
        module = by_path[path]


def cache_kwarg(module: torch.nn.Module) -> str:
    """The name a model takes its cache under: `cache` (transformers >= 5.24), else `past_key_values`, else
    `cache_params` (Mamba2 before 5.24). A cache under a name the model ignores would leave every state unread.
    A wrapper that passes its kwargs on (peft) is read through to the model it wraps."""
    base = getattr(module, "get_base_model", None)
    parameters = _parameters(base() if callable(base) else module)
    return next((name for name in ("cache", "past_key_values", "cache_params") if name in parameters),
                "past_key_values")


def _refuse_unknown_mixers(model: PreTrainedModel, known: list[str], mixer_layers: set[int], indexed: bool) -> None:
    """A module that looks stateful outside every known mixer, or a non-attention layer type without one.

    The body itself is never the one named (RecurrentGemmaModel is named for its family, not a mixer): the first
    module below it that looks stateful is."""
    for path, module in text_modules(model):
        name = type(module).__name__
        inside_or_around = any((path + ".").startswith(k) or k.startswith(path + ".") for k in known)  # or its block
        if path and _looks_stateful(module) and not inside_or_around:
            raise UnsupportedModel(
                f"{model_name(model)}: {path} ({name}) carries state across tokens outside attention, and treerl's "
                "table of token mixers (treerl.engine.recurrent.MIXERS) does not know how to hand it from a tree node "
                "to its children (use FlatEngine)"
            )
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    allowed = _ATTENTION_LAYER_TYPES | {"mlp", "moe", "hybrid"} | ({"indexed_attention"} if indexed else set())
    for index, kind in enumerate(layer_types):
        if kind not in allowed and index not in mixer_layers:
            raise UnsupportedModel(
                f"{model_name(model)}: layer {index} is of type {kind!r}, neither softmax attention nor a token mixer "
                "in treerl's table (treerl.engine.recurrent.MIXERS) (use FlatEngine)"
            )


def _looks_stateful(module: torch.nn.Module) -> bool:
    """A class named for a state carried along the sequence (not a norm named after its model), or a Conv1d."""
    name = type(module).__name__
    return bool(_STATEFUL.search(name) and not _NORM.search(name)) or isinstance(module, torch.nn.Conv1d)


def _parameters(module: torch.nn.Module) -> set[str]:
    return set(inspect.signature(module.forward).parameters)


_CACHE_CLASSES: dict[type, type] = {}


def _cache_class(base: type[Cache]) -> type[Cache]:
    """TreeStateCache, also an instance of the cache class a model insists on (MiniMax checks its own)."""
    if base is DynamicCache:
        return TreeStateCache
    if base not in _CACHE_CLASSES:
        _CACHE_CLASSES[base] = type(f"TreeState{base.__name__}", (TreeStateCache, base), {})
    return _CACHE_CLASSES[base]


class _LayerStates(list):
    """Stands in for a cache's (empty) list of layers, where a model keeps per-layer state: a compressed-attention
    layer's `CompressionState`, else the positions of the tokens before this call (Qwen4-Exp's indexer rotates its
    pooled keys by them): on the tree, the path's positions 0 .. past - 1."""

    def __init__(self, rows: int, past: int, device: torch.device | str,
                 compression: dict[int, CompressionState] | None = None):
        super().__init__()
        self.compression = compression or {}
        self.indexer_position_ids = None
        if past:
            self.indexer_position_ids = torch.arange(past, device=device).expand(3, rows, past)

    def __getitem__(self, layer):
        if isinstance(layer, int):
            return self.compression.get(layer, self)
        return super().__getitem__(layer)


class CompressionState:
    """A DeepSeek-V4 compressed-attention layer's cache layer for one call of the walk: the interface of transformers'
    DeepseekV4HCACache / DeepseekV4CSACache (`store_compression_weights`, `update_overlap_state`,
    `update_compressor_states`), answered from the parent's final states and keeping this call's as its own.

    For each of its compressors ("compressor", and a CSA layer's "indexer") a node hands its children the path's
    compressed entries (one per complete window of m tokens), the raw K/V and gates of the window still open at its
    end, and (CSA) the first half of the last complete window's projections, which the next window's entry overlaps.
    Windows are aligned to absolute positions: the path holds `past // m` complete windows, its open window starts at
    `past // m * m`. All of them enter as the cache's states (leaves with `requires_grad`), so their gradient travels
    back up the tree like K/V's."""

    def __init__(self, cache: TreeStateCache, layer: int, rate: int):
        self.cache, self.layer, self.rate = cache, layer, rate

    def _key(self, name: str, part: str) -> StateKey:
        return self.layer, f"{name} {part}", 0

    def store_compression_weights(self, name: str, kv: torch.Tensor,
                                  gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The open window's K/V and gates before this call's; the complete windows to compress and where the first
        starts; keep what is left open for the children."""
        kv, gate = self._behind_open_window(name, "buffer kv", kv), self._behind_open_window(name, "buffer gate", gate)
        usable = kv.shape[1] // self.rate * self.rate
        self.cache._keep(self._key(name, "buffer kv"), kv[:, usable:])
        self.cache._keep(self._key(name, "buffer gate"), gate[:, usable:])
        return kv[:, :usable], gate[:, :usable], self.cache.past // self.rate * self.rate

    def _behind_open_window(self, name: str, part: str, new: torch.Tensor) -> torch.Tensor:
        """This call's projections behind the parent's open window's (the path's tokens since its last full window)."""
        start = self.cache._start(self._key(name, part))
        return new if start is None else torch.cat([start.to(new.dtype), new], dim=1)

    def update_overlap_state(self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor,
                             head_dim: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The path's last complete window's overlap slice (None at the root); keep this call's last one."""
        prior = self.cache._start(self._key(name, "overlap kv")), self.cache._start(self._key(name, "overlap gate"))
        self.cache._keep(self._key(name, "overlap kv"), chunk_kv[:, -1, :, :head_dim])
        self.cache._keep(self._key(name, "overlap gate"), chunk_gate[:, -1, :, :head_dim])
        return prior

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """The path's compressed entries, then this call's; all of them are what the children continue. The indexer's
        keys choose, of entries tied at the k-th score, the earliest, as in one flat call (`EarliestTies`)."""
        start = self.cache._start(self._key(name, "entries"))
        entries = compressed if start is None else torch.cat([start.to(compressed.dtype), compressed], dim=1)
        if entries.shape[1]:  # none yet (no window closed on the path): nothing to hand on, nor a gradient to take
            self.cache._keep(self._key(name, "entries"), entries)
        return entries.as_subclass(EarliestTies) if name == "indexer" else entries

    def finish(self) -> None:
        """A state this call did not renew (no window closed: the overlap slice) is handed on as the parent's."""
        for key in self.cache.initial or {}:
            if key[0] == self.layer and key not in self.cache.final:
                self.cache._keep(key, self.cache._start(key))


class _HandedState(torch.Tensor):
    """A state handed to a layer: `copy_` into it (a one-token step updating the state in place) is recorded
    as the layer's new state instead of writing into the parent's state; every other op runs as usual."""

    written: torch.Tensor | None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and isinstance(args[0], _HandedState):
            args[0].written = args[1]
            return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def earliest_topk(scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
                  sorted: bool = True) -> torch.return_types.topk:
    """torch.topk that takes, of the keys tied at the k-th score, the earliest: the same keys whatever the row's width.

    On CPU torch.topk picks among such ties by the length of the row, which in the tree ([path | row]) is not the
    length of one flat call; CUDA's takes the earliest. Tied means equal up to rounding (`tie_tolerance`): keys that
    are equal in exact arithmetic (a token repeated at the start of a sequence gives Doge's first layers equal scores)
    come out a few units of rounding apart, in an order that changes with the shapes of the computation. Keys clearly
    above the k-th score are all taken; the rest of the k are the earliest keys within the tolerance of it. Without a
    tie at the k-th score every top-k is this one."""
    width = scores.shape[dim]
    top = torch.topk(scores, min(k + 1, width), dim=dim, largest=largest, sorted=True)
    if 0 < k < width:
        kth, after = top.values.narrow(dim, k - 1, 1), top.values.narrow(dim, k, 1)
        tolerance = tie_tolerance(kth)
        if bool((((kth - after).abs() <= tolerance) & kth.isfinite()).any()):  # a key left out ties with one taken
            sign = 1 if largest else -1
            margin = (scores - kth) * sign
            rank = torch.where(margin > tolerance, 2, torch.where(margin.abs() <= tolerance, 1, 0))
            chosen = torch.sort(rank, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
            values = scores.gather(dim, chosen)
            if sorted:  # by score, the earlier of equal scores first
                by_score = torch.sort(values, dim=dim, descending=largest, stable=True).indices
                chosen, values = chosen.gather(dim, by_score), values.gather(dim, by_score)
            return torch.return_types.topk((values, chosen))
    return torch.return_types.topk((top.values.narrow(dim, 0, k), top.indices.narrow(dim, 0, k)))


def tie_tolerance(kth: torch.Tensor) -> torch.Tensor:
    """How far apart two scores equal in exact arithmetic may come out: 256 units of rounding of the k-th score in
    float32 and float64 (scores computed through a few layers in different shapes); exact equality in 16-bit types,
    whose rounding unit is coarser than the gaps between distinct scores."""
    if kth.dtype not in (torch.float32, torch.float64):
        return torch.zeros_like(kth)
    return 256 * torch.finfo(kth.dtype).eps * kth.abs()


_TOPK = (torch.Tensor.topk, torch.topk)


class EarliestTies(torch.Tensor):
    """Indexer keys whose scores choose, among keys tied at the k-th score, the earliest (`earliest_topk`).

    The indexer's ops on them (scores, ReLU, head weights, the causal mask) keep the class, so its own
    `index_scores.topk(...)` lands here: the tree's choice does not depend on the width of its call."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _TOPK:
            with torch._C.DisableTorchFunctionSubclass():
                return earliest_topk(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


_EARLIEST_TIES: contextvars.ContextVar[bool] = contextvars.ContextVar("treerl_earliest_index_ties", default=False)


@contextlib.contextmanager
def earliest_index_ties(model: torch.nn.Module) -> Iterator[None]:
    """The model's own forward with the tree's rule for its whole-row indexers (WHOLE_ROW_TOPK_INDEXERS): of keys tied
    at the k-th index score, the earliest, as DfsEngine takes them, whatever the width of the call.

    Scoped to this block and this context (thread or task): each indexer's hidden states enter it as `EarliestTies`,
    so its own `index_scores.topk(...)` takes the earliest; the model and torch are otherwise untouched."""
    indexers = [m for m in model.modules() if type(m).__name__ in WHOLE_ROW_TOPK_INDEXERS]
    hooks = [m.register_forward_pre_hook(_earliest_ties_inputs, with_kwargs=True) for m in indexers]
    try:
        with earliest_mask_ties(model):
            yield
    finally:
        for hook in hooks:
            hook.remove()


_MASK_TIES_LOCK = threading.Lock()
_MASK_TIES_USERS: dict[int, int] = {}  # id(module) -> blocks that hold its ranking method to the earliest of ties


@contextlib.contextmanager
def earliest_mask_ties(model: torch.nn.Module) -> Iterator[None]:
    """The ranking methods of TOPK_MASK_METHODS take, of keys tied at the k-th score, the earliest while the block runs
    in this context: the module's method is wrapped (for this model only, counted across threads) so that its score
    argument enters as `EarliestTies` and its mask leaves as a plain tensor."""
    modules = [m for m in model.modules() if type(m).__name__ in TOPK_MASK_METHODS]
    with _MASK_TIES_LOCK:
        for module in modules:
            if _MASK_TIES_USERS.get(id(module), 0) == 0:
                name, argument = TOPK_MASK_METHODS[type(module).__name__]
                setattr(module, name, _earliest_ties_method(getattr(type(module), name).__get__(module), argument))
            _MASK_TIES_USERS[id(module)] = _MASK_TIES_USERS.get(id(module), 0) + 1
    token = _EARLIEST_TIES.set(True)
    try:
        yield
    finally:
        _EARLIEST_TIES.reset(token)
        with _MASK_TIES_LOCK:
            for module in modules:
                _MASK_TIES_USERS[id(module)] -= 1
                if _MASK_TIES_USERS[id(module)] == 0:
                    del _MASK_TIES_USERS[id(module)]
                    delattr(module, TOPK_MASK_METHODS[type(module).__name__][0])


def _earliest_ties_method(method, argument: str):
    def ranked(*args, **kwargs):
        if not _EARLIEST_TIES.get() or not isinstance(kwargs.get(argument), torch.Tensor):
            return method(*args, **kwargs)
        result = method(*args, **{**kwargs, argument: kwargs[argument].as_subclass(EarliestTies)})
        return result.as_subclass(torch.Tensor)
    return ranked


def _earliest_ties_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """An indexer's hidden states as EarliestTies (every index score derives from them), in `earliest_index_ties`."""
    if not _EARLIEST_TIES.get():
        return None
    if args and isinstance(args[0], torch.Tensor):
        return (args[0].as_subclass(EarliestTies), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"].as_subclass(EarliestTies)}
    raise UnsupportedModel(f"{type(module).__name__}: an indexer called without its hidden states; treerl cannot "
                           "hold its top-k to the earliest of tied keys")


@contextlib.contextmanager
def compressed_entries(model: torch.nn.Module) -> Iterator[None]:
    """While the block runs, each compressor of a compressed-attention layer (MixerKind.compressor) reports to its
    call's TreeStateCache what it appends to its attention's keys: how many entries, and their additive bias (each
    query's causal and top-k choice among them; None: every one visible), which treerl's attention applies to them."""
    compressors = [m for _, m in text_modules(model) if getattr(_BY_CLASS.get(type(m).__name__), "compressor", False)]
    hooks = [m.register_forward_hook(_report_appended, with_kwargs=True) for m in compressors]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _report_appended(module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> None:
    """A compressor's (entries, bias) into its call's cache, under its layer (`forward(hidden, q, positions, cache,
    layer_idx)`)."""
    cache = args[3] if len(args) > 3 else kwargs.get("cache")
    layer = args[4] if len(args) > 4 else kwargs.get("layer_idx")
    if isinstance(cache, TreeStateCache):
        entries, bias = output
        cache.appended[layer] = (entries.shape[2], bias)


class TreeStateCache(DynamicCache):
    """transformers' cache interface for one call of the DFS walk: every row starts from the parent's final
    state (`initial`, None at the root) and each layer's final state is kept by reference (`final`).

    Attention layers get their own K/V back unchanged from `update`: treerl's attention adds the path's. Layers that
    attend in their own code over what `update` returns (`attention`: the call) get [path | own] K/V.
    """

    def __init__(self, initial: dict[StateKey, torch.Tensor] | None, rows: int, past: int,
                 index_path: PathIndexKeys | None = None, device: torch.device | str = "cpu",
                 scan_layers: frozenset[int] = frozenset(), compression: dict[int, int] | None = None,
                 attention: TreeCall | None = None):
        Cache.__init__(self, layers=[])
        self.initial, self.rows, self.past, self.index_path = initial, rows, past, index_path
        self.attention = attention
        self.scan_layers = scan_layers  # layers whose scan continues the state (Mixers.scan_layers)
        self.index_keys: dict[int, torch.Tensor] = {}  # layer -> this call's indexer keys [rows, width, D]
        # compressed-attention layer -> (entries its compressor appended to the attention's keys, their additive bias)
        self.appended: dict[int, tuple[int, torch.Tensor | None]] = {}
        compressed = {layer: CompressionState(self, layer, rate) for layer, rate in (compression or {}).items()}
        self.layers = _LayerStates(rows, past, device, compressed)  # Qwen4-Exp's indexer reads the path's positions
        self.final: dict[StateKey, torch.Tensor] = {}
        self.handed: dict[StateKey, _HandedState] = {}
        self.read: set[StateKey] = set()
        self.replaying = False  # set after the forward: gradient checkpointing's recomputation writes nothing
        # under context parallelism with mixers side by side: the ranks before and after this one's pieces, which
        # convolution windows come from and go to (treerl.engine.state_passing.StatePassing)
        self.neighbours = None

    # -- attention layers: their K/V go to treerl's attention as they are, or over the path's to their own code
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.attention is not None:
            return self.attention.keys_over_path(key_states, value_states, layer_idx)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.past + query_length, 0

    def __len__(self) -> int:
        return 0

    # -- recurrent layers
    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.initial is not None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def _start(self, key: StateKey, read: bool = True) -> torch.Tensor | None:
        """The parent's final state for this key, one copy per row (a view: the gradient sums over rows)."""
        if self.initial is None or key not in self.initial:
            return None
        if read:
            self.read.add(key)
        state = self.initial[key]
        return state.expand(self.rows, *state.shape[1:])

    def _hand(self, key: StateKey) -> torch.Tensor | None:
        start = self._start(key)
        if start is None:
            return None
        handed = start.as_subclass(_HandedState)
        handed.written = None
        self.handed[key] = handed
        return handed

    def _keep(self, key: StateKey, state: torch.Tensor) -> None:
        if not self.replaying:
            self.final[key] = state

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._hand((layer_idx, "conv", state_idx))

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """The new inputs behind the parent's window (what the causal convolution reads); keep the new window."""
        key = (layer_idx, "conv", state_idx)
        start = self._start(key)
        if start is None and self.neighbours is not None:  # the previous rank's piece's window, if there is one
            start = self.neighbours.receive_window(key)
        width = conv_kernel_size or (start.shape[-1] if start is not None else conv_states.shape[-1])
        if start is not None:
            full = torch.cat([start.to(conv_states.dtype), conv_states], dim=-1)
        elif conv_states.shape[-1] < width:
            full = torch.nn.functional.pad(conv_states, (width - conv_states.shape[-1], 0))
        else:
            full = conv_states
        self._keep(key, full[..., -width:])
        if self.neighbours is not None:  # on to the next rank's piece
            full = self.neighbours.send_window(key, full, full[..., -width:])
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The parent's final state; for a layer whose scan starts from zero, handed to the scan instead (read when
        the scan takes it), and none to the layer: its calls, one token or many, all run the continued scan."""
        key = (layer_idx, "recurrent", state_idx)
        if layer_idx in self.scan_layers:
            selective_scan.hand(ScanStart(layer_idx, self._start(key, read=False), lambda: self.read.add(key)))
            return None
        return self._hand(key)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        if layer_idx in self.scan_layers:
            selective_scan.hand(None)  # the layer's scans are done
        self._keep((layer_idx, "recurrent", state_idx), recurrent_states)
        return recurrent_states

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self._hand((layer_idx, "linear", 0))

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self._keep((layer_idx, "linear", 0), linear_cache)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """This call's indexer keys behind the path's: what each query's top-k is chosen among (ties: the earliest,
        where the indexer ranks the call's whole row)."""
        if not self.replaying:
            self.index_keys[layer_idx] = indexer_key_states
        if self.index_path is None:
            return indexer_key_states
        past = self.index_path.read(layer_idx, self.past)
        keys = indexer_key_states
        if past is not None:
            keys = torch.cat([past.expand(self.rows, -1, -1).to(keys.dtype), keys], dim=1)
        return keys.as_subclass(EarliestTies) if layer_idx in self.index_path.whole_row_topk else keys

    def finish(self) -> None:
        """After the forward: take the in-place steps' writes as final states; later calls are replays."""
        for key, handed in self.handed.items():
            if handed.written is not None and key not in self.final:
                self._keep(key, handed.written)
        for state in self.layers.compression.values():
            state.finish()
        self.replaying = True

    def check_handed_on(self, layers: dict[int, MixerKind], open_rows: list[int]) -> None:
        """Every layer read the state it was handed, and (when a row hands on its state) gave back its final one.

        A layer that skipped either would leave a node's children starting from a state that is not its
        own: refused, naming the layer, before any output or gradient of the call is used."""
        unread = sorted(set(self.initial or {}) - self.read)
        if unread:
            kind = layers.get(unread[0][0])
            raise UnsupportedModel(f"layer {unread[0][0]} ({kind.name if kind else '?'}) did not read the "
                                   f"{unread[0][1]} state handed to it, so a tree node would not continue its parent")
        if open_rows:
            for index, kind in sorted(layers.items()):
                handed_on = index in self.index_keys if kind.indexer else any(k[0] == index for k in self.final)
                if not handed_on:
                    raise UnsupportedModel(f"layer {index} ({kind.name}) gave back no final state through the cache, "
                                           "so a tree node's children could not continue it")

    def row_states(self, row: int) -> dict[StateKey, torch.Tensor]:
        """The final states of one row (`[1, ...]`), what its last node hands to its children."""
        return {key: state[row : row + 1] for key, state in self.final.items()}


def checkpointing_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The layers transformers will recompute in backward (gradient checkpointing on, training mode)."""
    if not model.training:
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def check_checkpointing(model: PreTrainedModel) -> None:
    """Reentrant checkpointing runs a layer without a graph: the state a node hands on would have none."""
    for layer in checkpointing_layers(model):
        function = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(function, "keywords", {}).get("use_reentrant", True):
            raise UnsupportedModel(
                f"{model_name(model)}: reentrant gradient checkpointing runs each layer without an autograd graph, so "
                "the recurrent state a tree node hands its children would carry no gradient back; enable it with "
                "use_reentrant=False (transformers' default)"
            )


@contextlib.contextmanager
def cache_under_checkpointing(model: PreTrainedModel) -> Iterator[None]:
    """Let checkpointed layers keep the cache (transformers drops it by default, or the replay in backward
    would write it twice): TreeStateCache ignores the replay's writes and hands it the same states."""
    layers = [layer for layer in checkpointing_layers(model) if not layer._can_checkpoint_with_cache]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


class PathIndexKeys:
    """The indexer keys of the current path's tokens, per layer, at their positions (as PathKV holds K/V).

    No gradient travels back: the indexer runs without one (its choice of keys is not differentiable)."""

    def __init__(self, capacity: int, whole_row_topk: frozenset[int] = frozenset()):
        self.capacity = capacity
        self.whole_row_topk = whole_row_topk  # layers whose top-k the tree breaks ties in (Mixers.whole_row_topk)
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [1, capacity, D]

    def read(self, layer: int, end: int) -> torch.Tensor | None:
        """Keys of positions [0, end) of the path (None when there is no path yet)."""
        if end == 0 or layer not in self.keys:
            return None
        return self.keys[layer][:, :end]

    @torch.no_grad()
    def push(self, keys: dict[int, torch.Tensor], segments: list) -> None:
        """Make these segments (rows of the flattened call, at their positions) part of the path."""
        for layer, k in keys.items():
            flat = k.reshape(-1, k.shape[-1])
            if layer not in self.keys:
                self.keys[layer] = flat.new_zeros(1, self.capacity, flat.shape[-1])
            for s in segments:
                self.keys[layer][0, s.position : s.position + s.length] = flat[s.row : s.end]


class PathStates:
    """The final states of the current path's open nodes, innermost last, and the gradient sent back to each.

    A unit reads the innermost entry as its rows' initial state (a detached leaf per call, `leaves`); after
    its backward the leaves' gradients are added to the entry; when the node's subtree is done the entry is
    popped and its gradient goes into the unit that computed the state.
    """

    def __init__(self, with_grads: bool):
        self.with_grads = with_grads
        self.states: list[dict[StateKey, torch.Tensor]] = []
        self.grads: list[dict[StateKey, torch.Tensor]] = []

    def leaves(self) -> dict[StateKey, torch.Tensor] | None:
        """The innermost node's final states as leaves of a new graph (None at the root: no state yet)."""
        if not self.states:
            return None
        if not self.with_grads or not torch.is_grad_enabled():
            return {key: state.clone() for key, state in self.states[-1].items()}  # a layer may write into it
        return {key: state.detach().requires_grad_() for key, state in self.states[-1].items()}

    def add_grads(self, leaves: dict[StateKey, torch.Tensor] | None) -> None:
        """Add the gradients a unit's backward left in its leaves to the innermost entry."""
        if leaves is None or not self.with_grads:
            return
        grads = self.grads[-1]
        for key, leaf in leaves.items():
            if leaf.grad is not None:
                grads[key] = leaf.grad if key not in grads else grads[key] + leaf.grad

    def push(self, states: dict[StateKey, torch.Tensor]) -> None:
        self.states.append({key: state.detach() for key, state in states.items()})
        self.grads.append({})

    def pop(self) -> dict[StateKey, torch.Tensor]:
        """Leave the innermost node: the gradient its children sent to its final states."""
        self.states.pop()
        return self.grads.pop()


def iter_state_grads(cache: TreeStateCache, row: int,
                     grads: dict[StateKey, torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(final state of `row`, its gradient) pairs for a backward: the children's gradient of what it handed on."""
    for key, grad in grads.items():
        state = cache.final.get(key)
        if state is None or not state.requires_grad:
            raise UnsupportedModel(f"layer {key[0]}'s {key[1]} state has no graph in its recomputation (gradient "
                                   "checkpointing recomputes it without one?); its gradient cannot reach the node")
        yield state[row : row + 1], grad.to(state.dtype)

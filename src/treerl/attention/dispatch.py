"""One attention function for the tree engines, and the model's own attention everywhere else.

Step 5 (docs/architecture.md): each layer's attention, routed per call.

An engine call routes the model's attention through treerl by handing every layer a *call*
object in the attention kwargs (`treerl_call=`). transformers passes the kwargs of a forward
down to each layer's attention function, and gradient checkpointing captures them with the
layer's inputs, so a layer recomputed during backward reads its own call, not whichever ran last.

For the duration of any engine call the model's `_attn_implementation` is `"treerl"`: the
dispatcher below. With a call it runs treerl's attention; without one (another thread using the
same model, generation, the flat reference) it runs the implementation the user chose, with the
masks that implementation expects. Engine calls are counted per model, so overlapping calls
from several threads work, and the last one to finish restores the user's setting.

Everything a layer asks of its attention arrives here as kwargs (scale, sliding window,
soft-capping, sinks, dropout, causality). `layer_attention` turns them into an
`AttentionSpec`; a kwarg treerl does not know is refused, never dropped.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from treerl.attention.kernels import AttentionSpec
from treerl.errors import UserError

ATTENTION_NAME = "treerl"
CALL_KWARG = "treerl_call"
TREE_MASK = "treerl_causal_mask"  # attribute of a mask treerl handed out (plain causal over [path | row])


class UnsupportedModel(UserError, NotImplementedError):
    """A model or setting the engines cannot reproduce exactly; raised before any output (the CLI: one line, exit 2)."""


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention must compute: its score spec and its sink logits (if any)."""

    spec: AttentionSpec
    sinks: torch.Tensor | None = None  # [heads]: one learned logit per head joins the softmax
    indices: torch.Tensor | None = None  # [rows, queries, k]: the keys a learned indexer chose (sparse attention)
    mask: torch.Tensor | None = None  # [rows, 1, queries, path + row] bool: keys a layer allowed (an indexer's choice)
    bias: torch.Tensor | None = None  # [rows, heads, queries, path + row]: added to the scores (Inkling's distances)
    appended: int = 0  # keys after the row's own that a layer appended (DeepSeek-V4's compressed entries)
    appended_bias: torch.Tensor | None = None  # [rows, 1, queries, appended]: their additive bias (None: all visible)

    @property
    def dense(self) -> bool:
        """Whether the layer asks for what only treerl's dense attention over [path | row] computes: an indexer's choice
        of keys, a bias per query and key, a sink logit per query (not one per head), or appended keys."""
        per_query_sinks = self.sinks is not None and self.sinks.dim() > 1
        chosen = self.indices is not None or self.mask is not None
        return chosen or self.bias is not None or per_query_sinks or self.appended > 0


AttentionCall = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, LayerAttention], torch.Tensor]

# kwargs a layer may pass that change nothing treerl computes (flash metadata, caching, outputs).
_IGNORED = {
    "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "cache_position",
    "use_cache", "past_key_values", "position_embeddings", "output_hidden_states", "return_dict",
    "target_dtype", "layer_idx",
}


def layer_attention(module: torch.nn.Module, query: torch.Tensor, kwargs: dict) -> LayerAttention:
    """Read every attention kwarg of a layer into a spec; refuse what treerl cannot reproduce."""
    name = type(module).__name__
    scale = kwargs.pop("scaling", None)
    dropout = kwargs.pop("dropout", 0.0) or 0.0
    if dropout > 0:
        raise UnsupportedModel(f"{name}: attention dropout {dropout} in training mode (set it to 0 or call model.eval())")
    if kwargs.pop("is_causal", True) is False:
        raise UnsupportedModel(f"{name}: bidirectional (non-causal) attention; treerl trains causal language models")
    if kwargs.pop("output_attentions", False):
        raise UnsupportedModel(f"{name}: output_attentions=True is not supported by the tree engines")
    sinks = kwargs.pop("s_aux", None)
    if sinks is None:
        sinks = kwargs.pop("sinks", None)
    window = kwargs.pop("sliding_window", None)
    softcap = kwargs.pop("softcap", None)
    indices = kwargs.pop("indices", None)  # sparse attention: what it computes beside them is checked where it runs
    bias = kwargs.pop("position_bias", None)  # a bias over query-key distances: checked where it runs
    for key, value in kwargs.items():
        if key not in _IGNORED and value is not None and value is not False:
            raise UnsupportedModel(f"{name}: attention argument {key!r} is not supported by the tree engines")
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    chunk = None
    index = getattr(module, "layer_idx", None)
    if layer_types is not None and isinstance(index, int) and layer_types[index] == "chunked_attention":
        chunk = config.attention_chunk_size
    spec = AttentionSpec(
        scale=scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]),
        softcap=softcap or None,
        window=window,
        chunk=chunk,
    )
    return LayerAttention(spec, sinks, indices, bias=bias)


def common_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """q, k, v in one dtype: autocast's where it is on (as SDPA does), else the query's."""
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    return query.to(dtype), key.to(dtype), value.to(dtype)


# ---------------------------------------------------------------- routing

_IN_ENGINE: contextvars.ContextVar[bool] = contextvars.ContextVar("treerl_in_engine", default=False)
_CURRENT_CALL: contextvars.ContextVar[tuple[AttentionCall, bool] | None] = contextvars.ContextVar(
    "treerl_current_call", default=None)
_LOCK = threading.Lock()
_ORIGINAL: dict[int, str] = {}  # id(config) -> the implementation the user chose (top config and sub-configs)
_CALLS_IN_FLIGHT: dict[int, int] = {}  # id(top config) -> engine calls running on that model


# Modules that call the attention interface across one token's own stack of states (its earlier layers' outputs or
# passes), not across tokens: each token's queries see its own states only, so the tree changes nothing for them and
# they run the model's own attention function. Class -> what it attends over.
ACROSS_DEPTH = {
    "Inkling2BlockAttentionResidual": "the token's block states (attention residuals over depth)",
    "Inkling2LoopBlockAttentionResidual": "the token's block states (attention residuals over depth)",
    "Inkling2LoopMessageAttentionResidual": "the token's block states of the previous loop pass (its messages)",
}


def dispatch(module, query, key, value, attention_mask, **kwargs):
    """transformers attention function: treerl's call if the engine passed one, else the model's own."""
    call: AttentionCall | None = kwargs.pop(CALL_KWARG, None)
    if type(module).__name__ in ACROSS_DEPTH and _IN_ENGINE.get():
        _check_across_depth(module, query, key, attention_mask)
        return _original_function(module)(module, query, key, value, attention_mask, **kwargs)
    if call is None and _IN_ENGINE.get():
        call = _call_in_context(module)
    if call is not None:
        derived = attention_mask is not None and getattr(call, "wants_mask", False)  # see `dispatch_mask`
        if attention_mask is not None and not derived:
            raise UnsupportedModel(
                f"{type(module).__name__}: the model builds its own attention mask outside transformers' mask "
                "interface; treerl cannot tell what it hides"
            )
        layer = layer_attention(module, query, kwargs)
        if derived and not getattr(attention_mask, TREE_MASK, False):  # narrowed by the layer (an indexer's choice)
            layer = dataclasses.replace(layer, mask=attention_mask)
        return call(module, *common_dtype(query, key, value), layer), None
    if _IN_ENGINE.get():
        raise UnsupportedModel(
            f"{type(module).__name__}: this layer's attention did not receive treerl's routing argument "
            "(the model does not pass attention kwargs through its layers)"
        )
    return _original_function(module)(module, query, key, value, attention_mask, **kwargs)


def _check_across_depth(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask) -> None:
    """An ACROSS_DEPTH call attends within each token: the tokens sit where heads do (`[batch, tokens, ...]` in query
    and key alike), and no mask hides any of a token's states. Anything else may reach other tokens: refused."""
    if attention_mask is not None or query.shape[:2] != key.shape[:2] or getattr(module, "is_causal", False):
        raise UnsupportedModel(
            f"{type(module).__name__}: treerl takes it for attention over {ACROSS_DEPTH[type(module).__name__]}, "
            f"within each token, but this call (query {tuple(query.shape)}, key {tuple(key.shape)}, "
            f"{'a mask' if attention_mask is not None else 'no mask'}) may reach other tokens"
        )


def _call_in_context(module: torch.nn.Module) -> AttentionCall | None:
    """The running engine call, for a model whose layers do not pass attention kwargs on (StableLM's decoder
    layer calls its attention with named arguments only). Only the forward knows it: gradient checkpointing
    would run the layer again in backward, outside that call, so it is refused before any output."""
    current = _CURRENT_CALL.get()
    if current is None:
        return None
    call, checkpointing = current
    if checkpointing:
        raise UnsupportedModel(
            f"{type(module).__name__}: the model's layers do not pass attention kwargs on, so treerl routes its "
            "attention by the running call, which gradient checkpointing's recomputation in backward cannot see; "
            "turn gradient checkpointing off for this model"
        )
    return call


@contextlib.contextmanager
def routed_call(call: AttentionCall, checkpointing: bool) -> Iterator[None]:
    """While one engine call runs the model: the call its attention layers route to (see `dispatch`)."""
    token = _CURRENT_CALL.set((call, checkpointing))
    try:
        yield
    finally:
        _CURRENT_CALL.reset(token)


def dispatch_mask(*args, config=None, **kwargs):
    """transformers mask function: no mask inside an engine call (treerl builds its own), else the user's.

    A call whose layers read the mask themselves (a sparse-attention indexer scores every earlier key under
    it) gets the plain causal mask over [path | own row] that the cache's sizes describe, marked as treerl's:
    its attention computes the same pairs from the tree and ignores it."""
    if _IN_ENGINE.get():
        current = _CURRENT_CALL.get()
        if current is None or not getattr(current[0], "wants_mask", False):
            return None
        mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, config=config, **{**kwargs, "allow_is_causal_skip": False})
        setattr(mask, TREE_MASK, True)
        return mask
    original = _ORIGINAL.get(id(config), "sdpa")
    return ALL_MASK_ATTENTION_FUNCTIONS[original](*args, config=config, **kwargs)


def _original_function(module: torch.nn.Module) -> Callable:
    original = _ORIGINAL.get(id(getattr(module, "config", None)), "sdpa")
    if original == "eager":  # eager lives in each model's own file
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise UnsupportedModel(f"{type(module).__name__}: no eager_attention_forward to fall back to")
        return eager
    return ALL_ATTENTION_FUNCTIONS[original]


AttentionInterface.register(ATTENTION_NAME, dispatch)
AttentionMaskInterface.register(ATTENTION_NAME, dispatch_mask)


def all_configs(config) -> list:
    """The config and, recursively, its sub-configs: transformers sets the implementation on all of them."""
    found = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            found += all_configs(sub)
    return found


@contextlib.contextmanager
def engine_attention(model: PreTrainedModel) -> Iterator[None]:
    """Route `model`'s attention through the dispatcher while the block runs (thread-safe, re-entrant)."""
    top = model.config
    with _LOCK:
        if _CALLS_IN_FLIGHT.get(id(top), 0) == 0:
            for config in all_configs(top):
                _ORIGINAL[id(config)] = config._attn_implementation
            top._attn_implementation = ATTENTION_NAME
        _CALLS_IN_FLIGHT[id(top)] = _CALLS_IN_FLIGHT.get(id(top), 0) + 1
    token = _IN_ENGINE.set(True)
    try:
        yield
    finally:
        _IN_ENGINE.reset(token)
        with _LOCK:
            _CALLS_IN_FLIGHT[id(top)] -= 1
            if _CALLS_IN_FLIGHT[id(top)] == 0:
                del _CALLS_IN_FLIGHT[id(top)]
                for config in all_configs(top):
                    config._attn_implementation_internal = _ORIGINAL.pop(id(config), None)

"""Exact or refused: what every engine checks about a model and its settings before any compute.

Step 5 (docs/architecture.md), before any compute: exact or refused.

An engine either equals the flat reference, and the flat reference equals the model's own
forward on each sequence alone, or it raises `UnsupportedModel` here with what is wrong and what
to do. What cannot be read off the model statically (an attention argument treerl does not know,
a layer that bypasses transformers' attention interface) is refused by the attention dispatcher
at the first layer of the first call, before any output or gradient exists.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from treerl.attention import UnsupportedModel, all_configs

# Config keys of dropout probabilities a model applies in training mode (hidden, attention, embeddings...), and of
# LayerDrop (BART's family skips whole layers at random in training).
_DROPOUT_WORDS = ("dropout", "pdrop", "layerdrop")
_DROPOUT_IGNORED = {"classifier_dropout", "summary_first_dropout", "summary_last_dropout"}  # heads treerl never runs


def decoder_module(model: PreTrainedModel) -> torch.nn.Module:
    """The transformer body whose output is the final-normed hidden state the LM head reads.

    `get_decoder()` where it names a body (it is the seq2seq families' decoder, which their causal
    LM calls directly), else `base_model`, else `model.model` (Llama-4 reports itself for both).
    """
    candidates = [model.get_decoder() if hasattr(model, "get_decoder") else None, model.base_model,
                  getattr(model, "model", None)]
    for body in candidates:
        if isinstance(body, torch.nn.Module) and body is not model and _takes_input_ids(body):
            return body
    raise UnsupportedModel(f"{model_name(model)}: cannot find its transformer body (get_decoder / base_model)")


def _takes_input_ids(module: torch.nn.Module) -> bool:
    parameters = inspect.signature(module.forward).parameters
    return "input_ids" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


# Modules inside a text body that a text-only batch never runs (treerl passes input_ids alone): class -> what runs them.
# What is inside them is neither attention to route nor a state to hand on; the routing probe (treerl.engine.base)
# refuses a model in which one of them runs after all.
IDLE_IN_TEXT = {
    "MllamaCrossAttentionDecoderLayer": "cross-attention to image states, a layer transformers skips without them",
    "Phi4MultimodalImageEmbedding": "the image encoder, run on image_pixel_values only",
    "Phi4MultimodalAudioEmbedding": "the audio encoder, run on audio_input_features only",
    "GitVisionModel": "the image encoder, run on pixel_values only",
}


def text_modules(model: PreTrainedModel) -> list[tuple[str, torch.nn.Module]]:
    """The text body's named modules that a text-only batch runs: `decoder_module`'s, less those in and below an
    IDLE_IN_TEXT module (a vision tower outside the body never runs either)."""
    modules = list(decoder_module(model).named_modules())
    idle = [path + "." for path, m in modules if type(m).__name__ in IDLE_IN_TEXT]
    return [(path, m) for path, m in modules if not any((path + ".").startswith(i) for i in idle)]


@contextlib.contextmanager
def idle_modules_that_run(model: PreTrainedModel) -> Iterator[list[str]]:
    """The IDLE_IN_TEXT modules that run while the block runs (their paths and classes): none should, on text."""
    ran: list[str] = []

    def record(path: str, module: torch.nn.Module) -> None:
        ran.append(f"{path} ({type(module).__name__}: {IDLE_IN_TEXT[type(module).__name__]})")

    hooks = [m.register_forward_pre_hook(lambda module, args, path=path: record(path, module))
             for path, m in decoder_module(model).named_modules() if type(m).__name__ in IDLE_IN_TEXT]
    try:
        yield ran
    finally:
        for hook in hooks:
            hook.remove()


def last_hidden(outputs) -> torch.Tensor:
    """The body's final hidden states, whatever output class (or tuple) the model returns."""
    hidden = getattr(outputs, "last_hidden_state", None)
    return hidden if hidden is not None else outputs[0]


def model_name(model: PreTrainedModel) -> str:
    return f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"


# Model types no engine can train as causal LMs, for reasons no generic check sees.
_UNSUPPORTED_TYPES = {
    "xlnet": "its default attention is bidirectional (permutation LM), not causal",
    "cpmant": "it attends bidirectionally over its whole input (not a causal LM)",
    "reformer": "its LSH attention hashes with random rotations in training and it refuses backward in eval mode",
}


def check_known_model(model: PreTrainedModel) -> None:
    """What every engine, the flat reference included, needs: one token embedding, a causal LM."""
    kind = getattr(model.config, "model_type", None)
    if kind in _UNSUPPORTED_TYPES:
        raise UnsupportedModel(f"{model_name(model)}: {_UNSUPPORTED_TYPES[kind]}")
    if not isinstance(model.get_input_embeddings(), torch.nn.Embedding):
        raise UnsupportedModel(
            f"{model_name(model)}: its input embeddings are not one nn.Embedding (several codebooks?); "
            "treerl trains models over one token vocabulary"
        )


def check_tree_model(model: PreTrainedModel) -> None:
    """What the tree engines (DFS, packed) need of a model before its attention is probed: no dropout. Token mixers
    other than attention: treerl.engine.recurrent.

    Whether a layer really calls transformers' attention interface is checked where it happens, in a probe and at the
    first layer of each call (treerl.attention.dispatch), before any output or gradient: decided by what the layers
    do, not by a flag a model class declares. After the probe: `check_layer_indices`, then `check_positions`."""
    if model.training:
        check_no_dropout(model)


def check_layer_indices(model: PreTrainedModel) -> None:
    """Every attention module of the text body holds a layer_idx (itself or, for a wrapper, the attention inside it):
    one without would escape the all-layers-routed check. Checked after the routing probe, through which a module
    calling transformers' attention interface without a layer_idx is refused: one left here computes attention in its
    own code."""
    modules = text_modules(model)
    indexed = [path + "." for path, module in modules if isinstance(layer_index(module), int)]
    missing = [(path, module) for path, module in modules if is_attention(module) and not has_layer_index(module)
               and not any(i.startswith(path + ".") for i in indexed)]
    for path, module in missing:
        if not any(other.startswith(path + ".") for other, _ in missing):  # the innermost: the attention itself
            raise UnsupportedModel(
                f"{model_name(model)}: attention module {path} ({type(module).__name__}) has no layer_idx and computes "
                "attention in its own code, not through transformers' AttentionInterface; treerl cannot route it "
                "(use FlatEngine)"
            )


def check_positions(model: PreTrainedModel, attention_free: bool = False) -> None:
    """A tree node runs at its depth: the body takes position_ids, or its absolute position embeddings do
    (`position_embeddings`; checked once its attention is known to be routed: a model that computes attention in its
    own code is refused for that). `attention_free`: no layer attends (pure state-space models), so positions do not
    matter."""
    body = decoder_module(model)
    if attention_free or takes_position_ids(body) or position_embeddings(body):
        return
    named = [f"{path} ({type(m).__name__})" for path, m in body.named_modules() if path.endswith("embed_positions")]
    where = (f": its position embeddings {', '.join(named)} take no position_ids either" if named else "")
    raise UnsupportedModel(
        f"{model_name(model)}: its body takes no position_ids (positions come from the input length){where}, so a "
        "tree node cannot run at its depth (use FlatEngine)"
    )


def takes_position_ids(body: torch.nn.Module) -> bool:
    return _takes_position_ids(type(body))


@functools.cache
def _takes_position_ids(cls: type) -> bool:
    """Read once per class: every model call of every engine asks (`placed_at`)."""
    return "position_ids" in inspect.signature(cls.forward).parameters


def position_embeddings(body: torch.nn.Module) -> list[torch.nn.Module]:
    """A body that takes no position_ids (BART's decoder family: the position of token i is the cache's length + i)
    computes absolute position embeddings in modules named `embed_positions` that do take them: treerl places a call's
    tokens at their depths through those."""
    return [m for path, m in body.named_modules()
            if path.rsplit(".", 1)[-1] == "embed_positions" and takes_position_ids(m)]


@contextlib.contextmanager
def placed_at(body: torch.nn.Module, positions: torch.Tensor | None) -> Iterator[dict[str, torch.Tensor]]:
    """The body's inputs that place a call's tokens at `positions` (`[rows, width]`): its position_ids; or, for a
    body without them, the same positions handed to its position embeddings for the call (every row of a call
    starts at one depth, or the call is one row); or none where nothing reads positions (attention-free bodies)."""
    if positions is None or takes_position_ids(body):
        yield {} if positions is None else {"position_ids": positions}
        return
    row = positions[0]

    def give(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "position_ids": row}  # 1-D, as the body's own arange(width) + cache length

    hooks = [m.register_forward_pre_hook(give, with_kwargs=True) for m in position_embeddings(body)]
    try:
        yield {}
    finally:
        for hook in hooks:
            hook.remove()


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


def check_rope_lengths(model: PreTrainedModel, longest: int) -> None:
    """RoPE whose frequencies depend on the call's length gives a token different embeddings in different calls."""
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if rope_type is None:
            continue
        kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        for kind in kinds:
            if "dynamic" not in kind and kind != "longrope":
                continue
            # longrope switches to its long factors past `limit` positions; dynamic NTK keeps its original
            # frequencies only below `limit` (transformers' dynamic_rope_update)
            limit = _original_length(module)
            most = None if limit is None else limit if kind == "longrope" else limit - 1
            if most is None or longest > most:
                raise UnsupportedModel(
                    f"{model_name(model)}: RoPE type {kind!r} changes its frequencies with the length of each call "
                    f"(beyond {most} tokens), so a token's embedding would depend on how the batch is split; "
                    f"sequences reach {longest} tokens. Keep sequences to {most} tokens or use a "
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


def check_all_layers_routed(model: PreTrainedModel, called: set[int | None],
                            layers: set[int | None] | None = None) -> None:
    """Every attention layer must have run treerl's attention: one that did not saw no ancestors.

    `layers`: `attention_layers(model)`, when the caller already has it (it walks every module)."""
    layers = attention_layers(model) if layers is None else layers
    if layers and not called:
        raise UnsupportedModel(
            f"{model_name(model)}: no attention layer ran treerl's attention: the model computes attention in its own "
            "module code, not through transformers' AttentionInterface (use FlatEngine)"
        )
    if called != layers:
        raise UnsupportedModel(
            f"{model_name(model)}: only layers {sorted(called, key=str)} of {sorted(layers, key=str)} ran treerl's "
            "attention; the others do not dispatch through transformers' AttentionInterface (use FlatEngine)"
        )


def attention_layers(model: PreTrainedModel, mixers: frozenset[str] = frozenset()) -> set[int | None]:
    """The layer indices of the text body's modules (attention, and any other layer that holds a cache slot),
    leaving out the token mixers named in `mixers` (treerl.engine.recurrent), what is inside them, and the blocks
    around them, but not an attention module around one: a mixer inside attention (ZAYA's convolutional projections)
    leaves that attention to be routed like any other. None stands for attention modules whose layer_idx is None
    (Zamba's shared block, told its layer by each call: treerl's attention tells its calls apart by their order)."""
    modules = text_modules(model)
    skip = [path + "." for path, m in modules if type(m).__name__ in mixers]
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    feed_forward = {i for i, kind in enumerate(layer_types) if kind in ("mlp", "moe")}  # Nemotron-H's MLP layers

    def counted(path: str, module: torch.nn.Module) -> bool:
        inside = any((path + ".").startswith(k) for k in skip)
        around = any(k.startswith(path + ".") for k in skip)
        return not inside and (not around or is_attention(module))

    indexed = {layer_index(m) for path, m in modules if isinstance(layer_index(m), int)
               and layer_index(m) not in feed_forward and counted(path, m)}
    inner = [path + "." for path, m in modules if isinstance(layer_index(m), int)]
    unindexed = any(is_attention(m) and hasattr(m, "layer_idx") and m.layer_idx is None and counted(path, m)
                    and not any(i.startswith(path + ".") for i in inner)  # not a wrapper of an indexed attention
                    for path, m in modules)
    return indexed | ({None} if unindexed else set())


def layer_index(module: torch.nn.Module) -> int | None:
    """A module's layer index: its `layer_idx`, or an attention module's `layer_id` (GPT-Neo's, which it tells its
    cache by)."""
    if hasattr(module, "layer_idx"):
        return module.layer_idx
    return getattr(module, "layer_id", None) if is_attention(module) else None


def has_layer_index(module: torch.nn.Module) -> bool:
    return hasattr(module, "layer_idx") or (is_attention(module) and hasattr(module, "layer_id"))


def is_attention(module: torch.nn.Module) -> bool:
    """An attention module, by transformers' naming (`LlamaAttention`, `MllamaTextSelfAttention` ...)."""
    return type(module).__name__.endswith("Attention")


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

"""A tiny random-init instance of every causal-LM architecture in the installed transformers, nothing downloaded.

`tiny_config(t)` starts from the config class's defaults (the architecture as published) and shrinks every size
field it knows: width 64, 4 heads of 16 (GQA/MQA kept), 2 layers or the fewest that keep every layer kind of a
hybrid model, vocab 128, experts 4 (2 per token), windows 8 tokens, sparse attention's top 4 keys. Soft-caps, sinks,
logit scales and rope types stay as the defaults have them: they are what an engine must reproduce. `build_tiny(t)`
builds the mapped class from that config, seeded, in eval mode; `arch_info(t, model)` reads back the facts that matter
for exactness.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import sys
import warnings
from collections.abc import Callable

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

CAUSAL_LM_TYPES: list[str] = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, MOE_FFN, VOCAB, WINDOW, POSITIONS = 64, 4, 2, 16, 128, 32, 128, 8, 256
EXPERTS, EXPERTS_PER_TOKEN = 4, 2


class ZooSkip(Exception):
    """This model type cannot be built tiny (or run in the asked dtype) without a download; the message says why."""


# --------------------------------------------------------------------------------------------------------------
# Generic shrinking: config field -> small value, applied to the fields a config has, when it holds a number.

WINDOW_KEYS = ["sliding_window", "sliding_window_size", "attention_window_size", "window_size",
                "local_attention_window_len"]
_SMALL: dict[str, int] = {
    **dict.fromkeys(["hidden_size", "n_embd", "d_model", "word_embed_proj_dim", "emb_dim", "embedding_dim",
                     "hidden_size_global", "adapter_in_dim", "adapter_out_dim", "adapter_input_size",
                     "out_hidden_size"], HIDDEN),
    **dict.fromkeys(["num_attention_heads", "num_attention_heads_per_layer", "n_head", "n_heads", "num_heads",
                     "decoder_attention_heads", "encoder_attention_heads", "attention_heads",
                     "num_decoder_attention_heads", "num_encoder_attention_heads", "swa_num_attention_heads",
                     "indexer_n_heads", "index_n_heads"], HEADS),
    **dict.fromkeys(["head_dim", "attention_head_dim", "d_head", "kv_channels", "swa_head_dim", "attention_head_size",
                     "dim_head", "indexer_head_dim", "index_head_dim"], HEAD_DIM),
    **dict.fromkeys(["intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_inner", "dff",
                     "dim_ff", "feed_forward_size", "ffn_hidden_size", "intermediate_size_mlp",
                     "dense_intermediate_size", "prefix_dense_intermediate_size", "expert_ffn_hidden_size"], FFN),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size"], MOE_FFN),
    **dict.fromkeys(["num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"], EXPERTS),
    **dict.fromkeys(["num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts"],
                    EXPERTS_PER_TOKEN),
    **dict.fromkeys(["n_shared_experts", "num_shared_experts", "moe_num_shared_experts"], 1),
    **dict.fromkeys(["vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input", "unpadded_vocab_size"], VOCAB),
    **dict.fromkeys(WINDOW_KEYS, WINDOW),
    "attention_chunk_size": WINDOW,  # Llama-4's chunked attention: blocks of 8
    "local_attention": 2 * WINDOW,  # ModernBERT's spans both sides: its decoder's window is half of it
    # multi-head latent attention: query/key head = nope 16 + rope 8, value head 16 (they differ, as in DeepSeek)
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "qk_head_dim": 24,
    "v_head_dim": 16, "o_lora_rank": 16,
    # sparse attention (DeepSeek-V3.2, GLM-DSA ...): each query keeps its top-4 keys, so the indexer's choice matters on
    # a test's ~20 tokens (the default, 2048, keeps every key there)
    "index_topk": 4,
    # Doge's dynamic mask keeps each query's top keys by a learned per-key score once a call has more keys than this
    "keep_window_size": 4,
    # partial rotary of a fixed width (GPT-J, CodeGen): half the head
    "rotary_dim": HEAD_DIM // 2,
    # state-space / linear attention / recurrent widths
    **dict.fromkeys(["mamba_d_state", "state_size", "ssm_state_size"], 16),
    **dict.fromkeys(["mamba_d_head", "mamba_headdim", "mamba_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_head_dim"], HEAD_DIM),
    **dict.fromkeys(["mamba_n_heads", "mamba_num_heads", "linear_num_value_heads", "linear_num_heads"], HEADS),
    "linear_num_key_heads": KV_HEADS,
    "zero_expert_num": 2,  # LongCat's identity ("zero-computation") experts
    **dict.fromkeys(["shape_vocab_size", "pronunciation_vocab_size"], VOCAB),  # RoCBert's extra embeddings
    **dict.fromkeys(["shape_embed_dim", "pronunciation_embed_dim"], 16),
    "mlp_dim": FFN,  # vision towers
    **dict.fromkeys(["time_step_rank", "mamba_dt_rank"], 8),
    "lru_width": HIDDEN,
    # small side branches of a few models
    **dict.fromkeys(["embedding_size", "input_embedding_size", "output_embedding_size"], 32),  # factorised embeddings
    **dict.fromkeys(["hidden_size_per_layer_input", "laurel_rank", "hc_lowrank", "adapter_rank", "gated_norm_rank",
                     "router_hidden_size", "moe_latent_size"], 16),
}
# Fields some default configs leave None although the model cannot be built without them.
_FILL_NONE = {"head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS, "num_experts_per_tok": EXPERTS_PER_TOKEN,
              "n_routed_experts": EXPERTS, "n_shared_experts": 1}
_KV_HEAD_KEYS = ["num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "num_query_groups",
                 "indexer_kv_heads"]
_POSITION_KEYS = ["max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "max_source_positions"]
_LAYER_KEYS = ["num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers",
               "num_blocks"]
# lists of (zero-based) layer indices, not one entry per layer: remapped when layers are dropped
_LAYER_INDEX_LISTS = ["mlp_only_layers", "moe_layers", "full_attn_idxs", "attn_layer_indices", "hybrid_layer_ids",
                      "local_layer_ids", "cross_attention_layers"]
# "the first k layers are X" / "the last k layers are X"
_FIRST_K = ["first_k_dense_replace", "num_dense_layers"]
_LAST_K = ["num_kv_shared_layers"]


def _fields(config: PretrainedConfig) -> dict:
    """The config's own values (to_dict avoids per-layer attribute guards of heterogeneous configs)."""
    return config.to_dict()


def _derived(config: PretrainedConfig) -> set[str]:
    """Values the class computes in __post_init__ (not fields, or fields defaulting to None): derived again."""
    fields = _field_defaults(config)
    return {k for k in _fields(config) if k not in fields or fields[k] is None}


def _field_defaults(config: PretrainedConfig) -> dict:
    """Dataclass field defaults under the names to_dict uses (a field may be an attribute_map alias)."""
    return {config.attribute_map.get(f.name, f.name): f.default for f in dataclasses.fields(config)}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _select_layers(values: dict) -> dict:
    """Keep the first layer of each distinct kind (by every per-layer list), at least 2; remap what depends on it."""
    key = next((k for k in _LAYER_KEYS if isinstance(values.get(k), int) and values[k] > 0), None)
    if key is None:
        return {}
    n = values[key]
    per_layer = {k: v for k, v in values.items() if isinstance(v, list) and len(v) == n and n > 1
                 and k not in _LAYER_INDEX_LISTS}
    index_lists = {k: v for k, v in values.items() if k in _LAYER_INDEX_LISTS and isinstance(v, list)}
    first_k = {k: values[k] for k in _FIRST_K if isinstance(values.get(k), int)}
    last_k = {k: values[k] for k in _LAST_K if isinstance(values.get(k), int)}
    per_layer_config = values.get("per_layer_config") or {}

    def kind(i: int) -> tuple:
        return (tuple(str(v[i]) for v in per_layer.values()) + tuple(i in v for v in index_lists.values())
                + tuple(i < k for k in first_k.values()) + tuple(i >= n - k for k in last_k.values())
                + (str(per_layer_config.get(f"{i:02d}", per_layer_config.get(str(i)))),))

    chosen: list[int] = []
    for i in range(n):
        if kind(i) not in {kind(j) for j in chosen}:
            chosen.append(i)
    chosen += [i for i in range(n) if i not in chosen][: max(0, 2 - len(chosen))]
    chosen.sort()
    out: dict = {k: len(chosen) for k in _LAYER_KEYS if isinstance(values.get(k), int) and values[k] > 0}
    for k, v in per_layer.items():
        out[k] = [_SMALL[k] if k in _SMALL and _is_number(v[i]) else v[i] for i in chosen]
    for k, v in index_lists.items():
        out[k] = [chosen.index(i) for i in v if i in chosen]
    for k, first in first_k.items():
        out[k] = sum(i < first for i in chosen)
    for k, last in last_k.items():
        out[k] = sum(i >= n - last for i in chosen)
    if per_layer_config:
        out["per_layer_config"] = {f"{chosen.index(int(i)):02d}": layer
                                   for i, layer in per_layer_config.items() if int(i) in chosen}
    return out


def _shrink_layer(layer: dict, values: dict, shrunk: dict) -> dict:
    """A per-layer override of a heterogeneous config (Gemma-4's wider global-attention heads), shrunk in the same
    proportion as the global value it overrides, so that the layers still differ."""
    out = dict(layer)
    for k, v in layer.items():
        if _is_number(v) and _is_number(values.get(k)) and values[k] and k in shrunk:
            out[k] = max(1, round(shrunk[k] * v / values[k]))
    return out


def _shrink(values: dict, derived: set[str], fields: set[str]) -> dict:
    """Changed fields that make a config of these values tiny."""
    out: dict = {}
    for k, v in values.items():
        if k in _SMALL and (k not in derived or k in WINDOW_KEYS) and _is_number(v):  # a filled-in window too
            out[k] = _SMALL[k]
        elif k in _FILL_NONE and k in fields and v is None:
            out[k] = _FILL_NONE[k]
    # MLA models whose head_dim is the rope part (DeepSeek-style) or the whole query/key head: keep it so
    head_dim, rope, nope = values.get("head_dim"), values.get("qk_rope_head_dim"), values.get("qk_nope_head_dim")
    if head_dim is not None and head_dim == rope:
        out["head_dim"] = _SMALL["qk_rope_head_dim"]
    elif head_dim is not None and rope is not None and nope is not None and head_dim == rope + nope:
        out["head_dim"] = _SMALL["qk_head_dim"]
    heads = values.get("num_attention_heads", values.get("n_head"))
    for k in _KV_HEAD_KEYS:
        v = values.get(k)
        if k not in derived and isinstance(v, int) and v > 0:
            out[k] = 1 if v == 1 else (HEADS if heads is not None and v == heads else KV_HEADS)
    for group_key in ("n_group", "num_expert_group"):  # group-limited routing: 2 groups of 2 experts, 1 group picked
        if isinstance(values.get(group_key), int) and values[group_key] > 1:
            out[group_key] = 2
            if "topk_group" in values:
                out["topk_group"] = 1
    # mamba-2 style mixers: heads * head_dim must equal expand * hidden
    expand = values.get("mamba_expand", values.get("expand"))
    for heads_key, dim_key in (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"),
                               ("num_heads", "head_dim")):
        if isinstance(expand, int) and heads_key in values and dim_key in values and "mamba" in str(values):
            out[heads_key] = expand * HIDDEN // HEAD_DIM
            if dim_key not in derived:
                out[dim_key] = HEAD_DIM
    for k in _POSITION_KEYS:
        if isinstance(values.get(k), int):
            out[k] = POSITIONS
    if values.get("is_decoder") is False and "is_decoder" in fields:  # BERT & co: the LM head is for decoders
        out["is_decoder"] = True
    out.update(_select_layers(values))
    if out.get("per_layer_config"):
        out["per_layer_config"] = {i: _shrink_layer(layer, values, out) for i, layer in out["per_layer_config"].items()}
    vocab = out.get("vocab_size", values.get("vocab_size"))
    if vocab is not None:
        for k, v in values.items():
            if k.endswith(("_token_id", "_token_index", "token_ids")):
                out[k] = _in_vocab(v, vocab)
    return out


def _in_vocab(token, vocab: int):
    """Map a special-token id (or list of ids) into [0, vocab)."""
    if isinstance(token, list):
        return [_in_vocab(t, vocab) for t in token]
    if isinstance(token, int) and token >= vocab:
        return vocab - 1 - (token % 8)
    return token


# --------------------------------------------------------------------------------------------------------------
# Per-type overrides, only where the generic shrinker cannot work or the default config is not a buildable model.
# Values are config kwargs (a dict under a sub-config key goes to that sub-config). Each entry says why.

_QWEN4_INDEXER = {"indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
                  "indexer_compress_ratio": 4}

_INKLING_BIAS = {"rel_extent": 6, "log_scaling_n_floor": 4}

OVERRIDES: dict[str, dict] = {
    # layer kinds come from "attention every 8th layer from 4" / "MoE every 2nd from 1": one mamba+MLP layer, one
    # attention+MoE layer
    "jamba": {"num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    # the shared attention block is tied across hybrid layers and needs at least two of them
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # block_types is a repeating 3-pattern (recurrent, recurrent, attention), not one entry per layer
    "recurrent_gemma": {"num_hidden_layers": 2, "block_types": ["recurrent", "attention"]},
    # the default keeps no conv layer (full_attn_idxs = every layer); LFM2 checkpoints mix conv and attention
    "lfm2": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "lfm2_moe": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # falcon_h1's mamba inner width is its own field
    "falcon_h1": {"mamba_d_ssm": 8 * HEAD_DIM, "mamba_n_heads": 8, "mamba_d_head": HEAD_DIM},
    # the default's rope_parameters is {} although the model looks rope up per layer type; use Cohere2's pattern:
    # rope on sliding layers, none on the global one
    "cohere_compass_text": {
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 50000.0},
                            "full_attention": None},
    },
    # modeling_dbrx still reads attn_config.rope_theta, which the config class no longer has (transformers bug),
    # and clamps q/k/v to clip_qkv, which must then be set (DBRX checkpoints use 8)
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # the defaults have no attention layer at all, which the model's cache cannot handle; Bamba / Granite-4.0-H
    # checkpoints mix mamba and attention layers
    "bamba": {"num_hidden_layers": 2, "attn_layer_indices": [1]},
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
    # the sliding layers' per-layer MLA override (nope head 1.5x the global one, shrunk to 24) inherits head_dim,
    # which must equal their nope + rope head
    "dots3_note_text": {"head_dim": 32},
    "dots3_note": {"text_config": {"head_dim": 32}},
    # xLSTM's recurrent state is sized from qk_dim rounded up to a multiple of 64 while its projections are not
    # rounded (transformers bug for widths whose qk part is no multiple of 64): width 128 makes the qk part 64
    "xlstm": {"hidden_size": 128, "embedding_dim": 128},
    # vision / audio towers with wide convolutions (a few MB even at width 64)
    "got_ocr2": {"vision_config": {"output_channels": 16}},
    "phi4_multimodal": {"audio_config": {"ext_pw_out_channel": 32, "depthwise_separable_out_channel": 32,
                                         "nemo_conv_channels": 32}},
    # ZAYA supports one expert per token only
    "zaya": {"num_experts_per_tok": 1},
    # full attention layers are "indexed" (query-sparse attention); the default leaves the indexer unset, which
    # does not build: a small indexer that keeps 8 of the keys in blocks of 4
    "qwen4_exp_text": _QWEN4_INDEXER,
    "qwen4_exp": {"text_config": _QWEN4_INDEXER},
    # byte latent transformer: the hash n-gram embeddings have 500002 rows each by default
    # (use_cache: its forward builds DynamicCache(config=BltConfig), which has no num_hidden_layers: transformers bug)
    "blt": {"encoder_hash_byte_group_vocab": 64, "local_attention_window_len": WINDOW, "use_cache": False},
    # axial position embeddings must sum to the width
    "reformer": {"axial_pos_shape": [16, 16], "axial_pos_embds_dim": [16, 48]},
    # Dory loops its middle layers: the layer count is input + recurrent + output layers, one of each here
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # XLM's causal-LM mode (the xlm-clm checkpoints); its default is the masked-LM encoder
    "xlm": {"causal": True},
    # compressed attention: one entry per complete window of 128 (heavily compressed) or 4 (compressed sparse) tokens
    # would form none, or too few for the indexer's top 4 to bind, on a test's ~20 tokens: windows of 3 and of 2
    "deepseek_v4": {"compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 3}},
    # Inkling's relative position bias: its full layers' extent (1024) and the log scaling of queries and biases (from
    # position 128000 on, or none) would never act on a test's ~20 tokens: an extent of 6, scaling from position 4
    "inkling_text": _INKLING_BIAS,
    "inkling2_text": _INKLING_BIAS,
    # the loop layers (6 to 18 of the default) run 3 passes with a K/V slot and convolution states each: a pre-loop,
    # two loop layers and a post-loop layer, a block of attention residuals each (the loop starts on a block boundary)
    "inkling2_loop_text": {**_INKLING_BIAS, "num_hidden_layers": 4,
                           "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
                           "loop_layer_index_start": 1, "loop_layer_index_end": 3, "n_layers_per_attn_res_block": 1},
}

# The causal-LM class of these types takes one sub-config of the composite config.
_SUB_CONFIG = {"musicgen": "decoder", "musicgen_melody": "decoder"}


def _keep_in_fp32_strict(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Cast the model's `_keep_in_fp32_modules_strict` weights to float32, as transformers does for fp16/bf16 only."""
    patterns = model._keep_in_fp32_modules_strict or ()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and any(pattern in name for pattern in patterns):
            tensor.data = tensor.data.float()


# Set-up a built model needs before a text-only forward.
def _trained_dynamic_mask(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Doge initialises its dynamic mask's A to zero, so every key scores exp(0) = 1 and its top-k (keep_window_size)
    picks among ties, by the CPU kernel's whim (it differs with the call's width); trained, A is spread: draw it so."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn.A
            a.copy_(torch.randn(a.shape, generator=generator, dtype=torch.float64).to(a.dtype))


_AFTER_BUILD: dict[str, Callable[[PreTrainedModel, torch.dtype], None]] = {
    "doge": _trained_dynamic_mask,
    "xmod": lambda model, dtype: model.set_default_language("en_XX"),  # language adapters need a language
    # XLNet makes its attention weights with torch.FloatTensor, which ignores the dtype the model is built in
    "xlnet": lambda model, dtype: model.to(dtype),
    # the MoE router computes in float32 against its weight: keep that weight in float32 in any dtype
    "inkling2_text": _keep_in_fp32_strict,
}

# Types that cannot be built tiny at all; the reason is the skip message.
SKIPS: dict[str, str] = {
    "gemma4_assistant": "speculative-decoding drafter: forward needs the target model's inputs_embeds and "
                        "shared_kv_states, not input_ids (and its default config fails its own validation)",
    "gemma4_unified_assistant": "speculative-decoding drafter: forward needs the target model's inputs_embeds and "
                                "shared_kv_states, not input_ids",
}

# Types whose build imports a package that neither treerl nor its test extras install: type -> package. They build
# where the package is installed and skip where it is not, so docs/models.md lists them as not built on every machine
# (tests/engine/test_architectures.py) and tests/test_zoo.py expects the skip only where the package is absent.
OPTIONAL_PACKAGES: dict[str, str] = {
    "gemma3n": "timm",  # its vision tower is a TimmWrapperModel
}

# Types whose forward cannot run in float64 (they hard-code float32 somewhere); they build in float32.
FLOAT64_SKIPS: dict[str, str] = {
    "xglm": "eager attention clamps with torch.full((), finfo(float64).min) made in the default float32 dtype, which "
            "overflows (transformers bug); no sdpa path",
}


def _rebuild(config: PretrainedConfig, extra: dict | None = None) -> PretrainedConfig:
    """A new config of the same class: the values that differ from the class defaults, shrunk, plus `extra`."""
    cls = type(config)
    extra = extra or {}
    values = _fields(config)
    derived = _derived(config)
    changes = _shrink(values, derived, set(_field_defaults(config)))
    for k in values:
        sub = config.__dict__.get(k)
        if isinstance(sub, PretrainedConfig):
            changes[k] = _rebuild(sub, extra.get(k))
    try:
        defaults = _fields(cls())
    except Exception:  # noqa: BLE001 - a sub-config class whose defaults alone do not validate
        defaults = {}
    kwargs = {k: v for k, v in values.items() if k not in derived and (k not in defaults or defaults[k] != v)}
    for k in ("transformers_version", "architectures", "model_type", "_name_or_path", "dtype", "id2label",
              "label2id"):
        kwargs.pop(k, None)
    kwargs.update(changes)
    kwargs.update({k: v for k, v in extra.items() if not isinstance(changes.get(k), PretrainedConfig)})
    return cls(**kwargs)


@contextlib.contextmanager
def _quiet():
    """transformers warns at length about tiny configs (ids, rope, attention fallbacks); the zoo knows."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.setLevel(level)


def default_config(model_type: str) -> PretrainedConfig:
    """The config class's defaults, as the mapped causal-LM class takes them (MusicGen's takes its decoder's)."""
    with _quiet():
        config = CONFIG_MAPPING[model_type]()
    return getattr(config, _SUB_CONFIG[model_type]) if model_type in _SUB_CONFIG else config


def tiny_config(model_type: str) -> PretrainedConfig:
    """A small config of `model_type` from its class defaults; raises ZooSkip when it cannot be built tiny."""
    if model_type in SKIPS:
        raise ZooSkip(SKIPS[model_type])
    with _quiet():
        config = _rebuild(CONFIG_MAPPING[model_type](), OVERRIDES.get(model_type))
    if model_type in _SUB_CONFIG:
        config = getattr(config, _SUB_CONFIG[model_type])
    return config


def _construct(model_type: str, config: PretrainedConfig, seed: int, **kwargs) -> PreTrainedModel:
    """AutoModelForCausalLM.from_config, or the mapped class itself where it takes a sub-config (MusicGen).

    Initialised on one thread: the weights do not depend on the thread count, and LAPACK (orthogonal init) does not
    stall for seconds under OpenMP contention on a busy machine.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    try:
        if model_type in _SUB_CONFIG:
            return _causal_lm_class(model_type)._from_config(config, **kwargs)
        return AutoModelForCausalLM.from_config(config, **kwargs)
    finally:
        torch.set_num_threads(threads)


def _causal_lm_class(model_type: str) -> type[PreTrainedModel]:
    return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]


def build_tiny(model_type: str, dtype: torch.dtype = torch.float64, seed: int = 0,
               attn_implementation: str | None = "sdpa", experts_implementation: str = "eager") -> PreTrainedModel:
    """The mapped causal-LM class built from tiny_config, seeded, in eval mode (sdpa where supported, else eager:
    the model's config._attn_implementation says which).

    MoE experts default to the eager loop: transformers' default "grouped_mm" has no float64 kernel on CPU.
    """
    if dtype == torch.float64 and model_type in FLOAT64_SKIPS:
        raise ZooSkip(FLOAT64_SKIPS[model_type])
    config = tiny_config(model_type)
    if attn_implementation == "sdpa" and not _causal_lm_class(model_type)._supports_sdpa:
        attn_implementation = "eager"
    with _quiet():
        try:
            model = _construct(model_type, config, seed, dtype=dtype, attn_implementation=attn_implementation,
                               experts_implementation=experts_implementation)
        except ImportError as error:  # an optional package a sub-model needs (OPTIONAL_PACKAGES)
            first_sentence = " ".join(str(error).split()).split(". ")[0]
            raise ZooSkip(f"needs a package that is not installed: {first_sentence}") from error
        except ValueError as error:
            if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(error):
                raise
            model = _construct(model_type, config, seed, dtype=dtype, attn_implementation="eager",
                               experts_implementation=experts_implementation)
    if model_type in _AFTER_BUILD:
        _AFTER_BUILD[model_type](model, dtype)
    return model.eval()


def input_ids(model: PreTrainedModel, batch: int = 1, length: int = 24, seed: int = 0) -> torch.Tensor:
    """Random ordinary token ids a text-only forward of `model` takes: [batch, length], or [batch * codebooks,
    length] for MusicGen decoders (which give logits of that shape too). Special ids (pad, bos, eos, image, ...)
    are left out: some models treat them apart wherever they are (XLM masks every pad id)."""
    config = model.config.get_text_config()
    rows = batch * getattr(config, "num_codebooks", 1) if "Musicgen" in type(model).__name__ else batch
    return ordinary_ids(model, (rows, length), seed)


def ordinary_ids(model: PreTrainedModel, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random token ids of `shape` that no config of `model` names as special."""
    ordinary = torch.tensor(sorted(set(range(_vocab_size(model))) - _special_ids(model.config)))
    generator = torch.Generator().manual_seed(seed)
    return ordinary[torch.randint(0, len(ordinary), shape, generator=generator)]


def own_logprobs(model: PreTrainedModel, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The completion's log-probs by the model's own forward on prompt + completion alone (float64): what a sampler's
    recorded log-probs must equal."""
    sequence = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=sequence, use_cache=False).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, sequence[0, len(prompt) :, None])[:, 0]


def _special_ids(config: PretrainedConfig) -> set[int]:
    """Every id a config (or its sub-configs) names as a special token."""
    ids: set[int] = set()
    for k, v in _fields(config).items():
        sub = config.__dict__.get(k)
        if isinstance(sub, PretrainedConfig):
            ids |= _special_ids(sub)
        elif re.search(r"(token_id|token_ids|token_index|_index)$", k):
            ids |= {t for t in (v if isinstance(v, list) else [v]) if isinstance(t, int)}
    return ids


def _vocab_size(model: PreTrainedModel) -> int:
    return model.config.get_text_config().vocab_size


# --------------------------------------------------------------------------------------------------------------
# What a built model is: facts for exactness, read from its config and modules, and checked with forwards.


@dataclasses.dataclass
class ArchInfo:
    """Facts about a built tiny model that matter for computing exactly what its own forward computes."""

    model_type: str
    model_class: str
    attn_implementation: str
    vocab_size: int
    layers: int
    causal: bool  # checked: logits at j do not change when tokens > j change
    sliding_window: int | None  # effective window if any layer is windowed (after shrinking)
    layer_types: list[str] | None
    attn_softcap: float | None
    final_logit_softcap: float | None
    sinks: bool  # attention sinks (e.g. gpt_oss)
    logit_scaling: str | None  # e.g. "logit_scale=0.0625", "logits_scaling=1.0"
    recurrent: bool  # mamba / linear-attention / conv / rwkv / xlstm / recurrent state layers
    rope_type: str | None  # per-layer-type dicts summarised "full_attention:default, sliding_attention:default"
    kv_head_dims: tuple[int, int] | None  # (key head dim, value head dim) where they differ (MLA)
    moe: bool
    dropout_keys: dict[str, float]  # config keys with dropout probabilities > 0 in the default config
    notes: str
    # measured with a probe registered in transformers' AttentionInterface: None when the model's attention does
    # not dispatch through it (an engine that plugs in there would not see it), else calls per forward
    attention_calls: int | None = None
    attention_kwargs: dict[str, str] = dataclasses.field(default_factory=dict)  # extra kwargs the probe received
    lm_head_check: str = ""  # how logits relate to get_output_embeddings()(base model's last hidden state)


_RECURRENT_MODULE = re.compile(r"Mamba|Mixer|Rwkv|xLSTM|DeltaNet|DeltaAttention|ShortConv|Rglru|RecurrentBlock|"
                               r"LightningAttention|LinearAttention|Kda|KDA")
_ATTN_SOFTCAP_KEYS = ["attn_logit_softcapping", "attn_softcap", "attention_softcap"]
_FINAL_SOFTCAP_KEYS = ["final_logit_softcapping", "output_logit_soft_cap", "logits_soft_cap"]
_LOGIT_SCALE_KEYS = ["logit_scale", "logits_scaling", "lm_head_multiplier", "logits_mup_width_multiplier",
                     "output_multiplier", "dim_model_base", "scale_width", "width_multiplier", "mup_enabled"]


def arch_info(model_type: str, model: PreTrainedModel) -> ArchInfo:
    """Read and check the facts of a built tiny model (see ArchInfo); runs a few forwards."""
    config = model.config
    text = config.get_text_config()
    values = _fields(text)
    ids = input_ids(model, length=24)
    with torch.no_grad(), _quiet():
        logits = _logits(model, ids)
    notes: list[str] = []
    windows = [values[k] for k in WINDOW_KEYS if isinstance(values.get(k), int)]
    layer_types = _layer_types(values)
    calls, kwargs = _probe_attention(model, ids, logits, notes)
    return ArchInfo(
        model_type=model_type,
        model_class=type(model).__name__,
        attn_implementation=str(config._attn_implementation),
        vocab_size=logits.shape[-1],
        layers=next((values[k] for k in _LAYER_KEYS if isinstance(values.get(k), int)), 0),
        causal=_is_causal(model, ids, logits, notes),
        sliding_window=_window(values, layer_types, windows, kwargs),
        layer_types=layer_types,
        attn_softcap=next((values[k] for k in _ATTN_SOFTCAP_KEYS if values.get(k) is not None), None),
        final_logit_softcap=next((values[k] for k in _FINAL_SOFTCAP_KEYS if values.get(k) is not None), None),
        sinks=any("sink" in name.lower() or name.endswith("s_aux") for name, _ in model.named_parameters())
        or "s_aux" in kwargs or "sinks" in kwargs,
        logit_scaling=", ".join(f"{k}={values[k]}" for k in _LOGIT_SCALE_KEYS if values.get(k) not in (None, False))
        or None,
        recurrent=_is_recurrent(model),
        rope_type=_rope_type(values),
        kv_head_dims=_kv_head_dims(values),
        moe=any(re.search(r"Expert|Moe|MoE|Router", type(m).__name__) for m in model.modules()),
        dropout_keys=_dropout_keys(default_config(model_type)),
        notes="; ".join(notes + _position_notes(model, ids, logits) + _other_softcaps(values) + _dtype_notes(model)
                        + _attention_scale_notes(model)),
        attention_calls=calls,
        attention_kwargs=kwargs,
        lm_head_check=_lm_head_check(model, ids, logits, values),
    )


def _logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


def _is_causal(model: PreTrainedModel, ids: torch.Tensor, logits: torch.Tensor, notes: list[str]) -> bool:
    """Logits at positions <= j are unchanged when every token after j changes (j at a third and two thirds)."""
    with torch.no_grad(), _quiet():
        again = _logits(model, ids)
        if not torch.equal(again, logits):
            notes.append(f"forward not deterministic (max |diff| {(again - logits).abs().max():.2g})")
        leak = 0.0
        for j in (ids.shape[1] // 3, 2 * ids.shape[1] // 3):
            changed = torch.cat([ids[:, : j + 1], ordinary_ids(model, ids[:, j + 1:].shape, seed=j)], dim=1)
            leak = max(leak, float((_logits(model, changed) - logits)[:, : j + 1].abs().max()))
    if 0 < leak <= 1e-5:
        notes.append(f"later tokens change earlier logits by up to {leak:.2g} (rounding: causal)")
    return leak <= 1e-5


def _position_notes(model: PreTrainedModel, ids: torch.Tensor, logits: torch.Tensor) -> list[str]:
    """How the forward treats explicit position_ids (what a packed or tree layout passes)."""
    positions = torch.arange(ids.shape[1]).expand(ids.shape)
    try:
        with torch.no_grad(), _quiet():
            at_zero = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            stretched = model(input_ids=ids, position_ids=2 * positions, use_cache=False).logits  # rope is shift-free
    except Exception as error:  # noqa: BLE001
        return [f"position_ids not accepted ({type(error).__name__}: {str(error)[:60]})"]
    notes = []
    if not torch.equal(at_zero, logits):
        difference = (at_zero - logits).abs().max()
        notes.append(f"default positions are not arange(length) (logits differ by {difference:.2g})")
    if torch.equal(stretched, at_zero):
        notes.append("position_ids have no effect")
    return notes


def _other_softcaps(values: dict) -> list[str]:
    caps = {k: v for k, v in values.items() if re.search("softcap|soft_cap", k) and v is not None
            and k not in _ATTN_SOFTCAP_KEYS + _FINAL_SOFTCAP_KEYS}
    return [f"other soft-caps: {caps}"] if caps else []


def _layer_types(values: dict) -> list[str] | None:
    for key in ("layer_types", "layers_block_type", "block_types", "attn_layers", "attention_layers"):
        if isinstance(values.get(key), list) and all(isinstance(v, str) for v in values[key]):
            return list(values[key])
    return None


def _window(values: dict, layer_types: list[str] | None, windows: list[int], kwargs: dict[str, str]) -> int | None:
    """The sliding window some layer uses: as measured on the masks the probe saw, else from the config."""
    measured = [int(m) for m in re.findall(r"sliding window (\d+)", kwargs.get("mask", ""))]
    if measured:
        return max(measured)
    if "mask" in kwargs or not windows:  # the probe saw every mask: no sliding one
        return None
    windowed_types = layer_types and any(re.search("slid|local|swa", t) for t in layer_types)
    if windowed_types or values.get("use_sliding_window") is True:
        return windows[0]
    return None


def _is_recurrent(model: PreTrainedModel) -> bool:
    """A layer carries state along the sequence other than attention: SSM, linear attention, token convolution."""
    for name, module in model.named_modules():
        if re.search("vision|audio|image|patch", name):
            continue
        if _RECURRENT_MODULE.search(type(module).__name__) or isinstance(module, torch.nn.Conv1d):
            return True
    return False


def _rope_type(values: dict) -> str | None:
    rope = values.get("rope_parameters") or values.get("rope_scaling")
    if not isinstance(rope, dict) or not rope:
        return None
    if "rope_type" in rope or "type" in rope:
        return str(rope.get("rope_type", rope.get("type")))
    return ", ".join(f"{k}:{v.get('rope_type') if isinstance(v, dict) else None}" for k, v in rope.items())


def _kv_head_dims(values: dict) -> tuple[int, int] | None:
    if values.get("qk_nope_head_dim") is not None and values.get("qk_rope_head_dim") is not None:
        key_dim = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]
    else:
        key_dim = values.get("qk_head_dim") or values.get("head_dim")
    value_dim = values.get("v_head_dim")
    if isinstance(key_dim, int) and isinstance(value_dim, int) and key_dim != value_dim:
        return (key_dim, value_dim)
    return None


def _dropout_keys(config: PretrainedConfig, prefix: str = "") -> dict[str, float]:
    """Config keys (recursing into sub-configs) that name a dropout-like probability and are > 0."""
    out: dict[str, float] = {}
    for k, v in _fields(config).items():
        sub = config.__dict__.get(k)
        if isinstance(sub, PretrainedConfig):
            out.update(_dropout_keys(sub, f"{prefix}{k}."))
        elif re.search("drop|pdrop", k) and _is_number(v) and v > 0:
            out[prefix + k] = float(v)
    return out


def _dtype_notes(model: PreTrainedModel) -> list[str]:
    """Weights or buffers not in the model's dtype, and modules that compute in float32 inside a float64 model."""
    dtype = model.dtype
    notes = []
    stray = sorted({f"{name.rsplit('.', 1)[-1]}:{str(t.dtype).removeprefix('torch.')}"
                    for name, t in [*model.named_parameters(), *model.named_buffers()]
                    if t.is_floating_point() and t.dtype != dtype})
    if stray:
        notes.append("tensors not in model dtype: " + ", ".join(stray[:6]) + (" ..." if len(stray) > 6 else ""))
    if dtype == torch.float64:
        downcasts, float32_made = _low_precision_modules(model)
        if downcasts:
            notes.append("casts float64 down to float32 in: " + ", ".join(downcasts))
        if float32_made:
            notes.append("float32 math on float32-made tensors (masks, rope tables...) in: " + ", ".join(float32_made))
    return notes


def _low_precision_modules(model: PreTrainedModel) -> tuple[list[str], list[str]]:
    """Classes of the innermost modules in which an op returns a float32/16 tensor during a float64 forward: those
    where the op read a float64 tensor (a downcast of model data), and the others (float32 made from scratch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    stack: list[str] = []
    downcasts: dict[str, None] = {}
    float32_made: dict[str, None] = {}
    low = (torch.float32, torch.float16, torch.bfloat16)

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outputs = out if isinstance(out, (tuple, list)) else (out,)
            if any(isinstance(t, torch.Tensor) and t.dtype in low for t in outputs):
                inputs = torch.utils._pytree.tree_leaves((args, kwargs))
                read_float64 = any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in inputs)
                (downcasts if read_float64 else float32_made)[stack[-1] if stack else type(model).__name__] = None
            return out

    def enter(module, args):
        stack.append(type(module).__name__)

    def leave(module, args, output):
        stack.pop()

    hooks = []
    for module in model.modules():
        hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        with torch.no_grad(), _quiet(), Watch():
            _logits(model, input_ids(model, length=8))
    finally:
        for hook in hooks:
            hook.remove()
    return list(downcasts), [m for m in float32_made if m not in downcasts]


def _attention_scale_notes(model: PreTrainedModel) -> list[str]:
    """Attention modules whose `scaling` is not 1/sqrt(head_dim)."""
    odd = set()
    for module in model.modules():
        scaling, head_dim = getattr(module, "scaling", None), getattr(module, "head_dim", None)
        if _is_number(scaling) and isinstance(head_dim, int) and abs(scaling - head_dim**-0.5) > 1e-12:
            odd.add(f"{type(module).__name__}.scaling={scaling:.4g} (head_dim {head_dim})")
    return sorted(odd)


def _probe_attention(model: PreTrainedModel, ids: torch.Tensor, logits: torch.Tensor,
                     notes: list[str]) -> tuple[int | None, dict[str, str]]:
    """Swap in an attention function that records its calls and delegates to the model's own; count the calls.

    Returns (calls per forward, or None when attention does not dispatch through AttentionInterface; what the
    calls saw: q/k/v shapes per module, the mask pattern, and every other keyword argument's values)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = model.config._attn_implementation
    name = f"zoo_probe_{original}"
    calls: list[dict] = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        calls.append({"module": type(module).__name__, "q": tuple(query.shape), "k": tuple(key.shape),
                      "v": tuple(value.shape), "mask": _mask_pattern(attention_mask, query, key),
                      **{k: _short(v) for k, v in kwargs.items()}})
        if original == "eager":
            eager = sys.modules[type(module).__module__].eager_attention_forward
            return eager(module, query, key, value, attention_mask, **kwargs)
        return ALL_ATTENTION_FUNCTIONS[original](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, probe)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    with _quiet():
        try:
            model.set_attn_implementation(name)
        except Exception as error:  # noqa: BLE001 - any refusal means "not pluggable"
            notes.append(f"attention implementation cannot be swapped ({type(error).__name__})")
            return None, {}
        if model.config._attn_implementation != name:
            notes.append("set_attn_implementation refused: attention is not written against AttentionInterface")
            return None, {}
        try:
            with torch.no_grad():
                probed = _logits(model, ids)
        except Exception as error:  # noqa: BLE001
            notes.append(f"forward fails with a swapped-in attention function ({type(error).__name__}: "
                         f"{str(error)[:80]})")
            return None, {}
        finally:
            model.set_attn_implementation(original)
    if not calls:
        inline = any("Attention" in type(m).__name__ for m in model.modules())
        notes.append("attention computed inline, not through AttentionInterface" if inline else "no attention layer")
        return None, {}
    if not torch.equal(probed, logits):
        notes.append(f"swapping in the same attention function changes logits by {(probed - logits).abs().max():.2g}")
    seen: dict[str, dict[str, None]] = {}
    for call in calls:
        for k, v in call.items():
            if k not in ("q", "k", "v", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):
                seen.setdefault(k, {})[v] = None
    shapes = dict.fromkeys(f"{c['module']} q{c['q'][1:]} k{c['k'][1:]} v{c['v'][1:]}" for c in calls)
    return len(calls), {"shapes": " / ".join(shapes), **{k: ", ".join(v) for k, v in seen.items() if k != "module"}}


def _mask_pattern(mask, query: torch.Tensor, key: torch.Tensor) -> str:
    """What the mask an attention function receives lets each query see, for self-attention on one sequence."""
    if mask is None:
        return "none"
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or query.shape[-2] != key.shape[-2]:
        return f"{type(mask).__name__}{tuple(getattr(mask, 'shape', ()))}"
    allowed = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] > torch.finfo(mask.dtype).min / 2
    length = allowed.shape[-1]
    rows = torch.arange(length)
    if torch.equal(allowed, torch.ones_like(allowed)):
        return "full (bidirectional)"
    if torch.equal(allowed, rows[None, :] <= rows[:, None]):
        return "causal"
    visible = allowed.sum(-1)
    key, query = rows[None, :], rows[:, None]
    for window in range(1, length):
        if torch.equal(allowed, (key <= query) & (key > query - window)):
            return f"sliding window {window}"
        if torch.equal(allowed, (key <= query) & (key // window == query // window)):
            return f"chunks of {window}"
    return f"other (keys visible per query: {visible.tolist()})"


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    return str(value)[:40]


def _lm_head_check(model: PreTrainedModel, ids: torch.Tensor, logits: torch.Tensor, values: dict) -> str:
    """Compare logits with get_output_embeddings()(h), h the decoder's last hidden state, and name the difference."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"no single linear output embedding ({type(head).__name__})"
    try:
        with torch.no_grad(), _quiet():
            hidden = _decoder(model)(input_ids=ids, use_cache=False)[0]
    except Exception as error:  # noqa: BLE001
        return f"decoder forward fails ({type(error).__name__}: {str(error)[:80]})"
    prefix, atol = "", 1e-10
    if logits.dtype != head.weight.dtype:  # compare in the weights' dtype, at the logits' precision
        prefix, atol = f"logits in {str(logits.dtype).removeprefix('torch.')}! ", 1e-5
        logits = logits.to(head.weight.dtype)
    with torch.no_grad(), _quiet():
        for name, transform in _head_transforms(model, head):
            try:
                raw = transform(hidden)
            except Exception:  # noqa: BLE001, S112 - not a module that takes the hidden state alone
                continue
            if raw.shape == logits.shape and torch.allclose(raw.to(logits.dtype), logits, rtol=0, atol=atol):
                return prefix + ("equal" if name == "lm_head(h)" else f"logits = {name}")
        try:
            raw = head(hidden)
        except Exception as error:  # noqa: BLE001
            return prefix + f"output embedding does not take h ({str(error)[:60]})"
    if raw.shape != logits.shape:
        return prefix + f"shape differs: lm_head(h) {tuple(raw.shape)} vs logits {tuple(logits.shape)}"
    caps = [values[k] for k in _FINAL_SOFTCAP_KEYS if _is_number(values.get(k))]
    for cap in [None, *caps]:
        target = logits if cap is None else cap * torch.atanh((logits / cap).clamp(-1 + 1e-15, 1 - 1e-15))
        scale = float((target * raw).sum() / (raw * raw).sum())
        if torch.allclose(scale * raw, target, rtol=1e-6, atol=max(atol, 1e-9)):
            inner = f"{scale:.6g} * lm_head(h)" if abs(scale - 1) > max(atol, 1e-9) else "lm_head(h)"
            return prefix + "logits = " + (f"{cap} * tanh({inner} / {cap})" if cap else inner)
    return prefix + f"unexplained: max |logits - lm_head(h)| = {(logits - raw).abs().max():.3g}"


def _decoder(model: PreTrainedModel) -> torch.nn.Module:
    """The module whose first output is the hidden state the LM head reads."""
    head = model.get_output_embeddings()
    for get in (lambda: model.base_model, model.get_decoder, lambda: model.model):
        try:
            decoder = get()
        except Exception:  # noqa: BLE001, S112
            continue
        if isinstance(decoder, torch.nn.Module) and decoder is not model and decoder is not head:
            return decoder
    raise ValueError(f"no decoder module found in {type(model).__name__}")


def _head_transforms(model: PreTrainedModel, head: torch.nn.Linear):
    """Candidates for "h -> logits": the output embedding, modules around it (BERT's cls.predictions), and a
    sibling transform before it (ModernBERT's lm_head then decoder)."""
    yield "lm_head(h)", head
    head_name = next(name for name, module in model.named_modules() if module is head)
    parts = head_name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        outer = ".".join(parts[:depth])
        yield f"{outer}(h) ({type(model.get_submodule(outer)).__name__}, a transform around {head_name})", \
            model.get_submodule(outer)
    for name, child in model.named_children():
        if child is not head and child is not _decoder(model) and sum(p.numel() for p in child.parameters()):
            yield f"{head_name}({name}(h)) ({type(child).__name__} before the output embedding)", \
                lambda h, child=child: head(child(h))


_TABLE_HEAD = ["type", "class", "attn", "causal", "window", "layer kinds", "softcap attn/final", "sinks",
               "logit scaling", "recurrent", "rope", "k/v head dims", "MoE", "dropout > 0 (default config)",
               "logits vs lm_head(h)", "AttentionInterface calls", "build s"]


def _markdown_table(infos: dict[str, ArchInfo | str], seconds: dict[str, float]) -> str:
    """One row per model type: what it is when built, or why it is skipped."""
    rows = ["| " + " | ".join(_TABLE_HEAD) + " |", "|" + "---|" * len(_TABLE_HEAD)]
    for model_type, info in infos.items():
        if isinstance(info, str):
            cells = [model_type, f"**skipped**: {info}"] + [""] * (len(_TABLE_HEAD) - 3)
        else:
            caps = f"{info.attn_softcap or '-'}/{info.final_logit_softcap or '-'}"
            cells = [
                model_type, info.model_class, info.attn_implementation, "yes" if info.causal else "**no**",
                info.sliding_window or "", ", ".join(sorted(set(info.layer_types or []))),
                "" if caps == "-/-" else caps, "yes" if info.sinks else "", info.logit_scaling or "",
                "yes" if info.recurrent else "", info.rope_type or "", info.kv_head_dims or "",
                "yes" if info.moe else "",
                ", ".join(f"{k}={v}" for k, v in info.dropout_keys.items()), info.lm_head_check,
                "**none**" if info.attention_calls is None else info.attention_calls,
            ]
        rows.append("| " + " | ".join(str(c).replace("|", "/") for c in [*cells, f"{seconds[model_type]:.2f}"]) + " |")
    return "\n".join(rows)


def _markdown_details(infos: dict[str, ArchInfo | str]) -> str:
    """Per built type: what the attention probe saw, and the notes."""
    lines = []
    for model_type, info in infos.items():
        if isinstance(info, ArchInfo):
            seen = "; ".join(f"{k}: {v}" for k, v in info.attention_kwargs.items())
            saw = f"  \n  attention calls saw: {seen}" if seen else ""
            lines.append(f"- **{model_type}**: {info.notes or '-'}{saw}")
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/zoo.py > table.md : build every type, print the report table
    import time

    torch.set_num_threads(1)  # tiny models: threads only add OpenMP contention
    infos: dict[str, ArchInfo | str] = {}
    seconds: dict[str, float] = {}
    for model_type in CAUSAL_LM_TYPES:
        start = time.perf_counter()
        try:
            built = build_tiny(model_type)
            seconds[model_type] = time.perf_counter() - start
            infos[model_type] = arch_info(model_type, built)
        except ZooSkip as skip:
            seconds[model_type] = time.perf_counter() - start
            infos[model_type] = str(skip)
        print(model_type, file=sys.stderr, flush=True)
    print(_markdown_table(infos, seconds), _markdown_details(infos), sep="\n\n")

"""Models: a transformers causal LM from a local path, or a randomly initialised config of a real architecture.

Beside the steps (docs/architecture.md): the policy steps 1 and 5 run.

Nothing here downloads weights: a path must exist on disk, and the built-in shapes (tiny ones for
tests and the CPU demo, real-size ones for GPU benchmarks) start from random weights.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    BambaConfig,
    Lfm2Config,
    LlamaConfig,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from treerl.errors import ModelPathError, UserError

DTYPES = ("float32", "bfloat16", "float16", "float64")  # the parameter dtypes a model may be built or loaded in
ARCHITECTURES = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig,
                 "qwen3_5_text": Qwen3_5TextConfig, "bamba": BambaConfig, "lfm2": Lfm2Config,
                 "qwen2_5_vl": Qwen2_5_VLConfig, "qwen3_moe": Qwen3MoeConfig}
# Hybrids: Gated DeltaNet beside gated attention (Qwen3.5), Mamba2 beside attention (Bamba), short convolutions
# beside attention (LFM2); their recurrent layers' state travels through the tree (treerl.engine.recurrent).
_QWEN35_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)

# Named shapes: (architecture, overrides). "tiny" ones are for tests and the CPU demo.
SHAPES: dict[str, tuple[str, dict]] = {
    "tiny-qwen3": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16)),
    "tiny-qwen2": ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2)),
    "tiny-llama": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2)),
    "tiny-qwen3.5": ("qwen3_5_text", dict(**_QWEN35_TINY, num_hidden_layers=2,
                                          layer_types=["linear_attention", "full_attention"])),
    "tiny-bamba": ("bamba", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
                                 mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16)),
    # MoE: 4 experts, 2 a token (trainer.routing_replay replays the sampler's choice: docs/mismatch.md)
    "tiny-qwen3-moe": ("qwen3_moe", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         num_experts=4, num_experts_per_tok=2)),
    "tiny-lfm2": ("lfm2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, layer_types=["conv", "full_attention"],
                               block_auto_adjust_ff_dim=False)),
    "small-qwen3": ("qwen3", dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=4, head_dim=32)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 tie_word_embeddings=True, rope_theta=1_000_000.0)),
    "small-qwen3.5": ("qwen3_5_text", dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                           num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                           linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
                                           linear_value_head_dim=32, layer_types=["linear_attention"] * 3
                                           + ["full_attention"])),
    # Vision-language (treerl.engine.images): tiny-qwen3's text sizes under a 2-block Qwen2.5-VL vision tower that reads
    # 4x4 patches and merges 2x2 of them into a placeholder token (the shapes task's 32 x 32 images: 16 tokens).
    "tiny-qwen2.5-vl": ("qwen2_5_vl", dict(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                 "mrope_section": [4, 2, 2]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                           temporal_patch_size=1, spatial_merge_size=2, out_hidden_size=64, window_size=16,
                           fullatt_block_indexes=[1]))),
    # small-qwen3's text sizes under a Qwen2.5-VL vision tower that reads 4x4
    # patches and merges 2x2 of them into a placeholder token (a 64 x 64 image: 64 tokens). Its image, video and
    # vision start/end ids are the top four of the vocabulary.
    "small-qwen2.5-vl": ("qwen2_5_vl", dict(
        text_config=dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                 "mrope_section": [8, 4, 4]}),
        vision_config=dict(depth=4, hidden_size=128, intermediate_size=384, num_heads=4, patch_size=4,
                           temporal_patch_size=1, spatial_merge_size=2, out_hidden_size=256, window_size=16,
                           fullatt_block_indexes=[3]))),
}


def shows_images(shape: str) -> bool:
    """A vision-language shape: its tokenizer needs the image tokens (treerl.rollout.conversations.tokenizer.VISION_TOKENS)."""
    return shape in SHAPES and "vision_config" in SHAPES[shape][1]


def check_device(device: str, key: str) -> torch.device:
    """`device` as a torch device this machine has (cpu; cuda or cuda:N with CUDA; mps on Apple silicon), checked
    before anything is built; a UserError naming `key` (model.device, --device) and what is allowed otherwise."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise UserError(f"{key}={device!r} is not a device: use cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(f"{key}={device!r}, but torch sees no CUDA device here (torch.cuda.is_available() is "
                            "False): use cpu")
        if parsed.index is not None and parsed.index >= count:
            raise UserError(f"{key}={device!r}, but there are only {count} CUDA devices (cuda:0 to cuda:{count - 1})")
        return parsed
    if parsed.type == "mps" and torch.backends.mps.is_available():
        return parsed
    raise UserError(f"{key}={device!r}: treerl trains on cpu or cuda (cuda:N), not on {parsed.type!r} here")


def model_config(shape: str, vocab_size: int | None = None, max_positions: int = 32768):
    """The transformers config of a named shape (see SHAPES), random weights to be initialised from it."""
    if shape not in SHAPES:
        raise UserError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    arch, overrides = SHAPES[shape]
    kwargs = dict(vocab_size=512, max_position_embeddings=max_positions, tie_word_embeddings=False)
    kwargs.update(overrides.get("text_config", overrides))
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    if "text_config" not in overrides:
        return ARCHITECTURES[arch](**kwargs)
    top = kwargs["vocab_size"] - 1  # a vision-language shape: the text sizes go to its text config
    ids = dict(image_token_id=top, video_token_id=top - 1, vision_start_token_id=top - 2, vision_end_token_id=top - 3)
    kwargs.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # not the family's: its vocabulary is ours
    return ARCHITECTURES[arch](text_config=kwargs, vision_config=overrides["vision_config"], **ids)


def policy_config(path: str | None, shape: str, vocab_size: int | None = None, trust_remote_code: bool = False):
    """The config of the checkpoint at `path`, else of shape `shape`: what `build_model` builds, without building it."""
    return load_config(path, trust_remote_code) if path else model_config(shape, vocab_size=vocab_size)


def build_model(
    path: str | None = None,
    shape: str = "tiny-qwen3",
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    auto_class: type = AutoModelForCausalLM,
    overrides: dict | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a model from a local `path`, or build shape `shape`; weights not in the checkpoint are seeded.

    `auto_class` and config `overrides` build other heads on the same body (the critic:
    AutoModelForTokenClassification with num_labels=1). Python code shipped with a checkpoint
    (`auto_map`) runs only with `trust_remote_code=True`.
    """
    config = policy_config(path, shape, vocab_size, trust_remote_code)
    config.update(overrides or {})
    config._attn_implementation = attn_implementation
    if auto_class is AutoModelForCausalLM and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES \
            and hasattr(config, "vision_config"):  # a vision-language model: its image-text-to-text class
        auto_class = AutoModelForImageTextToText
    torch.manual_seed(seed)
    if not path:
        return auto_class.from_config(config, dtype=dtype).to(device)
    try:
        model = auto_class.from_pretrained(path, config=config, dtype=dtype, local_files_only=True,
                                           trust_remote_code=trust_remote_code, use_safetensors=True)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # missing, truncated or mismatched weights
        raise ModelPathError(f"model path {str(path)!r}: cannot load its weights ({_first_line(e)})") from None
    if bad := first_nonfinite(model.state_dict()):
        raise ModelPathError(f"model path {str(path)!r}: weight {bad} holds NaN or inf; training from it would only "
                             "produce NaN")
    return model.to(device)


@dataclass(frozen=True)
class ModelGeometry:
    """The sizes that memory budgets and FLOP counts are computed from (one reading of the config for all)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # MLP width
    layers: int
    vocab: int


def model_geometry(config) -> ModelGeometry:
    """The text model's geometry, from configs of any family (GPT-2's n_inner, OPT's ffn_dim, per-layer sizes)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = _size(c, "hidden_size", "n_embd", "d_model")
    heads = _size(c, "num_attention_heads", "n_head") or 1
    return ModelGeometry(
        hidden=hidden, heads=heads, kv_heads=_size(c, "num_key_value_heads") or heads,
        head_dim=_size(c, "head_dim") or hidden // heads,
        ffn=_size(c, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden,  # GPT-2, OPT: the usual 4x width
        layers=_size(c, "num_hidden_layers", "n_layer"), vocab=_size(c, "vocab_size"),
    )


def _size(config, *names: str) -> int:
    """The first of `names` the config sets, as one number (the largest, where it varies by layer)."""
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - per-layer configs refuse a global read (Gemma-4)
            value = [getattr(layer, name, 0) or 0 for layer in getattr(config, "per_layer_config", [])]
        if isinstance(value, (list, tuple)):
            value = max(value, default=0)
        if value:
            return int(value)
    return 0


def load_config(path: str, trust_remote_code: bool = False) -> object:
    """The config of a local checkpoint, without its weights; a clear error for a directory that is not one."""
    check_model_dir(path)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise ModelPathError(f"model path {str(path)!r} needs its own Python code to load (auto_map in its "
                                 "config.json); set model.trust_remote_code=true only if you trust that code") from None
        raise ModelPathError(f"model path {str(path)!r}: unreadable config.json ({_first_line(e)})") from None


def check_model_dir(path: str | Path, key: str = "model path") -> None:
    """A local transformers checkpoint directory (with a config.json), or a ModelPathError naming `key` and what
    the directory lacks."""
    if not Path(path).exists():
        raise ModelPathError(f"{key}={str(path)!r} does not exist (treerl only loads local checkpoints)")
    if not (Path(path) / "config.json").is_file():
        raise ModelPathError(f"{key}={str(path)!r} is not a transformers checkpoint directory: it has no config.json "
                             "(expected config.json, *.safetensors weights and tokenizer files, as save_pretrained "
                             "writes them)")
    check_no_pickled_weights(Path(path), key)


PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")  # what from_pretrained would unpickle


def check_no_pickled_weights(path: Path, key: str) -> None:
    """Weights in pickle files only (pytorch_model.bin) are refused, never unpickled: nothing from a file runs as
    code. With safetensors beside them, transformers reads those."""
    pickled = [name for name in PICKLED_WEIGHTS if (path / name).is_file()]
    if pickled and not any(path.glob("*.safetensors")):
        raise ModelPathError(f"{key}={str(path)!r}: its weights are {pickled[0]}, a pickle, which treerl does not "
                             "load (unpickling can run code); it needs safetensors weights: save them with "
                             "model.save_pretrained(dir, safe_serialization=True), or `treerl export` a treerl "
                             "checkpoint")


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a save_pretrained directory (model.safetensors, or the shards its index lists); safetensors
    only, so no code runs from the files."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    try:
        if (path / "model.safetensors").exists():
            return load_file(path / "model.safetensors")
        if not index.exists():
            raise ModelPathError(f"{path}: no model.safetensors or model.safetensors.index.json")
        weights: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            weights.update(load_file(path / shard))
        return weights
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        if isinstance(e, ModelPathError):
            raise
        raise ModelPathError(f"{path}: unreadable safetensors weights ({_first_line(e)})") from None


def first_nonfinite(weights: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or inf, or None."""
    for name, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def tied_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters registered under several names (tied embeddings): saved once, loaded through the other."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return {name for names in by_id.values() if len(names) > 1 for name in names}


def model_names(model: PreTrainedModel, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under the names the model holds them by: `save_pretrained` writes a family's original
    layout (Qwen-VL: `model.layers.*`, `visual.*` for the model's `model.language_model.layers.*`, `model.visual.*`),
    and the renamings `from_pretrained` applies map it back. (Conversions that merge weights, e.g. experts fused on
    load, are not renamings: such a checkpoint is refused by the name check.)"""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]
    return {rename_source_key(name, renamings, [])[0]: tensor for name, tensor in weights.items()}


# ---------------------------------------------------------------------------------------------- LoRA
ADAPTER_FILE = "adapter_model.safetensors"  # what peft's save_pretrained writes, beside adapter_config.json


def add_lora(model: PreTrainedModel, rank: int, alpha: float, target_modules: str = "all-linear") -> PreTrainedModel:
    """`model` wrapped with LoRA adapters (peft): only the adapters require gradients, the base is frozen.

    `target_modules`: "all-linear" (every linear layer but the output head) or comma-separated module names.
    No adapter dropout: the tree engines and the sampler must compute one function.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("model.lora.rank > 0 needs peft: pip install 'treerl[lora]'") from None
    names = target_modules.strip()
    targets: str | list[str] = names if names == "all-linear" else [n.strip() for n in names.split(",") if n.strip()]
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings():  # peft still asks transformers for the deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, config)
    except ValueError as e:  # no module matched, or a module type peft cannot adapt
        raise UserError(f"model.lora.target_modules={target_modules!r}: {_first_line(e)}") from None


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model with adapters (its checkpoints hold only the adapters)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def adapter_names(model: torch.nn.Module) -> dict[str, str]:
    """Each adapter parameter's name in peft's saved files -> its name in `model.state_dict()` (peft's own mapping)."""
    from peft.utils import get_peft_model_state_dict

    state = dict(model.state_dict())
    saved = get_peft_model_state_dict(model, state_dict=state)
    by_tensor = {id(tensor): name for name, tensor in state.items()}
    return {saved_name: by_tensor[id(tensor)] for saved_name, tensor in saved.items()}


def base_fingerprint(model: torch.nn.Module) -> list[float]:
    """Sum and norm (float64) of every frozen parameter: tells whether adapters are loaded onto the base they were
    trained on (a changed file at model.path, another model.seed or shape) without keeping a copy of it."""
    values = []
    for _, param in sorted(model.named_parameters()):
        if not param.requires_grad:
            values += [float(torch.sum(param, dtype=torch.float64)),
                       float(torch.linalg.vector_norm(param, dtype=torch.float64))]
    return values


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"

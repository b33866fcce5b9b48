"""Tiny random vision-language models and sequences that show images, for the engine and sampler tests.

Qwen2-VL and Qwen2.5-VL (a 2-block vision tower that merges 2x2 patches, multimodal RoPE with (t, h, w) sections),
Qwen3-VL (DeepStack features added in the text body's first two layers), Qwen3.5 (Gated DeltaNet and attention
layers, the same tower) and LLaVA (a 2-layer CLIP tower on 8x8 images, 16 patch tokens, 1-D positions).
"""

from __future__ import annotations

import torch
from transformers import (
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from treerl.tree import ImageSpan, TokenSequence

IMAGE, START, END = 100, 102, 103  # the image placeholder and the tokens around an image
TEXT = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}}
VISION = {"depth": 2, "hidden_size": 32, "num_heads": 4, "patch_size": 2, "temporal_patch_size": 1,
          "spatial_merge_size": 2, "in_channels": 3}
SPECIAL = {"image_token_id": IMAGE, "video_token_id": 101, "vision_start_token_id": START, "vision_end_token_id": END,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
BUILDS = {
    "qwen2_5_vl": lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=TEXT, vision_config={**VISION, "intermediate_size": 64, "out_hidden_size": 32, "window_size": 8,
                                         "fullatt_block_indexes": [1]}, **SPECIAL)),
    "qwen2_vl": lambda: Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=TEXT, vision_config={**VISION, "embed_dim": 32, "mlp_ratio": 2}, **SPECIAL)),
    "qwen3_vl": lambda: Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config={**TEXT, "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
        vision_config={**VISION, "intermediate_size": 64, "out_hidden_size": 32, "num_position_embeddings": 16,
                       "deepstack_visual_indexes": [0, 1]}, **SPECIAL)),
    "qwen3_5": lambda: Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config={**TEXT, "hidden_size": 64, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                     "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                     "layer_types": ["linear_attention", "full_attention"],
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                                         "mrope_section": [1, 1, 0]}},
        vision_config={**VISION, "intermediate_size": 64, "out_hidden_size": 64}, **SPECIAL)),
    "llava": lambda: LlavaForConditionalGeneration(LlavaConfig(
        text_config={**TEXT, "model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 8, "patch_size": 2},
        image_token_id=IMAGE, vision_feature_layer=-2, vision_feature_select_strategy="default",
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
}
_MODELS: dict[str, torch.nn.Module] = {}


def vl_model(name: str) -> torch.nn.Module:
    if name not in _MODELS:
        torch.manual_seed(0)
        _MODELS[name] = BUILDS[name]().double().eval()
    return _MODELS[name]


def image(seed: int, start: int, h: int = 4, w: int = 4, llava: bool = False) -> ImageSpan:
    """Qwen-VL: an h x w patch image (3 channels, 2x2 pixels a patch) at `start`, h * w / 4 placeholder tokens. LLaVA:
    an 8 x 8 image, 16 placeholder tokens (h and w ignored)."""
    g = torch.Generator().manual_seed(seed)
    if llava:
        return ImageSpan(start, 16, torch.randn(3, 8, 8, generator=g, dtype=torch.float64))
    pixels = torch.randn(h * w, 12, generator=g, dtype=torch.float64)
    return ImageSpan(start, h * w // 4, pixels, torch.tensor([1, h, w]))


def sequence(parts: list, seed: int = 0, llava: bool = False) -> TokenSequence:
    """Text (lists of token ids) and images ((seed, h, w) tuples) in order, each image between START and END."""
    tokens, spans = [], []
    for part in parts:
        if isinstance(part, tuple):
            tokens.append(START)
            spans.append(image(part[0], len(tokens), *part[1:], llava=llava))
            tokens += [IMAGE] * spans[-1].length + [END]
        else:
            tokens += part
    g = torch.Generator().manual_seed(seed)
    return TokenSequence(torch.tensor(tokens), images=tuple(spans),
                         fields={"advantages": torch.randn(len(tokens), generator=g, dtype=torch.float64)})


# Gemma 3 as its rollouts see it: a tokenizer that merges newlines (Gemma's does: "\n\n\n" is one token), its special
# tokens named as Gemma's tokenizer_config names them, and a Gemma-3-like chat template that writes <start_of_image>
# for an image part; a tiny model whose image ids are that tokenizer's.
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                 "<end_of_image>", "<image_soft_token>"]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def gemma_tokenizer():
    """A character-level BPE whose merges join runs of newlines, with Gemma 3's special tokens and template."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = list(string.digits + string.ascii_letters + string.punctuation + " \n")
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIAL + characters + ["\n\n", "\n\n\n", "\n\n\n\n"])}
    backend = Tokenizer(models.BPE(vocab, [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n")], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    tokenizer.add_tokens(GEMMA_SPECIAL[4:6], special_tokens=True)  # already in the vocabulary: ids unchanged
    tokenizer.chat_template = GEMMA_TEMPLATE
    return tokenizer


def gemma3_model(tokenizer) -> torch.nn.Module:
    """A tiny float64 Gemma 3 (a 1-layer SigLIP tower on 8 x 8 images pooled to 4 tokens, a sliding window of 4 that
    binds around the images) whose image, start and end ids are `tokenizer`'s."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    ids = tokenizer.convert_tokens_to_ids
    text = {**TEXT, "vocab_size": len(tokenizer), "head_dim": 8, "sliding_window": 4, "rope_parameters": None,
            "layer_types": ["sliding_attention", "full_attention"], "bos_token_id": ids("<bos>"),
            "eos_token_id": ids("<eos>"), "pad_token_id": ids("<pad>")}
    model = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=text, vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                         "num_attention_heads": 4, "image_size": 8, "patch_size": 2},
        mm_tokens_per_image=4, image_token_index=ids("<image_soft_token>"), boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"))).double().eval()
    with torch.no_grad():  # initialised to zero, it would show every image as zeros
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    return model

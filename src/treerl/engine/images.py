"""Images in a tree: each distinct image through the vision tower once a step, its embeddings read by every node that
shows it, and multimodal RoPE positions per node.

Step 5 (docs/architecture.md): what a vision-language model's calls read beside token ids.

A sequence shows an image as a run of placeholder tokens (`treerl.tree.ImageSpan`); the prefix tree merges sequences
by image identity, so a node holding an image's tokens holds the same image for every sequence through it.
`ImageTable` runs the vision tower once on the step's distinct images, without a graph, and keeps its output as leaves:
a call's input embeddings are the token embeddings with the image rows taken from them, and their gradient, summed over
every call that read them, goes back through the tower at the end of the step (`ImageTable.backward`, one image at a
time, its graph recomputed), exactly as each sequence's own call would send it.

Positions: Qwen-VL's multimodal RoPE gives an image's tokens (t, h, w) positions and the text after it positions one
past the image's largest (LLaVA's are the plain depths). A sequence's positions are the model's own `get_rope_index`
of it; they depend only on the prefix, so a node's are those of any sequence through it (`sequence_positions`). The
engines hand a Qwen-VL body `[depth | t | h | w]` position rows: the depth (a token's index in its sequence) orders the
attention, the other three rotate it.

Served: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (its DeepStack features too), Qwen3.5 (hybrid: its calls run in rows, each
padded by repeating its last token's image row and positions) and LLaVA (`VISION_LANGUAGE`: each family's tower,
positions and own-forward inputs), and Gemma 3, whose image tokens attend to each other both ways: the flat reference
(and the embedded sampler) compute that with the model's own masks, DfsEngine with one more attention part per image
(its later keys, treerl.attention.tree_attention). Other vision-language models are refused with images, naming why.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from treerl.attention import UnsupportedModel
from treerl.engine.support import model_name
from treerl.tree import ImageSpan, TokenSequence


class QwenVL:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5: an image is `pixel_values` of one row per patch and its (t, h, w)
    `grid_thw`; the tower (`get_image_features`) merges each 2x2 of patches into one placeholder token's embedding (Qwen3-VL: and DeepStack
    features for the text body's first layers); positions are multimodal RoPE (`get_rope_index`)."""

    both_ways = False  # an image's tokens attend causally, like text

    def placeholders(self, config, grid_thw: torch.Tensor | None) -> int:
        """Placeholder tokens of an image with this patch grid: one per `spatial_merge_size`^2 patches."""
        return int(grid_thw.prod()) // config.vision_config.spatial_merge_size**2

    def malformed(self, model: PreTrainedModel, image: ImageSpan) -> str | None:
        if image.grid_thw is None or image.grid_thw.shape != (3,):
            return f"has no (t, h, w) patch grid (grid_thw), which {model.config.model_type} needs"
        patches = int(image.grid_thw.prod())
        if (made := self.placeholders(model.config, image.grid_thw)) != image.length:
            return f"its grid {image.grid_thw.tolist()} makes {made} placeholder tokens, not {image.length}"
        if image.pixel_values.dim() != 2 or image.pixel_values.shape[0] != patches:
            return (f"pixel_values of shape {tuple(image.pixel_values.shape)}, not one row per patch of its grid "
                    f"({patches} rows)")
        return None

    def features(self, model: PreTrainedModel, images: list[ImageSpan]) -> tuple[list, list]:
        """Each image's embeddings, and (Qwen3-VL) each DeepStack layer's features of each image."""
        device = _device(model)
        pixels = torch.cat([image.pixel_values for image in images]).to(device)
        grids = torch.stack([image.grid_thw for image in images]).to(device)
        output = model.model.get_image_features(pixels, grids, return_dict=True)
        return list(output.pooler_output), [list(layer) for layer in getattr(output, "deepstack_features", None) or []]

    def tower_parameters(self, model: PreTrainedModel):
        return model.model.visual.parameters()

    def blank(self, config) -> ImageSpan:
        """The smallest image the tower takes (one merged patch of zeros), at the start of a sequence."""
        vision = config.vision_config
        merge = vision.spatial_merge_size
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        return ImageSpan(0, 1, torch.zeros(merge * merge, width), torch.tensor([1, merge, merge]))

    def positions(self, model: PreTrainedModel, sequence: TokenSequence) -> torch.Tensor:
        depth = torch.arange(len(sequence))
        if not sequence.images:
            return depth.expand(4, -1)
        ids = sequence.tokens[None].to(_device(model))
        grids = torch.stack([image.grid_thw for image in sequence.images]).to(ids.device)
        types = image_token_types(sequence)[None].to(ids.device)
        rope, _ = model.model.get_rope_index(ids, types, image_grid_thw=grids)
        return torch.cat([depth[None], rope[:, 0].cpu()])

    def own_inputs(self, model: PreTrainedModel, sequence: TokenSequence, ids: torch.Tensor) -> dict:
        return {"pixel_values": torch.cat([i.pixel_values for i in sequence.images]).to(ids.device),
                "image_grid_thw": torch.stack([i.grid_thw for i in sequence.images]).to(ids.device),
                "mm_token_type_ids": image_token_types(sequence)[None, : ids.shape[-1]].to(ids.device)}


class Llava:
    """LLaVA: an image is `pixel_values` of shape (channels, height, width); the tower (a CLIP-style encoder, one
    layer's patch states through the projector, `get_image_features`) gives one placeholder token per patch; positions
    are the plain 1-D ones (the depth)."""

    both_ways = False  # an image's tokens attend causally, like text

    def placeholders(self, config, grid_thw: torch.Tensor | None = None) -> int:
        """Placeholder tokens of an image: one per patch (and the CLS state's, when the projector keeps it)."""
        vision = config.vision_config
        return (vision.image_size // vision.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")

    def malformed(self, model: PreTrainedModel, image: ImageSpan) -> str | None:
        vision = model.config.vision_config
        if image.pixel_values.shape != (vision.num_channels, vision.image_size, vision.image_size):
            return (f"pixel_values of shape {tuple(image.pixel_values.shape)}, not the tower's (channels, height, "
                    f"width) = {(vision.num_channels, vision.image_size, vision.image_size)}")
        tokens = self.placeholders(model.config)
        if image.length != tokens:
            return f"the tower makes {tokens} placeholder tokens of an image, not {image.length}"
        return None

    def features(self, model: PreTrainedModel, images: list[ImageSpan]) -> tuple[list, list]:
        pixels = torch.stack([image.pixel_values for image in images]).to(_device(model))
        output = model.model.get_image_features(
            pixels, vision_feature_layer=model.config.vision_feature_layer,
            vision_feature_select_strategy=model.config.vision_feature_select_strategy, return_dict=True)
        return list(output.pooler_output), []

    def tower_parameters(self, model: PreTrainedModel):
        return [*model.model.vision_tower.parameters(), *model.model.multi_modal_projector.parameters()]

    def blank(self, config) -> ImageSpan:
        """An image of zeros at the start of a sequence (the tower takes one size)."""
        vision = config.vision_config
        pixels = torch.zeros(vision.num_channels, vision.image_size, vision.image_size)
        return ImageSpan(0, self.placeholders(config), pixels)

    def positions(self, model: PreTrainedModel, sequence: TokenSequence) -> torch.Tensor:
        return torch.arange(len(sequence))[None]

    def own_inputs(self, model: PreTrainedModel, sequence: TokenSequence, ids: torch.Tensor) -> dict:
        return {"pixel_values": torch.stack([i.pixel_values for i in sequence.images]).to(ids.device)}


class Gemma3(Llava):
    """Gemma 3: an image is `pixel_values` of shape (channels, height, width); the tower (SigLIP, then the projector
    pooling its patches, `get_image_features`) gives `mm_tokens_per_image` placeholder tokens; positions are the plain
    1-D ones. An image's tokens attend to each other both ways (a bidirectional block per image inside the causal
    mask; on sliding-window layers the window still bounds what lies before): the flat reference computes it with the
    model's own mask (`body_mask`), DfsEngine with each image's later keys as one more part of its attention."""

    both_ways = True

    def placeholders(self, config, grid_thw: torch.Tensor | None = None) -> int:
        return config.mm_tokens_per_image

    def features(self, model: PreTrainedModel, images: list[ImageSpan]) -> tuple[list, list]:
        pixels = torch.stack([image.pixel_values for image in images]).to(_device(model))
        return list(model.model.get_image_features(pixels, return_dict=True).pooler_output), []

    def own_inputs(self, model: PreTrainedModel, sequence: TokenSequence, ids: torch.Tensor) -> dict:
        return {**super().own_inputs(model, sequence, ids),
                "token_type_ids": image_token_types(sequence)[None, : ids.shape[-1]].long().to(ids.device)}

    def body_mask(self, model: PreTrainedModel, types: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                  padding: torch.Tensor | None = None, cache=None) -> dict:
        """The text body's attention masks (full and sliding layers) for tokens of these image `types` `[B, L]`,
        as the model's own forward builds them: causal, or both ways inside each image."""
        from transformers.models.gemma3.modeling_gemma3 import (
            create_masks_for_vision_model,
            get_block_sequence_ids_for_mask,
        )

        return create_masks_for_vision_model(
            config=model.config.get_text_config(), inputs_embeds=embeds, attention_mask=padding, cache=cache,
            position_ids=positions, block_sequence_ids=get_block_sequence_ids_for_mask(types, device=embeds.device))


# Vision-language model types whose images treerl feeds, and how.
VISION_LANGUAGE = {"qwen2_vl": QwenVL(), "qwen2_5_vl": QwenVL(), "qwen3_vl": QwenVL(), "qwen3_5": QwenVL(),
                   "llava": Llava(), "gemma3": Gemma3()}


# Vision-language model types refused with images for a reason of their own (the others: not fed yet).
REFUSED_WITH_IMAGES = {
    "paligemma": "its prompt and image tokens attend to each other both ways (a bidirectional prefix), which treerl's "
                 "tree attention does not compute",
}


def vision_family(model_or_config) -> QwenVL | Llava | None:
    """How treerl feeds the images of this model (or config) type; None for a model whose images it does not feed."""
    config = getattr(model_or_config, "config", model_or_config)
    return VISION_LANGUAGE.get(getattr(config, "model_type", None))


def check_images(model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> None:
    """Images only for a model whose vision tower treerl feeds, each shown as its model's placeholder token, as many of
    them as the tower makes of it, and not the sequence's last token."""
    shown = [(i, s) for i, s in enumerate(sequences) if s.images]
    if not shown:
        return
    family = vision_family(model)
    kind = getattr(model.config, "model_type", None)
    if kind in REFUSED_WITH_IMAGES:
        i, sequence = shown[0]
        raise UnsupportedModel(f"{sequence.label(i)} shows an image, and {model_name(model)}: "
                               f"{REFUSED_WITH_IMAGES[kind]}")
    if family is None:
        i, sequence = shown[0]
        raise UnsupportedModel(
            f"{sequence.label(i)} shows an image, and {model_name(model)} is not a vision-language model whose images "
            f"treerl feeds ({', '.join(VISION_LANGUAGE)}); training on its placeholder tokens without the pixels "
            "behind them would be wrong"
        )
    image_token = model.config.image_token_id
    for i, sequence in shown:
        for k, image in enumerate(sequence.images):
            what = f"{sequence.label(i)}: image {k} at tokens [{image.start}, {image.end})"
            token = int(sequence.tokens[image.start])
            if token != image_token:
                raise UnsupportedModel(f"{what} shows as token {token}, not the model's image token {image_token}")
            why = family.malformed(model, image)
            if why is not None:
                raise UnsupportedModel(f"{what}: {why}")
            if image.end >= len(sequence):
                raise UnsupportedModel(f"{what} ends the sequence: the model reads every token but the last, so the "
                                       "image would reach it cut short; end the sequence with text")


def image_token_types(sequence: TokenSequence) -> torch.Tensor:
    """1 on the tokens an image is shown at, 0 on text: what a Qwen-VL processor's `mm_token_type_ids` marks. An
    image token the model wrote itself (a sampled reply) is text, as the sampler decoded it: only a processor places
    images."""
    types = torch.zeros(len(sequence), dtype=torch.int)
    for image in sequence.images:
        types[image.start : image.end] = 1
    return types


def sequence_positions(model: PreTrainedModel, sequence: TokenSequence) -> torch.Tensor:
    """`[rows, len]`: each token's depth, then (Qwen-VL) its (t, h, w) rotary positions, as the model's own forward
    computes them."""
    return vision_family(model).positions(model, sequence)


def body_positions(positions: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The body's position_ids for a call of `shape` from `[rows, tokens]` positions: `[rows, *shape]`, or the plain
    `shape` of 1-D positions."""
    rows = positions.numel() // shape.numel()
    return positions.reshape(shape) if rows == 1 else positions.reshape(rows, *shape)


def own_forward_inputs(model: PreTrainedModel, sequence: TokenSequence, ids: torch.Tensor) -> dict:
    """What the model's own forward takes beside `ids` for the sequence's images, as its processor hands them over."""
    return vision_family(model).own_inputs(model, sequence, ids) if sequence.images else {}


def blank_image_inputs(model: PreTrainedModel) -> dict | None:
    """The model's own forward inputs for one blank image and a token after it; None for a model without a tower that
    treerl feeds. A data-parallel wrapper reduces the gradients of the parameters its forward ran: the gradient sync's
    forward shows this image, so the vision tower's gradients are summed over ranks with the rest."""
    family = vision_family(model)
    if family is None:
        return None
    image = family.blank(model.config)
    sequence = TokenSequence(torch.tensor([model.config.image_token_id] * image.length + [0]), images=(image,))
    ids = sequence.tokens[None].to(_device(model))
    return {"input_ids": ids, **family.own_inputs(model, sequence, ids)}


def tower_parameters(model: PreTrainedModel) -> list[torch.nn.Parameter]:
    """The vision tower's parameters (and its projector's); none for a model without a tower that treerl feeds."""
    family = vision_family(model)
    return [] if family is None else list(family.tower_parameters(model))


def _device(model: PreTrainedModel) -> torch.device:
    return model.get_input_embeddings().weight.device


class ImageTable:
    """The step's distinct images through the vision tower: one embedding row per placeholder token, by image (and,
    for Qwen3-VL, one more row a token per DeepStack layer: features the text body adds to the image tokens' hidden
    states in its first layers).

    The walk never holds the tower's graph: the table is computed without one, as leaves the calls read, and
    `backward` runs the tower again on one image at a time, with a graph, sending it that image's rows' gradient. So
    the memory a walk holds with images is the text walk's plus the leaves (a row per placeholder token), and at the end
    one image's graph alone, never more than a flat call on a sequence showing that image holds; the price is one more
    vision forward a step."""

    def __init__(self, model: PreTrainedModel, sequences: Sequence[TokenSequence], grad: bool, attached: bool = False):
        """`grad`: the leaves take gradients (when the tower trains); `attached`: the calls read the tower's output
        itself, with its graph, one backward through all (the flat reference's call on one sequence)."""
        distinct: dict[int, ImageSpan] = {}
        for sequence in sequences:
            for image in sequence.images:
                distinct.setdefault(image.digest, image)
        self.model, self.images = model, list(distinct.values())
        self.positions: dict[int, torch.Tensor] = {}  # id(sequence) -> its positions (`span`)
        self.base: dict[int, int] = {}  # image digest -> its first row
        rows = 0
        for digest, image in distinct.items():
            self.base[digest] = rows
            rows += image.length
        self.rows = rows
        self.leaves: list[torch.Tensor] = []  # the embeddings, then each DeepStack layer's features
        self.recomputes = False  # backward runs the tower again, an image at a time
        if not distinct:
            return
        family = vision_family(model)
        trains = grad and any(p.requires_grad for p in family.tower_parameters(model))
        with torch.set_grad_enabled(attached and trains):
            main, deep = family.features(model, self.images)
        self.leaves = [torch.cat(main)] + [torch.cat(layer) for layer in deep]
        if trains and not attached:
            self.leaves = [leaf.requires_grad_() for leaf in self.leaves]
        self.recomputes = trains and not attached

    def span(self, sequence: TokenSequence, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [start, end) of `sequence` as a call reads them: their positions (`[rows, end - start]`,
        `sequence_positions`, computed once a sequence) and each one's table row (-1 for text)."""
        if id(sequence) not in self.positions:
            self.positions[id(sequence)] = sequence_positions(self.model, sequence)
        rows = torch.full((end - start,), -1, dtype=torch.long)
        for image in sequence.images:
            lo, hi = max(image.start, start), min(image.end, end)
            if lo < hi:
                base = self.base[image.digest] - image.start
                rows[lo - start : hi - start] = torch.arange(base + lo, base + hi)
        return self.positions[id(sequence)][:, start:end], rows

    def inputs(self, model: PreTrainedModel, ids: torch.Tensor, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The body's inputs for `ids` and their table rows (`rows`, same shape, -1 for text): token embeddings with
        the image tokens' taken from the table, and Qwen3-VL's DeepStack features of the image tokens, in order."""
        embeds = model.get_input_embeddings()(ids)
        shown = rows >= 0
        chosen = rows[shown]
        inputs = {"inputs_embeds": embeds.masked_scatter(shown[..., None], self.leaves[0][chosen].to(embeds.dtype))}
        if len(self.leaves) > 1:
            inputs["visual_pos_masks"] = shown
            inputs["deepstack_visual_embeds"] = [leaf[chosen].to(embeds.dtype) for leaf in self.leaves[1:]]
        return inputs

    def backward(self) -> None:
        """What every call sent to the image rows, back through the vision tower: one image at a time, its graph
        recomputed (a tower encodes each image on its own, so this is the gradient of the one call on all)."""
        if not self.recomputes or all(leaf.grad is None for leaf in self.leaves):
            return
        family = vision_family(self.model)
        for image in self.images:
            span = slice(self.base[image.digest], self.base[image.digest] + image.length)
            with torch.enable_grad():
                main, deep = family.features(self.model, [image])
            outputs = [main[0]] + [layer[0] for layer in deep]
            grads = [leaf.grad[span] if leaf.grad is not None else torch.zeros_like(out)
                     for leaf, out in zip(self.leaves, outputs)]
            torch.autograd.backward(outputs, grads)
        for leaf in self.leaves:
            leaf.grad = None

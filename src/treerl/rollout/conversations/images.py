"""Images in prompts: read from where a user's data or an agent's request keeps them, and turned into the pixels and
placeholder tokens the model's processor makes of them.

Step 1 (docs/architecture.md): the images a prompt shows, as `treerl.tree.ImageSpan`s beside its token ids.

A chat message shows an image as a content part, in transformers' form (`{"type": "image", "image": ...}`) or
OpenAI's (`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`). The image is a PIL image, an
`[height, width, 3]` uint8 array, the bytes of an image file, a datasets `Image` value (`{"bytes", "path"}`), a
local file path or a base64 data URL; nothing is downloaded (an http URL is refused with a clear error). The chat
template writes one image token per image part (Qwen-VL: `<|vision_start|><|image_pad|><|vision_end|>`, the built-in
tokenizer: `<vision_start><image><vision_end>`); `ImageProcessor` turns the image into the model's `pixel_values`
(and Qwen-VL's patch grid) and says how many placeholder tokens that one token expands to, as the model's own
processor does: Qwen-VL's `Qwen2VLImageProcessor` (its images keep their size, rounded to whole merged patches,
unless a checkpoint's preprocessor config says otherwise), LLaVA's CLIP processor (resized to the tower's size).
Gemma 3's template writes `<start_of_image>`, which its processor expands in the rendered text (newlines around the
image's tokens, which the tokenizer merges with the text's own): its prompts are tokenized by transformers'
`Gemma3Processor` after that expansion (`ImageProcessor.tokenize_with_images`), pan & scan crops included.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from transformers import PreTrainedTokenizerBase

from treerl.engine.images import Gemma3, Llava, QwenVL, vision_family
from treerl.errors import UserError
from treerl.tree import ImageSpan

IMAGE_PARTS = ("image", "image_url")  # content part types that show an image
MAX_ASPECT_RATIO = 200  # longest side / shortest side of an image (Qwen-VL's processor refuses more)


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The image content parts of a conversation, in order."""
    return [part for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if isinstance(part, dict) and part.get("type") in IMAGE_PARTS]


def part_image(part: dict[str, Any]) -> Any:
    """What an image content part holds: transformers' `image` (or `url` / `path`), or OpenAI's `image_url.url`."""
    if part["type"] == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    return None


def read_images(messages: list[dict[str, Any]], who: str) -> list[Image.Image]:
    """Every image a conversation shows, in order, read (`load_image`); errors name `who` and the image's index."""
    return [load_image(part_image(part), f"{who}, image {k}") for k, part in enumerate(image_parts(messages))]


def load_image(value: Any, who: str) -> Image.Image:
    """`value` as an RGB PIL image; a UserError naming `who` when it is none of the accepted forms, unreadable, or of
    a size no processor takes (`check_size`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)  # PIL only warns up to twice its limit
        return _load_image(value, who)


def _load_image(value: Any, who: str) -> Image.Image:
    """`load_image`, with PIL's decompression-bomb warning raised as an error."""
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, np.ndarray):
            image = Image.fromarray(value)
        elif isinstance(value, dict) and ("bytes" in value or "path" in value):  # a datasets Image value
            return _load_image(value.get("bytes") or value.get("path"), who)
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, str) and value.startswith("data:"):
            header, _, data = value.partition(",")
            if not header.endswith(";base64"):
                raise UserError(f"{who}: a data URL must be base64 (data:image/png;base64,...), got {header!r}")
            image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        elif isinstance(value, str) and value.split(":", 1)[0] in ("http", "https"):
            raise UserError(f"{who}: {value[:80]!r} is a web address; treerl downloads nothing at run time: save the "
                            "image and give its local path, its bytes or a data URL")
        elif isinstance(value, (str, Path)):
            if Path(value).is_dir():
                raise UserError(f"{who}: image path {str(value)!r} is a directory, not an image file")
            if not Path(value).is_file():
                raise UserError(f"{who}: image file {str(value)!r} does not exist")
            image = Image.open(value)
        else:
            raise UserError(f"{who}: an image must be a PIL image, a uint8 array, bytes, a local path or a data URL, "
                            f"not {type(value).__name__}")
        check_size(image, who)  # from the header, before the pixels are decoded
        image.load()
    except UserError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # PIL's, when the file is opened
        raise UserError(f"{who}: the image is larger than {Image.MAX_IMAGE_PIXELS} pixels, the most treerl decodes "
                        "(a decompression bomb?)") from None
    except (UnidentifiedImageError, OSError, ValueError, TypeError, binascii.Error) as e:
        raise UserError(f"{who}: cannot read the image ({e})") from None
    return image.convert("RGB")


def check_size(image: Image.Image, who: str) -> None:
    """An image every vision-language processor treerl feeds can take: at most PIL's decompression-bomb limit of
    pixels (a small file may claim a huge size), and no more than MAX_ASPECT_RATIO times longer than wide (Qwen-VL's
    processor refuses more, mid-rollout)."""
    width, height = image.size
    if width < 1 or height < 1:
        raise UserError(f"{who}: the image is {width}x{height} pixels, it has none")
    if Image.MAX_IMAGE_PIXELS is not None and width * height > Image.MAX_IMAGE_PIXELS:
        raise UserError(f"{who}: the image is {width}x{height} pixels, more than the {Image.MAX_IMAGE_PIXELS} treerl "
                        "decodes (a decompression bomb?)")
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise UserError(f"{who}: the image is {width}x{height} pixels, an aspect ratio above {MAX_ASPECT_RATIO} "
                        "(Qwen-VL's processor refuses it): crop or pad it")


class ImageProcessor:
    """A vision-language model's image preprocessing: an image -> its `pixel_values`, patch grid and placeholder count.

    `path`: a local checkpoint whose `preprocessor_config.json` sets the processing (sizes, means); without one the
    processor is built from the model config alone."""

    def __init__(self, config, path: str | None = None):
        family = vision_family(config)
        if family is None:
            raise UserError(f"{config.model_type} is not a vision-language model whose images treerl feeds")
        self.config, self.family = config, family
        self.image_token_id: int = config.image_token_id
        self.processor = _checkpoint_processor(path) or _processor_from_config(config, family)
        self._text_processor: tuple[PreTrainedTokenizerBase, Any] | None = None  # (tokenizer, its Gemma3Processor)

    @property
    def expands_text(self) -> bool:
        """Whether the model's processor expands an image's start token in the rendered *text* (Gemma 3: "\n\n", the
        start token, the image's tokens, the end token, "\n\n"), so that the tokenizer merges those newlines with the
        text around them: then the prompt is tokenized after the expansion (`tokenize_with_images`), not before."""
        return isinstance(self.family, Gemma3)

    def span(self, image: Image.Image, start: int) -> ImageSpan:
        """The image at token `start`, as the engines and the sampler read it (float32 pixels)."""
        out = self.processor(images=[image], return_tensors="pt")
        pixels = out["pixel_values"].float()
        grid = out["image_grid_thw"][0] if "image_grid_thw" in out else None
        if isinstance(self.family, Llava):
            pixels = pixels[0]
        return ImageSpan(start, self.family.placeholders(self.config, grid), pixels, grid, source=png_bytes(image))

    def tokenize_with_images(self, text: str, images: list[Image.Image], tokenizer: PreTrainedTokenizerBase, who: str,
                             offset: int = 0) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """Rendered `text`, whose chat template wrote one start token per image, as the model's own processor
        tokenizes it (transformers' Gemma3Processor: each start token expanded in the text, pan & scan crops
        included when the image processor asks for them), and every image it shows as a span (a crop is an image
        of its own), placed `offset` tokens further on."""
        processor = self._processor_with(tokenizer)
        written = text.count(tokenizer.boi_token)
        if written != len(images):
            raise UserError(f"{who} shows {len(images)} images, but the chat template wrote {written} "
                            f"{tokenizer.boi_token} tokens: give the model's own chat template")
        out = processor(text=[text], images=[images] if images else None, add_special_tokens=False,
                        return_tensors="pt", **self._pan_and_scan())
        ids = out["input_ids"][0].tolist()
        starts = [i for i, token in enumerate(ids)
                  if token == self.image_token_id and (i == 0 or ids[i - 1] != self.image_token_id)]
        pixels = out["pixel_values"].float() if images else torch.zeros(0)
        if len(starts) != len(pixels):
            raise UserError(f"{who}: the processor made {len(pixels)} images (crops included) but {len(starts)} runs of "
                            f"image tokens")
        length = self.family.placeholders(self.config)
        return ids, tuple(ImageSpan(offset + start, length, pixels[k]) for k, start in enumerate(starts))

    def _processor_with(self, tokenizer: PreTrainedTokenizerBase):
        """transformers' Gemma3Processor over this image processor and `tokenizer`, checked and built once."""
        if self._text_processor is None or self._text_processor[0] is not tokenizer:
            from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

            for name in ("boi_token", "eoi_token", "image_token"):
                if getattr(tokenizer, name, None) is None:
                    raise UserError(f"{self.config.model_type}: the tokenizer names no {name} (its tokenizer_config's "
                                    "extra_special_tokens): give the checkpoint's own tokenizer (model.tokenizer_path)")
            if tokenizer.image_token_id != self.image_token_id:
                raise UserError(f"the tokenizer's image token {tokenizer.image_token!r} is id "
                                f"{tokenizer.image_token_id}, the model's image_token_id {self.image_token_id}: give "
                                "the checkpoint's own tokenizer")
            self._text_processor = (tokenizer, Gemma3Processor(image_processor=self.processor, tokenizer=tokenizer,
                                                               image_seq_length=self.family.placeholders(self.config)))
        return self._text_processor[1]

    def _pan_and_scan(self) -> dict[str, Any]:
        """The image processor's own pan & scan settings (a checkpoint's preprocessor_config), which the processor's
        call would otherwise replace with its defaults (off)."""
        keys = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                "pan_and_scan_min_ratio_to_activate")
        return {key: getattr(self.processor, key) for key in keys if getattr(self.processor, key, None) is not None}


def png_bytes(image: Image.Image) -> bytes:
    """The image as a PNG file (lossless): what an inference server is sent, to process as the trainer did."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _checkpoint_processor(path: str | None):
    """The image processor a local checkpoint ships (its preprocessor_config.json), else None; never downloaded."""
    if path is None or not (Path(path) / "preprocessor_config.json").is_file():
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")


def _processor_from_config(config, family: QwenVL | Llava):
    """The image processor of a random-init shape: the model's own processor class, sized by its vision config."""
    vision = config.vision_config
    if isinstance(family, Gemma3):
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        return Gemma3ImageProcessorPil(size={"height": vision.image_size, "width": vision.image_size})
    if isinstance(family, QwenVL):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        factor = vision.patch_size * vision.spatial_merge_size
        return Qwen2VLImageProcessorPil(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                        merge_size=vision.spatial_merge_size, min_pixels=factor**2,
                                        max_pixels=1024 * 1024)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    side = vision.image_size
    return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def image_processor(config, path: str | None = None) -> ImageProcessor | None:
    """The model's image processor when treerl feeds its images, else None (a text model)."""
    return ImageProcessor(config, path) if vision_family(config) is not None else None


def expand_images(ids: list[int], images: list[Image.Image], processor: ImageProcessor | None, who: str,
                  offset: int = 0) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """The rendered prompt `ids`, whose chat template wrote one image token per image, with each such token expanded
    into the image's placeholder tokens, and the images as spans over them (placed `offset` tokens further on: `ids`
    continue a context that long)."""
    if not images:
        return ids, ()
    if processor is None:
        raise UserError(f"{who} shows an image, but the model is not a vision-language model whose images treerl "
                        "feeds (treerl.engine.images.VISION_LANGUAGE)")
    if processor.expands_text:
        raise ValueError(f"{processor.config.model_type} expands its images in the text: ImageProcessor."
                         "tokenize_with_images, before tokenizing")
    shown = [i for i, token in enumerate(ids) if token == processor.image_token_id]
    if len(shown) != len(images):
        raise UserError(f"{who} shows {len(images)} images, but the chat template wrote {len(shown)} image tokens "
                        f"(id {processor.image_token_id}): give the model's own chat template")
    out: list[int] = []
    spans = []
    last = 0
    for where, image in zip(shown, images):
        out += ids[last:where]
        spans.append(processor.span(image, offset + len(out)))
        out += [processor.image_token_id] * spans[-1].length
        last = where + 1
    return out + ids[last:], tuple(spans)


"""A training sequence: tokens plus the per-token and per-sequence data a loss reads, and the images it shows.

Step 2 (docs/architecture.md): what every later step reads.

An image sits in a sequence as the run of placeholder tokens its model's processor makes for it (Qwen-VL: one
`<|image_pad|>` per merged patch), with the pixels the vision tower reads (`ImageSpan`). Two sequences share a prefix
through an image only where it is the same image at the same place: the prefix tree merges sequences by `merge_keys`,
the tokens with each placeholder replaced by a key of the image's content and its offset in it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from treerl.errors import UserError


class BatchError(UserError):
    """Bad input found before any compute; the message names the sequence and the field."""


# Per-token field of an MoE policy's rollouts: the experts each decoder layer routed the token to, [tokens, decoder
# layers, experts per token] (vLLM's layout; -1 where nothing was routed). treerl.engine.routing replays it.
ROUTED_EXPERTS = "routed_experts"
IMAGE_KEY_OFFSETS = 2**20  # most placeholder tokens one image may have (its offsets are part of its merge keys)


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """An image shown at tokens [start, start + length) of its sequence (its placeholder tokens), with what the
    model's vision tower reads: `pixel_values` as its processor makes them, `grid_thw` its patch grid (Qwen-VL), and
    `source`, the image itself as a PNG file's bytes, for an inference server that processes images itself (a
    rollout's spans carry it; the engines never read it)."""

    start: int
    length: int
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor | None = None
    source: bytes | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.length

    @functools.cached_property
    def digest(self) -> int:
        """The image's identity: a 40-bit hash of its pixels (values, dtype, shape) and grid. Two images share a
        prefix only if their digests are equal (distinct images collide with probability about 2^-40 a pair)."""
        h = hashlib.blake2b(digest_size=5)
        for part in (self.pixel_values, self.grid_thw):
            if part is not None:
                part = part.detach().cpu().contiguous()
                h.update(f"{part.dtype}{tuple(part.shape)}".encode())
                h.update(part.view(torch.uint8).numpy().tobytes() if part.numel() else b"")
        return int.from_bytes(h.digest(), "big")

    def stand_in(self) -> ImageSpan:
        """This image for the tree without its pixels: the same place, grid and digest (so it merges as the image
        does), for counting a batch's tokens and sharing without holding the image."""
        span = ImageSpan(self.start, self.length, self.pixel_values.new_empty(0), self.grid_thw)
        span.__dict__["digest"] = self.digest  # the cached property, set to the image's
        return span


@dataclass
class TokenSequence:
    """One training sequence.

    `fields` holds per-token tensors aligned with `tokens` (same length): loss mask, advantages,
    behaviour log-probs ... `info` holds per-sequence values: reward, group id, policy version ...
    Sequences that share a prefix may carry different field values on the shared tokens.
    """

    tokens: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    images: tuple[ImageSpan, ...] = ()  # in order of their place in the sequence

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        self.fields = {k: torch.as_tensor(v) for k, v in self.fields.items()}
        self.images = tuple(self.images)

    @property
    def merge_keys(self) -> torch.Tensor:
        """What the prefix tree merges sequences by: the tokens, with the i-th placeholder token of an image replaced
        by -(1 + digest * IMAGE_KEY_OFFSETS + i) (negative: no token id), so that equal keys are the same token or the
        same image at the same offset."""
        if not self.images:
            return self.tokens
        keys = self.tokens.clone()
        for image in self.images:
            offsets = torch.arange(image.length, dtype=torch.long)
            keys[image.start : image.end] = -(1 + image.digest * IMAGE_KEY_OFFSETS + offsets)
        return keys

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def label(self, index: int) -> str:
        """How error messages name this sequence."""
        return f"sequence {index}" + (f" ({self.name!r})" if self.name else "")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_sequences(
    sequences: Sequence[TokenSequence],
    vocab_size: int | None = None,
    max_positions: int | None = None,
) -> None:
    """Reject a bad batch before any compute, naming the sequence and the field (docs/design.md, invariant 3)."""
    if len(sequences) == 0:
        raise BatchError("the batch holds no sequences")
    for i, seq in enumerate(sequences):
        if not isinstance(seq, TokenSequence):
            raise BatchError(f"sequence {i}: expected treerl.tree.Sequence, got {type(seq).__name__}")
        who = seq.label(i)
        n = len(seq)
        if n == 0:
            raise BatchError(f"{who}: field 'tokens' is empty")
        if max_positions is not None and 0 < max_positions < n:  # <= 0: the model sets no limit (XLNet)
            raise BatchError(
                f"{who}: field 'tokens' has {n} tokens, more than the model's maximum of {max_positions} positions"
            )
        if vocab_size is not None:
            lo, hi = int(seq.tokens.min()), int(seq.tokens.max())
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                pos = int((seq.tokens == bad).nonzero()[0])
                raise BatchError(
                    f"{who}: field 'tokens' has id {bad} at position {pos}, outside the vocabulary [0, {vocab_size})"
                )
        for key, value in seq.fields.items():
            if value.dim() != (3 if key == ROUTED_EXPERTS else 1) or value.shape[0] != n:
                raise BatchError(
                    f"{who}: field {key!r} has shape {tuple(value.shape)}, but the sequence has {n} tokens"
                )
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                pos = int((~torch.isfinite(value)).nonzero()[0])
                raise BatchError(f"{who}: field {key!r} is {value[pos].item()} at token {pos} (NaN/inf not allowed)")
        for key, value in seq.info.items():
            if _is_number(value) and not math.isfinite(value):
                raise BatchError(f"{who}: field {key!r} is {value} (NaN/inf not allowed)")
        _validate_images(seq, who)


def _validate_images(seq: TokenSequence, who: str) -> None:
    """Images in order, each a run of tokens inside the sequence, none overlapping, pixels finite."""
    end = 0
    for k, image in enumerate(seq.images):
        what = f"{who}: image {k}"
        if not isinstance(image, ImageSpan):
            raise BatchError(f"{what}: expected treerl.tree.ImageSpan, got {type(image).__name__}")
        if not 1 <= image.length <= IMAGE_KEY_OFFSETS:
            raise BatchError(f"{what} has {image.length} placeholder tokens (1 to {IMAGE_KEY_OFFSETS})")
        if image.start < end or image.end > len(seq):
            where = ("overlaps the image before it" if image.start < end
                     else f"ends past the sequence's {len(seq)} tokens")
            raise BatchError(f"{what} at tokens [{image.start}, {image.end}) {where}")
        placeholders = seq.tokens[image.start : image.end]
        if bool((placeholders != placeholders[0]).any()):
            raise BatchError(f"{what} at tokens [{image.start}, {image.end}): its placeholder tokens are not one "
                             "repeated id (the model's image token)")
        if not isinstance(image.pixel_values, torch.Tensor) or not image.pixel_values.is_floating_point():
            raise BatchError(f"{what}: pixel_values must be a floating-point tensor")
        if not bool(torch.isfinite(image.pixel_values).all()):
            raise BatchError(f"{what}: pixel_values hold NaN/inf")
        end = image.end

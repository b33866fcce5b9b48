"""Images in sequences: the prefix tree shares a prefix through an image only where it is the same image at the same
place, and bad image spans are named before any compute (the engines: tests/engine/test_images.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treerl.tree import BatchError, ImageSpan, PrefixTree, TokenSequence, validate_sequences

PAD = 9  # the placeholder token every image shows as


def _image(seed: int, start: int, length: int = 3) -> ImageSpan:
    g = torch.Generator().manual_seed(seed)
    return ImageSpan(start, length, torch.rand(length * 4, 6, generator=g), torch.tensor([1, 2, 2 * length]))


def _sequence(prefix: list[int], images: list[tuple[int, int]], suffix: list[int]) -> TokenSequence:
    """`prefix`, then each (seed, length) image as PAD tokens, then `suffix`."""
    tokens, spans = list(prefix), []
    for seed, length in images:
        spans.append(_image(seed, len(tokens), length))
        tokens += [PAD] * length
    return TokenSequence(torch.tensor(tokens + suffix), images=tuple(spans))


def _shared(tree: PrefixTree, a: int, b: int) -> int:
    """Tokens the paths of sequences a and b share."""
    common = set(tree.path(a)) & set(tree.path(b))
    return max((tree.nodes[n].end for n in common), default=0)


def test_the_same_image_at_the_same_place_is_shared_a_different_one_is_not():
    group = [_sequence([1, 2], [(0, 3)], [4, 5]), _sequence([1, 2], [(0, 3)], [6]),  # one image prompt, two samples
             _sequence([1, 2], [(1, 3)], [4, 5])]  # the same tokens, another image
    tree = PrefixTree.build(group)
    assert _shared(tree, 0, 1) == 5  # prompt and image once
    assert _shared(tree, 0, 2) == 2  # only the text before the image
    assert [tree.nodes[n].tokens.tolist() for n in tree.path(2)] == [[1, 2], [PAD, PAD, PAD, 4, 5]]  # real ids


def test_an_agent_episode_shares_every_earlier_screenshot():
    turns = [(0, 2), (1, 2), (2, 2)]
    episode = [_sequence([1], turns[: t + 1], [3 + t]) for t in range(3)]
    branch = _sequence([1], [(0, 2), (1, 2), (7, 2)], [5])  # a retry whose last screenshot differs
    tree = PrefixTree.build([*episode, branch])
    assert _shared(tree, 2, 3) == 5  # the first two screenshots
    # [1, shot 0] once, each turn's own text, shot 1 once, shot 2 and shot 7 with their texts: 3 + 1 + 2 + 1 + 3 + 3
    assert tree.stats().unique_tokens == 13


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=3), st.lists(st.integers(0, 2), max_size=2)),
                min_size=1, max_size=6))
def test_sequences_share_exactly_the_prefix_of_equal_tokens_and_images(specs):
    """Random text and images (seeds 0-2, two tokens each): two sequences share the longest prefix on which their
    tokens are equal and every image is the same one, nothing more or less."""
    sequences = [_sequence(text, [(seed, 2) for seed in images], [3]) for text, images in specs]
    tree = PrefixTree.build(sequences)
    for a in range(len(sequences)):
        assert torch.cat([tree.nodes[n].tokens for n in tree.path(a)])[: len(sequences[a])].tolist() == \
            sequences[a].tokens.tolist()
        for b in range(len(sequences)):
            ka, kb = sequences[a].merge_keys.tolist(), sequences[b].merge_keys.tolist()
            same = next((i for i, (x, y) in enumerate(zip(ka, kb)) if x != y), min(len(ka), len(kb)))
            if a != b:
                assert _shared(tree, a, b) == same


def test_equal_pixels_are_one_image_whatever_tensor_holds_them():
    a, b = _image(0, 0), _image(0, 0)
    assert a.digest == b.digest and a.pixel_values is not b.pixel_values
    assert _image(1, 0).digest != a.digest
    regridded = ImageSpan(0, 3, a.pixel_values, torch.tensor([1, 6, 2]))
    assert regridded.digest != a.digest  # the same pixels on another grid are another image to the model


@pytest.mark.parametrize("spans, says", [
    ([ImageSpan(3, 3, torch.rand(4, 2))], r"image 0 at tokens \[3, 6\) ends past the sequence's 5 tokens"),
    ([ImageSpan(0, 2, torch.rand(4, 2)), ImageSpan(1, 2, torch.rand(4, 2))], "image 1 at tokens .* overlaps"),
    ([ImageSpan(0, 0, torch.rand(4, 2))], "image 0 has 0 placeholder tokens"),
    ([ImageSpan(1, 2, torch.rand(4, 2))], r"image 0 at tokens \[1, 3\): its placeholder tokens are not one repeated id"),
    ([ImageSpan(2, 2, torch.full((4, 2), float("nan")))], "image 0: pixel_values hold NaN"),
    ([ImageSpan(2, 2, torch.ones(4, 2, dtype=torch.long))], "image 0: pixel_values must be a floating-point tensor"),
])
def test_a_bad_image_span_is_named_before_any_compute(spans, says):
    sequence = TokenSequence(torch.tensor([PAD, PAD, PAD, PAD, 1]), images=tuple(spans), name="shot")
    sequence.tokens[1] = 2 if "repeated" in says else PAD
    with pytest.raises(BatchError, match=rf"sequence 0 \('shot'\): {says}"):
        validate_sequences([sequence])


def test_a_sequence_that_shows_images_is_not_written_to_json_lines_without_them(tmp_path):
    from treerl.errors import DataError
    from treerl.tree.io import write_jsonl

    path = tmp_path / "batch.jsonl"
    with pytest.raises(DataError, match=r"sequence 1 shows 1 image\(s\); JSON lines hold tokens and fields only"):
        write_jsonl([TokenSequence(torch.tensor([1, 2])), _sequence([1], [(0, 2)], [3])], path)
    assert not path.exists()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(1, 5), min_size=1, max_size=4), st.integers(0, 3))
def test_chunks_never_cut_an_image_when_asked(chunk, lengths, gap):
    """`chunked(..., whole_images=True)` (Gemma 3: an image's tokens see each other both ways): every image lies in
    one piece, a piece is longer than the chunk only by holding an image, and the tree's tokens are unchanged."""
    sequence = _sequence([1] * gap, [(seed, n) for seed, n in enumerate(lengths)], [2, 3])
    tree = PrefixTree.build([sequence])
    pieces = tree.chunked(chunk, whole_images=True).nodes[1:]
    assert [p.start for p in pieces[1:]] == [p.end for p in pieces[:-1]] and pieces[-1].end == len(sequence)
    for image in sequence.images:
        assert any(p.start <= image.start and image.end <= p.end for p in pieces), (image.start, image.end, pieces)
    for p in pieces:
        assert p.length <= chunk or any(p.start <= i.start < i.end <= p.end and i.length > 1 for i in sequence.images)

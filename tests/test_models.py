"""Models load from a local path or build from a named shape; nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

from treerl.errors import ModelPathError
from treerl.models import SHAPES, build_model


def test_local_checkpoint_round_trip(tmp_path):
    model = build_model(shape="tiny-llama", vocab_size=32, seed=3)
    model.save_pretrained(tmp_path)
    loaded = build_model(path=str(tmp_path))
    assert type(loaded) is type(model)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_missing_path_and_unknown_shape_are_clear():
    with pytest.raises(ModelPathError, match="does not exist"):
        build_model(path="/nonexistent/checkpoint")
    with pytest.raises(ValueError, match="unknown model shape 'qwen9'"):
        build_model(shape="qwen9")


@pytest.mark.parametrize("shape", [s for s in SHAPES if s.startswith("tiny")])
def test_tiny_shapes_are_seeded(shape):
    a, b = build_model(shape=shape, seed=1), build_model(shape=shape, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))

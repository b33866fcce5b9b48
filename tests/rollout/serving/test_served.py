"""What both of `treerl serve`'s protocols share (treerl.rollout.serving.served): a weight load reads a checkpoint as
`save_pretrained` wrote it, in its family's layout, so a server reloads the very checkpoint it was started from."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from treerl.rollout import EmbeddedSampler
from treerl.rollout.serving.server import build_app
from treerl.trainer.core.build import load_policy
from treerl.trainer.core.config import ModelConfig
from treerl.trainer.core.export import export_shape


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory):
    """`treerl export --shape tiny-qwen2.5-vl`: written in Qwen-VL's layout (`model.layers.*`, `visual.*`), which the
    model holds as `model.language_model.layers.*`, `model.visual.*`."""
    return export_shape("tiny-qwen2.5-vl", tmp_path_factory.mktemp("vl") / "model")


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_server_reloads_the_vision_language_checkpoint_it_was_started_from(vision_checkpoint, protocol):
    model, tokenizer = load_policy(ModelConfig(path=str(vision_checkpoint)), torch.device("cpu"))
    with TestClient(build_app(EmbeddedSampler(model), tokenizer, "policy", protocol=protocol)) as client:
        if protocol == "vllm":
            answer = client.post("/collective_rpc", json={"method": "reload_weights",
                                                          "kwargs": {"weights_path": str(vision_checkpoint)}})
        else:
            answer = client.post("/update_weights_from_disk", json={"model_path": str(vision_checkpoint),
                                                                    "weight_version": "1"})
    assert answer.status_code == 200, answer.text

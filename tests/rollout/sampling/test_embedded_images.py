"""The embedded sampler generates from prompts that show images: each image through the vision tower once, every token
at the multimodal position the engines train it at, so a sampled token's behaviour log-prob is the one DfsEngine
recomputes on the prompt and its completion (importance ratio 1 on-policy)."""

from __future__ import annotations

import pytest
import torch
from support import fresh_model
from vision_models import sequence, vl_model

from treerl.attention import UnsupportedModel
from treerl.engine import DfsEngine
from treerl.rollout.sampling.embedded import EmbeddedSampler
from treerl.rollout.sampling.sampler import SamplingParams
from treerl.tree import TokenSequence


def _prompts(name: str) -> list[TokenSequence]:
    """Two image prompts of different lengths (left padding), one on two images, and a text-only prompt."""
    llava = name == "llava"
    return [sequence([[1, 5, 6], (0, 4, 4), [7]], llava=llava), sequence([[1], (1, 4, 6), [8, 9, 10, 11]], llava=llava),
            sequence([[1, 5], (0, 4, 4), [20], (2, 2, 4), [21]], llava=llava), sequence([[1, 5, 6, 7, 8]])]


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava"])
def test_behaviour_logprobs_of_image_prompts_are_what_the_engine_recomputes(name):
    model = vl_model(name)
    prompts = _prompts(name)
    sampler = EmbeddedSampler(model)
    params = SamplingParams(n=3, max_new_tokens=6, seed=0)
    results = sampler.generate([p.tokens.tolist() for p in prompts], params, images=[p.images for p in prompts])
    sequences, behaviour = [], []
    for prompt, completions in zip(prompts, results):
        for completion in completions:
            tokens = torch.cat([prompt.tokens, torch.tensor(completion.tokens)])
            sequences.append(TokenSequence(tokens, images=prompt.images))
            behaviour.append((len(prompt), torch.tensor(completion.logprobs, dtype=torch.float64)))
    outputs = DfsEngine().forward(model, sequences)
    tol = 1e-6 if name == "qwen3_5" else 1e-9  # transformers' delta rule steps in float32 when decoding (1e-7)
    for out, (start, logprobs) in zip(outputs, behaviour):
        assert torch.allclose(out["logprobs"][start:], logprobs, atol=tol, rtol=0), (out["logprobs"][start:], logprobs)


def test_the_samples_of_an_image_prompt_depend_on_its_image():
    """The pixels reach the model: the same tokens on another image sample other tokens (same seed)."""
    model = vl_model("qwen2_5_vl")
    a, b = sequence([[1, 5, 6], (0, 4, 4), [7]]), sequence([[1, 5, 6], (3, 4, 4), [7]])
    params = SamplingParams(n=4, max_new_tokens=8, seed=0)
    sampler = EmbeddedSampler(model)
    first = sampler.generate([a.tokens.tolist()], params, images=[a.images])[0]
    second = sampler.generate([b.tokens.tolist()], params, images=[b.images])[0]
    assert [c.logprobs for c in first] != [c.logprobs for c in second]


def test_images_for_a_model_that_cannot_take_them_are_refused_before_sampling():
    prompt = sequence([[1, 5, 6], (0, 4, 4), [7]])
    with pytest.raises(UnsupportedModel, match="not a vision-language model whose images treerl feeds"):
        EmbeddedSampler(fresh_model(vocab_size=128)).generate([prompt.tokens.tolist()], SamplingParams(),
                                                               images=[prompt.images])
    with pytest.raises(ValueError, match="1 image lists for 2 prompts"):
        EmbeddedSampler(vl_model("qwen2_vl")).generate([[1, 2], [3, 4]], SamplingParams(), images=[()])

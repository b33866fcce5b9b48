"""Exact or refused, for generation: on tiny instances of transformers' causal LMs (tests/zoo.py), one a kind of what a
layer asks of its attention or carries beside it, the embedded sampler's shared-prefix path samples what the model's
own forward gives (each prompt and completion alone), or `refusal` turns the model away before anything is sampled (the
padded path then generates). float32: MoE layers run there (their grouped matrix multiply has no float64).

Every causal-LM type of the installed transformers passed it once, in float64 and in float32 (2026-11-28, ~6 CPU minutes
each: the hybrids' reference kernels are slow on CPU, too long for every run). In float64 127 were served; the others
were refused (attention in their own code, absolute position embeddings without position_ids, an indexer, chunked
attention, MoE layers without a float64 matrix multiply) or could not be built tiny (4)."""

from __future__ import annotations

import pytest
import torch
from zoo import CAUSAL_LM_TYPES, build_tiny, ordinary_ids, own_logprobs

from treerl.rollout import EmbeddedSampler, SamplingParams
from treerl.rollout.sampling.prefix_sharing import refusal

pytestmark = pytest.mark.slow  # ~40 s on 2 cores

# what each brings: soft-cap and a binding window (gemma2), sliding layers with their own RoPE (gemma3_text), a window
# (mistral), sinks (gpt_oss), a logit scale (cohere), multipliers (granite), latent attention (deepseek_v3), two
# attention calls a layer (diffllama), a shared attention block (zamba2), Gated DeltaNet and gated attention
# (qwen3_next), Mamba2 (falcon_h1), Mamba and MoE (jamba), pure Mamba (mamba), lightning attention (minimax), short
# convolutions (lfm2), MoE (qwen3_moe); refused: ALiBi in its own code (bloom), absolute positions (bert), chunked
# attention (llama4_text), an indexer (deepseek_v32)
FAMILIES = ["gemma2", "gemma3_text", "mistral", "gpt_oss", "cohere", "granite", "deepseek_v3", "diffllama", "zamba2",
            "qwen3_next", "falcon_h1", "jamba", "mamba", "minimax", "lfm2", "qwen3_moe", "bloom", "bert", "llama4_text",
            "deepseek_v32"]
REFUSED = {"bloom", "bert", "llama4_text", "deepseek_v32"}

TOLERANCE = 1e-3  # float32 rounding over a few layers (float64 runs: at most 5e-7); a wrong path is off by 0.1 or more


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_shared_path_samples_the_models_own_forward_or_refuses(model_type):
    assert model_type in CAUSAL_LM_TYPES
    model = build_tiny(model_type, dtype=torch.float32)
    why = refusal(model)
    assert (why is not None) == (model_type in REFUSED), why
    if why is not None:
        return
    ids = ordinary_ids(model, (12,), seed=1).tolist()
    prompts = [ids[:6], ids[:4] + ids[8:10], ids[10:11]]  # a shared node, its two children, a one-token prompt
    groups = EmbeddedSampler(model).generate(prompts, SamplingParams(n=2, max_new_tokens=3, seed=0))
    for prompt, group in zip(prompts, groups):
        for completion in group:
            own = own_logprobs(model, prompt, completion.tokens)
            off = (torch.tensor(completion.logprobs, dtype=torch.float64) - own).abs().max()
            assert off <= TOLERANCE, (model_type, float(off))

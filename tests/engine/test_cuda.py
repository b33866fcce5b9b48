"""The engines on a CUDA device: the GPU kernels (flash / memory-efficient attention, FlexAttention, the bf16 -> float32
GEMM of the head) train as exactly as the flat reference does there, and the memory contract holds on the caching
allocator's own peak counter. Marked `gpu`: CI has no GPU; `pytest -m gpu` runs them where one is.

Each check is a function of the device so that it can be read (and tried) on CPU; the tests call it with "cuda".
"""

from __future__ import annotations

import pytest
import torch

from treerl.bench.peak import peak_memory
from treerl.bench.workloads import AgentShape, agent_trees, grpo_groups, random_trees
from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.engine.memory import ONE_PATH_SLACK, graph_bytes
from treerl.models import build_model
from support import as_close_as_flat

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 512
ENGINES = {
    "keep-graph": lambda: DfsEngine(recompute="never"),
    "recompute": lambda: DfsEngine(recompute="always"),
    "chunk-7": lambda: DfsEngine(chunk_tokens=7),
    "one-path": lambda: DfsEngine(memory="one-path"),
    "packed": lambda: PackedEngine(),  # FlexAttention on CUDA
    "flat-packed": lambda: FlatEngine(layout="packed"),
}


def _loss(view):
    mask = view.fields["loss_mask"].to(view.logprobs)
    return -(view.logprobs * view.fields["advantages"].to(view.logprobs) * mask).sum() - 0.01 * (view.entropy * mask).sum()


def _batches() -> dict[str, list]:
    """Long enough that the kernels take real tiles: a GRPO group, an agent episode tree, a random trie."""
    return {
        "grpo": grpo_groups(prompts=2, group_size=6, prompt_len=300, response_len=120, vocab=VOCAB, seed=1),
        "agent": agent_trees(AgentShape(tasks=1, samples_per_task=2).scaled(1 / 24), vocab=VOCAB, seed=1),
        "random": random_trees(sequences=12, length=200, sharing=3.0, vocab=VOCAB, seed=1),
    }


def check_as_close_as_flat(device: str, shape: str, mode: str, engines: list[str], batch: str) -> list[str]:
    """Each of `engines` on `device` is no further from the float64 run than the flat reference on `device` is;
    answers what failed, engine by engine (empty: all held).

    mode: "float32", "bfloat16" (the model's weights in bf16) or "bf16-mixed" (autocast over float32 weights).
    """
    dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    model = build_model(shape=shape, vocab_size=VOCAB, dtype=dtype, seed=0).to(device)
    high = build_model(shape=shape, vocab_size=VOCAB, dtype=torch.float64, seed=0).to(device)
    high.load_state_dict({k: v.double() for k, v in model.state_dict().items()})  # the same (rounded) weights
    return as_close_as_flat(model, high, _batches()[batch], _loss, mode, {name: ENGINES[name] for name in engines})


def check_peak_within_the_contract(device: str, shape: str, batch: str) -> dict[str, int]:
    """The caching allocator's peak of one step: DfsEngine never above flat's micro-batch of the same max_tokens (a
    hybrid: flat's one sequence, or 1.5x the one-path walk), one-path mode never above 1.5x the walk."""
    model = build_model(shape=shape, vocab_size=VOCAB, dtype=torch.float32, seed=0).to(device)
    graph_bytes(model)  # the probe runs once per model, outside the steps measured
    sequences = _batches()[batch]

    def peak(engine) -> int:
        out = peak_memory(lambda: engine.forward_backward(model, sequences, _loss), device)
        model.zero_grad(set_to_none=True)
        return out

    hybrid = shape.endswith("qwen3.5")
    one_path = ONE_PATH_SLACK * peak(DfsEngine(batch_tokens=0, recompute="always"))
    flat = peak(FlatEngine(layout="sequences") if hybrid else FlatEngine(layout="packed", max_tokens=2048))
    dfs = peak(DfsEngine(max_tokens=2048))
    strict = peak(DfsEngine(memory="one-path"))
    assert dfs <= max(flat, one_path) if hybrid else dfs <= flat, (batch, dfs, flat)
    assert strict <= one_path, (batch, strict, one_path)
    return {"flat": flat, "dfs": dfs, "one-path": strict}


@pytest.mark.parametrize("batch", ["grpo", "agent", "random"])
@pytest.mark.parametrize("mode", ["float32", "bfloat16", "bf16-mixed"])
def test_engines_on_cuda_as_close_to_float64_as_flat(mode, batch):
    assert not check_as_close_as_flat("cuda", "small-qwen3", mode, list(ENGINES), batch)


@pytest.mark.parametrize("batch", ["grpo", "agent", "random"])
@pytest.mark.parametrize("mode", ["float32", "bf16-mixed"])
def test_a_hybrid_on_cuda_as_close_to_float64_as_flat(mode, batch):
    assert not check_as_close_as_flat("cuda", "small-qwen3.5", mode, ["keep-graph", "recompute", "one-path"], batch)


@pytest.mark.parametrize("shape", ["small-qwen3", "small-qwen3.5"])
@pytest.mark.parametrize("batch", ["grpo", "agent", "random"])
def test_cuda_peak_within_the_contract(shape, batch):
    check_peak_within_the_contract("cuda", shape, batch)


def test_the_head_accumulates_bf16_products_in_float32_on_cuda():
    """bf16-mixed's head gradient takes the one accumulating GEMM (`addmm(..., out_dtype=float32)`) on this GPU."""
    from treerl.engine.head import _mixed_gemm

    assert _mixed_gemm(torch.device("cuda"))

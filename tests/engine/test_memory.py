"""DfsEngine's memory contract: never more than FlatEngine's packed micro-batch of `max_tokens` tokens (or 1.5x
the one-path walk when one path alone needs more); `memory="one-path"`: 1.5x the one-path walk. Checked as
planned graph tokens on random trees and as measured peak bytes of real steps; nothing here is timed."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treerl.bench.engines import ENGINES
from treerl.bench.peak import peak_memory
from treerl.bench.workloads import AgentShape, agent_trees, grpo_groups, random_trees
from treerl.engine import DfsEngine, FlatEngine
from treerl.engine.base import run_length
from treerl.engine.memory import (
    ONE_PATH_SLACK,
    graph_bytes,
    micro_batch_tokens,
    path_bytes_per_token,
)
from treerl.models import build_model
from treerl.trainer.core.build import build_train_engine
from treerl.trainer.core.config import ConfigError, load_config
from treerl.tree import PrefixTree, TokenSequence

_MODEL: list = []


def _model():
    """tiny-qwen3 in float32 (what users train in), built once."""
    if not _MODEL:
        _MODEL.append(build_model(shape="tiny-qwen3", vocab_size=512, dtype=torch.float32, seed=0))
    return _MODEL[0]


def _loss(view):
    mask = view.fields["loss_mask"].to(view.logprobs)
    return -(view.logprobs * view.fields["advantages"].to(view.logprobs) * mask).sum() - 0.01 * (view.entropy * mask).sum()


def _trees(seed: int) -> dict[str, list[TokenSequence]]:
    """A GRPO group, an agent episode tree (long chains, a few forks) and a random trie, ~100-300 tokens a sequence."""
    return {
        "grpo": grpo_groups(prompts=2, group_size=6, prompt_len=120, response_len=60, vocab=512, seed=seed),
        "agent": agent_trees(AgentShape(tasks=1, samples_per_task=2).scaled(1 / 48), vocab=512, seed=seed),
        "random": random_trees(sequences=12, length=160, sharing=3.0, vocab=512, seed=seed),
    }


def _largest_node(engine: DfsEngine, batch: list[TokenSequence]) -> int:
    tree = PrefixTree.build(batch).chunked(engine.chunk_tokens)
    return max(run_length(node, engine.head.shifted) for node in tree.nodes[1:])


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 1000), workload=st.sampled_from(["grpo", "agent", "random"]),
       max_tokens=st.sampled_from([64, 256, 1024]), memory=st.sampled_from(["micro-batch", "one-path"]),
       batch_tokens=st.sampled_from([0, 128, 8192]))
def test_the_plan_holds_at_most_the_contract(seed, workload, max_tokens, memory, batch_tokens):
    """Planned graph tokens held at once <= the budget; the budget <= flat's micro-batch in bytes (with the path's
    K/V store) unless one node alone needs more, when it is the one-path floor; one-path mode is the floor."""
    model = _model()
    batch = _trees(seed)[workload]
    engine = DfsEngine(memory=memory, max_tokens=max_tokens, batch_tokens=batch_tokens)
    tree = PrefixTree.build(batch).chunked(engine.chunk_tokens)
    budget = engine.graph_budget_tokens(model, tree)
    largest = _largest_node(engine, batch)
    plan = engine.plan(model, tree)
    assert plan.peak_graph_tokens() <= max(budget, largest)
    floor = int(ONE_PATH_SLACK * largest)
    if memory == "one-path":
        assert budget == floor
    else:
        held = budget * graph_bytes(model).per_token + max(map(len, batch)) * path_bytes_per_token(model)
        flat = micro_batch_tokens([len(s) - 1 for s in batch], max_tokens)  # rows of flat's largest micro-batch
        assert held <= flat * graph_bytes(model).per_token or budget == floor


@pytest.mark.slow  # ~15 s on 2 cores: twelve measured steps
@pytest.mark.parametrize("workload", ["grpo", "agent", "random"])
def test_measured_peak_within_the_contract(workload):
    """Peak bytes of one step: the default never above FlatEngine's packed micro-batch of the same max_tokens
    (when no node alone exceeds it), one-path mode never above 1.5x the one-path walk."""
    model = _model()
    graph_bytes(model)  # the probe runs once per model: not part of any step measured below
    batch = _trees(0)[workload]

    def peak(engine):
        out = peak_memory(lambda: engine.forward_backward(model, batch, _loss))
        model.zero_grad(set_to_none=True)
        return out

    max_tokens = 512  # several sequences per micro-batch, more than the largest node
    assert _largest_node(DfsEngine(), batch) * ONE_PATH_SLACK < max_tokens
    flat = peak(FlatEngine(layout="packed", max_tokens=max_tokens))
    dfs = peak(DfsEngine(max_tokens=max_tokens))
    assert dfs <= flat, f"{workload}: DfsEngine held {dfs / 2**20:.2f} MiB, flat's micro-batch {flat / 2**20:.2f} MiB"
    one_path = peak(DfsEngine(batch_tokens=0, recompute="always"))
    strict = peak(DfsEngine(memory="one-path"))
    assert strict <= ONE_PATH_SLACK * one_path, f"{workload}: one-path mode held {strict / one_path:.2f}x the walk"


@pytest.mark.slow  # ~15 s on 2 cores
@pytest.mark.parametrize("workload", ["grpo", "agent", "random"])
def test_a_hybrids_peak_within_flats_one_sequence_micro_batch(workload):
    """Flat cannot pack a hybrid's sequences (a recurrent state would run from one into the next): its micro-batch is
    one sequence, so the default DfsEngine holds no more than that or 1.5x the one-path walk (the larger: one
    sequence is one path), whatever max_tokens says; one-path mode no more than 1.5x the walk. The random trie's
    many short nodes are the hard case: the delta rule pads each row to 64 tokens (it was 1.2x over before the
    plan counted that padding)."""
    model = build_model(shape="tiny-qwen3.5", vocab_size=512, dtype=torch.float32, seed=0)
    graph_bytes(model)  # the probe runs once per model: not part of any step measured below
    batch = _trees(0)[workload]

    def peak(engine):
        out = peak_memory(lambda: engine.forward_backward(model, batch, _loss))
        model.zero_grad(set_to_none=True)
        return out

    flat = peak(FlatEngine(layout="sequences"))
    one_path = ONE_PATH_SLACK * peak(DfsEngine(batch_tokens=0, recompute="always"))
    dfs = peak(DfsEngine(max_tokens=8192))
    contract = max(flat, one_path)
    assert dfs <= contract, f"{workload}: DfsEngine held {dfs / 2**20:.2f} MiB, the contract {contract / 2**20:.2f} MiB"
    strict = peak(DfsEngine(memory="one-path"))
    assert strict <= one_path, f"{workload}: one-path mode held {strict / 2**20:.2f} MiB, 1.5x the walk " \
                               f"{one_path / 2**20:.2f}"


def _tensor_bytes() -> int:
    """Bytes of every tensor Python can reach, parameters aside (their .grad included)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance reads a deprecated module attribute of torch.distributed
        warnings.simplefilter("ignore", FutureWarning)
        return sum(t.numel() * t.element_size() for t in gc.get_objects()
                   if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter))


@pytest.mark.parametrize("engine, shape", [(e, "tiny-qwen3") for e in ("flat-packed", "flat-sequences", "packed", "dfs")]
                         + [("dfs", "tiny-qwen3.5")])
def test_a_step_leaves_nothing_behind(engine, shape):
    """A second step leaves no more behind than the first: a unit kept its K/V as the tensors themselves, a cycle
    through autograd's nodes that Python's collector cannot free, and flat's packed rows kept every micro-batch's
    K/V (on an H100, 67 GiB within one step of Qwen3-0.6B)."""
    model = _model() if shape == "tiny-qwen3" else build_model(shape=shape, vocab_size=512, dtype=torch.float32, seed=0)
    batch, step = _trees(0)["agent"], ENGINES[engine]()
    left = []
    for _ in range(2):
        step.forward_backward(model, batch, _loss)
        model.zero_grad(set_to_none=True)
        left.append(_tensor_bytes())
    assert left[1] <= left[0], f"{engine}: {(left[1] - left[0]) / 2**20:.2f} MiB more after the second step"


def test_the_probe_finds_the_padding_of_a_hybrids_chunked_mixers():
    """Gated DeltaNet's torch path pads each row to 64 tokens: a one-token row holds a good part of a whole chunk's
    graph, a row of 64 exactly 64 graph tokens; an attention-only model pads nothing."""
    hybrid = graph_bytes(build_model(shape="tiny-qwen3.5", vocab_size=512, dtype=torch.float32, seed=0))
    assert hybrid.chunk == 64 and hybrid.padded > 0.2 * hybrid.per_token
    assert hybrid.row_tokens(64) == 64 and hybrid.row_tokens(65) > 65 + 10 and hybrid.row_tokens(1) > 10
    plain = graph_bytes(_model())
    assert plain.padded == 0 and plain.row_tokens(5) == 5


def test_the_probe_counts_what_autograd_saves_per_token():
    """The probe's bytes per token follow what the model saves: the same for a second model of the shape, more
    for a wider and deeper one, about half in bfloat16; a frozen model gets the geometric estimate (still > 0)."""
    tiny = graph_bytes(_model()).per_token
    again = build_model(shape="tiny-qwen3", vocab_size=512, dtype=torch.float32, seed=1)
    assert graph_bytes(again).per_token == tiny
    small = build_model(shape="small-qwen3", vocab_size=512, dtype=torch.float32, seed=0)
    assert graph_bytes(small).per_token > 4 * tiny  # 4x the width, 2x the layers
    half = build_model(shape="tiny-qwen3", vocab_size=512, dtype=torch.bfloat16, seed=0)
    assert 0.4 < graph_bytes(half).per_token / tiny < 0.6
    half.requires_grad_(False)
    assert graph_bytes(half).per_token > 0


def test_bad_settings_are_named_before_any_compute():
    model = _model()
    seqs = [TokenSequence(torch.arange(4), fields={"advantages": torch.zeros(4), "loss_mask": torch.ones(4)})]
    cases = [
        (DfsEngine(memory="lots"), "memory must be 'micro-batch' or 'one-path', got 'lots'"),
        (DfsEngine(max_tokens=0), "max_tokens must be > 0, got 0"),
        (DfsEngine(memory_budget_tokens=10, memory_budget_bytes=10),
         "set one memory budget, not memory_budget_tokens and memory_budget_bytes"),
        (DfsEngine(memory_budget_bytes=-1), "memory_budget_bytes must be > 0, got -1"),
    ]
    for engine, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.forward_backward(model, seqs, _loss)
        assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ConfigError, match="engine.memory must be 'micro-batch' or 'one-path', got 'lots'"):
        load_config(overrides=["engine.memory=lots"])
    with pytest.raises(ConfigError, match="set one memory budget, not engine.memory_budget_tokens and engine.memory_budget_bytes"):
        load_config(overrides=["engine.memory_budget_tokens=10", "engine.memory_budget_bytes=10"])


def test_the_config_reaches_the_engine():
    config = load_config(overrides=["engine.memory=one-path", "engine.max_tokens=1000"])
    engine = build_train_engine(config.engine)
    assert isinstance(engine, DfsEngine) and engine.memory == "one-path" and engine.max_tokens == 1000

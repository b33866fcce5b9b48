"""Hybrid models: DfsEngine hands each tree node's recurrent state to its children, exactly.

One model per kind of state (treerl.engine.recurrent.MIXERS): Gated DeltaNet (tiny-qwen3.5: the short-
convolution window and the delta-rule state), Mamba2 (tiny-bamba: the convolution window and the SSM
state), short convolutions (tiny-lfm2: the window alone), each beside softmax attention. Inside
`float64_throughout` (transformers' float32 casts kept in float64) every plan matches the flat reference
to float64 rounding; the stock models (their mixers compute in float32) to 1e-6.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import float64_throughout, fresh_model
from test_exactness import HAND, ORACLE, _with_data, random_batches, sequence_loss, token_loss
from transformers import AutoModelForCausalLM
from zoo import build_tiny, tiny_config

from treerl.attention import UnsupportedModel
from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.engine.recurrent import MIXERS, find_mixers
from treerl.testing import assert_engines_agree, assert_matches_model, compare_runs, run_engine
from treerl.tree.plan import PlanCost

VOCAB = 64
EXACT = 1e-8  # float64 throughout, as tests/engine/test_exactness.py: whole gradient ~1e-15; worst seen 4.8e-10, a
# k_proj gradient zero up to rounding (2e-16 off) on a tree of one repeated token, against compare_runs' floor
FAMILY_TOL = 1e-8  # the zoo's builds keep some float32 norms and routers (a small router weight's own gradient
# is off by ~1e-7 of its norm): outputs, loss and the whole gradient, measured <= 1.3e-9 (zamba2)
KINDS = {"deltanet": "tiny-qwen3.5", "mamba2": "tiny-bamba", "short-conv": "tiny-lfm2"}
PLANS = {
    "default": DfsEngine(),
    "keep-graph": DfsEngine(recompute="never"),
    "recompute": DfsEngine(recompute="always"),
    "one-node-per-call": DfsEngine(batch_tokens=0),
    "chunks-carry-state": DfsEngine(chunk_tokens=2),
    "one-token-rows": DfsEngine(chunk_tokens=1, recompute="always", batch_tokens=0),  # the layers' one-token step
    "small-calls": DfsEngine(chunk_tokens=3, batch_tokens=8),
    "tight-budget": DfsEngine(memory_budget_tokens=1, batch_tokens=16),
}
_MODELS: dict[str, torch.nn.Module] = {}


def _model(kind: str) -> torch.nn.Module:
    if kind not in _MODELS:
        _MODELS[kind] = fresh_model(KINDS[kind], VOCAB, exact=True)
    return _MODELS[kind]


def _every_shape(seed: int = 1) -> list:
    """The degenerate trees at once: a GRPO group (rows of unequal length), a chain, a fork below a chain,
    one-token nodes, a prefix of another, duplicates."""
    rng = random.Random(seed)
    lists = HAND["grpo group"] + HAND["fork below a chain"] + HAND["single-token nodes"] + HAND["prefix of another"]
    lists += HAND["identical duplicates"][:2]
    return [_with_data(t, rng, str(i)) for i, t in enumerate(lists)]


FAST_PLANS = ["default", "keep-graph", "one-token-rows"]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("plans", [pytest.param(FAST_PLANS, id="fast"), pytest.param(
    [p for p in PLANS if p not in FAST_PLANS], id="more", marks=pytest.mark.slow)])
def test_every_plan_carries_the_state_exactly(kind, plans):
    """Per state kind: batched rows of unequal length, keep / recompute, chunks, one-token rows (the layers'
    in-place step), a budget of one node. The first three plans are the fast selection; the rest are slow."""
    seqs = _every_shape()
    with float64_throughout():
        for name in plans:
            engine = PLANS[name]
            for loss in (token_loss, sequence_loss):
                try:
                    assert_engines_agree(_model(kind), seqs, loss, engine, ORACLE, tol=EXACT)
                except AssertionError as error:
                    raise AssertionError(f"{kind}, plan {name}: {error}") from None


@pytest.mark.parametrize("kind", list(KINDS))
def test_stock_hybrids_match_their_own_forward(kind):
    """Without the float64 patch: log-probs equal the model's own forward on each sequence alone, the gradient
    the flat reference's, within the float32 rounding of transformers' mixers."""
    model = fresh_model(KINDS[kind], VOCAB, exact=False)
    seqs = _every_shape(2)
    engine = DfsEngine(chunk_tokens=3)
    assert_matches_model(model, seqs, engine.forward(model, seqs), tol=1e-6)
    errors = compare_runs(run_engine(engine, model, seqs, token_loss), run_engine(ORACLE, model, seqs, token_loss))
    assert errors["gradient"] <= 1e-6 and errors["loss"] <= 1e-6


# Every hybrid family transformers ships a CPU path for (tests/zoo.py's tiny builds), by the state it carries.
FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen4_exp_text", "olmo_hybrid",  # Gated DeltaNet
            "kimi_linear",  # KDA
            "mamba2", "nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "zamba2",  # Mamba2
            "lfm2",  # short convolutions
            "minimax"]  # lightning attention
FAMILY_PLANS = ["keep-graph", "recompute", "chunks-carry-state", "one-token-rows", "small-calls"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_hybrid_family_in_every_plan(model_type):
    """Each family's own tiny build (not only the three shapes above): siblings batched on the parent's state, keep
    and recompute, a chunk boundary carrying the state, the layers' one-token step, calls of a few rows."""
    model = build_tiny(model_type, experts_implementation="eager")
    seqs = _every_shape(6)
    with float64_throughout():
        for name in FAMILY_PLANS:
            errors = compare_runs(run_engine(PLANS[name], model, seqs, token_loss),
                                  run_engine(ORACLE, model, seqs, token_loss))
            whole = {k: e for k, e in errors.items() if not k.startswith("grad.")}  # outputs, loss, whole gradient
            worst = max(whole, key=whole.get)
            assert whole[worst] <= FAMILY_TOL, (name, worst, whole[worst])


def test_jamba_is_refused_for_its_zero_initialised_scan():
    """Jamba's Mamba layers start every multi-token call from a zero SSM state (transformers' own cache path is off
    by ~1e-4 for that reason): refused before compute, naming the scan."""
    model = build_tiny("jamba")
    with pytest.raises(UnsupportedModel, match="selective scan starts every multi-token call from a zero SSM state"):
        DfsEngine().forward_backward(model, _every_shape(), token_loss)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lists=random_batches(),
    kind=st.sampled_from(list(KINDS)),
    chunk=st.sampled_from([1, 2, 3, 5, 2048]),
    recompute=st.sampled_from(["auto", "always", "never"]),
    batch_tokens=st.sampled_from([0, 1, 6, 8192]),
    budget=st.sampled_from([None, 1, 300_000, 1 << 30]),
    call_cost=st.sampled_from([0.0, 48.0, 1e6]),
    sequence_level=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_trees_and_plans(lists, kind, chunk, recompute, batch_tokens, budget, call_cost, sequence_level, seed):
    rng = random.Random(seed)
    seqs = [_with_data(t, rng, f"s{i}") for i, t in enumerate(lists)]
    engine = DfsEngine(chunk_tokens=chunk, recompute=recompute, batch_tokens=batch_tokens, memory_budget_bytes=budget,
                       plan_cost=PlanCost(call=call_cost, forward_call=call_cost / 3))
    with float64_throughout():
        assert_engines_agree(_model(kind), seqs, sequence_loss if sequence_level else token_loss, engine, ORACLE,
                             tol=EXACT)


# bf16 error from float64, DfsEngine's over FlatEngine's (measured on these trees, every plan: log-probs, entropy and
# the whole gradient 0.81-1.11x; the loss, one scalar sum whose rounding errors partly cancel, 0.75-1.49x).
BF16_RATIO = {"logprobs": 1.25, "entropy": 1.25, "gradient": 1.25, "loss": 2.0}


@pytest.mark.parametrize("kind", list(KINDS))
def test_bfloat16_error_no_larger_than_the_flat_references(kind):
    """bf16 autocast over float32 weights, as users train: DfsEngine's error from the float64 run is FlatEngine's,
    within the scatter of rounding (BF16_RATIO), with a state handed on at every node and at chunk boundaries."""
    rng = random.Random(3)
    seqs = [_with_data(t, rng, str(i)) for i, t in enumerate(HAND["grpo group"] + HAND["fork below a chain"])]
    low = fresh_model(KINDS[kind], VOCAB, exact=False, dtype=torch.float32)
    high = fresh_model(KINDS[kind], VOCAB, exact=False, dtype=torch.float64)
    high.load_state_dict({k: v.double() for k, v in low.state_dict().items()})
    reference = run_engine(ORACLE, high, seqs, token_loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        flat = compare_runs(run_engine(ORACLE, low, seqs, token_loss), reference)
        ours = compare_runs(run_engine(DfsEngine(chunk_tokens=4), low, seqs, token_loss), reference)
    for part, ratio in BF16_RATIO.items():
        flat_worst = max(e for k, e in flat.items() if k.endswith(part))
        our_worst = max(e for k, e in ours.items() if k.endswith(part))
        assert our_worst <= ratio * flat_worst, (part, our_worst, flat_worst)


@pytest.mark.parametrize("kind", list(KINDS))
def test_gradient_checkpointing(kind):
    """transformers' non-reentrant checkpointing (its default) keeps the state's graph: exact. Reentrant
    checkpointing runs each layer without one: refused before any gradient."""
    rng = random.Random(4)
    seqs = [_with_data(t, rng, str(i)) for i, t in enumerate(HAND["fork below a chain"] + HAND["grpo group"])]
    with float64_throughout():
        for reentrant in (False, True):
            model = fresh_model(KINDS[kind], VOCAB, exact=True).train()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            reference = fresh_model(KINDS[kind], VOCAB, exact=True).train()
            engine = DfsEngine(chunk_tokens=4)
            if reentrant:
                with pytest.raises(UnsupportedModel, match="use_reentrant=False"):
                    engine.forward_backward(model, seqs, token_loss)
                assert all(p.grad is None for p in model.parameters())
                continue
            errors = compare_runs(run_engine(engine, model, seqs, token_loss),
                                  run_engine(ORACLE, reference, seqs, token_loss))
            assert max(errors.values()) <= EXACT, max(errors, key=errors.get)


@pytest.mark.parametrize("engine", [PackedEngine(), FlatEngine(layout="packed")], ids=["packed", "flat-packed"])
def test_engines_that_pack_rows_refuse_a_recurrent_state_and_name_the_one_that_serves_it(engine):
    model = _model("deltanet")
    with pytest.raises(UnsupportedModel, match="Gated DeltaNet.*DfsEngine"):
        engine.forward_backward(model, _every_shape(), token_loss)
    assert all(p.grad is None for p in model.parameters())


def test_a_mixer_the_table_does_not_know_is_refused_naming_the_layer():
    model = fresh_model("tiny-qwen3", VOCAB)

    class MyRecurrentBlock(torch.nn.Module):  # a state carried along the sequence that treerl cannot see
        def forward(self, x):
            return x

    model.model.layers[1].token_state = MyRecurrentBlock()
    with pytest.raises(UnsupportedModel, match=r"layers\.1\.token_state \(MyRecurrentBlock\).*MIXERS"):
        find_mixers(model)
    with pytest.raises(UnsupportedModel, match="MyRecurrentBlock"):
        DfsEngine().forward_backward(model, _every_shape(), token_loss)
    assert all(p.grad is None for p in model.parameters())


def test_the_table_names_how_each_kind_carries_its_state():
    model = _model("mamba2")
    mixers = find_mixers(model)
    assert {kind.name for kind in mixers.layers.values()} == {"Mamba2"} and list(mixers.layers) == [0]
    assert find_mixers(fresh_model("tiny-qwen3", VOCAB)).layers == {}


@contextlib.contextmanager
def ties_to_the_earliest() -> Iterator[None]:
    """torch.topk with ties broken toward the lower index, for the flat reference and the tree alike.

    torch.topk leaves the order of equal values unspecified, and which of several keys tied at the k-th index
    score it returns depends on the width of the call, in transformers' own forward too; with a stable choice,
    any difference left is treerl's."""
    topk = torch.Tensor.topk

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        order = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, order), order))

    torch.Tensor.topk = stable_topk
    try:
        yield
    finally:
        torch.Tensor.topk = topk


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "qwen4_exp_text"])
def test_sparse_attention_chooses_each_querys_keys_among_its_ancestors(model_type):
    """Sparse attention with a learned indexer: the indexer keys of the path travel like K/V, each query's keys
    are chosen among its own ancestors (DeepSeek-V3.2 / GLM-DSA: top-3 keys; Qwen4-Exp: top-2 blocks of 4 keys),
    and the attention over them matches each sequence alone, in every plan."""
    config = tiny_config(model_type)
    config.vocab_size = VOCAB
    if hasattr(config, "index_topk"):
        config.index_topk = 3  # a real choice: fewer keys than most queries see
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa",
                                             experts_implementation="eager").eval()
    seqs = _every_shape(5)
    with float64_throughout(), ties_to_the_earliest():
        for name in ["default", "keep-graph", "recompute", "one-token-rows", "small-calls"]:
            errors = compare_runs(run_engine(PLANS[name], model, seqs, sequence_loss),
                                  run_engine(ORACLE, model, seqs, sequence_loss))
            outputs = max(e for k, e in errors.items() if k.startswith("seq"))
            assert outputs <= EXACT and errors["gradient"] <= EXACT, (name, outputs, errors["gradient"])


def test_the_hybrid_page_names_every_kind_in_the_table():
    """docs/hybrid-models.md explains MIXERS: a kind added to the table gets its row in the page."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "hybrid-models.md").read_text()
    for kind in MIXERS:
        assert f"| {kind.name} |" in page, kind.name

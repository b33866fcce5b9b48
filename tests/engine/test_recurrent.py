"""Hybrid models: DfsEngine hands each tree node's recurrent state to its children, exactly.

One model per kind of state (treerl.engine.recurrent.MIXERS): Gated DeltaNet (tiny-qwen3.5: the short-
convolution window and the delta-rule state), Mamba2 (tiny-bamba: the convolution window and the SSM
state), short convolutions (tiny-lfm2: the window alone), each beside softmax attention. Inside
`float64_throughout` (transformers' float32 casts kept in float64) every plan matches the flat reference
to float64 rounding; the stock models (their mixers compute in float32) to 1e-6.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import assert_bf16_no_worse_than_flat, float64_throughout, fresh_model, indexer_top_k
from test_exactness import HAND, ORACLE, _with_data, random_batches, sequence_loss, token_loss
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5GatedDeltaNet
from zoo import build_tiny, tiny_config

from treerl.attention import UnsupportedModel, tree_attention
from treerl.engine import DfsEngine, FlatEngine, PackedEngine, selective_scan
from treerl.engine.memory import graph_bytes
from treerl.engine.recurrent import MIXERS, TreeStateCache, earliest_topk, find_mixers
from treerl.engine.selective_scan import ScanStart
from treerl.testing import assert_engines_agree, assert_matches_model, compare_runs, run_engine
from treerl.tree import TokenSequence
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
            "lara_mini",
            "kimi_linear",  # KDA
            "mamba2", "nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "zamba2",  # Mamba2
            "mamba", "falcon_mamba", "jamba", "zamba",  # Mamba (selective scan); Zamba's attention block is shared
            "lfm2",  # short convolutions
            "minimax",  # lightning attention
            "zaya"]  # convolutional attention projection (CCA)
FAMILY_PLANS = ["keep-graph", "recompute", "chunks-carry-state", "one-token-rows", "small-calls"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_hybrid_family_in_every_plan(model_type, small_scan_chunks):
    """Each family's own tiny build (not only the three shapes above): siblings batched on the parent's state, keep
    and recompute, a chunk boundary carrying the state, the layers' one-token step, calls of a few rows (Mamba's
    selective scan in chunks of 3 tokens)."""
    model = build_tiny(model_type, experts_implementation="eager")
    seqs = _every_shape(6)
    with float64_throughout():
        for name in FAMILY_PLANS:
            errors = compare_runs(run_engine(PLANS[name], model, seqs, token_loss),
                                  run_engine(ORACLE, model, seqs, token_loss))
            whole = {k: e for k, e in errors.items() if not k.startswith("grad.")}  # outputs, loss, whole gradient
            worst = max(whole, key=whole.get)
            assert whole[worst] <= FAMILY_TOL, (name, worst, whole[worst])


# Mamba's selective scan (treerl.engine.selective_scan), which transformers starts from zero in every call: the zoo's
# builds of the families that run it, the scan in chunks of 3 tokens, so that a node of `_every_shape` crosses chunk
# boundaries inside one call. The convolution window (4 tokens) fills on every longer node. Zamba scans its two heads
# one by one (a state per head) and runs one attention block, tied across its layers, without a layer index.
SCANS = ["mamba", "falcon_mamba", "jamba", "zamba"]
SCAN_CHUNK = 3
# In bf16 Jamba's router (2 of 4 experts) sends a token near a tie to another expert in one engine than in the other
# (measured: one token 6.4e-3 off, 10x its flat error, in every plan and scan chunk): an error of the routing, not of
# the state, so the bf16 test runs the Mamba families without a router.
BF16_SCANS = ["mamba", "falcon_mamba", "zamba"]


@pytest.fixture
def small_scan_chunks(monkeypatch):
    monkeypatch.setattr(selective_scan, "SCAN_CHUNK", SCAN_CHUNK)


@pytest.fixture
def handed_scan_states(monkeypatch) -> list[float]:
    """The norm of every parent's state a selective scan continued (a test with none, or only zeros, covers nothing)."""
    norms: list[float] = []
    take = ScanStart.next

    def recorded(self, channels: int):
        state = take(self, channels)
        if state is not None:
            norms.append(float(state.detach().norm()))
        return state

    monkeypatch.setattr(ScanStart, "next", recorded)
    return norms


@pytest.mark.parametrize("model_type", ["mamba", "jamba", "zamba"])
def test_the_selective_scan_continues_the_parents_state(model_type, small_scan_chunks, handed_scan_states):
    """transformers' scan starts every call from a zero SSM state; treerl adds the parent's state on top (decayed,
    read out through C, gated as the layer gates), and the state carried into each chunk of the scan: exact in the
    fast plans, with log-probs equal to the model's own forward on each whole sequence (Jamba's own cached path, a
    prefix then the rest from its cache, is off by ~1e-4: the reference is the one whole call)."""
    model = build_tiny(model_type)
    seqs = _every_shape(6)
    with float64_throughout():
        reference = run_engine(ORACLE, model, seqs, token_loss)
        for name in FAST_PLANS:
            errors = compare_runs(run_engine(PLANS[name], model, seqs, token_loss), reference)
            whole = {k: e for k, e in errors.items() if not k.startswith("grad.")}
            assert max(whole.values()) <= FAMILY_TOL, (name, max(whole, key=whole.get), max(whole.values()))
        assert_matches_model(model, seqs, DfsEngine(chunk_tokens=5).forward(model, seqs), tol=FAMILY_TOL)
    assert handed_scan_states and min(handed_scan_states) > 0, "no scan continued a non-zero state"


def test_a_long_node_scans_in_chunks_of_bounded_memory(monkeypatch):
    """Two nodes of 300 tokens below a shared prompt, the scan in chunks of 8: no tensor of a node's length times the
    SSM state ([rows, d_inner, L, N], what transformers' scan builds for a whole call) is allocated, forward or
    backward: the largest holds a few d_inner-wide vectors per token (the layer's own activations). Control: the scan
    in one chunk of the whole node allocates it."""
    model = build_tiny("mamba")
    width, state, length = model.config.intermediate_size, model.config.state_size, 300
    prompt = torch.arange(3, 9)
    seqs = [TokenSequence(torch.cat([prompt, (torch.arange(length) * k + k) % 100 + 3]),
                          fields={"advantages": torch.ones(6 + length, dtype=torch.float64)}) for k in (1, 7)]
    graph_bytes(model)  # the memory probe (the model's own forward on 64 tokens), once per model: not the walk's
    largest = {}
    for chunk in (8, length):
        monkeypatch.setattr(selective_scan, "SCAN_CHUNK", chunk)
        with _LargestTensor() as seen:
            DfsEngine().forward_backward(model, seqs, lambda view: -(view.logprobs * view.fields["advantages"]).sum())
        largest[chunk] = seen.numel
    model.zero_grad(set_to_none=True)
    assert largest[8] < width * state * length / 4, largest
    assert largest[length] >= width * state * (length - 1), largest  # a leaf's last token predicts nothing


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while the block runs (forward and backward)."""

    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


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


@pytest.mark.parametrize("kind", list(KINDS) + BF16_SCANS)
def test_bfloat16_error_no_larger_than_the_flat_references(kind, small_scan_chunks):
    """bf16 autocast over float32 weights, as users train: DfsEngine's error from the float64 run is FlatEngine's,
    within the scatter of rounding (support.BF16_RATIO), with a state handed on at every node and at chunk boundaries
    (of the nodes, and of Mamba's selective scan)."""
    rng = random.Random(3)
    seqs = [_with_data(t, rng, str(i)) for i, t in enumerate(HAND["grpo group"] + HAND["fork below a chain"])]
    low, high = _float32_and_64(kind)
    assert_bf16_no_worse_than_flat(low, high, seqs, token_loss, DfsEngine(chunk_tokens=4), ORACLE)


def _float32_and_64(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The stock model of a kind (KINDS) or zoo type in float32, and the same weights in float64."""
    build = (lambda dtype: fresh_model(KINDS[kind], VOCAB, exact=False, dtype=dtype)) if kind in KINDS else (
        lambda dtype: build_tiny(kind, dtype=dtype))
    low, high = build(torch.float32), build(torch.float64)
    high.load_state_dict({k: v.double() for k, v in low.state_dict().items()})
    return low, high


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


@pytest.mark.parametrize("name", ["MyRecurrentBlock", "MyRwkvTimeMix"])
def test_a_mixer_the_table_does_not_know_is_refused_naming_the_layer(name):
    """A module named for a state (in any case: RWKV's classes are "Rwkv...") is refused, naming it, not the model
    body around it, even when the body's own class is named for its family's recurrence (as RecurrentGemmaModel)."""
    model = fresh_model("tiny-qwen3", VOCAB)
    model.model.__class__ = type("MyRecurrentModel", (type(model.model),), {})
    model.model.layers[1].token_state = type(name, (torch.nn.Identity,), {})()  # a state treerl cannot see
    with pytest.raises(UnsupportedModel, match=rf": layers\.1\.token_state \({name}\).*MIXERS"):
        find_mixers(model)
    with pytest.raises(UnsupportedModel, match=name):
        DfsEngine().forward_backward(model, _every_shape(), token_loss)
    assert all(p.grad is None for p in model.parameters())


def test_an_attention_layer_holding_a_mixer_is_still_checked_for_routing():
    """A known mixer inside an attention module (as ZAYA's convolutional projections) leaves that module an attention
    layer: when it computes its attention without treerl and without the cache's K/V, the layer is refused as
    unrouted, not dropped from the check with the blocks around the mixer (its mixer hands its state on; only its
    attention misses the ancestors). One that attends in its own code over the K/V its cache returns is served that
    way (treerl.engine.base.attends_in_own_code), the mixer's state and the path's K/V both through the cache: exact."""
    for through_cache in (False, True):
        model = _with_mixing_attention(through_cache)
        if not through_cache:
            with pytest.raises(UnsupportedModel, match="no attention layer ran treerl's attention"):
                DfsEngine().forward_backward(model, _every_shape(), token_loss)
            assert all(p.grad is None for p in model.parameters())
            continue
        with float64_throughout():
            assert_engines_agree(model, _every_shape(), token_loss, DfsEngine(chunk_tokens=3), ORACLE, tol=EXACT)


def _with_mixing_attention(through_cache: bool) -> torch.nn.Module:
    """tiny-qwen3.5 whose full-attention layer is a `_MixingAttention` (the stock layer's weights, layer 0's mixer's)."""
    model = fresh_model("tiny-qwen3.5", VOCAB)
    full = model.config.layer_types.index("full_attention")
    attention = model.model.layers[full].self_attn
    mixing = _MixingAttention(model.config, full, through_cache).to(torch.float64)
    mixing.load_state_dict({**attention.state_dict(), **{f"mixer.{k}": v for k, v in
                                                         model.model.layers[0].linear_attn.state_dict().items()}})
    model.model.layers[full].self_attn = mixing
    return model


class _MixingAttention(Qwen3_5Attention):
    """Qwen3.5's attention with a Gated DeltaNet of its own layer inside, run on its input first; its attention reads a
    copy of the config, which keeps SDPA where treerl routes the model's: it never runs treerl's attention. Its K/V go
    through the cache (`through_cache`) or not (a cache holding only the mixer's state)."""

    def __init__(self, config, layer_idx: int, through_cache: bool):
        super().__init__(config, layer_idx)
        self.mixer = Qwen3_5GatedDeltaNet(config, layer_idx)
        self.config = copy.copy(config)
        self.through_cache = through_cache

    def forward(self, hidden_states, cache=None, **kwargs):
        mixed = hidden_states + self.mixer(hidden_states=hidden_states, cache=cache)
        return super().forward(mixed, cache=cache if self.through_cache else None, **kwargs)


def test_the_table_names_how_each_kind_carries_its_state():
    model = _model("mamba2")
    mixers = find_mixers(model)
    assert {kind.name for kind in mixers.layers.values()} == {"Mamba2"} and list(mixers.layers) == [0]
    assert find_mixers(fresh_model("tiny-qwen3", VOCAB)).layers == {}


# Sparse attention, each build with a top-k that binds on `_every_shape`'s sequences (up to 17 tokens): DeepSeek-V3.2
# and GLM-DSA keep each query's top-4 keys (tests/zoo.py), their indexers ranking the call's whole key row; GLM-DSA
# twice: every layer running its own indexer, and layer 1 reusing layer 0's choice ("shared"). Qwen4-Exp keeps the
# top-2 blocks of 4 keys, ranking only the query's own complete blocks (the same row alone as in the tree). The same
# DeepSeek indexer under other class names: A.X K2 (a gated MLA), dots3-note (indexed layers beside sliding-window ones,
# the window of 8 filled), HY-V4 (attention sinks, hyper-connections, its third layer "shared").
SPARSE = {
    "deepseek_v32": ("deepseek_v32", {}),
    "glm_moe_dsa": ("glm_moe_dsa", {"indexer_types": ["full", "full"]}),
    "glm_moe_dsa-shared": ("glm_moe_dsa", {"indexer_types": ["full", "shared"]}),
    "qwen4_exp_text": ("qwen4_exp_text", {}),
    "axk2": ("axk2", {}),
    "dots3_note_text": ("dots3_note_text", {}),
    "hy_v4": ("hy_v4", {}),
}
SPARSE_PLANS = {**PLANS, "one-path": DfsEngine(memory="one-path", chunk_tokens=5)}


def _sparse_model(build: str) -> torch.nn.Module:
    """The build's tiny float64 model (tests/zoo.py, its top-k as the zoo sets it) in the tests' vocabulary, its
    attention sinks drawn away from their init of 0 (where a sink's scale or sign would not show), and the weights a
    model keeps in float32 (HY-V4's hyper-connections, sinks and LM head) in float64 too, for `float64_throughout`."""
    model_type, changes = SPARSE[build]
    config = tiny_config(model_type)
    config.vocab_size = VOCAB
    for key, value in config.to_dict().items():  # a special id the tests' vocabulary does not hold (a pad embedding)
        if key.endswith("_token_id") and isinstance(value, int) and value >= VOCAB:
            setattr(config, key, None)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager",
                                             attn_implementation="sdpa" if _sdpa(model_type) else "eager").eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.0)
    return model.to(torch.float64)


def _sdpa(model_type: str) -> bool:
    """Whether the type's causal LM runs transformers' SDPA attention (HY-V4 has only its eager one, with sinks)."""
    return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]._supports_sdpa


@pytest.mark.parametrize("build", list(SPARSE))
@pytest.mark.parametrize("plans", [pytest.param(FAST_PLANS, id="fast"), pytest.param(
    [p for p in SPARSE_PLANS if p not in FAST_PLANS], id="more", marks=pytest.mark.slow)])
def test_sparse_attention_chooses_each_querys_keys_among_its_ancestors(build, plans):
    """Sparse attention with a learned indexer: the indexer keys of the path travel like K/V, each query's keys
    are chosen among its own ancestors, and the attention over them matches each sequence alone, in every plan.

    Where an indexer ranks the call's whole key row, every engine takes the earliest of keys tied at the k-th score
    (as torch.topk on CUDA): DfsEngine and the flat reference both run as users run them (`indexer_top_k` only counts
    what the reference's top-k met). These sequences hold such ties (the indexers' ReLU scores many keys exactly 0)."""
    model = _sparse_model(build)
    seqs = _every_shape(5)
    with float64_throughout():
        with indexer_top_k(model, earliest=False) as seen:
            reference = run_engine(ORACLE, model, seqs, sequence_loss)
        assert seen.binding > 0, f"{build}: the top-k keeps every key of these sequences; the test covers no choice"
        whole_row = find_mixers(model).whole_row_topk
        assert seen.ties > 0 or not whole_row, f"{build}: no key ties at the k-th score; the test covers no tie"
        window = getattr(model.config.get_text_config(), "sliding_window", None)
        assert not window or max(map(len, seqs)) > window, f"{build}: no sequence fills the window of {window}"
        for name in plans:
            errors = compare_runs(run_engine(SPARSE_PLANS[name], model, seqs, sequence_loss), reference)
            outputs = max(e for k, e in errors.items() if k.startswith("seq"))
            assert max(outputs, errors["loss"], errors["gradient"]) <= EXACT, (name, outputs, errors["gradient"])


# DeepSeek-V4's compressed attention (tests/zoo.py: one entry per complete window of 3 tokens in its heavily compressed
# layers, of 2 in its compressed sparse one, whose indexer keeps each query's top 4 entries), with one indexer head
# here, whose ReLU scores many entries exactly 0: ties at the k-th score on these sequences. Its sinks and the
# compressors' position biases are drawn away from their init of 0, its float32 weights made float64 for
# `float64_throughout`.
COMPRESSED_FAST = ["default", "one-token-rows"]  # rows of unequal length; one-token calls (each closes a window or not)


def _compressed_model() -> torch.nn.Module:
    config = tiny_config("deepseek_v4")
    config.vocab_size, config.index_n_heads = VOCAB, 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager").eval()
    with torch.no_grad():
        for module in model.modules():
            for name in ("sinks", "position_bias"):
                if isinstance(getattr(module, name, None), torch.nn.Parameter):
                    getattr(module, name).normal_(0.0, 1.0)
    return model.to(torch.float64)


@pytest.mark.parametrize("plans", [pytest.param(COMPRESSED_FAST, id="fast"), pytest.param(
    [p for p in SPARSE_PLANS if p not in COMPRESSED_FAST], id="more", marks=pytest.mark.slow)])
def test_compressed_attention_continues_the_paths_windows(plans, monkeypatch):
    """A node hands its children what transformers' V4 cache layers keep: the path's compressed entries (with their
    gradient, like K/V), the open window's raw K/V and gates, the overlap slice and the indexer's compressed keys;
    each query reads the entries its compressor appended under their causal and top-k bias. Exact in every plan, keys
    tied at the indexer's k-th score going to the earliest entry in both engines."""
    model = _compressed_model()
    seqs = _every_shape(5)
    handed = _handed_compression_states(monkeypatch)
    with float64_throughout():
        with indexer_top_k(model, earliest=False) as seen:
            reference = run_engine(ORACLE, model, seqs, token_loss)
        assert seen.binding > 0 and seen.ties > 0, seen
        for name in plans:
            errors = compare_runs(run_engine(SPARSE_PLANS[name], model, seqs, token_loss), reference)
            assert max(errors.values()) <= EXACT, (name, max(errors, key=errors.get), max(errors.values()))
    parts = {f"{name} {part}" for name in ("compressor", "indexer") for part in ("entries", "buffer kv", "overlap kv")}
    assert parts <= handed, f"never handed on: {parts - handed}"


def _handed_compression_states(monkeypatch) -> set[str]:
    """The compressed-attention states (`CompressionState`'s) a node was handed non-empty by its parent."""
    handed: set[str] = set()
    start = TreeStateCache._start

    def recorded(self, key, read=True):
        state = start(self, key, read)
        if state is not None and state.numel() and key[1] not in ("conv", "recurrent", "linear"):
            handed.add(key[1])
        return state

    monkeypatch.setattr(TreeStateCache, "_start", recorded)
    return handed


@pytest.mark.parametrize("extra", [{"sliding_window": 4}, {"softcap": 30.0}])
def test_sparse_attention_refuses_a_window_or_soft_cap(monkeypatch, extra):
    """A sparse-attention layer that also asks for a sliding window or soft-capping: refused before any output, naming
    it (treerl's sparse attention applies the scale, the indexer's choice and sinks, nothing else)."""
    model = _sparse_model("deepseek_v32")
    dispatch = ALL_ATTENTION_FUNCTIONS["treerl"]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "treerl", lambda *args, **kwargs: dispatch(*args, **kwargs, **extra))
    name = "a sliding window" if "sliding_window" in extra else "soft-capping"
    with pytest.raises(UnsupportedModel, match=f"layer 0: sparse attention .* with {name}"):
        DfsEngine().forward_backward(model, _every_shape(), token_loss)
    assert all(p.grad is None for p in model.parameters())


def test_index_ties_go_to_the_earliest_key_whatever_the_width_of_the_call():
    """The tree's top-k (`earliest_topk`): among keys tied at the k-th score the earliest, whatever the number of
    masked keys after them, where torch.topk's choice on CPU changes with it; without a tie, torch.topk's keys."""
    scores = torch.tensor([0.0, 0.5, -0.25, 0.0, -1.0, 0.0, 0.75, 0.0, -0.5, 0.0, 0.0], dtype=torch.float64)
    for width in range(len(scores), 300):  # the keys after the query's are masked: -inf up to the call's width
        row = torch.cat([scores, scores.new_full((width - len(scores),), float("-inf"))])
        assert sorted(earliest_topk(row, 4).indices.tolist()) == [0, 1, 3, 6], width
        distinct = row + torch.arange(width) * 1e-3
        assert sorted(earliest_topk(distinct, 4).indices.tolist()) == sorted(torch.topk(distinct, 4).indices.tolist())


def test_the_hybrid_page_names_every_kind_in_the_table():
    """docs/hybrid-models.md explains MIXERS: a kind added to the table gets its row in the page."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "hybrid-models.md").read_text()
    for kind in MIXERS:
        assert f"| {kind.name} |" in page, kind.name


def test_the_models_own_cpu_forward_differs_from_the_engines_only_after_a_tied_index_score():
    """Every engine takes the earliest of keys tied at an indexer's k-th score, as torch.topk does on CUDA (FlatEngine
    through `earliest_index_ties`); the model's own forward on CPU picks among them by the width of its call. On each
    sequence the two agree to float64 rounding under the test's own earliest rule (`indexer_top_k`'s stable sort), and
    without it on every token up to the first query whose k-th score ties: a tie is the only cause of a difference,
    and on these sequences there is one."""
    model = _sparse_model("glm_moe_dsa")
    seqs = _every_shape(5)
    flat = ORACLE.forward(model, seqs)
    differing = 0
    for i, (sequence, out) in enumerate(zip(seqs, flat)):
        with indexer_top_k(model):
            ruled = _own_logprobs(model, sequence)
        assert (ruled - out["logprobs"]).abs().max() <= 1e-12, i
        with indexer_top_k(model, earliest=False) as seen:
            raw = _own_logprobs(model, sequence)
        off = ((raw - out["logprobs"]).abs() > 1e-12).nonzero()
        if len(off):
            differing += 1
            first_differing_query = int(off[0]) - 1  # log-prob j is read off query j - 1
            assert seen.first_tie is not None and first_differing_query >= seen.first_tie, (i, first_differing_query)
    assert differing, "no sequence's own CPU forward picked other tied keys: the engines' rule is not tested here"


@torch.no_grad()
def _own_logprobs(model: torch.nn.Module, sequence: TokenSequence) -> torch.Tensor:
    """The model's own forward on one sequence, as transformers computes it (no tie rule of treerl's)."""
    if len(sequence) == 1:
        return torch.zeros(1, dtype=torch.float64)
    logits = model(input_ids=sequence.tokens[None, :-1], use_cache=False).logits[0].double()
    chosen = torch.log_softmax(logits, -1).gather(1, sequence.tokens[1:, None])[:, 0]
    return torch.cat([chosen.new_zeros(1), chosen])


# Inkling's attention adds a bias per query and key, read off a learned profile over their distance (`position_bias`,
# zero from `rel_extent` on), and Inkling2's a sink logit per query; short convolutions sit on its keys, values and
# residual branches, and Inkling2's attention residuals attend over each token's own earlier layers. The zoo's builds
# cut the extent to 6 and scale queries and biases from position 4 on (both act on these sequences); Inkling2-loop
# runs its two loop layers three times, each pass with its own K/V slot and convolution states.
INKLING = ["inkling_text", "inkling2_text", "inkling2_loop_text"]
INKLING_FAST = ["default", "small-calls"]  # rows of unequal length and calls of a few rows; the one-token step: slow


@pytest.mark.parametrize("model_type", INKLING)
@pytest.mark.parametrize("plans", [pytest.param(INKLING_FAST, id="fast"), pytest.param(
    ["keep-graph", "recompute", "chunks-carry-state"], id="more", marks=pytest.mark.slow), pytest.param(
    ["one-token-rows"], id="one-token", marks=pytest.mark.slow)])
def test_a_bias_over_distances_reads_the_path_at_its_distances(model_type, plans, monkeypatch):
    """The layer computes its bias over [path | row] from the cache's offsets (the distances of its sequence alone),
    and treerl's dense attention adds it to the scores of the path's keys and the row's: exact in every plan."""
    model = build_tiny(model_type).to(torch.float64)  # the convolutions and routers it keeps in float32 too
    config, seqs = model.config.get_text_config(), _every_shape(6)
    assert config.rel_extent < max(map(len, seqs)) and config.log_scaling_n_floor < max(map(len, seqs))
    calls = _dense_calls(monkeypatch)
    with float64_throughout():
        reference = run_engine(ORACLE, model, seqs, token_loss)
        for name in plans:
            errors = compare_runs(run_engine(PLANS[name], model, seqs, token_loss), reference)
            assert max(errors.values()) <= EXACT, (name, max(errors, key=errors.get), max(errors.values()))
    assert any(biased and end > 0 for biased, end, _ in calls), "no biased query saw a path: the tree is not tested"
    passes = {slot for _, _, slot in calls}
    loops = getattr(config, "loop_num_passes", 1)
    assert {n for _, n in passes} == set(range(loops)), passes  # Inkling2-loop: a K/V slot per pass of a loop layer


def _dense_calls(monkeypatch) -> list[tuple[bool, int, tuple]]:
    """(whether the layer brought a bias, the path's length, its K/V slot) of each call of treerl's dense attention."""
    calls: list[tuple[bool, int, tuple]] = []
    dense = tree_attention.dense_attention

    def recorded(q, k, v, layer, path, unit, layout, index):
        calls.append((layer.bias is not None, layout.path_end, index))
        return dense(q, k, v, layer, path, unit, layout, index)

    monkeypatch.setattr(tree_attention, "dense_attention", recorded)
    return calls

"""Attention a model computes in its own code, and positions a body makes from the call's length.

Bloom, MPT, Falcon, GPT-Neo, Doge, MVP, TrOCR, GPT-NeoX-Japanese and GIT compute attention in their own module code (a matmul, their
ALiBi or rotary, their own causal mask) over the K/V that their cache's `update` returns. DfsEngine hands them a cache
that returns [path | own row] K/V and says the path's length, and runs every row of a call from the path's end: the
mask they build is then the sequence's own, and the keys are the sequence's. The path's K/V gradient goes to its
store like treerl's attention's. PackedEngine, which packs nodes into one row, refuses them (tests/engine/
test_refusals.py). BART's decoder family takes no position_ids: its position embeddings are given the depths
(tests/engine/test_model_features.py runs both kinds through random trees too).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support import assert_bf16_no_worse_than_flat
from test_exactness import HAND, ORACLE, _with_data, token_loss
from transformers import AutoModelForCausalLM
from zoo import build_tiny, tiny_config

from treerl.engine import DfsEngine
from treerl.engine.base import attends_in_own_code
from treerl.testing import assert_engines_agree, assert_matches_model, compare_runs, run_engine

# float64 throughout: the flat reference is exact to rounding. Bloom and MPT take their softmax in float32, GPT-Neo its
# whole attention (1e-7). GPT-Neo's local layers (a window of 8) and everyone's causal mask over [path | row] are their
# own code's; Doge's dynamic mask keeps each query's top 4 keys (keep_window_size; repeated tokens tie at its first
# layer: every engine takes the earliest, treerl.engine.recurrent.TOPK_MASK_METHODS).
TOL = {"falcon": 1e-9, "falcon-alibi": 1e-9, "mvp": 1e-9, "gpt_neox_japanese": 1e-9, "git": 1e-9, "trocr": 1e-9,
       "bloom": 1e-6, "mpt": 1e-6, "gpt_neo": 1e-6, "doge": 1e-6}
_MODELS: dict[str, torch.nn.Module] = {}


def own_code_model(name: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The zoo's tiny build; `falcon-alibi`: Falcon with ALiBi instead of rotary positions (its own code's other path)."""
    key = f"{name}-{dtype}"
    if key not in _MODELS:
        if name == "falcon-alibi":
            config = tiny_config("falcon")
            config.alibi = True
            torch.manual_seed(0)
            _MODELS[key] = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        else:
            _MODELS[key] = build_tiny(name, dtype=dtype)
    return _MODELS[key]


def _batch(lists: list[list[int]], seed: int = 0):
    rng = random.Random(seed)
    return [_with_data([5 + t for t in tokens], rng, f"s{i}") for i, tokens in enumerate(lists)]


@pytest.mark.parametrize("name", list(TOL))
def test_attention_in_the_models_own_code_is_exact(name):
    model = own_code_model(name)
    batch = _batch(HAND["grpo group"] + HAND["fork below a chain"])
    engine = DfsEngine(chunk_tokens=3)
    assert_matches_model(model, batch, engine.forward(model, batch), tol=TOL[name])
    assert_engines_agree(model, batch, token_loss, engine, ORACLE, tol=TOL[name])
    assert attends_in_own_code(model)  # served through the cache, not through treerl's attention


@pytest.mark.slow  # ~10 s on 2 cores
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a token repeated at the start: Doge's second layer scores keys 0-3 equal in exact arithmetic, a few units of rounding
# apart in an order that changes with the call's shapes (treerl.engine.recurrent.tie_tolerance)
@example(name="doge", lists=[[1, 0, 0], [1, 1, 1, 1, 3, 0]], chunk=1, batch_tokens=6, recompute="auto")
@given(
    name=st.sampled_from(["falcon", "falcon-alibi", "mvp", "gpt_neox_japanese", "gpt_neo", "doge", "bloom"]),
    lists=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=6),
    chunk=st.sampled_from([1, 2, 3, 2048]),
    batch_tokens=st.sampled_from([0, 6, 8192]),
    recompute=st.sampled_from(["auto", "always", "never"]),
)
def test_random_trees_and_plans(name, lists, chunk, batch_tokens, recompute):
    """A small alphabet: much sharing, nodes of every length, rows of a call padded to its widest."""
    engine = DfsEngine(chunk_tokens=chunk, batch_tokens=batch_tokens, recompute=recompute)
    assert_engines_agree(own_code_model(name), _batch(lists, len(lists)), token_loss, engine, ORACLE, tol=TOL[name])


def test_gradient_checkpointing_replays_the_own_code_over_the_same_keys():
    """transformers' checkpointing recomputes each layer in backward: the cache hands the replay the same [path | row]
    K/V (the path's gradient reaches its store once per use, not once per replay)."""
    model = own_code_model("falcon")
    reference = build_tiny("falcon").train()
    checkpointed = build_tiny("falcon").train()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _batch(HAND["fork below a chain"] + HAND["grpo group"])
    errors = compare_runs(run_engine(DfsEngine(chunk_tokens=3), checkpointed, batch, token_loss),
                          run_engine(ORACLE, reference, batch, token_loss))
    assert max(errors.values()) <= 1e-9, errors
    assert model is not checkpointed


@pytest.mark.parametrize("name", ["bart", "marian", "bloom", "falcon", "mvp"])
def test_bfloat16_error_no_larger_than_the_flat_references(name):
    """bf16 autocast over float32 weights, as users train: the positions handed to BART's and Marian's embeddings and
    the [path | row] K/V handed to the own-code attentions err no more than training each sequence alone."""
    batch = _batch(HAND["grpo group"] + HAND["fork below a chain"], seed=3)
    low, high = build_tiny(name, dtype=torch.float32), build_tiny(name, dtype=torch.float64)
    high.load_state_dict({k: v.double() for k, v in low.state_dict().items()})
    assert_bf16_no_worse_than_flat(low, high, batch, token_loss, DfsEngine(chunk_tokens=3), ORACLE)

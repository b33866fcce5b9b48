"""Exact or refused on the attention and output features real architectures add.

Absolute positions that the body computes from the call's length, not from position_ids (BART's decoder family:
learned with an offset, Marian: sinusoidal): treerl hands the tokens' depths to the position embeddings.

Sliding windows (Mistral; Qwen2 on some layers), soft-capped scores and logits (Gemma-2), attention sinks (gpt-oss),
logit scaling (Cohere, Granite), key and value heads of different sizes (DeepSeek-V3 MLA), no
`intermediate_size` (GPT-2), and RoPE whose frequencies depend on the call's length (Phi-3
longrope). Tiny float64 configs with float64 norms; windows of 5 tokens so that random trees
cross them in every way. Gemma-2 and gpt-oss run eager attention, whose softmax transformers takes
in float32: ~1e-9 there.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import exact_norms, float64_throughout
from test_exactness import HAND, _with_data, token_loss
from transformers import (
    AutoModelForCausalLM,
    BartConfig,
    CohereConfig,
    DeepseekV3Config,
    Gemma2Config,
    GPT2Config,
    GptOssConfig,
    GraniteConfig,
    MarianConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
)
from zoo import build_tiny

from treerl.attention import UnsupportedModel
from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.engine.base import attention_slots
from treerl.engine.support import attention_layers
from treerl.testing import assert_engines_agree, assert_matches_model, compare_runs, run_engine
from treerl.tree import TokenSequence

VOCAB = 64
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 0}
# an encoder-decoder's decoder as a causal LM: no dropout, positions made from the call's length
BART = {"vocab_size": VOCAB, "d_model": 32, "decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 64,
        "encoder_layers": 1, "encoder_attention_heads": 4, "encoder_ffn_dim": 64, "max_position_embeddings": 256,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, "decoder_start_token_id": 1}
FEATURES = {
    "mistral-window": lambda: MistralConfig(**SMALL, sliding_window=5),
    "qwen2-window-layers": lambda: Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "gemma2-softcap-window": lambda: Gemma2Config(**SMALL, head_dim=8, sliding_window=5, attn_logit_softcapping=1.0,
                                                  final_logit_softcapping=2.0, query_pre_attn_scalar=8),
    "gpt-oss-sinks-window": lambda: GptOssConfig(**{**SMALL, "intermediate_size": 16}, head_dim=8, sliding_window=5,
                                                 num_local_experts=4, num_experts_per_tok=2),
    "cohere-logit-scale": lambda: CohereConfig(**SMALL, logit_scale=0.3),
    "granite-logits-scaling": lambda: GraniteConfig(**SMALL, logits_scaling=4.0, residual_multiplier=0.5,
                                                    embedding_multiplier=3.0, attention_multiplier=0.2),
    "deepseek-v3-mla": lambda: DeepseekV3Config(**{**SMALL, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16,
                                                qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                                                num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                                                n_group=1, topk_group=1),
    "bart-positions-from-length": lambda: BartConfig(**BART),
    "marian-sinusoidal-from-length": lambda: MarianConfig(**BART),
    "gpt2-no-intermediate-size": lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                                    bos_token_id=1, eos_token_id=2),
}
EAGER_ONLY = {"gemma2-softcap-window", "gpt-oss-sinks-window"}  # transformers offers no SDPA for these
# How close the flat reference itself can be: 1e-9 where every op runs in float64 (norms patched),
# the 1e-6 contract where the model keeps float32 pieces (LayerNorm, MoE router), 1e-5 for eager
# attention (transformers takes its softmax in float32).
TOL = {"mistral-window": 1e-9, "bart-positions-from-length": 1e-9, "marian-sinusoidal-from-length": 1e-9, "qwen2-window-layers": 1e-9, "granite-logits-scaling": 1e-9, "gpt2-no-intermediate-size": 1e-9,
       "gemma2-softcap-window": 1e-5, "gpt-oss-sinks-window": 1e-5}
_MODELS: dict[str, torch.nn.Module] = {}


def feature_model(name: str) -> torch.nn.Module:
    if name not in _MODELS:
        torch.manual_seed(0)
        implementation = "eager" if name in EAGER_ONLY else "sdpa"
        _MODELS[name] = exact_norms(AutoModelForCausalLM.from_config(
            FEATURES[name](), dtype=torch.float64, attn_implementation=implementation, experts_implementation="eager"
        ).eval())
    return _MODELS[name]


def _sequences(token_lists: list[list[int]], seed: int) -> list[TokenSequence]:
    g = torch.Generator().manual_seed(seed)
    return [TokenSequence(torch.tensor(t), fields={"advantages": torch.randn(len(t), generator=g, dtype=torch.float64)})
            for t in token_lists]


def _loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum() - 0.1 * view.entropy.sum()


def _grpo_like(seed: int) -> list[TokenSequence]:
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(9)]
    lists = [prompt + [rng.randrange(VOCAB) for _ in range(n)] for n in (4, 7, 11, 0)]
    return _sequences(lists + [[rng.randrange(VOCAB) for _ in range(13)]], seed)


# dfs-per-node: each call below the path (a tree of one call has no path: every position starts from its prompt's)
ENGINES = {"flat": FlatEngine(), "dfs": DfsEngine(chunk_tokens=3), "dfs-batched": DfsEngine(),
           "dfs-per-node": DfsEngine(chunk_tokens=3, batch_tokens=0), "packed": PackedEngine()}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", FEATURES)
def test_every_engine_equals_the_models_own_forward(name, engine):
    model = feature_model(name)
    batch = _grpo_like(0)
    tol = TOL.get(name, 1e-6)
    assert_matches_model(model, batch, ENGINES[engine].forward(model, batch), tol=tol)
    assert_engines_agree(model, batch, _loss, ENGINES[engine], FlatEngine(), tol=tol)


@pytest.mark.slow  # ~5 s on 2 cores
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["mistral-window", "qwen2-window-layers", "gemma2-softcap-window", "gpt-oss-sinks-window",
                          "bart-positions-from-length", "marian-sinusoidal-from-length"]),
    lists=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=16), min_size=1, max_size=6),
    chunk=st.sampled_from([1, 2, 3, 5, 2048]),
    batch_tokens=st.sampled_from([0, 64]),
    recompute=st.sampled_from(["auto", "always"]),
)
def test_random_trees_cross_windows_in_every_way(name, lists, chunk, batch_tokens, recompute):
    """Small alphabet: lots of sharing; nodes end and start at every offset from the window's edge.

    Eager-only models: transformers' eager softmax is float32, so the flat reference itself is only
    ~1e-6 exact; there DfsEngine is held to 1e-9 against PackedEngine (exact float64 math, no walk)
    and PackedEngine to 1e-5 against the flat reference.
    """
    model = feature_model(name)
    batch = _sequences(lists, seed=len(lists))
    engine = DfsEngine(chunk_tokens=chunk, batch_tokens=batch_tokens, recompute=recompute)
    if name in EAGER_ONLY:
        assert_engines_agree(model, batch, _loss, engine, PackedEngine(), tol=1e-9)
        errors = compare_runs(run_engine(PackedEngine(), model, batch, _loss), run_engine(FlatEngine(), model, batch, _loss))
        worst = max(e for k, e in errors.items() if not k.startswith("grad."))  # outputs, loss, the whole gradient
        assert worst <= 1e-5, worst  # (one parameter's small gradient can carry 1e-4 of float32 softmax noise)
    else:
        assert_engines_agree(model, batch, _loss, engine, FlatEngine(), tol=1e-9)


def _longrope_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Phi3Config(**{**SMALL, "max_position_embeddings": 64}, original_max_position_embeddings=16,
                        rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [3.0] * 4})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


@pytest.mark.parametrize("engine", ENGINES)
def test_length_dependent_rope_is_exact_below_its_switch_and_refused_above(engine):
    model = _longrope_model()
    short = _sequences([[3, 4, 5, 6, 7, 8], [3, 4, 5, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], seed=0)
    assert_matches_model(model, short, ENGINES[engine].forward(model, short), tol=1e-6)
    long = short + _sequences([list(range(20))], seed=1)
    calls = []
    model.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(UnsupportedModel, match="'longrope' changes its frequencies with the length of each call"):
        ENGINES[engine].forward_backward(model, long, _loss)
    assert calls == []


# Layers that attend more than once per forward, each call over its own keys: DiffLlama's differential attention (two
# calls of one module on the same keys, each with half the values), Dory's looped middle layer (two passes, one window
# of 8 that fills), HRM's cycles (16 calls of two layer indices, some under no_grad). The path holds one K/V slot per
# (layer, n-th call of the forward). The zoo's builds (tests/zoo.py); Zamba's shared block: tests/engine/test_recurrent.py.
REPEATED = ["diffllama", "dory", "hrm_text"]


def _repeated_batch() -> list[TokenSequence]:
    """A GRPO group and a fork below a chain (rows of unequal length, a chain across calls), up to 17 tokens."""
    rng = random.Random(7)
    return [_with_data(t, rng, str(i)) for i, t in enumerate(HAND["grpo group"] + HAND["fork below a chain"])]


@pytest.mark.parametrize("model_type", REPEATED)
def test_a_layer_that_attends_more_than_once_has_a_path_slot_per_call(model_type):
    """DfsEngine equals the flat reference, and its log-probs each sequence's own forward, with nodes chunked across
    calls and recomputed: every call of a layer reads the path's keys of that same call."""
    model = build_tiny(model_type)
    seqs = _repeated_batch()
    with float64_throughout():
        reference = run_engine(FlatEngine(layout="sequences"), model, seqs, token_loss)
        for engine in (DfsEngine(chunk_tokens=3), DfsEngine(chunk_tokens=4, recompute="always", batch_tokens=0)):
            errors = compare_runs(run_engine(engine, model, seqs, token_loss), reference)
            whole = {k: e for k, e in errors.items() if not k.startswith("grad.")}
            assert max(whole.values()) <= 1e-9, (model_type, max(whole, key=whole.get), max(whole.values()))
        assert_matches_model(model, seqs, DfsEngine(chunk_tokens=5).forward(model, seqs), tol=1e-9)
    slots = attention_slots(model)  # counted by the routing probe
    assert slots > len(attention_layers(model)), f"{model_type}: no layer attends twice ({slots} calls)"


def test_gradient_checkpointing_of_a_layer_that_attends_twice_is_refused():
    """Checkpointing recomputes one layer at a time in backward, which cannot tell which of a layer's calls it replays:
    refused at the first call, before any gradient (the same model without checkpointing is exact, above)."""
    model = build_tiny("diffllama").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(UnsupportedModel, match="layer 0 calls attention more than once per forward.*checkpointing"):
        DfsEngine().forward_backward(model, _repeated_batch(), token_loss)
    assert all(p.grad is None for p in model.parameters())

"""Every causal-LM type of the installed transformers builds tiny without a download, or is a known skip."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from support import indexer_top_k
from zoo import (
    CAUSAL_LM_TYPES,
    OPTIONAL_PACKAGES,
    ZooSkip,
    arch_info,
    build_tiny,
    default_config,
    input_ids,
    tiny_config,
)

# Each skip with the reason build_tiny gives (a regex); a type that newly fails to build fails the test.
EXPECTED_SKIPS = {
    "gemma4_assistant": "speculative-decoding drafter",
    "gemma4_unified_assistant": "speculative-decoding drafter",
    "xglm": "overflows",  # in float64 only
}
# A type whose build needs an optional package (zoo.OPTIONAL_PACKAGES) skips only where the package is absent.
EXPECTED_SKIPS.update({model_type: f"needs a package that is not installed: .*{package}"
                       for model_type, package in OPTIONAL_PACKAGES.items()
                       if importlib.util.find_spec(package) is None})

MAX_PARAMETERS = 600_000  # < 5 MB in float64
# Types with a sparse-attention indexer (a learned top-k of each query's keys, or of key blocks)
SPARSE_ATTENTION = ["axk2", "deepseek_v32", "deepseek_v4", "dots3_note_text", "glm_moe_dsa", "hy_v4", "qwen4_exp_text"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and OpenMP spin-waits cost seconds on a busy shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", CAUSAL_LM_TYPES)
def test_every_type_builds_tiny_and_gives_finite_logits(model_type):
    if model_type in EXPECTED_SKIPS:
        with pytest.raises(ZooSkip, match=EXPECTED_SKIPS[model_type]):
            build_tiny(model_type)
        return
    model = build_tiny(model_type)
    ids = input_ids(model, length=24)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (*ids.shape, model.config.get_text_config().vocab_size)
    assert torch.isfinite(logits).all()
    assert not model.training
    assert sum(p.numel() for p in model.parameters()) < MAX_PARAMETERS


@pytest.mark.parametrize("model_type", CAUSAL_LM_TYPES)
def test_tiny_config_keeps_every_layer_kind_and_special_ids_in_vocab(model_type):
    if model_type in EXPECTED_SKIPS and "overflows" not in EXPECTED_SKIPS[model_type]:
        pytest.skip(EXPECTED_SKIPS[model_type])
    tiny = tiny_config(model_type).get_text_config().to_dict()
    default = default_config(model_type).get_text_config().to_dict()
    for key in ("layer_types", "mlp_layer_types", "layers_block_type"):
        if isinstance(default.get(key), list) and isinstance(tiny.get(key), list):
            assert set(tiny[key]) >= set(default[key]), key
    for key, value in tiny.items():
        if key.endswith("_token_id") and isinstance(value, int):
            assert 0 <= value < tiny["vocab_size"], key


@pytest.mark.parametrize("model_type", SPARSE_ATTENTION)
def test_sparse_attention_chooses_among_the_keys_of_a_tests_sequence(model_type):
    """A top-k sized for production (2048 keys) keeps every key of a test's ~20 tokens and tests nothing of sparse
    attention (docs/design.md, invariant 6): on 24 tokens the zoo's indexers leave keys out."""
    model = build_tiny(model_type)
    with indexer_top_k(model) as seen, torch.no_grad():
        model(input_ids=input_ids(model, length=24))
    assert seen.binding > 0, f"{model_type}: the indexer keeps every key of 24 tokens"


def test_build_is_seeded():
    a, b, c = build_tiny("qwen3", seed=1), build_tiny("qwen3", seed=1), build_tiny("qwen3", seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert a.dtype == torch.float64 and build_tiny("qwen3", dtype=torch.float32).dtype == torch.float32


def test_attention_falls_back_to_eager_where_sdpa_is_unsupported():
    assert build_tiny("gemma2").config._attn_implementation == "eager"
    assert build_tiny("llama").config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    ("model_type", "facts"),
    [
        ("llama", {"causal": True, "sliding_window": None, "moe": False, "recurrent": False, "lm_head_check": "equal"}),
        ("gemma2", {"causal": True, "sliding_window": 8, "attn_softcap": 50.0, "final_logit_softcap": 30.0,
                    "lm_head_check": "logits = 30.0 * tanh(lm_head(h) / 30.0)"}),
        ("gpt_oss", {"sinks": True, "moe": True, "sliding_window": 8}),
        ("deepseek_v3", {"kv_head_dims": (24, 16), "moe": True}),
        ("cohere", {"logit_scaling": "logit_scale=0.0625", "lm_head_check": "logits = 0.0625 * lm_head(h)"}),
        ("bert", {"causal": True, "attention_calls": 2}),  # a decoder (is_decoder=True)
        ("xlnet", {"causal": False, "attention_calls": None}),  # bidirectional; attention computed inline
        ("mamba", {"recurrent": True, "attention_calls": None}),
        ("llama4_text", {"sliding_window": None}),  # chunked attention is no sliding window
    ],
)
def test_arch_info_reads_known_facts(model_type, facts):
    info = arch_info(model_type, build_tiny(model_type))
    for name, value in facts.items():
        assert getattr(info, name) == value, name


def test_arch_info_measures_masks_and_heads():
    info = arch_info("llama4_text", build_tiny("llama4_text"))
    assert "chunks of 8" in info.attention_kwargs["mask"]
    info = arch_info("bert", build_tiny("bert"))
    assert "cls.predictions(h)" in info.lm_head_check  # a transform between the hidden state and the decoder
    assert info.dropout_keys == {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}

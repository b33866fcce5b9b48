"""A refusal names the real obstacle: the layer and the mechanism the model has, read against the model itself.

tests/engine/test_architectures.py reads every refusal of every causal-LM type this way (`reason_errors`); here, fast,
the families whose reasons once named something else: Bloom and MPT (once blamed on position_ids; their attention is
computed in their own code, which DfsEngine now serves through the cache and PackedEngine refuses for that), RWKV (its
state went unseen: "Rwkv..." is no "RWKV"), xLSTM and RecurrentGemma (the model body was named, not the mixer),
GPT-Neo (once refused for an attention module without layer_idx: it tells its cache its `layer_id`), OpenAI GPT (an
attention module without a layer index, computed inline over no cache), XLM (its own attention over the cache, but its
body slices its input by the cache's length: the routing probe runs a token below its prefix and compares); and the ones once refused for what is no obstacle
(an attention wrapper, modules a text-only batch never runs, positions made from the call's length, attention in the
model's own code).
"""

from __future__ import annotations

import re

import pytest
import torch
from zoo import ArchInfo, arch_info, build_tiny

from treerl.attention import UnsupportedModel
from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.engine.support import IDLE_IN_TEXT, decoder_module
from treerl.testing import compare_runs, run_engine
from treerl.tree import TokenSequence

# "<path> (<Class>," / "<path> (<Class>)" / "<path> (<Class>:": a module a reason names, path relative to the body
_NAMED_MODULE = re.compile(r"(?:: |attention module )([\w.]*) \((\w+)[,:)]")
_POSITIONS = "takes no position_ids"
_INLINE = "in its own module code|in their own module code|computes attention in its own code"


def reason_errors(model: torch.nn.Module, reason: str, info: ArchInfo, engine: str) -> list[str]:
    """What in a refusal does not hold for the model (empty: it names the real obstacle), against the zoo's own facts
    (`ArchInfo`: its probe of transformers' AttentionInterface, its reading of recurrent modules)."""
    errors = []
    body = decoder_module(model)
    for path, cls in _NAMED_MODULE.findall(reason):
        if not path:
            errors.append(f"names the model body ({cls}), not a module in it")
            continue
        try:
            found = type(body.get_submodule(path)).__name__
        except AttributeError:
            errors.append(f"names {path}, which the model body does not have")
            continue
        if found != cls:
            errors.append(f"names {path} a {cls}; it is a {found}")
    if _POSITIONS in reason and info.attention_calls is None:
        errors.append("blames position_ids, but the model's attention never calls transformers' AttentionInterface")
    if re.search(_INLINE, reason) and info.attention_calls is not None:
        errors.append("says attention is computed in the model's own code, but it calls transformers' "
                      f"AttentionInterface ({info.attention_calls} calls a forward)")
    if engine == "DfsEngine" and info.recurrent and (_POSITIONS in reason or re.search(_INLINE, reason)):
        errors.append("refuses a model with a recurrent layer for its attention, leaving the state unnamed")
    return errors


def _refusal(model: torch.nn.Module, engine: str = "DfsEngine") -> str:
    sequences = [TokenSequence(torch.arange(3, 9)), TokenSequence(torch.arange(3, 7))]
    with pytest.raises(UnsupportedModel) as refused:
        {"DfsEngine": DfsEngine(), "PackedEngine": PackedEngine()}[engine].forward(model, sequences)
    return str(refused.value)


@pytest.mark.parametrize("model_type, engine, says", [
    ("bloom", "PackedEngine", "attend over the K/V their cache returns under a causal mask they build themselves"),
    ("mpt", "PackedEngine", "attend over the K/V their cache returns under a causal mask they build themselves"),
    ("xlm", "DfsEngine", "a token run over its prefix's K/V from the cache failed .* the body reads the cache some "
                         "other way"),
    ("openai-gpt", "DfsEngine", r"attention module h\.0\.attn \(Attention\) has no layer_idx"),
    ("rwkv", "DfsEngine", r"blocks\.0\.attention \(RwkvSelfAttention, RWKV time and channel mixing\): .*`state` list"),
    ("xlstm", "DfsEngine", r"blocks\.0\.mlstm_layer \(xLSTMLayer, mLSTM\): .*rnn_state"),
    ("recurrent_gemma", "DfsEngine", r"layers\.0\.temporal_block \(RecurrentGemmaRecurrentBlock, RG-LRU"),
    ("gpt_neo", "PackedEngine", "attend over the K/V their cache returns under a causal mask they build themselves"),
])
def test_a_refusal_names_the_obstacle_the_model_has(model_type, engine, says):
    model = build_tiny(model_type)
    reason = _refusal(model, engine)
    assert re.search(says, reason), reason
    assert reason_errors(model, reason, arch_info(model_type, model), engine) == []
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("model_type", ["bert-generation", "mllama", "phi4_multimodal", "bart", "bloom", "mpt"])
def test_a_module_that_is_no_obstacle_refuses_nothing(model_type):
    """Once refused for what is no obstacle: BERT-Generation for an attention wrapper without a layer_idx (the attention
    inside it holds one), Mllama for its image cross-attention layers and Phi-4-multimodal for the convolutions of its
    audio encoder, which a text-only batch never runs; BART for positions its body makes from the call's length (its
    position embeddings take the depths), Bloom and MPT for attention computed in their own code (over the K/V the
    cache returns: the path's and the row's). DfsEngine equals the flat reference on them."""
    model = build_tiny(model_type)
    g = torch.Generator().manual_seed(0)
    sequences = [TokenSequence(torch.tensor(t), fields={"advantages": torch.randn(len(t), generator=g,
                                                                                  dtype=torch.float64)})
                 for t in ([5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 12, 13], [5, 6, 14])]
    errors = compare_runs(run_engine(DfsEngine(chunk_tokens=2), model, sequences, _loss),
                          run_engine(FlatEngine(), model, sequences, _loss))
    assert max(errors["gradient"], *(e for k, e in errors.items() if k.startswith("seq"))) <= 1e-6, errors


def _loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum()


def test_a_module_taken_for_idle_in_a_text_batch_that_runs_is_refused(monkeypatch):
    """IDLE_IN_TEXT (Mllama's image cross-attention, Phi-4's audio and image encoders) is a claim about what a text-only
    batch runs: the routing probe checks it, and a listed module that runs after all is refused before any compute."""
    model = build_tiny("llama")
    monkeypatch.setitem(IDLE_IN_TEXT, "LlamaMLP", "an MLP taken for idle here, to see the probe check it")
    reason = _refusal(model)
    assert re.search(r"layers\.0\.mlp \(LlamaMLP: an MLP taken for idle.*\) ran on a text-only batch", reason), reason


def test_a_body_that_reads_the_cache_some_other_way_is_refused_before_compute():
    """The routing probe runs a token below its prefix through the cache and compares it with the model's own forward:
    a body whose cache changes what it computes in another way (built here: its input shifted once the cache holds a
    prefix) is refused, not served wrong."""
    model = build_tiny("falcon")
    body = decoder_module(model)
    cache_names = ("cache", "past_key_values")

    def shifted(module, args, kwargs):
        cache = next((kwargs[n] for n in cache_names if kwargs.get(n) is not None), None)
        if cache is not None and cache.get_seq_length() > 0:
            kwargs = {**kwargs, "input_ids": (kwargs["input_ids"] + 1) % model.config.vocab_size}
        return args, kwargs

    body.register_forward_pre_hook(shifted, with_kwargs=True)
    reason = _refusal(model)
    assert re.search(r"a token run over its prefix's K/V from the cache is not the token of the model's own forward "
                     r"\(off by [\d.e+-]+ of the hidden state's scale\)", reason), reason
    assert all(p.grad is None for p in model.parameters())

"""MoE routing replay (R3, treerl.engine.routing): every engine replays the recorded experts exactly, one routing per
tree node (the first sequence's), the model's own routes replay its own forward, other routes change the outputs, and
routes that do not fit the model are refused naming the sequence, before any compute."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import exact_norms, tiny_model
from test_exactness import random_batches
from zoo import build_tiny

from treerl.attention import UnsupportedModel
from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.engine.routing import find_routers, recording_routes, routing_replay
from treerl.testing import compare_runs, model_outputs, relative_error, run_engine
from treerl.tree import BatchError, TokenSequence

VOCAB = 128
EXACT = 1e-6  # float64 models whose routers' softmax rounds to float32 (transformers' Qwen3-MoE): docs/design.md
ORACLE = FlatEngine(layout="sequences")
TREE_ENGINES = {
    "dfs": DfsEngine(),
    "dfs-one-path": DfsEngine(memory="one-path", batch_tokens=0),
    "dfs-recompute-chunks": DfsEngine(chunk_tokens=3, recompute="always"),
    "packed": PackedEngine(),
    "flat-packed": FlatEngine(layout="packed", max_tokens=12),
}
_MODELS: dict[str, torch.nn.Module] = {}


def moe(model_type: str = "qwen3_moe") -> torch.nn.Module:
    """A cached tiny float64 MoE model of the zoo with float64 norms (tests leave it as they found it)."""
    if model_type not in _MODELS:
        _MODELS[model_type] = exact_norms(build_tiny(model_type))
    return _MODELS[model_type]


def own_routes(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The experts the model's own forward routes each token to, as a sampler records them."""
    with torch.no_grad(), recording_routes(model) as record:
        model(input_ids=tokens[None], use_cache=False)
        return record.take(len(tokens))


def random_routes(model: torch.nn.Module, n: int, seed: int) -> torch.Tensor:
    """Routes drawn at random (distinct experts per token), -1 on dense layers and on the last token."""
    routers = find_routers(model)
    g = torch.Generator().manual_seed(seed)
    routes = torch.full((n, routers.layers, routers.top_k), -1, dtype=torch.int16)
    for layer in routers.routed_layers:
        routes[:, layer] = torch.rand(n, routers.experts, generator=g).argsort(-1)[:, : routers.top_k].short()
    routes[-1] = -1  # the last sampled token: no sampler runs it
    return routes


def with_data(tokens: list[int], routes: torch.Tensor, seed: int) -> TokenSequence:
    g = torch.Generator().manual_seed(seed)
    n = len(tokens)
    return TokenSequence(torch.tensor(tokens), fields={"routed_experts": routes,
                                                      "advantages": torch.randn(n, generator=g, dtype=torch.float64)})


def loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum() / 5 + 0.01 * view.entropy.sum()


def replayed_run(engine, model, sequences):
    with routing_replay(model):
        return run_engine(engine, model, sequences, loss)


def first_routes(sequences: list[TokenSequence]) -> list[TokenSequence]:
    """Each token's routing taken from the first sequence with the same prefix that has one (a direct per-token
    implementation of one routing per tree node)."""
    out = []
    for seq in sequences:
        routes = seq.fields["routed_experts"].clone()
        for p in range(len(seq)):
            for other in sequences:
                theirs = other.fields["routed_experts"]
                if len(other) > p and torch.equal(other.tokens[: p + 1], seq.tokens[: p + 1]) and bool(
                        (theirs[p][theirs[p] >= 0]).numel()):
                    routes[p] = theirs[p]
                    break
        out.append(TokenSequence(seq.tokens, fields={**seq.fields, "routed_experts": routes}))
    return out


def assert_close(run, reference, tol=EXACT):
    errors = compare_runs(run, reference)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= tol, f"{worst} off by {errors[worst]:.3g}"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "llama4_text"])
def test_own_routes_replay_the_models_own_forward(model_type):
    """Replaying the routes the model's own forward took gives its own log-probs; shifted routes do not."""
    model = moe(model_type)
    rng = random.Random(0)
    tokens = torch.tensor([rng.randrange(3, VOCAB) for _ in range(12)])
    sequence = TokenSequence(tokens, fields={"routed_experts": own_routes(model, tokens)})
    own = model_outputs(model, sequence)["logprobs"]
    with routing_replay(model):
        replayed = ORACLE.forward(model, [sequence])[0]["logprobs"]
        routes = sequence.fields["routed_experts"]
        other = torch.where(routes >= 0, (routes + 1) % find_routers(model).experts, routes)
        moved = ORACLE.forward(model, [TokenSequence(tokens, fields={"routed_experts": other})])[0]["logprobs"]
    assert relative_error(replayed, own) <= 1e-12
    assert relative_error(moved, own) > 1e-4


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lists=random_batches(), engine=st.sampled_from(list(TREE_ENGINES)), seed=st.integers(0, 2**16))
def test_tree_engines_replay_like_the_flat_reference(lists, engine, seed):
    """A tree engine with replayed routes equals the flat reference with the same routes (float64, log-probs and
    gradients), and both replay the first sequence's routing on a shared node (each sequence brings its own random
    routes, so they disagree on every shared token)."""
    model = moe()
    sequences = [with_data(t, random_routes(model, len(t), seed + i), seed + i) for i, t in enumerate(lists)]
    reference = replayed_run(ORACLE, model, sequences)
    assert_close(replayed_run(TREE_ENGINES[engine], model, sequences), reference)
    assert_close(replayed_run(ORACLE, model, first_routes(sequences)), reference)


def test_a_hybrids_row_units_replay_like_the_flat_reference():
    """LFM2-MoE (short convolutions beside attention): DfsEngine runs rows from the parent's state, padded at the end,
    and each row's routes follow its tokens."""
    model = moe("lfm2_moe")
    rng = random.Random(2)
    prompt = [rng.randrange(3, VOCAB) for _ in range(6)]
    lists = [prompt + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (4, 2, 5)] + [prompt[:3]]
    sequences = [with_data(t, random_routes(model, len(t), i), i) for i, t in enumerate(lists)]
    reference = replayed_run(ORACLE, model, sequences)
    for engine in (DfsEngine(), DfsEngine(chunk_tokens=3, recompute="always")):
        assert_close(replayed_run(engine, model, sequences), reference)


def test_other_routes_change_every_engine():
    """The engines read the routes they are given: moving one sequence's experts changes its outputs."""
    model = moe()
    rng = random.Random(1)
    prompt = [rng.randrange(3, VOCAB) for _ in range(6)]
    lists = [prompt + [rng.randrange(3, VOCAB) for _ in range(5)] for _ in range(3)]
    sequences = [with_data(t, random_routes(model, len(t), i), i) for i, t in enumerate(lists)]
    moved = [with_data(t, random_routes(model, len(t), 100 + i), i) for i, t in enumerate(lists)]
    for name, engine in {"flat": ORACLE, **TREE_ENGINES}.items():
        with routing_replay(model):
            ours, theirs = engine.forward(model, sequences), engine.forward(model, moved)
        assert min(relative_error(a["logprobs"], b["logprobs"]) for a, b in zip(ours, theirs)) > 1e-4, name


def test_disagreements_are_counted():
    """routing/disagree_tokens counts the sequence tokens whose own routing differs from their node's replayed one."""
    model = moe()
    prompt = [5, 6, 7, 8]
    lists = [prompt + [9, 10], prompt + [11], prompt + [9, 10]]
    shared = random_routes(model, 6, 7)  # one routing for all ...
    sequences = [with_data(t, torch.cat([shared[: len(t) - 1], shared[-1:]]), 0) for t in lists]
    sequences[1].fields["routed_experts"][:2] = random_routes(model, 3, 8)[:2]  # ... but sequence 1's first two tokens
    sequences[2].fields["routed_experts"][4] = random_routes(model, 2, 9)[0]  # ... and sequence 2's fifth
    expected = sum(int(not torch.equal(seq.fields["routed_experts"][p], sequences[0].fields["routed_experts"][p]))
                   for seq in sequences[1:] for p in range(len(seq) - 1) if len(sequences[0]) > p
                   and torch.equal(seq.tokens[: p + 1], sequences[0].tokens[: p + 1]))
    routed = sum(len(s) - 1 for s in sequences)
    for name, engine in {"flat": ORACLE, **TREE_ENGINES}.items():
        with routing_replay(model):
            stats = engine.forward_backward(model, sequences, loss)
        model.zero_grad(set_to_none=True)
        assert stats.metrics["routing/disagree_tokens"] == expected == 3, name
        assert stats.metrics["routing/routed_tokens"] == routed, name


def _routes(model, n=6):
    return random_routes(model, n, 0)


@pytest.mark.parametrize("case", ["layers", "top_k", "expert", "negative", "float", "partial", "missing", "unrouted"])
def test_routes_that_do_not_fit_are_refused_naming_the_sequence(case):
    model = moe()
    routers = find_routers(model)
    routes = _routes(model)
    good = with_data([3, 4, 5, 6, 7, 8], routes, 0)
    bad_routes = {
        "layers": routes[:, :1], "top_k": routes[:, :, :1], "float": routes.double(),
        "expert": routes.index_fill(0, torch.tensor([2]), routers.experts),
        "negative": routes.index_fill(0, torch.tensor([2]), -2),
        "partial": torch.cat([routes[:2], routes[2:3].index_fill(2, torch.tensor([0]), -1), routes[3:]]),
        "unrouted": routes.index_fill(0, torch.tensor([2]), -1),
    }
    fields = {"advantages": good.fields["advantages"]}
    if case != "missing":
        fields["routed_experts"] = bad_routes[case]
    bad = TokenSequence(good.tokens + 6, fields=fields, name="bad-one")  # shares nothing: its own routes are read
    words = {"layers": "decoder layers", "top_k": "experts per token", "float": "integer", "expert": "names expert",
             "negative": "names expert", "partial": "some MoE layers", "missing": "return_routed_experts",
             "unrouted": "no routing"}
    for engine in (ORACLE, DfsEngine(), PackedEngine()):
        with routing_replay(model), pytest.raises(BatchError, match=f"sequence 1 \\('bad-one'\\).*{words[case]}"):
            engine.forward_backward(model, [good, bad], loss)
        assert all(p.grad is None for p in model.parameters())  # refused before any compute


def test_models_without_plain_routers_are_refused_in_one_line():
    """A dense model, a router that does not pick experts by one top-k (Phi-MoE's sparse mixer), and a second router
    in a layer (JetMoE's attention experts beside its MLP's)."""
    with pytest.raises(UnsupportedModel, match="no MoE layers"), routing_replay(tiny_model("tiny-qwen3", 64)):
        pass
    with pytest.raises(UnsupportedModel, match="without a top-k"), routing_replay(build_tiny("phimoe")):
        pass
    with pytest.raises(UnsupportedModel, match="JetMoeTopKGating also picks 2 of 4"), routing_replay(build_tiny("jetmoe")):
        pass

"""Exact or refused under the settings users turn on: gradient checkpointing, attention implementations,
dropout, autocast, in-place losses, threads, tuple outputs. And the model is left as it was found."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from support import fresh_model
from zoo import build_tiny

from treerl.attention import UnsupportedModel, kernels
from treerl.engine import AutocastEngine, DfsEngine, FlatEngine, PackedEngine
from treerl.testing import assert_engines_agree, assert_matches_model, compare_runs, run_engine
from treerl.tree import TokenSequence

TREE_ENGINES = {
    "dfs": DfsEngine(),
    "dfs-never": DfsEngine(recompute="never", batch_tokens=0),
    "dfs-always-chunked": DfsEngine(recompute="always", chunk_tokens=3),
    "packed": PackedEngine(),
    "flat-packed": FlatEngine(layout="packed", max_tokens=20),
}
ORACLE = FlatEngine(layout="sequences")  # the model's own attention, one sequence per call


def _batch(seed: int = 0, vocab: int = 64) -> list[TokenSequence]:
    """Two groups sharing prompts, one sequence a prefix of another, and a lone sequence."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g)
    a, b = rand(7), rand(5)
    tokens = [torch.cat([a, rand(4)]), torch.cat([a, rand(6)]), torch.cat([a, rand(2), rand(3)]), a[:5],
              torch.cat([b, rand(3)]), torch.cat([b, rand(3)]), rand(9)]
    return [TokenSequence(t, fields={"advantages": torch.randn(len(t), generator=g, dtype=torch.float64)}) for t in tokens]


def _loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum() - 0.1 * view.entropy.sum()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", TREE_ENGINES)
def test_gradient_checkpointing_is_exact(name, reentrant):
    """A recomputed layer reads its own unit's ancestors (the call is captured with the layer's inputs)."""
    model = fresh_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    batch = _batch()
    reference = fresh_model()  # the same weights, no checkpointing: the gradients users would get without it
    reference.train()
    ours = run_engine(TREE_ENGINES[name], model, batch, _loss)
    flat = run_engine(ORACLE, reference, batch, _loss)
    errors = compare_runs(ours, flat)
    assert max(errors.values()) < 1e-10, max(errors, key=errors.get)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("name", TREE_ENGINES)
def test_attention_implementations(name, implementation):
    """Whatever implementation the model was loaded with, every engine equals the model's own forward."""
    model = fresh_model(attn_implementation=implementation)
    batch = _batch(1)
    engine = TREE_ENGINES[name]
    tol = 1e-6 if implementation == "eager" else 1e-10  # eager takes its softmax in float32 even in float64
    assert_matches_model(model, batch, engine.forward(model, batch), tol=tol)
    assert_matches_model(model, batch, ORACLE.forward(model, batch), tol=tol)
    assert_engines_agree(model, batch, _loss, engine, ORACLE, tol=tol)
    assert model.config._attn_implementation == implementation


@pytest.mark.parametrize("name", TREE_ENGINES)
def test_dropout_in_training_is_refused_before_the_model_runs(name):
    model = fresh_model(overrides={"attention_dropout": 0.1})
    model.train()
    calls = []
    model.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(UnsupportedModel, match="attention_dropout=0.1"):
        TREE_ENGINES[name].forward_backward(model, _batch(), _loss)
    assert calls == [] and all(p.grad is None for p in model.parameters())
    model.eval()  # dropout off: exact again
    assert_engines_agree(model, _batch(), _loss, TREE_ENGINES[name], ORACLE, tol=1e-10)


def test_layerdrop_in_training_is_refused():
    """BART's family skips whole decoder layers at random in training (decoder_layerdrop): a shared prefix computed
    once would skip other layers than each sequence alone."""
    model = build_tiny("bart").train()
    model.config.decoder_layerdrop = 0.5
    with pytest.raises(UnsupportedModel, match="decoder_layerdrop=0.5"):
        DfsEngine().forward(model, _batch())


def test_dropout_modules_are_refused_too():
    model = fresh_model()
    model.model.layers[0].mlp.register_module("dropout", torch.nn.Dropout(0.2))
    model.train()
    with pytest.raises(UnsupportedModel, match="dropout p=0.2 at model.layers.0.mlp.dropout"):
        DfsEngine().forward(model, _batch())


@pytest.mark.parametrize("name", TREE_ENGINES)
def test_autocast_bf16_is_as_close_to_float64_as_flat(name):
    """bf16-mixed (every call under autocast, float32 parameters): the tree engines err no more than 1.5x the flat
    reference does (both against float64), and gradients land in float32."""
    model32 = fresh_model(exact=False, dtype=torch.float32)
    model64 = copy.deepcopy(model32).double()
    batch = _batch(2)
    reference = run_engine(ORACLE, model64, batch, _loss)
    flat = run_engine(AutocastEngine(ORACLE, torch.bfloat16), model32, batch, _loss)
    ours = run_engine(AutocastEngine(TREE_ENGINES[name], torch.bfloat16), model32, batch, _loss)
    assert {g.dtype for g in ours.grads.values()} == {torch.float32}
    flat_errors, our_errors = compare_runs(flat, reference), compare_runs(ours, reference)
    for kind in ("logprobs", "grad."):
        flat_worst = max(e for k, e in flat_errors.items() if kind in k)
        our_worst = max(e for k, e in our_errors.items() if kind in k)
        assert 1e-4 < flat_worst < 0.1, (kind, flat_worst)  # bfloat16 compute really happened
        assert our_worst <= 1.5 * flat_worst + 1e-3, (kind, our_worst, flat_worst)


@pytest.mark.parametrize("name", ["dfs", "dfs-always-chunked", "dfs-never"])
def test_the_math_kernels_forced_everywhere_are_exact(name, monkeypatch):
    """The exact math version (what runs where no fused kernel exists) carries the whole tree walk, forward and
    backward, as exactly as the fused kernels do."""
    calls = []
    monkeypatch.setattr(kernels, "backend", lambda *args: calls.append(1) or "math")
    model = fresh_model()
    assert_engines_agree(model, _batch(4), _loss, TREE_ENGINES[name], FlatEngine(), tol=1e-10)
    assert calls  # the walk really asked for (and got) the math version


@pytest.mark.parametrize("name", TREE_ENGINES)
def test_in_place_edits_of_outputs_in_the_loss(name):
    def in_place(view):
        lp = view.logprobs.mul_(2.0)
        view.entropy.add_(1.0)
        return -(lp * view.fields["advantages"]).sum() + view.entropy.sum()

    model = fresh_model()
    assert_engines_agree(model, _batch(), in_place, TREE_ENGINES[name], ORACLE, tol=1e-10)


@pytest.mark.parametrize("name", TREE_ENGINES)
def test_tuple_outputs(name):
    model = fresh_model()
    model.config.return_dict = False
    batch = _batch(3)
    assert_matches_model(model, batch, TREE_ENGINES[name].forward(model, batch), tol=1e-10)
    assert_engines_agree(model, batch, _loss, TREE_ENGINES[name], ORACLE, tol=1e-10)


@pytest.mark.parametrize("name", [*TREE_ENGINES, "flat"])
def test_a_loss_that_reads_no_output_leaves_grad_none(name):
    """As with the flat reference: no gradient is not a zero gradient (weight decay would move it)."""
    model = fresh_model()
    engine = TREE_ENGINES.get(name, ORACLE)
    engine.forward_backward(model, _batch(), lambda view: torch.tensor(1.0))
    assert all(p.grad is None for p in model.parameters())


def test_two_threads_share_a_model():
    """Concurrent engine calls (and a plain forward) on one model each get their own exact results."""
    model = fresh_model()
    batches = [_batch(seed) for seed in range(5)]
    engines = [DfsEngine(), PackedEngine(), DfsEngine(recompute="always", chunk_tokens=2), ORACLE,
               FlatEngine(layout="packed")]
    expected = [engine.forward(model, batch) for engine, batch in zip(engines, batches)]
    plain = model(input_ids=batches[0][0].tokens[None]).logits
    failures = []

    def work(i: int) -> None:
        try:
            for _ in range(4):
                got = engines[i].forward(model, batches[i])
                for out, ref in zip(got, expected[i]):
                    torch.testing.assert_close(out["logprobs"], ref["logprobs"], rtol=0, atol=1e-12)
                torch.testing.assert_close(model(input_ids=batches[0][0].tokens[None]).logits, plain, rtol=0, atol=1e-12)
        except Exception as error:  # noqa: BLE001 - reported below
            failures.append(f"thread {i}: {error!r}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert model.config._attn_implementation == "sdpa"


def test_concurrent_forward_backward_sums_gradients():
    model = fresh_model()
    batches = [_batch(seed) for seed in range(2)]
    single = [run_engine(DfsEngine(), model, batch, _loss).grads for batch in batches]
    threads = [threading.Thread(target=DfsEngine().forward_backward, args=(model, b, _loss)) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, single[0][name] + single[1][name], rtol=1e-10, atol=1e-12)


def test_a_failing_loss_leaves_the_model_as_it_was():
    model = fresh_model()

    def broken(view):
        raise ValueError("user bug")

    for engine in TREE_ENGINES.values():
        with pytest.raises(ValueError, match="user bug"):
            engine.forward_backward(model, _batch(), broken)
        assert model.config._attn_implementation == "sdpa"
    assert model(input_ids=torch.arange(5)[None]).logits.isfinite().all()

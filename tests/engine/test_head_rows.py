"""The engines' `head_rows` option: the LM head runs only on the positions some sequence reads (a field's nonzero
positions, `loss_mask` in training; a tree position is read if ANY sequence through it reads it).

Against the flat reference computing every position: at read positions the same log-probs and entropy, elsewhere 0
(FlatEngine shares nothing: 0 wherever the sequence itself does not read), and the same loss and parameter gradients
for a loss that reads only its own masked positions (float64 to EXACT; float32 and bf16-mixed as close to float64 as
the flat reference is). The head is given the read rows only: what is skipped is counted.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import CLOSE_AS_FLAT_FLOOR, CLOSE_AS_FLAT_RATIO, float64_throughout, fresh_model, tiny_model
from test_exactness import ENGINES, EXACT, HAND, ORACLE, VOCAB, random_batches, sequence_loss, token_loss
from test_routing_replay import moe, random_routes

from treerl.engine import AutocastEngine, DfsEngine, FlatEngine, PackedEngine, PolicyHead
from treerl.engine.routing import RoutingReplayEngine
from treerl.testing import EngineRun, compare_runs, run_engine
from treerl.tree import BatchError, TokenSequence

READ = "loss_mask"
DENSITIES = (0.8, 0.3, 0.0, 1.0)  # a sequence's share of read positions; 0: a sequence whose mask is all 0
TREE_ENGINES = {name: dataclasses.replace(engine, head_rows=READ) for name, engine in ENGINES.items()}
ALL_ENGINES = TREE_ENGINES | {"flat-sequences": FlatEngine(layout="sequences", head_rows=READ)}


def masked(tokens: list[int], rng: random.Random, density: float, name: str = "") -> TokenSequence:
    """A sequence whose mask reads about `density` of its positions (never position 0), with its own loss data."""
    n = len(tokens)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    mask = (torch.rand(n, generator=g) < density).double()
    mask[0] = 0.0
    return TokenSequence(torch.tensor(tokens), fields={
        READ: mask, "advantages": torch.randn(n, generator=g, dtype=torch.float64),
        "old_logprobs": -torch.rand(n, generator=g, dtype=torch.float64) * 4}, info={"reward": rng.uniform(-1, 1)},
        name=name)


def batch_of(lists: list[list[int]], seed: int, densities=DENSITIES) -> list[TokenSequence]:
    rng = random.Random(seed)
    return [masked(t, rng, densities[i % len(densities)], str(i)) for i, t in enumerate(lists)]


def reads(sequences: list[TokenSequence], s: int, shared: bool) -> torch.Tensor:
    """Which positions of sequence `s` are read, straight from the definition: position j is read if a sequence with
    the same first j + 1 tokens (`shared`: any; else `s` itself) reads it."""
    seq = sequences[s]
    read = torch.zeros(len(seq), dtype=torch.bool)
    for other in sequences if shared else [seq]:
        for j in range(min(len(seq), len(other))):
            if not torch.equal(other.tokens[: j + 1], seq.tokens[: j + 1]):
                break
            read[j] |= bool(other.fields[READ][j] != 0)
    return read


def inner(engine):
    while isinstance(engine, (AutocastEngine, RoutingReplayEngine)):
        engine = engine.engine
    return engine


def read_only(run: EngineRun, sequences: list[TokenSequence], shared: bool) -> EngineRun:
    """`run` (every position computed) with its outputs at positions nobody reads set to 0."""
    outputs = [{name: torch.where(reads(sequences, s, shared).to(out.device), out, 0.0) for name, out in outs.items()}
               for s, outs in enumerate(run.outputs)]
    return EngineRun(outputs, run.loss, run.grads)


def check_unread_are_zero(run: EngineRun, sequences: list[TokenSequence], shared: bool) -> None:
    for s, outs in enumerate(run.outputs):
        unread = ~reads(sequences, s, shared)
        for name, out in outs.items():
            assert bool((out.cpu()[unread] == 0).all()), f"sequence {s}: {name} at a position nobody reads is not 0"


def assert_reads_exactly(model, sequences, loss, engine, reference=ORACLE, tol=EXACT) -> None:
    """`engine` (with head_rows) against `reference` computing everywhere: read outputs, loss, every gradient."""
    shared = not isinstance(inner(engine), FlatEngine)
    ours = run_engine(engine, model, sequences, loss)
    check_unread_are_zero(ours, sequences, shared)
    errors = compare_runs(ours, read_only(run_engine(reference, model, sequences, loss), sequences, shared))
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= tol, f"{worst} off by {errors[worst]:.3g}"


@pytest.mark.parametrize("batch", list(HAND))
@pytest.mark.parametrize("engine", list(ALL_ENGINES))
def test_every_engine_computes_the_read_positions_exactly(batch, engine):
    """The exactness suite's degenerate trees, with masks that read most, some, none or all of each sequence."""
    sequences = batch_of(HAND[batch], 1)
    for loss in (token_loss, sequence_loss):
        assert_reads_exactly(tiny_model("tiny-qwen3", VOCAB), sequences, loss, ALL_ENGINES[engine])


class CountingHead(PolicyHead):
    """PolicyHead that counts the rows it computes."""

    rows = 0

    def replay(self, model, hidden, targets, known):
        CountingHead.rows += hidden.shape[0]
        return super().replay(model, hidden, targets, known)


def test_a_position_is_read_if_any_sequence_through_it_reads_it():
    """Two sequences share a prefix; each reads a shared position the other does not: the tree engines compute both
    for both (one row each), FlatEngine each for its own. The head runs on exactly the read rows."""
    rng = random.Random(7)
    prefix = [rng.randrange(VOCAB) for _ in range(8)]
    sequences = [masked(prefix + [1, 2, 3], rng, 0.0, "a"), masked(prefix + [4, 5], rng, 0.0, "b")]
    sequences[0].fields[READ][[3, 9]] = 1.0
    sequences[1].fields[READ][[5, 9]] = 1.0  # position 9: token 2 in a, token 5 in b: not shared
    assert reads(sequences, 1, shared=True).nonzero()[:, 0].tolist() == [3, 5, 9]
    model = tiny_model("tiny-qwen3", VOCAB)
    head = CountingHead()
    for engine, rows in ((DfsEngine(head=head, head_rows=READ), 4), (PackedEngine(head=head, head_rows=READ), 4),
                         (DfsEngine(head=head, head_rows=READ, chunk_tokens=2, batch_tokens=0), 4),
                         (FlatEngine(head=head, head_rows=READ), 4), (FlatEngine(head=head, layout="packed",
                                                                                  head_rows=READ), 4),
                         (DfsEngine(head=head), 12)):  # without the option: every row (7 + 2 fork rows, 2 + 1 own)
        CountingHead.rows = 0
        engine.forward(model, sequences)
        assert CountingHead.rows == rows, (engine, CountingHead.rows)
        if engine.head_rows is not None:
            assert_reads_exactly(model, sequences, token_loss, engine, FlatEngine(head=head, layout="sequences"))
    out = DfsEngine(head_rows=READ).forward(model, sequences)
    flat = FlatEngine(head_rows=READ).forward(model, sequences)
    assert out[1]["logprobs"][3] != 0 and flat[1]["logprobs"][3] == 0  # read by a only


def test_recomputation_replays_only_the_read_rows():
    """DfsEngine recomputing every unit on the way up (`Head.replay` with the known outputs) and chunked nodes."""
    sequences = batch_of(HAND["deep chain"] + HAND["fork below a chain"], 3)
    for engine in (DfsEngine(chunk_tokens=3, recompute="always", batch_tokens=8, head_rows=READ),
                   DfsEngine(chunk_tokens=1, recompute="always", batch_tokens=0, head_rows=READ)):
        assert_reads_exactly(tiny_model("tiny-llama", VOCAB), sequences, sequence_loss, engine)


@pytest.mark.slow  # 30 random trees: ~15 s on 2 cores
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lists=random_batches(),
    densities=st.lists(st.sampled_from([0.0, 0.2, 0.7, 1.0]), min_size=1, max_size=4),
    chunk=st.sampled_from([1, 2, 3, 2048]),
    recompute=st.sampled_from(["auto", "always", "never"]),
    batch_tokens=st.sampled_from([0, 6, 8192]),
    budget=st.sampled_from([None, 2_000, 1 << 30]),
    sequence_level=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_trees_and_masks(lists, densities, chunk, recompute, batch_tokens, budget, sequence_level, seed):
    """Random trees, masks of random density per sequence (shared prefixes read by some sequences only), every plan."""
    sequences = batch_of(lists, seed, densities)
    loss = sequence_loss if sequence_level else token_loss
    model = tiny_model("tiny-qwen2", VOCAB)
    dfs = DfsEngine(chunk_tokens=chunk, recompute=recompute, batch_tokens=batch_tokens, memory_budget_bytes=budget,
                    head_rows=READ)
    for engine in (dfs, PackedEngine(max_tokens=chunk * 4, head_rows=READ),
                   FlatEngine(max_tokens=chunk * 4, layout="packed", head_rows=READ)):
        assert_reads_exactly(model, sequences, loss, engine)


@pytest.mark.slow  # ~5 s each on 2 quiet cores
@pytest.mark.parametrize("kind", ["tiny-qwen3.5", "tiny-bamba"])
def test_a_hybrids_row_units_compute_the_read_rows(kind):
    """Gated DeltaNet and Mamba2 hybrids: DfsEngine's row units (each row from its parent's state), batched or one
    token at a time, with recomputation."""
    sequences = batch_of(HAND["grpo group"] + HAND["single-token nodes"] + HAND["prefix of another"], 4)
    model = fresh_model(kind, VOCAB, exact=True)
    with float64_throughout():
        for engine in (DfsEngine(chunk_tokens=3, batch_tokens=8, head_rows=READ),
                       DfsEngine(chunk_tokens=1, recompute="always", batch_tokens=0, head_rows=READ)):
            assert_reads_exactly(model, sequences, token_loss, engine)


def test_routing_replay_wraps_an_engine_with_head_rows():
    """An MoE policy replaying the sampler's routes: RoutingReplayEngine passes the option's engine through."""
    model = moe()
    rng = random.Random(5)
    lists = [[rng.randrange(3, 128) for _ in range(6)]]
    lists += [lists[0] + [rng.randrange(3, 128) for _ in range(k)] for k in (3, 5)]
    sequences = [masked(t, rng, density) for t, density in zip(lists, (0.5, 1.0, 0.0))]
    for i, seq in enumerate(sequences):
        seq.fields["routed_experts"] = random_routes(model, len(seq), i)
    engine = RoutingReplayEngine(DfsEngine(chunk_tokens=3, head_rows=READ))
    assert_reads_exactly(model, sequences, token_loss, engine, RoutingReplayEngine(ORACLE), tol=1e-6)


@pytest.mark.parametrize("mode", ["float32", "bf16-mixed"])
@pytest.mark.parametrize("engine", ["recompute", "packed", "flat-sequences"])
def test_low_precision_read_rows_are_as_close_to_float64_as_the_flat_reference(mode, engine):
    """float32, and bf16 autocast over float32 weights (AutocastEngine): at the read positions each engine is no
    further from the float64 run than the flat reference computing everywhere."""
    sequences = batch_of(HAND["grpo group"] + HAND["prefix of another"], 6)
    low = fresh_model("tiny-qwen3", VOCAB, exact=False, dtype=torch.float32)
    high = fresh_model("tiny-qwen3", VOCAB, exact=False, dtype=torch.float64)
    high.load_state_dict({k: v.double() for k, v in low.state_dict().items()})
    ours_engine = ALL_ENGINES[engine]
    shared = not isinstance(ours_engine, FlatEngine)
    reference = read_only(run_engine(ORACLE, high, sequences, token_loss), sequences, shared)
    if mode == "bf16-mixed":
        ours_engine = AutocastEngine(ours_engine, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16-mixed"):
        flat = compare_runs(read_only(run_engine(ORACLE, low, sequences, token_loss), sequences, shared), reference)
    ours_run = run_engine(ours_engine, low, sequences, token_loss)
    check_unread_are_zero(ours_run, sequences, shared)
    ours = compare_runs(ours_run, reference)
    for part, ratio in CLOSE_AS_FLAT_RATIO.items():
        flat_worst = max(e for k, e in flat.items() if k.endswith(part))
        our_worst = max(e for k, e in ours.items() if k.endswith(part))
        assert our_worst <= ratio * flat_worst + CLOSE_AS_FLAT_FLOOR[mode], (part, our_worst, flat_worst)


@pytest.mark.parametrize("engine", list(ALL_ENGINES))
def test_a_sequence_without_the_field_is_refused_naming_it_before_compute(engine):
    model = tiny_model("tiny-qwen3", VOCAB)
    sequences = batch_of(HAND["no sharing"], 8)
    del sequences[1].fields[READ]
    ran = []
    hook = model.get_input_embeddings().register_forward_hook(lambda *_: ran.append(1))
    try:
        with pytest.raises(BatchError, match=r"^sequence 1 \('1'\): no field 'loss_mask', which the engine's "
                                             "head_rows names"):
            ALL_ENGINES[engine].forward(model, sequences)
        with pytest.raises(BatchError, match="no field 'loss_mask'"):
            ALL_ENGINES[engine].forward_backward(model, sequences, token_loss)
    finally:
        hook.remove()
    assert not ran

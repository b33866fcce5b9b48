"""Context parallelism: DfsEngine's calls split over 2 and 4 gloo ranks give the single-process log-probs and, summed
over the ranks, its gradients (float64, against the flat reference), in the plans of the exactness suite: attention
models, and a hybrid of each state kind, its mixer layers run side by side on the ranks (each scan corrected by the
earlier pieces' states: treerl.engine.parallel_scan) or in turn (each rank's states passed on to the next:
treerl.engine.state_passing)."""

from __future__ import annotations

import itertools
import os
import zlib
from dataclasses import replace

import pytest
import torch
import torch.multiprocessing as mp
from support import float64_throughout, free_port, fresh_model
from test_head_rows import reads
from test_model_features import feature_model
from zoo import build_tiny

from treerl.attention import UnsupportedModel
from treerl.attention.context_parallel import ContextParallel
from treerl.engine import DfsEngine, FlatEngine, selective_scan
from treerl.models import build_model
from treerl.testing import EngineRun, compare_runs, run_engine
from treerl.tree import PrefixTree, TokenSequence

pytestmark = pytest.mark.slow  # 2 and 4 processes that import torch and transformers

PLANS = {  # one call for the whole batch; calls of at most 24 tokens over the path; a call per node of 7 or fewer
    "default": {}, "small-calls": {"chunk_tokens": 10, "batch_tokens": 24},
    "per-node-recompute": {"chunk_tokens": 7, "batch_tokens": 0, "recompute": "always"},
}
# tiny-qwen3; Gemma 2's soft-capping and a sliding window (5) that binds; gpt-oss' attention sinks, window and experts.
ATTENTION = ("tiny-qwen3", "gemma2-softcap-window", "gpt-oss-sinks-window")
# A hybrid of each state kind (treerl.engine.recurrent.MIXERS): Gated DeltaNet, Mamba2, short convolution (the three
# shapes of the recurrent suite, also on 4 ranks), Mamba's selective scan (in chunks of 3 tokens, so that a rank's
# piece crosses chunks), lightning attention, KDA. The batch's rows are up to 70 tokens: every rank gets columns.
# All side by side but lightning attention, whose layers run in turn (its scan is inline in the layer's forward).
HYBRIDS = ("tiny-qwen3.5", "tiny-bamba", "tiny-lfm2")
HYBRIDS_ON_TWO = ("jamba", "minimax", "kimi_linear")
MODELS = {2: ATTENTION + HYBRIDS + HYBRIDS_ON_TWO, 4: ("tiny-qwen3", *HYBRIDS)}
# the plans each model runs on R ranks (4 processes share 2 cores in CI): every plan for tiny-qwen3 and tiny-qwen3.5 on
# 2 ranks; one call and calls that cut chains and read the path most for the other models of the suite's shapes on 2
# and for tiny-qwen3 on 4; the latter alone for the hybrids on 4 and those of the other state kinds on 2
RUNS = {(world, name): list(PLANS) if world == 2 and name in ("tiny-qwen3", "tiny-qwen3.5")
        else ["small-calls"] if (world == 4 and name != "tiny-qwen3") or name in HYBRIDS_ON_TWO
        else ["default", "small-calls"] for world, names in MODELS.items() for name in names}
# flat vs the model's own forward; the zoo's hybrid builds keep some float32 norms and routers, so their bound is on
# the outputs, loss and whole gradient (as tests/engine/test_recurrent.py's families)
TOL = {"tiny-qwen3": 1e-12, "gemma2-softcap-window": 1e-5, "gpt-oss-sinks-window": 1e-5,
       **dict.fromkeys(HYBRIDS, 1e-9), **dict.fromkeys(HYBRIDS_ON_TWO, 1e-8)}
SCAN_CHUNK = 3
# the path's K/V held whole by each rank (trainer.context_parallel_path=replicated; sharded everywhere else): on 2
# ranks, attention sinks and a window
REPLICATED = ("gpt-oss-sinks-window",)
# gradient checkpointing (its layers replayed in backward, their gathers and the sharded path's collectives too, and a
# hybrid's split scans and windows), on 2 ranks: both of torch's checkpoint kinds (a hybrid: the non-reentrant one,
# the other refused for every hybrid: its replay has no graph for the state)
CHECKPOINTED = ("tiny-qwen3", "tiny-qwen3.5")
# the mixer layers in turn (trainer.context_parallel_mixers=in-turn; side by side where the model allows it everywhere
# else), on 2 ranks: a Gated DeltaNet hybrid
IN_TURN = ("tiny-qwen3.5",)


def model(name: str) -> torch.nn.Module:
    if name == "tiny-qwen3":
        return build_model(shape=name, dtype=torch.float64)
    if name in HYBRIDS:
        return fresh_model(name, 64, exact=True)
    if name in HYBRIDS_ON_TWO:
        return build_tiny(name, experts_implementation="eager")
    return feature_model(name)


def batch(vocab: int) -> list[TokenSequence]:
    """A shared system prompt, two GRPO groups below it (two replies differ in their last token only: one-token
    nodes, so a call can have fewer rows than ranks), an agent episode's branches, and one long sequence alone."""
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()
    system, lists = draw(30), []
    for task in range(2):
        prompt = system + draw(6)
        lists += [prompt + draw(4 + 3 * k + task) for k in range(3)]
        lists.append(lists[-1][:-1] + [(lists[-1][-1] + 1) % vocab])
    episode = draw(12)
    for turn in range(3):
        lists.append(episode + draw(3))
        episode = episode + draw(5)
    lists.append(draw(70))
    return [TokenSequence(t, {"advantages": torch.randn(len(t), generator=g, dtype=torch.float64),
                              "loss_mask": (torch.rand(len(t), generator=g) < 0.5).double()}) for t in lists]


BF16 = ("tiny-qwen3", "tiny-qwen3.5")
BF16_PLAN = {"chunk_tokens": 10, "batch_tokens": 24}


def bf16_batch() -> list[TokenSequence]:
    return [TokenSequence(s.tokens, {"advantages": s.fields["advantages"].float()}) for s in batch(512)]


def loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum() - 0.1 * view.entropy.sum()


def masked_loss(view):
    """`loss` on the loss_mask positions alone: what DfsEngine(head_rows="loss_mask") computes the head for."""
    mask = view.fields["loss_mask"]
    return -(view.logprobs * view.fields["advantages"] * mask).sum() - 0.1 * (view.entropy * mask).sum()


HEAD_ROWS = ("tiny-qwen3", "tiny-qwen3.5")  # on 2 ranks, small calls: each rank's head on its read rows only


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from treerl.distributed import close_distributed, exit_process, init_distributed

    init_distributed()
    selective_scan.SCAN_CHUNK = SCAN_CHUNK
    cp, results = ContextParallel.over(), {}
    for name in MODELS[world]:
        net = model(name)
        sequences = batch(net.config.get_text_config().vocab_size)
        for plan in RUNS[world, name]:
            results[f"{name}/{plan}"] = _summed_run(net, sequences, cp, PLANS[plan])
        for reentrant in ((False, True) if name in ATTENTION else (False,)) if world == 2 and name in CHECKPOINTED \
                else ():
            training = net.training
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            net.train()  # transformers replays layers in training mode only
            run = _summed_run(net, sequences, cp, PLANS["small-calls"])
            net.gradient_checkpointing_disable()
            net.train(training)
            results[f"{name}/checkpointed-{'reentrant' if reentrant else 'non-reentrant'}"] = run
        if world == 2 and name in REPLICATED:
            results[f"{name}/replicated"] = _summed_run(net, sequences, replace(cp, path="replicated"),
                                                        PLANS["small-calls"])
        if world == 2 and name in HEAD_ROWS:
            results[f"head-rows/{name}"] = _summed_run(net, sequences, cp,
                                                       {**PLANS["small-calls"], "head_rows": "loss_mask"}, masked_loss)
        if world == 2 and name in IN_TURN:
            results[f"{name}/in-turn"] = _summed_run(net, sequences, replace(cp, mixers="in-turn"),
                                                     PLANS["small-calls"])
    for shape in BF16 if world == 2 else ():  # bf16 autocast over float32 weights: compared with one process's error
        low = build_model(shape=shape, dtype=torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            run = run_engine(DfsEngine(context_parallel=cp, **BF16_PLAN), low, bf16_batch(), loss)
        for grad in run.grads.values():
            dist.all_reduce(grad)
        results[f"bf16/{shape}"] = vars(run)
    if world == 2:
        results["plans"] = _plans_of_ranks_that_measure_apart(cp)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"cp{world}.pt"))
    assert close_distributed() == "gloo"
    exit_process(0)


def _summed_run(net, sequences: list[TokenSequence], cp: ContextParallel, settings: dict, loss_fn=None) -> dict:
    """A float64 run on these ranks, its gradients summed over them (each rank's is its rows' share), as plain tensors
    and dicts (what torch.load reads safely)."""
    import torch.distributed as dist

    with float64_throughout():
        run = run_engine(DfsEngine(context_parallel=cp, **settings), net, sequences, loss_fn or loss)
    for grad in run.grads.values():
        dist.all_reduce(grad)
    return vars(run)


def _plans_of_ranks_that_measure_apart(cp: ContextParallel) -> torch.Tensor:
    """Each rank's plan (a checksum of its units) when rank 1's probe measures 3x the graph bytes of rank 0's, under a
    budget in bytes: what the ranks plan from must be agreed on, or they walk different units."""
    import torch.distributed as dist

    from treerl.engine import memory

    net = build_model(shape="tiny-qwen3.5", dtype=torch.float64)  # a new model: probed afresh
    probe = memory._probe
    memory._probe = lambda *args: probe(*args) * (1 + 2 * cp.rank)
    try:
        # about 40 graph tokens of rank 0's (tiny-qwen3.5 in float64 measures ~30 kB a token), 13 of rank 1's
        engine = DfsEngine(context_parallel=cp, chunk_tokens=8, memory_budget_bytes=1_200_000)
        sequences = batch(net.config.vocab_size)
        tree = engine._tree(net, sequences)
        units = [(tuple(unit.nodes), unit.width, unit.open, unit.keep) for unit in engine.plan(net, tree).all_units()]
    finally:
        memory._probe = probe
    checksums = [torch.zeros(1, dtype=torch.long) for _ in range(cp.size)]
    dist.all_gather(checksums, torch.tensor([zlib.crc32(repr(units).encode())]))
    return torch.cat(checksums)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda r: f"{r}-ranks")
def ranks(request, tmp_path_factory) -> tuple[int, dict]:
    out_dir = str(tmp_path_factory.mktemp("cp"))
    mp.spawn(_worker, args=(request.param, free_port(), out_dir), nprocs=request.param, join=True)
    saved = torch.load(os.path.join(out_dir, f"cp{request.param}.pt"))
    return request.param, {key: EngineRun(**run) if isinstance(run, dict) else run for key, run in saved.items()}


@pytest.mark.parametrize("name", MODELS[2])
def test_context_parallel_ranks_compute_the_flat_references_logprobs_and_gradients(ranks, name, monkeypatch):
    world, results = ranks
    if name not in MODELS[world]:
        pytest.skip(f"{name}: on 2 ranks")
    monkeypatch.setattr(selective_scan, "SCAN_CHUNK", SCAN_CHUNK)
    net = model(name)
    sequences = batch(net.config.get_text_config().vocab_size)
    with float64_throughout():
        reference = run_engine(FlatEngine(layout="sequences"), net, sequences, loss)
    extra = [key.split("/", 1)[1] for key in results if key.startswith(f"{name}/")]  # checkpointed, replicated runs
    for plan in RUNS[world, name] + [run for run in extra if run not in PLANS]:
        errors = compare_runs(results[f"{name}/{plan}"], reference)
        if name in HYBRIDS_ON_TWO:
            errors = {k: e for k, e in errors.items() if not k.startswith("grad.")}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOL[name], (world, plan, worst, errors[worst])


@pytest.mark.parametrize("name", HEAD_ROWS)
def test_ranks_computing_the_head_on_loss_mask_rows_only_equal_the_flat_reference(ranks, name):
    """DfsEngine(head_rows="loss_mask") split over 2 ranks: each rank's head on its read rows, gathered; log-probs and
    entropy of the flat reference where a sequence through the position reads it, 0 elsewhere; the same gradients."""
    world, results = ranks
    if world != 2:
        pytest.skip("on 2 ranks")
    net = model(name)
    sequences = batch(net.config.get_text_config().vocab_size)
    with float64_throughout():
        reference = run_engine(FlatEngine(layout="sequences"), net, sequences, masked_loss)
    ours = results[f"head-rows/{name}"]
    for s, outputs in enumerate(ours.outputs):
        where = reads(sequences, s, shared=True)
        for key, value in outputs.items():
            assert bool((value[~where] == 0).all()), (s, key)
            reference.outputs[s][key] = torch.where(where, reference.outputs[s][key], 0.0)
    errors = compare_runs(ours, reference)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL[name], (worst, errors[worst])


@pytest.mark.parametrize("shape", BF16)
def test_bfloat16_error_of_two_ranks_is_one_process_error(ranks, shape):
    """Under bf16 autocast 2 ranks round like one process: their errors from the float64 run are alike (an attention
    model, and a hybrid whose state crosses ranks)."""
    world, results = ranks
    if world != 2:
        pytest.skip("measured on 2 ranks")
    high = build_model(shape=shape, dtype=torch.float64)
    low = build_model(shape=shape, dtype=torch.float32)
    reference = run_engine(FlatEngine(layout="sequences"), high, batch(512), loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        one = compare_runs(run_engine(DfsEngine(**BF16_PLAN), low, bf16_batch(), loss), reference)
    two = compare_runs(results[f"bf16/{shape}"], reference)
    for part, ratio in {"logprobs": 1.5, "entropy": 1.5, "gradient": 1.5}.items():
        worst = lambda errors, part=part: max(e for k, e in errors.items() if k.endswith(part))
        assert worst(two) <= ratio * worst(one), (part, worst(two), worst(one))


def test_ranks_that_measure_different_graph_bytes_walk_one_plan(ranks):
    """A probe's bytes differ from process to process (a few storages); the ranks plan with the largest, so their units
    are the same and their collectives match."""
    world, results = ranks
    if world != 2:
        pytest.skip("measured on 2 ranks")
    checksums = results["plans"]
    assert checksums[0] == checksums[1], checksums


def test_what_context_parallelism_does_not_compute_yet_is_refused_before_compute():
    """State kept inside attention layers (ZAYA's convolutions over queries and keys; sparse attention's indexers):
    refused, naming why; no collective runs (no process group here)."""
    cp = ContextParallel(rank=0, size=2)
    zaya = build_tiny("zaya")
    with pytest.raises(UnsupportedModel, match=r"attention layers carry state of their own \(convolutional"):
        DfsEngine(context_parallel=cp).forward(zaya, batch(zaya.config.vocab_size)[:2])
    hybrid = build_model(shape="tiny-qwen3.5", dtype=torch.float32)  # replayed in turn: refused; side by side: runs
    hybrid.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hybrid.train()
    with pytest.raises(UnsupportedModel, match=r"gradient checkpointing .* with the mixers side by side only.*; "
                                               r"train it without \(trainer.context_parallel=1\)$"):
        DfsEngine(context_parallel=ContextParallel(0, 2, mixers="in-turn")).forward(hybrid, batch(512)[:2])


def test_rows_are_dealt_zigzag_so_causal_work_is_even():
    """2R chunks, rank r holds chunks r and 2R - 1 - r: on one causal run of 64 rows every rank has the same number of
    query-key pairs; every row is held once, and a call shorter than the ranks leaves some ranks none."""
    for size in (2, 4):
        held = [ContextParallel(rank=r, size=size).ranges(64) for r in range(size)]
        rows = sorted(i for ranges in held for lo, hi in ranges for i in range(lo, hi))
        assert rows == list(range(64))
        pairs = [sum(i + 1 for lo, hi in ranges for i in range(lo, hi)) for ranges in held]
        assert len(set(pairs)) == 1, pairs
    assert [ContextParallel(rank=r, size=4).ranges(2) for r in range(4)] == [[(1, 2)], [], [], [(0, 1)]]


def test_a_recurrent_models_columns_are_dealt_in_order_two_at_least():
    """A state passes from each rank's columns to the next's: contiguous pieces in rank order that tile the row, each
    of two columns or more (a one-token piece would take a layer's in-place step); ranks left over get none."""
    for size in (2, 3, 4):
        for width in range(1, 40):
            columns = ContextParallel(rank=0, size=size).columns(width)
            pieces = [(lo, hi) for lo, hi in columns if hi > lo]
            assert pieces[0][0] == 0 and pieces[-1][1] == width
            assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
            assert all(hi - lo >= 2 for lo, hi in pieces) or pieces == [(0, width)]
            assert len(pieces) == max(1, min(size, width // 2))
            assert columns[len(pieces):] == [(width, width)] * (size - len(pieces))


def test_each_rank_holds_its_share_of_a_call_so_the_walk_packs_larger_calls():
    """Under the default contract (never more graph than flat's micro-batch, per rank) a rank holds 1/R of each call's
    activations but the call's gathered K/V whole: the walk's budget grows nearly R-fold, and a tree whose walk the
    budget cuts into calls runs in fewer, larger ones."""
    net = build_model(shape="tiny-qwen3", dtype=torch.float32)
    tree = PrefixTree.build(batch(net.config.vocab_size)).chunked(2048)
    engine = lambda size, max_tokens: DfsEngine(context_parallel=ContextParallel(0, size) if size > 1 else None,
                                                max_tokens=max_tokens)
    budgets = {size: engine(size, 128).graph_budget_tokens(net, tree) for size in (1, 2, 4)}
    assert 1.5 * budgets[1] < budgets[2] <= 2 * budgets[1], budgets
    assert 1.5 * budgets[2] < budgets[4] <= 2 * budgets[2], budgets
    # a rank holds 1/R of a sharded path's K/V and gradients: what a replicated one takes of the budget is left for
    # graph (the path's 2 x 2 bytes a token beside the graph's per_token / R + K/V: ~ (R - 1) / R x path tokens)
    replicated = DfsEngine(context_parallel=ContextParallel(0, 4, path="replicated"), max_tokens=128)
    assert budgets[4] > replicated.graph_budget_tokens(net, tree), budgets
    calls = {size: len(engine(size, 64).plan(net, tree).all_units()) for size in (1, 2, 4)}
    assert calls[1] > calls[2] > calls[4], calls


def test_a_hybrid_whose_ranks_split_their_scans_budgets_what_a_later_rank_holds():
    """Side by side, a rank after the first scans its piece with transfer columns beside (more graph a token than the
    model's own scan): the memory probe measures such a rank, and the per-rank budget holds fewer tokens than in turn."""
    from treerl.engine.memory import graph_bytes
    from treerl.engine.state_passing import side_by_side_scans

    net = build_model(shape="tiny-qwen3.5", dtype=torch.float32)
    tree = PrefixTree.build(batch(net.config.vocab_size)).chunked(2048)
    side_by_side, in_turn = ContextParallel(0, 2), ContextParallel(0, 2, mixers="in-turn")
    scans = side_by_side_scans(net, side_by_side)
    assert scans and side_by_side_scans(net, in_turn) is None
    assert graph_bytes(net, scans).per_token > 1.05 * graph_bytes(net).per_token
    budget = lambda cp: DfsEngine(context_parallel=cp, max_tokens=128).graph_budget_tokens(net, tree)
    assert budget(side_by_side) < budget(in_turn)

"""Context parallelism: DfsEngine's calls split over 2 and 4 gloo ranks give the single-process log-probs and, summed
over the ranks, its gradients (float64, against the flat reference), in the plans of the exactness suite."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from support import float64_throughout, free_port
from test_model_features import feature_model

from treerl.attention import UnsupportedModel
from treerl.attention.context_parallel import ContextParallel
from treerl.engine import DfsEngine, FlatEngine
from treerl.models import build_model
from treerl.testing import EngineRun, compare_runs, run_engine
from treerl.tree import TokenSequence

pytestmark = pytest.mark.slow  # 2 and 4 processes that import torch and transformers

PLANS = {  # one call for the whole batch; calls of at most 24 tokens over the path; a call per node of 7 or fewer
    "default": {}, "small-calls": {"chunk_tokens": 10, "batch_tokens": 24},
    "per-node-recompute": {"chunk_tokens": 7, "batch_tokens": 0, "recompute": "always"},
}
# tiny-qwen3; Gemma 2's soft-capping and a sliding window (5) that binds; gpt-oss' attention sinks, window and experts.
MODELS = ("tiny-qwen3", "gemma2-softcap-window", "gpt-oss-sinks-window")
TOL = {"tiny-qwen3": 1e-12, "gemma2-softcap-window": 1e-5, "gpt-oss-sinks-window": 1e-5}  # flat vs the model's own


def model(name: str) -> torch.nn.Module:
    if name == "tiny-qwen3":
        return build_model(shape=name, dtype=torch.float64)
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
    return [TokenSequence(t, {"advantages": torch.randn(len(t), generator=g, dtype=torch.float64)}) for t in lists]


def loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum() - 0.1 * view.entropy.sum()


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from treerl.distributed import close_distributed, exit_process, init_distributed

    init_distributed()
    cp, results = ContextParallel.over(), {}
    for name in MODELS:
        net = model(name)
        sequences = batch(net.config.vocab_size)
        for plan, settings in PLANS.items():
            with float64_throughout():
                run = run_engine(DfsEngine(context_parallel=cp, **settings), net, sequences, loss)
            for grad in run.grads.values():  # each rank's is its rows' share
                dist.all_reduce(grad)
            results[f"{name}/{plan}"] = vars(run)  # plain tensors and dicts: what torch.load reads safely
    if world == 2:  # bf16 autocast over float32 weights: the error of 2 ranks, and of one process, from float64
        low = build_model(shape="tiny-qwen3", dtype=torch.float32)
        sequences = [TokenSequence(s.tokens, {"advantages": s.fields["advantages"].float()}) for s in batch(512)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            run = run_engine(DfsEngine(context_parallel=cp, chunk_tokens=10, batch_tokens=24), low, sequences, loss)
        for grad in run.grads.values():
            dist.all_reduce(grad)
        results["bf16"] = vars(run)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"cp{world}.pt"))
    assert close_distributed() == "gloo"
    exit_process(0)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda r: f"{r}-ranks")
def ranks(request, tmp_path_factory) -> tuple[int, dict]:
    out_dir = str(tmp_path_factory.mktemp("cp"))
    mp.spawn(_worker, args=(request.param, free_port(), out_dir), nprocs=request.param, join=True)
    saved = torch.load(os.path.join(out_dir, f"cp{request.param}.pt"))
    return request.param, {key: EngineRun(**run) for key, run in saved.items()}


@pytest.mark.parametrize("name", MODELS)
def test_context_parallel_ranks_compute_the_flat_references_logprobs_and_gradients(ranks, name):
    world, results = ranks
    net = model(name)
    sequences = batch(net.config.vocab_size)
    with float64_throughout():
        reference = run_engine(FlatEngine(layout="sequences"), net, sequences, loss)
    for plan in PLANS:
        errors = compare_runs(results[f"{name}/{plan}"], reference)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOL[name], (world, plan, worst, errors[worst])


def test_bfloat16_error_of_two_ranks_is_one_process_error(ranks):
    """Under bf16 autocast 2 ranks round like one process: their errors from the float64 run are alike."""
    world, results = ranks
    if world != 2:
        pytest.skip("measured on 2 ranks")
    high = build_model(shape="tiny-qwen3", dtype=torch.float64)
    low = build_model(shape="tiny-qwen3", dtype=torch.float32)
    sequences = batch(512)
    reference = run_engine(FlatEngine(layout="sequences"), high, sequences, loss)
    single = [TokenSequence(s.tokens, {"advantages": s.fields["advantages"].float()}) for s in sequences]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        one = compare_runs(run_engine(DfsEngine(chunk_tokens=10, batch_tokens=24), low, single, loss), reference)
    two = compare_runs(results["bf16"], reference)
    for part, ratio in {"logprobs": 1.5, "entropy": 1.5, "gradient": 1.5}.items():
        worst = lambda errors, part=part: max(e for k, e in errors.items() if k.endswith(part))
        assert worst(two) <= ratio * worst(one), (part, worst(two), worst(one))


def test_what_context_parallelism_does_not_compute_yet_is_refused_before_compute():
    """Hybrid layers (a recurrent state to pass between ranks) and images: refused, naming why; no collective runs
    (no process group here)."""
    cp = ContextParallel(rank=0, size=2)
    hybrid = build_model(shape="tiny-qwen3.5", dtype=torch.float64)
    with pytest.raises(UnsupportedModel, match="recurrent state, which context parallelism does not pass"):
        DfsEngine(context_parallel=cp).forward(hybrid, batch(hybrid.config.vocab_size)[:2])


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

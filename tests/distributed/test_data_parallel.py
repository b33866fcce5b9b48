"""Two gloo ranks on CPU take one training step that equals the single-process step (DDP and FSDP2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from support import float64_throughout, free_port

from treerl.distributed import balance
from treerl.engine import DfsEngine, FlatEngine
from treerl.models import build_model
from treerl.tree import TokenSequence

STRATEGIES = ("ddp", "fsdp2")
two_ranks = pytest.mark.slow  # starting 2 processes that import torch and transformers takes ~10 s on 2 cores
LR = 0.5


def batch() -> list[TokenSequence]:
    """One tree (a shared 'system prompt'), so that 2 ranks must split it and both compute the prefix."""
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 512, (24,), generator=g).tolist()
    out = []
    for task in range(2):
        prompt = system + torch.randint(0, 512, (6,), generator=g).tolist()
        for sample in range(3):
            n = 4 + 3 * sample + task
            tokens = prompt + torch.randint(0, 512, (n,), generator=g).tolist()
            mask = torch.zeros(len(tokens))
            mask[len(prompt):] = 1.0
            out.append(TokenSequence(tokens, {"loss_mask": mask, "advantages": torch.randn(len(tokens), generator=g)},
                                name=f"task{task}/sample{sample}"))
    return out


def token_mean_loss(denominator: float):
    """PPO-style token-mean over the GLOBAL batch: every rank divides by the same denominator."""

    def loss_fn(view):
        mask = view.fields["loss_mask"].to(view.logprobs.dtype)
        adv = view.fields["advantages"].to(view.logprobs.dtype)
        return ((-view.logprobs * adv + 0.01 * view.entropy) * mask).sum() / denominator

    return loss_fn


def _worker(rank: int, world: int, port: int, out_dir: str, micro_batch_tokens: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from treerl.distributed import DistributedModel, close_distributed, exit_process, global_sum, init_distributed

    env = init_distributed()
    assert global_sum(env.rank + 1) == 3.0
    sequences = batch()
    denominator = sum(float(s.fields["loss_mask"].sum()) for s in sequences)  # every rank holds the global batch
    assignment = balance(sequences, env.world_size, micro_batch_tokens=micro_batch_tokens)
    calls = _count_collectives()
    for strategy in STRATEGIES:
        dp = DistributedModel(build_model(shape="tiny-qwen3", dtype=torch.float64), strategy)
        optimizer = torch.optim.SGD(dp.parameters(), lr=LR)
        calls.clear()
        # FSDP2 also with recomputation and chunked nodes: forwards between the engine's backward calls.
        engine = DfsEngine(recompute="always", chunk_tokens=8) if strategy == "fsdp2" else DfsEngine()
        with dp.gradient_step() as model:
            for micro_batch in assignment.micro_batches(env.rank):
                engine.forward_backward(model, [sequences[i] for i in micro_batch], token_mean_loss(denominator))
        step_calls = dict(calls)
        optimizer.step()
        with dp.gathered() as model:  # forward-only engine call on the updated parameters (FSDP2: gathered)
            logprobs = DfsEngine().forward(model, sequences[:2])
        state = dp.full_state_dict()
        if env.is_main:
            result = {"state": state, "ranks": assignment.ranks, "calls": step_calls, "logprobs": logprobs}
            torch.save(result, os.path.join(out_dir, f"{strategy}.pt"))
    assert close_distributed() == "gloo"
    exit_process(0)  # a spawned rank's end, as the CLI's


def _count_collectives() -> dict[str, int]:
    """Count the collectives that DDP's comm hook and torch 2.13's FSDP2 look up on torch.distributed at call time."""
    calls: dict[str, int] = {}
    for name in ("all_reduce", "reduce_scatter_single", "all_gather_single"):
        original = getattr(torch.distributed, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(torch.distributed, name, counted)
    return calls


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict[str, dict]:
    out_dir = str(tmp_path_factory.mktemp("dp"))
    mp.spawn(_worker, args=(2, free_port(), out_dir, 45), nprocs=2, join=True)
    return {s: torch.load(os.path.join(out_dir, f"{s}.pt")) for s in STRATEGIES}


@pytest.fixture(scope="module")
def single_process() -> dict:
    """Parameters before and after one SGD step of the flat reference on the whole batch, in one process."""
    model = build_model(shape="tiny-qwen3", dtype=torch.float64)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sequences = batch()
    denominator = sum(float(s.fields["loss_mask"].sum()) for s in sequences)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    FlatEngine().forward_backward(model, sequences, token_mean_loss(denominator))
    optimizer.step()
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"before": before, "after": after, "logprobs": FlatEngine().forward(model, sequences[:2])}


@two_ranks
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forward_after_the_step_sees_the_updated_model(strategy, two_rank_results, single_process):
    for got, want in zip(two_rank_results[strategy]["logprobs"], single_process["logprobs"]):
        torch.testing.assert_close(got["logprobs"], want["logprobs"], rtol=1e-6, atol=1e-9)


@two_ranks
def test_trees_are_split_across_ranks(two_rank_results):
    ranks = two_rank_results["ddp"]["ranks"]
    assert all(len(rank) >= 1 for rank in ranks), ranks  # both ranks work, so both compute the shared system prompt
    assert any(len(rank) >= 2 for rank in ranks), ranks  # and a rank runs several micro-batches without syncing


@two_ranks
def test_gradients_sync_once_per_step_not_once_per_node(two_rank_results):
    """The DFS engine runs one backward per tree node; the wrappers must still reduce once per step."""
    print({s: r["calls"] for s, r in two_rank_results.items()})
    # which parameters some rank's calls gave a gradient (one small all-reduce), then the gradients: one DDP bucket
    assert two_rank_results["ddp"]["calls"] == {"all_reduce": 2}
    fsdp_groups = 2 + 1  # one per decoder layer, and the root
    assert two_rank_results["fsdp2"]["calls"] == {"all_gather_single": fsdp_groups, "reduce_scatter_single": fsdp_groups}


@two_ranks
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_step_equals_single_process(strategy, two_rank_results, single_process):
    before, after = single_process["before"], single_process["after"]
    state = two_rank_results[strategy]["state"]
    assert set(state) == set(after)
    for name in after:
        got, want = state[name].to(torch.float64), after[name]
        assert torch.linalg.norm(got - want) <= 1e-6 * torch.linalg.norm(want), name
        update, want_update = got - before[name], want - before[name]
        assert torch.linalg.norm(update - want_update) <= 1e-6 * torch.linalg.norm(want_update) + 1e-300, name


def test_single_process_without_torchrun(monkeypatch):
    """Plain `python`: rank 0 of 1, no process group; strategy 'none' is a pass-through."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    from treerl.distributed import DistributedModel, init_distributed

    env = init_distributed()
    assert (env.rank, env.world_size, env.is_main) == (0, 1, True)
    model = build_model(shape="tiny-qwen3", dtype=torch.float64)
    with pytest.raises(RuntimeError, match="process group"):
        DistributedModel(model, "ddp")
    with pytest.raises(ValueError, match="strategy"):
        DistributedModel(model, "zero3")
    dp = DistributedModel(model, "none")
    sequences = batch()
    with dp.gradient_step() as same:
        assert same is model
        DfsEngine().forward_backward(same, sequences, token_mean_loss(1.0))
    assert model.lm_head.weight.grad is not None and set(dp.full_state_dict()) == set(model.state_dict())


def test_closing_without_a_process_group_is_a_no_op():
    """A single process (no torchrun) has no group to close: the CLI's ending then raises or returns as usual."""
    from treerl.distributed import close_distributed

    assert close_distributed() is None and close_distributed(wait_for_all=False) is None


def test_a_rank_exits_with_its_code_and_its_output_flushed():
    """exit_process skips the interpreter's shutdown (gloo's abort at exit) but loses no output and keeps the code."""
    script = "from treerl.distributed import exit_process\nprint('saved', end='')\nexit_process(3)\nprint('never')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout to a pipe: block-buffered
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert (done.returncode, done.stdout) == (3, "saved"), done.stderr


# Vision-language models: a text-only step, then a step showing images, on 2 ranks and in one process.
VL_MODELS = ("qwen2_5_vl", "llava")


def vl_steps(name: str) -> list[list[TokenSequence]]:
    """Step 1 shows no image (the tower must stay untouched: no gradient, no weight decay); step 2 a GRPO group on one
    image prompt and an agent episode with a screenshot a turn (the tower's gradient summed over both ranks)."""
    from vision_models import sequence

    llava = name == "llava"
    text = [sequence([[1, 5, 6], [7 + k, 8, 9, 10 + k]], seed=k, llava=llava) for k in range(4)]
    prompt = [[1, 5, 6], (0, 4, 4), [7]]
    shown = [sequence(prompt + [[8 + k, 9, 10]], seed=k, llava=llava) for k in range(3)]
    shown += [sequence([[1, 5], (1, 4, 4), [20], (2, 2, 4), [21, 22]], seed=5, llava=llava),
              sequence([[1, 5], (1, 4, 4), [20], (3, 4, 4), [23]], seed=6, llava=llava)]
    return [text, shown]


def vl_loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum()  # a sum: each rank's part adds up to the whole


def vl_train(model, dp, steps, rank: int = 0, world: int = 1, engine=None) -> None:
    """SGD with weight decay (which moves a parameter with a zero gradient, and skips one with none)."""
    optimizer = torch.optim.SGD(dp.parameters() if dp is not None else model.parameters(), lr=0.1, weight_decay=0.1)
    for sequences in steps:
        if dp is None:
            (engine or FlatEngine()).forward_backward(model, sequences, vl_loss)
        else:
            assignment = balance(sequences, world, micro_batch_tokens=48)
            with dp.gradient_step(images=any(s.images for s in sequences)) as inner:
                for micro_batch in assignment.micro_batches(rank):
                    DfsEngine().forward_backward(inner, [sequences[i] for i in micro_batch], vl_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _vl_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from vision_models import BUILDS

    from treerl.distributed import DistributedModel, close_distributed, exit_process, init_distributed

    env = init_distributed()
    for name in VL_MODELS:
        for strategy in STRATEGIES:
            torch.manual_seed(0)
            model = BUILDS[name]().double()
            dp = DistributedModel(model, strategy)
            with float64_throughout():  # transformers' float32 casts would put a 1e-7 floor under the comparison
                vl_train(model, dp, vl_steps(name), env.rank, env.world_size)
            state = dp.full_state_dict()
            if env.is_main:
                torch.save(state, os.path.join(out_dir, f"{name}-{strategy}.pt"))
    assert close_distributed() == "gloo"
    exit_process(0)


@pytest.fixture(scope="module")
def two_rank_vl_results(tmp_path_factory) -> str:
    out_dir = str(tmp_path_factory.mktemp("dp-vl"))
    mp.spawn(_vl_worker, args=(2, free_port(), out_dir), nprocs=2, join=True)
    return out_dir


@two_ranks
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", VL_MODELS)
def test_a_vision_language_policy_trains_on_two_ranks_as_in_one_process(name, strategy, two_rank_vl_results):
    """The sync's forward runs the tower on a blank image, so its gradients are summed over the ranks (each rank's
    micro-batches show other images); after a step that shows none, the tower's gradients are None as in one process
    (the optimizer's weight decay leaves it alone)."""
    from vision_models import BUILDS

    from treerl.engine.images import tower_parameters

    torch.manual_seed(0)
    model = BUILDS[name]().double()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with float64_throughout():
        vl_train(model, None, vl_steps(name))
    want = model.state_dict()
    got = torch.load(os.path.join(two_rank_vl_results, f"{name}-{strategy}.pt"))
    assert set(got) == set(want)
    # a floor for updates that are zero in exact arithmetic (CLIP's key bias: softmax ignores a bias all keys share)
    floor = 1e-12 * torch.linalg.norm(torch.cat([(want[k] - before[k]).flatten() for k in want]))
    for key in want:
        update, want_update = got[key] - before[key], want[key] - before[key]
        assert torch.linalg.norm(update - want_update) <= 1e-9 * torch.linalg.norm(want_update) + floor, key
    tower = {k for k, p in model.named_parameters() if any(p is q for q in tower_parameters(model))}
    assert any(not torch.equal(want[k], before[k]) for k in tower)  # the image step trained the tower
    # what one process never gave a gradient (LLaVA's last tower layer, whose output the projector skips) stays put:
    # no weight decay from a zero gradient made up for the sync
    unused = [k for k in want if torch.equal(want[k], before[k])]
    assert unused == [] if name == "qwen2_5_vl" else unused
    assert all(torch.equal(got[k], before[k]) for k in unused)

"""Data parallelism: load-balanced assignment of prefix trees to ranks, and one gradient sync per step.

Steps 4 and 6 (docs/architecture.md): the split over ranks, the gradient sync.

A training step under `torchrun --nproc-per-node K` (every rank holds the same global batch):

    env = init_distributed()                                  # gloo on CPU, nccl on CUDA; rank 0 of 1 without torchrun
    dp = DistributedModel(model.to(env.device), "fsdp2")          # or "ddp"; "none" in a single process
    optimizer = torch.optim.AdamW(dp.parameters(), lr=...)    # after wrapping (FSDP2: the shards)
    assignment = balance(batch, env.world_size, micro_batch_tokens, cost=cost_model)  # same on every rank
    denominator = sum(s.fields["loss_mask"].sum() for s in batch)  # over the GLOBAL batch
    with dp.gradient_step() as policy:                        # the transformers model itself
        for micro_batch in assignment.micro_batches(env.rank):
            engine.forward_backward(policy, [batch[i] for i in micro_batch], loss_fn_dividing_by(denominator))
    optimizer.step(); optimizer.zero_grad()                   # .grad held the SUM over ranks
    state = dp.full_state_dict()                              # every rank calls it; rank 0 (env.is_main) saves
    if close_distributed() == "gloo":                         # at the end of the run, on every rank
        exit_process(0)                                       # (why: its docstring)

Forward-only engine calls (old log-probs) go inside `with dp.gathered() as policy:`.
"""

from treerl.distributed.assign import (
    Assignment,
    BalanceStats,
    ContextSplit,
    balance,
    evaluate,
    first_fit,
    lpt,
    split_over_context,
)
from treerl.distributed.cost import CostModel, tree_features
from treerl.distributed.order import FEATURES, TrieOrder
from treerl.distributed.parallel import (
    DistEnv,
    DistributedModel,
    Mesh,
    build_mesh,
    close_distributed,
    exit_process,
    global_sum,
    init_distributed,
)

__all__ = [
    "FEATURES",
    "Assignment",
    "BalanceStats",
    "ContextSplit",
    "CostModel",
    "DistEnv",
    "DistributedModel",
    "Mesh",
    "TrieOrder",
    "balance",
    "build_mesh",
    "close_distributed",
    "evaluate",
    "exit_process",
    "first_fit",
    "global_sum",
    "init_distributed",
    "lpt",
    "split_over_context",
    "tree_features",
]

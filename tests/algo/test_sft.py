"""SFT on tree-shaped agent trajectories: the masked NLL and its gradient equal transformers' own
cross-entropy with every sequence run separately (a shared prefix counts once per branch)."""

from __future__ import annotations

import torch.nn.functional as F
from algo_testing import RTOL, VOCAB

from treerl.algo import AlgoConfig, LossNormalizer, build_loss
from treerl.engine import DfsEngine
from treerl.tree import PrefixTree
from treerl.bench.workloads import AgentShape, agent_trees


def test_sft_on_agent_trees_equals_per_sequence_cross_entropy(policy) -> None:
    batch = agent_trees(AgentShape(tasks=1, samples_per_task=2).scaled(0.004), vocab=VOCAB, seed=0)
    assert PrefixTree.build(batch).stats().compression > 1.5 and len(batch) >= 4
    # The reference: transformers' forward and cross-entropy, one sequence at a time.
    policy.zero_grad(set_to_none=True)
    total_tokens = sum(float(s.fields["loss_mask"].sum()) for s in batch)
    want_loss = 0.0
    for seq in batch:
        logits = policy(input_ids=seq.tokens[None]).logits[0, :-1]
        nll = F.cross_entropy(logits.double(), seq.tokens[1:], reduction="none")
        loss = (nll * seq.fields["loss_mask"][1:].double()).sum() / total_tokens
        loss.backward()
        want_loss += float(loss.detach())
    want = {n: p.grad.clone() for n, p in policy.named_parameters()}

    policy.zero_grad(set_to_none=True)
    stats = DfsEngine().forward_backward(
        policy, batch, build_loss(AlgoConfig(loss="sft"), LossNormalizer.from_sequences(batch))
    )
    assert abs(stats.metrics["nll"] - want_loss) <= RTOL * want_loss
    for name, p in policy.named_parameters():
        assert (p.grad - want[name]).norm() <= RTOL * want[name].norm(), name

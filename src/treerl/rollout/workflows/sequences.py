"""One model call as a training sequence: the context it saw plus the reply it sampled.

Step 2 (docs/architecture.md): a sample as the sequence the later steps read.

Per-token fields, aligned with the tokens:
- `loss_mask` (float32): 1 on the reply's tokens (the ones this call generated), 0 on the context.
  In a multi-turn episode the earlier replies inside the context are 0 here: each is trained in
  the sequence of the call that generated it.
- `old_logprobs` (float64): the behaviour log-prob of each reply token (0 on the context).
- `versions` (int64): the policy version that produced each reply token (-1 on the context).
- `routed_experts` (rollout.return_routed_experts, an MoE policy): `[tokens, decoder layers, top_k]`, the experts each
  layer routed each token to when the sampler ran it (treerl.engine.routing replays them).
"""

from __future__ import annotations

from typing import Any

import torch

from treerl.rollout.sampling.sampler import Completion
from treerl.tree import ImageSpan, TokenSequence
from treerl.tree.sequence import ROUTED_EXPERTS


def model_call_sequence(context: list[int], completion: Completion, info: dict[str, Any], name: str,
                        images: tuple[ImageSpan, ...] = ()) -> TokenSequence:
    """The training sequence of one model call (and the images its context showed)."""
    n_context, n_reply = len(context), len(completion.tokens)
    fields = {
        "loss_mask": torch.cat([torch.zeros(n_context), torch.ones(n_reply)]),
        "old_logprobs": torch.cat(
            [torch.zeros(n_context, dtype=torch.float64), torch.tensor(completion.logprobs, dtype=torch.float64)]
        ),
        "versions": torch.cat(
            [torch.full((n_context,), -1, dtype=torch.long), torch.tensor(completion.versions, dtype=torch.long)]
        ),
    }
    if completion.routed_experts is not None:  # an MoE policy's routing of the context and the reply
        if len(completion.routed_experts) != n_context + n_reply:
            raise ValueError(f"{name}: the sampler routed {len(completion.routed_experts)} tokens, but the call's "
                             f"context and reply hold {n_context + n_reply}")
        fields[ROUTED_EXPERTS] = completion.routed_experts
    return TokenSequence(
        tokens=torch.tensor(context + completion.tokens, dtype=torch.long),
        fields=fields,
        info=info,
        name=name,
        images=images,
    )


def environment_info(env: str | None, metrics: dict[str, float]) -> dict[str, Any]:
    """The info keys that say which environment (rollout.env) a sample came from and its named metrics: `env` and
    `env_metrics` (none for a task of treerl's own), read by `treerl.rollout.workflows.stats.environment_metrics`."""
    if env is None:
        return {"env_metrics": dict(metrics)} if metrics else {}
    return {"env": env, "env_metrics": dict(metrics)}


"""Generation that a weight update interrupts and that resumes on the new weights (AReaL's interruptible rollout).

Step 1 (docs/architecture.md) in a worker: new weights from step 6 taken mid-reply.

The embedded sampler decodes a whole call on one set of weights. With `trainer.on_update=interrupt`
a rollout worker decodes in segments of `trainer.interrupt_tokens` tokens and, before each
segment (and each sampler call, so every turn of an episode), loads the newest published weights.
The unfinished replies then go on under those weights: each is prefilled again (prompt + its tokens
so far, so the KV cache is recomputed with the new weights, as AReaL does) and decoded further.
A resumed reply holds tokens of several policy versions; every token keeps the version and the
behaviour log-prob of the weights that sampled it (and, for routing replay, the routing of the forward that sampled
the token after it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from treerl.rollout import Completion, EmbeddedSampler, SamplingParams
from treerl.rollout.sampling.prefix_sharing import PrefixCounts
from treerl.rollout.tasks.base import rng_for
from treerl.tree import ImageSpan


@dataclass
class InterruptibleSampler:
    """A `Sampler` over an embedded sampler whose weights `refresh()` may replace between segments."""

    inner: EmbeddedSampler
    refresh: Callable[[], None]  # loads newer weights into inner.model, if any, and sets inner.version
    segment_tokens: int = 8

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def counts(self) -> PrefixCounts:
        return self.inner.counts

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[tuple[ImageSpan, ...]] | None = None) -> list[list[Completion]]:
        """`params.n` completions per prompt, decoded `segment_tokens` at a time on the newest weights (a prompt's
        images stay where they are: a resumed reply only extends its prompt)."""
        budget = params.max_new_tokens
        self.refresh()
        first = self.inner.generate(prompts, replace(params, max_new_tokens=min(self.segment_tokens, budget)),
                                    images=images)
        replies = [(p, completion) for p, group in enumerate(first) for completion in group]
        segment = 0
        while unfinished := [(i, p, c) for i, (p, c) in enumerate(replies) if c.finish_reason == "length"
                             and len(c.tokens) < budget]:
            segment += 1
            self.refresh()
            done = len(unfinished[0][2].tokens)  # every unfinished reply has decoded the same number of tokens
            seed = None if params.seed is None else rng_for("segment", params.seed, segment).getrandbits(62)
            more = self.inner.generate(
                [prompts[p] + c.tokens for _, p, c in unfinished],
                replace(params, n=1, max_new_tokens=min(self.segment_tokens, budget - done), seed=seed),
                images=None if images is None else [images[p] for _, p, _ in unfinished],
            )
            for (i, p, c), [extra] in zip(unfinished, more):
                replies[i] = (p, Completion(c.tokens + extra.tokens, c.logprobs + extra.logprobs, extra.finish_reason,
                                            c.versions + extra.versions, resumed_routes(c, extra)))
        grouped: list[list[Completion]] = [[] for _ in prompts]
        for p, completion in replies:
            grouped[p].append(completion)
        return grouped


def resumed_routes(before: Completion, extra: Completion) -> torch.Tensor | None:
    """The routing of a resumed reply (rollout.return_routed_experts): each token's from the call whose forward
    sampled the next token, so the earlier segment's up to its last token, then the resumed call's from it on."""
    if before.routed_experts is None or extra.routed_experts is None:
        return None
    return torch.cat([before.routed_experts[:-1], extra.routed_experts[len(before.routed_experts) - 1 :]])

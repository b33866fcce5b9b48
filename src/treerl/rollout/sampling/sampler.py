"""What every sampler shares: sampling parameters, a completion, and the `generate` interface.

Step 1 (docs/architecture.md): the interface every sampler implements (`EmbeddedSampler` in process,
`CompletionsClient` for a server). A sampler is not an engine: in treerl an engine is what trains
(`treerl.engine`), a sampler what generates.

Log-prob semantics (the same for every sampler): the behaviour log-prob of a sampled token is its
log-prob under the distribution it was drawn from. Untruncated (`top_p = 1`, `top_k = 0`, `min_p = 0`,
the default) that is `log_softmax(logits / temperature)[token]`, exactly what the trainer recomputes
with `treerl.engine.PolicyHead(temperature=T)`: the importance ratio is 1 on-policy. Truncated, the
tempered distribution is cut as vLLM cuts it (`truncate_logits`: min_p, then top_k, then top_p) and
renormalised over the tokens kept, and the log-prob is that of the renormalised distribution (what
vLLM returns with `--logprobs-mode processed_logprobs`). The policy the trainer differentiates stays
the untruncated one, so truncated samples are off-policy by construction: the trainer then trains
decoupled PPO, whose weight pi_prox / pi_behav corrects for the truncation (trainer.core.config
refuses a loss that would not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from treerl.tree import ImageSpan

FinishReason = Literal["stop", "length", "cut"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: `n` completions per prompt of at most `max_new_tokens` tokens each."""

    n: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus: the most likely tokens whose probability reaches top_p (1: all)
    top_k: int = 0  # only the k most likely tokens (0: all)
    min_p: float = 0.0  # only tokens at least min_p x the most likely one's probability (0: all)
    stop_token_ids: tuple[int, ...] = ()  # generation stops after emitting one of these (it is kept in the completion)
    seed: int | None = None  # same seed, weights and prompts -> same completions (embedded sampler)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling: n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"sampling: temperature must be > 0 (RL needs a sampling policy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling: top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling: top_k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"sampling: min_p must be in [0, 1), got {self.min_p}")

    @property
    def truncates(self) -> bool:
        """Tokens are drawn from a cut-down distribution (top_p, top_k or min_p set)."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    tokens: list[int]  # generated token ids, the stop token included when finish_reason == "stop"
    logprobs: list[float]  # behaviour log-prob of each generated token (see module docstring)
    finish_reason: FinishReason  # "stop": emitted a stop token; "length": reached max_new_tokens; "cut": the agent
    # proxy kept only its first tool call (parallel_tool_calls=false), so it ends without a stop token
    versions: list[int] = field(default_factory=list)  # policy version that produced each token
    # an MoE policy's routing (rollout.return_routed_experts): [prompt + generated tokens, decoder layers, top_k], the
    # experts each layer routed each token to (-1: none, as on the last token, which no sampler runs); None: not asked
    routed_experts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.tokens) or len(self.versions) != len(self.tokens):
            raise ValueError(
                f"completion: {len(self.tokens)} tokens but {len(self.logprobs)} log-probs and "
                f"{len(self.versions)} versions"
            )


def truncate_logits(logits: torch.Tensor, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> torch.Tensor:
    """Tempered logits with the tokens outside the sampling set at -inf, cut as vLLM 0.32 cuts them: min_p on the
    probabilities, then the top_k largest (ties kept), then the smallest nucleus whose mass reaches top_p (computed
    over what top_k kept; the most likely token always stays). `log_softmax` of the result is the behaviour log-prob."""
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ascending, order = logits.sort(dim=-1)
        below = ascending.softmax(-1).cumsum(-1) <= 1 - top_p  # the least likely tokens holding at most 1 - top_p
        below[..., -1] = False
        logits = logits.masked_fill(torch.zeros_like(below).scatter(-1, order, below), float("-inf"))
    return logits


class Sampler(Protocol):
    """Samples completions; `version` is the policy version its weights are at (the trainer bumps it)."""

    version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[tuple[ImageSpan, ...]] | None = None) -> list[list[Completion]]:
        """`params.n` completions for each prompt (token ids), in prompt order; `images`: the images each prompt
        shows (a vision-language model), or None."""
        ...


def images_kwarg(images: list[tuple[ImageSpan, ...]]) -> dict:
    """`generate`'s `images` argument when some prompt shows an image, else nothing: a text batch stays callable on
    any sampler, with or without image support."""
    return {"images": images} if any(images) else {}


def check_prompts(prompts: list[list[int]], vocab_size: int | None = None) -> None:
    """Reject empty prompts and out-of-vocabulary ids before anything is sent to a model."""
    if not prompts:
        raise ValueError("generate: no prompts")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"generate: prompt {i} is empty")
        if vocab_size is not None:
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"generate: prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")

"""What every sampler shares: sampling parameters, a completion, and the `generate` interface.

Step 1 (docs/architecture.md): the interface every sampler implements (`EmbeddedSampler` in process,
`CompletionsClient` for a server). A sampler is not an engine: in treerl an engine is what trains
(`treerl.engine`), a sampler what generates.

Log-prob semantics (the same for every sampler): the behaviour log-prob of a sampled token is
`log_softmax(logits / temperature)[token]`, the log-prob of the *untruncated* tempered distribution,
which is exactly what the trainer recomputes with `treerl.engine.PolicyHead(temperature=T)`. With
`top_p < 1` tokens are sampled from the nucleus (the smallest set of most likely tokens whose
tempered probability reaches `top_p`, renormalised), but the recorded log-prob is still that of the
full tempered distribution, so the importance ratio new/old is 1 on-policy; the sampling
distribution then differs from the one the ratio assumes, as in every RL framework that samples
with top-p. Keep `top_p = 1` for exact on-policy training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "cut"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: `n` completions per prompt of at most `max_new_tokens` tokens each."""

    n: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
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


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    tokens: list[int]  # generated token ids, the stop token included when finish_reason == "stop"
    logprobs: list[float]  # behaviour log-prob of each generated token (see module docstring)
    finish_reason: FinishReason  # "stop": emitted a stop token; "length": reached max_new_tokens; "cut": the agent
    # proxy kept only its first tool call (parallel_tool_calls=false), so it ends without a stop token
    versions: list[int] = field(default_factory=list)  # policy version that produced each token

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.tokens) or len(self.versions) != len(self.tokens):
            raise ValueError(
                f"completion: {len(self.tokens)} tokens but {len(self.logprobs)} log-probs and "
                f"{len(self.versions)} versions"
            )


class Sampler(Protocol):
    """Samples completions; `version` is the policy version its weights are at (the trainer bumps it)."""

    version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions for each prompt (token ids), in prompt order."""
        ...


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

"""Synthetic batches with the prefix structure of real RL workloads (docs/design.md, "Measurement").

Beside the steps (docs/architecture.md): batches shaped like real workloads, for the benchmark and tests.

Token ids are random: the engines' cost depends on the tree's shape, not on which tokens fill it.
Every generator is seeded and returns plain `TokenSequence`s with a `loss_mask` on generated tokens
and random `advantages`, so the same batch can be trained on by any engine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from treerl.tree.sequence import ImageSpan, TokenSequence


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _sequence(tokens: list[int], generated_from: int, rng: random.Random, name: str) -> TokenSequence:
    """A sequence whose tokens from `generated_from` on are trained on, with random advantages."""
    n = len(tokens)
    mask = torch.zeros(n)
    mask[max(generated_from, 1) :] = 1.0
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    return TokenSequence(
        tokens=torch.tensor(tokens),
        fields={"loss_mask": mask, "advantages": torch.randn(n, generator=gen)},
        name=name,
    )


def grpo_groups(
    prompts: int = 2, group_size: int = 8, prompt_len: int = 512, response_len: int = 256,
    vocab: int = 1000, jitter: float = 0.0, seed: int = 0,
) -> list[TokenSequence]:
    """G samples per prompt: one shared prompt, G different responses of about `response_len` tokens."""
    rng = random.Random(seed)
    out = []
    for p in range(prompts):
        prompt = _tokens(rng, prompt_len, vocab)
        for g in range(group_size):
            n = max(1, round(response_len * (1 - jitter * rng.random())))
            out.append(_sequence(prompt + _tokens(rng, n, vocab), prompt_len, rng, f"prompt{p}/sample{g}"))
    return out


@dataclass(frozen=True)
class AgentShape:
    """Sizes of a tau2-bench-like multi-turn episode (AREAL-DTA paper), scaled by `scale`."""

    system_len: int = 4800
    task_len: int = 300
    context_len: int = 16384
    reply_len: int = 300
    tool_len: int = 900
    tasks: int = 2
    samples_per_task: int = 4
    branch_at: tuple[int, ...] = (3,)  # after these turns the tool call forks into `branches` continuations
    branches: int = 2

    def scaled(self, scale: float) -> AgentShape:
        """The same shape with every length multiplied by `scale` (CPU-sized runs)."""
        s = lambda n: max(1, round(n * scale))
        return AgentShape(
            s(self.system_len), s(self.task_len), s(self.context_len), s(self.reply_len), s(self.tool_len),
            self.tasks, self.samples_per_task, self.branch_at, self.branches,
        )


def agent_trees(shape: AgentShape = AgentShape(), vocab: int = 1000, seed: int = 0) -> list[TokenSequence]:
    """Multi-turn agent episodes: every model call is a training sequence (context so far + its reply).

    All episodes share the system prompt; the samples of one task share the task. After the
    turns in `branch_at` the tool call forks into `branches` continuations (retries, parallel
    tool results), so one episode is a tree. An episode ends when its context would exceed
    `context_len`.
    """
    rng = random.Random(seed)
    system = _tokens(rng, shape.system_len, vocab)
    out: list[TokenSequence] = []

    def episode(context: list[int], turn: int, name: str) -> None:
        while True:
            reply_n = max(1, round(shape.reply_len * (0.5 + rng.random())))
            if len(context) + reply_n > shape.context_len:
                return
            reply = _tokens(rng, reply_n, vocab)
            out.append(_sequence(context + reply, len(context), rng, f"{name}/turn{turn}"))
            context = context + reply
            tool_n = max(1, round(shape.tool_len * (0.5 + rng.random())))
            turn += 1
            if turn in shape.branch_at and shape.branches > 1:
                for b in range(shape.branches):
                    episode(context + _tokens(rng, tool_n, vocab), turn, f"{name}/b{b}")
                return
            context = context + _tokens(rng, tool_n, vocab)

    for t in range(shape.tasks):
        task = system + _tokens(rng, shape.task_len, vocab)
        for g in range(shape.samples_per_task):
            episode(task, 0, f"task{t}/sample{g}")
    return out


def random_trees(
    sequences: int = 32, length: int = 256, sharing: float = 4.0, vocab: int = 1000, seed: int = 0,
) -> list[TokenSequence]:
    """Sequences of about `length` tokens whose compression T/U is about `sharing` (1.0 = none).

    Each new sequence copies the prefix of a random earlier one up to a random fork point
    (mean fraction 1 - 1/sharing) and continues with fresh tokens.
    """
    if sharing < 1.0:
        raise ValueError(f"sharing must be >= 1.0, got {sharing}")
    rng = random.Random(seed)
    shared = 1.0 - 1.0 / sharing
    made: list[list[int]] = []
    out = []
    for i in range(sequences):
        n = max(2, round(length * (0.75 + 0.5 * rng.random())))
        if made and shared > 0:
            base = rng.choice(made)
            frac = min(max(rng.gauss(shared, 0.1 * shared), 0.0), 0.999)
            cut = min(round(frac * n), len(base))
            tokens = base[:cut] + _tokens(rng, n - cut, vocab)
        else:
            tokens = [i % vocab] + _tokens(rng, n - 1, vocab)  # distinct first tokens: no accidental sharing
        made.append(tokens)
        out.append(_sequence(tokens, 1, rng, f"random{i}"))
    return out


@dataclass(frozen=True)
class ImageShape:
    """How a Qwen-VL model takes an image (treerl.engine.images): `side` x `side` patches of `patch_values` values
    each, merged `merge` x `merge` into a placeholder token; its placeholder and vision start / end ids."""

    side: int
    patch_values: int
    merge: int
    image_token: int
    start_token: int
    end_token: int

    @property
    def tokens(self) -> int:
        return (self.side // self.merge) ** 2

    @classmethod
    def of(cls, config, side: int = 16) -> ImageShape:
        """The image shape of a Qwen-VL `config` (a 64 x 64 screenshot for small-qwen2.5-vl's 4 x 4 patches)."""
        vision = config.vision_config
        values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        return cls(side, values, vision.spatial_merge_size, config.image_token_id, config.vision_start_token_id,
                   config.vision_end_token_id)

    def image(self, rng: random.Random, start: int) -> ImageSpan:
        """A random image whose placeholder tokens begin at `start` (after its start token)."""
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        pixels = torch.randn(self.side * self.side, self.patch_values, generator=g)
        return ImageSpan(start, self.tokens, pixels, torch.tensor([1, self.side, self.side]))


def _with_images(parts: list, shape: ImageShape, generated_from: int, rng: random.Random, name: str) -> TokenSequence:
    """Text (token lists) and images (ImageSpan factories: `shape.image`) in order, each image between its start and
    end tokens; trained on from `generated_from`."""
    tokens: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, ImageSpan):
            tokens.append(shape.start_token)
            images.append(ImageSpan(len(tokens), part.length, part.pixel_values, part.grid_thw))
            tokens += [shape.image_token] * part.length + [shape.end_token]
        else:
            tokens += part
    sequence = _sequence(tokens, generated_from, rng, name)
    sequence.images = tuple(images)
    return sequence


def image_grpo(shape: ImageShape, prompts: int = 4, group_size: int = 8, prompt_len: int = 512,
               response_len: int = 256, vocab: int = 1000, seed: int = 0) -> list[TokenSequence]:
    """G samples per prompt, each prompt an image between two runs of text (a visual question); `vocab` holds the
    text ids, below the image ids."""
    rng = random.Random(seed)
    out = []
    for p in range(prompts):
        prompt = [_tokens(rng, prompt_len // 2, vocab), shape.image(rng, 0), _tokens(rng, prompt_len // 2, vocab)]
        length = prompt_len + shape.tokens + 2
        for g in range(group_size):
            out.append(_with_images(prompt + [_tokens(rng, response_len, vocab)], shape, length, rng,
                                    f"prompt{p}/sample{g}"))
    return out


def agent_screenshots(shape: ImageShape, samples: int = 4, turns: int = 4, system_len: int = 2400,
                      reply_len: int = 150, tool_len: int = 150, vocab: int = 1000,
                      seed: int = 0) -> list[TokenSequence]:
    """Computer-use episodes: every model call is a training sequence (the context so far, then its reply); after
    each reply the environment returns a screenshot and some text. The samples share the system prompt, the task and
    the first screenshot; each then sees its own screenshots."""
    rng = random.Random(seed)
    start = [_tokens(rng, system_len, vocab), shape.image(rng, 0), _tokens(rng, tool_len, vocab)]
    out = []
    for g in range(samples):
        context = list(start)
        for turn in range(turns):
            reply = _tokens(rng, reply_len, vocab)
            trained_from = sum(p.length + 2 if isinstance(p, ImageSpan) else len(p) for p in context)
            out.append(_with_images(context + [reply], shape, trained_from, rng, f"sample{g}/turn{turn}"))
            context += [reply, shape.image(rng, 0), _tokens(rng, tool_len, vocab)]
    return out

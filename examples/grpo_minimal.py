"""GRPO in one file: sample G answers per prompt, merge them into a prefix tree, train on the tree.

    python examples/grpo_minimal.py              # 100 steps, under a minute on a CPU
    python examples/grpo_minimal.py --steps 2

A tiny random-init Qwen3 starts learning one-digit sums: its mean reward rises from about 0.01 to 0.07.

Each step: the policy samples GROUP answers to each of PROMPTS prompts; each answer is scored and becomes a
training sequence (prompt + answer); the sequences are merged into a prefix tree (a prompt's answers share it);
DfsEngine walks the tree once, forward and backward, computing each shared prompt once, and accumulates the
gradient of the GRPO loss, the same gradient as training every sequence on its own; then an optimizer step.
`treerl train` is this loop plus checkpoints, evaluation, metrics, asynchronous rollouts and data parallelism.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from treerl.algo import AlgoConfig, LossNormalizer, build_loss, compute_advantages
from treerl.engine import DfsEngine
from treerl.models import build_model
from treerl.rollout import ChatFormat, EmbeddedSampler, SamplingParams, builtin_tokenizer
from treerl.rollout.tasks import Arithmetic
from treerl.tree import PrefixTree, TokenSequence

PROMPTS = 8  # prompts per step
GROUP = 8  # answers sampled per prompt: GRPO's group, whose mean reward is each answer's baseline
LR = 1e-3


def sample(sampler: EmbeddedSampler, chat: ChatFormat, task: Arithmetic, step: int) -> list[TokenSequence]:
    """GROUP answers to each of the step's prompts, each a sequence with what the loss and advantages read."""
    prompts = task.prompts(step, PROMPTS)
    contexts = [chat.prompt(p.messages) for p in prompts]  # token ids: the chat template with the question
    params = SamplingParams(n=GROUP, max_new_tokens=task.max_new_tokens, stop_token_ids=tuple(chat.stop_token_ids),
                            seed=step)
    sequences = []
    for prompt, context, answers in zip(prompts, contexts, sampler.generate(contexts, params)):
        for answer in answers:
            reward = task.reward_fn(prompt=prompt.text, completion=chat.reply_text(answer.tokens), answer=prompt.answer)
            n, m = len(context), len(answer.tokens)
            sequences.append(TokenSequence(
                torch.tensor(context + answer.tokens),
                fields={
                    "loss_mask": torch.cat([torch.zeros(n), torch.ones(m)]),  # train the answer, not the prompt
                    "old_logprobs": torch.tensor([0.0] * n + answer.logprobs, dtype=torch.float64),  # the sampler's
                },
                info={"reward": reward, "group": prompt.id},  # the group: the answers that share a baseline
            ))
    return sequences


def train_step(model, optimizer, engine: DfsEngine, config: AlgoConfig, batch: list[TokenSequence]) -> None:
    """Advantages from the group rewards, one forward + backward over the batch's prefix tree, one optimizer step."""
    compute_advantages(config, batch)  # GRPO: (reward - group mean) / group std, on every answer token
    loss_fn = build_loss(config, LossNormalizer.from_sequences(batch))  # the clipped surrogate, batch-normalised
    engine.forward_backward(model, batch, loss_fn)  # the gradient of the batch's loss, accumulated in .grad
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def main(steps: int) -> None:
    torch.manual_seed(0)
    tokenizer = builtin_tokenizer()  # characters; comes with a chat template
    chat = ChatFormat(tokenizer)
    model = build_model(shape="tiny-qwen3", vocab_size=len(tokenizer))  # random init, float32
    sampler = EmbeddedSampler(model)  # samples with the policy itself (transformers, with a KV cache)
    engine = DfsEngine()  # dynamic tree attention: the tree's nodes depth first, shared prefixes once
    config = AlgoConfig(loss="grpo")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    task = Arithmetic()  # "a+b=" with a, b in 0..4; reward 1 for the sum, a little for digits
    for step in range(steps):
        batch = sample(sampler, chat, task, step)
        tree = PrefixTree.build(batch).stats()
        train_step(model, optimizer, engine, config, batch)
        if step % 10 == 0 or step == steps - 1:
            reward = statistics.fmean(s.info["reward"] for s in batch)
            print(f"step {step}: mean reward {reward:.3f}; {tree.flat_tokens} tokens, computed as the tree's "
                  f"{tree.unique_tokens} ({tree.compression:.1f}x fewer)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    main(parser.parse_args().steps)

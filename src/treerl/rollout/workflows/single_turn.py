"""Single-turn verifiable tasks: each prompt -> `group_size` samples -> one reward each.

Steps 1 and 2 (docs/architecture.md): a group of samples per prompt, each a training sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from treerl.rollout.conversations.chat import ChatFormat
from treerl.rollout.rewards.functions import SCORERS, RewardFailure, UserCode, call_scored
from treerl.rollout.sampling.sampler import Sampler, SamplingParams, images_kwarg
from treerl.rollout.tasks.base import Prompt, SingleTurnTask
from treerl.rollout.workflows.sequences import environment_info, model_call_sequence
from treerl.rollout.workflows.stats import DroppedSample, RolloutStats
from treerl.tree import TokenSequence


@dataclass
class SingleTurnWorkflow:
    """Samples a group per prompt in one sampler call (each prompt prefilled once) and scores every sample.

    Each sample is one sequence, prompt + reply, with info: `reward`, `group` (the prompt's id,
    shared by its samples), `trajectory` (the sample's id), `turn` (0), `finish_reason`. A prompt whose
    tokens + max_new_tokens exceed `max_context_tokens` is not sampled: its samples are dropped (context_limit).
    """

    task: SingleTurnTask
    chat: ChatFormat
    sampling: SamplingParams  # n = group size; the seed is set per run
    user_code: UserCode = field(default_factory=UserCode)  # runs the reward function (time limit per call)
    max_context_tokens: int | None = None  # prompt + reply budget at most (rollout.max_context_tokens); None: no limit
    drop_prefix: str = "reward"  # what scores the samples, in the reasons of dropped ones: "reward" (a reward
    # function: reward_raised ...) or "env" (an environment library's scorer: env_raised ...)

    def run(
        self, sampler: Sampler, prompts: list[Prompt], stats: RolloutStats, seed: int | None = None
    ) -> list[TokenSequence]:
        """The training sequences of `prompts`; `stats` counts what was sampled, kept and dropped."""
        stats.prompts += len(prompts)
        rendered = [self.chat.prompt_with_images(p.messages, who=f"prompt {p.id}") for p in prompts]
        fits = [not stats.drop_over_context(p.id, p.text, len(c), self.sampling.max_new_tokens, self.max_context_tokens,
                                            self.sampling.n) for p, (c, _) in zip(prompts, rendered)]
        prompts = [p for p, ok in zip(prompts, fits) if ok]
        contexts = [c for (c, _), ok in zip(rendered, fits) if ok]
        images = [i for (_, i), ok in zip(rendered, fits) if ok]
        params = replace(self.sampling, seed=seed)
        groups = sampler.generate(contexts, params, **images_kwarg(images)) if prompts else []
        sequences = []
        for prompt, context, image, group in zip(prompts, contexts, images, groups):
            for j, completion in enumerate(group):
                stats.count_reply(completion)
                text = self.chat.reply_text(completion.tokens)
                scored = call_scored(
                    lambda: self.task.reward_fn(prompt=prompt.text, completion=text, answer=prompt.answer),
                    self.user_code,
                )
                if isinstance(scored, RewardFailure):
                    sample = DroppedSample(f"{SCORERS[self.drop_prefix]} {scored.message}", prompt.id, prompt.text, text)
                    stats.drop(sample, f"{self.drop_prefix}_{scored.kind}")
                    continue
                stats.keep(scored.reward)
                info = {"reward": scored.reward, "group": prompt.id, "trajectory": f"{prompt.id}/{j}", "turn": 0,
                        "finish_reason": completion.finish_reason, **environment_info(prompt.env, scored.metrics)}
                sequences.append(model_call_sequence(context, completion, info, name=f"{prompt.id}/{j}", images=image))
        stats.sequences += len(sequences)
        return sequences

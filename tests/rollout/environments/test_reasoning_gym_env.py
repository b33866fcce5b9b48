"""reasoning-gym (the real package) through rollout.env: its questions sampled, each reply scored by the dataset's own
scorer, several datasets mixed, its composite, and the ways a user gets it wrong refused before any sampling."""

from __future__ import annotations

import sys

import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer
from refusals import refused_before_sampling

from treerl.errors import UserError
from treerl.rollout import Rollout, RolloutConfig
from treerl.rollout.workflows.stats import environment_metrics

REPLIES = ("<answer>{answer}</answer>", "<answer>{answer}0</answer>", "{answer}")  # right; wrong; right, no tags


def rollout(tokenizer, sampler, env, env_args=None, **options) -> Rollout:
    config = RolloutConfig(env=env, env_args=env_args or {}, prompts_per_step=4, group_size=len(REPLIES),
                           max_new_tokens=48, system_prompt="", **options)
    return Rollout(config, tokenizer, sampler)


def answering(scripted, answers: dict[str, str]):
    """A sampler that answers each question (looked up in its prompt) in the REPLIES' three ways."""
    def reply(prompt: str, j: int) -> str:
        answer = next(a for question, a in answers.items() if question.strip() in prompt)
        return REPLIES[j].format(answer=answer)
    return scripted(reply)


@pytest.mark.parametrize(("name", "args"), [("leg_counting", {"min_animals": 1, "max_animals": 2}),
                                            ("basic_arithmetic", {"min_terms": 2, "max_terms": 2}),
                                            ("spell_backward", {})])
def test_each_reply_gets_the_datasets_own_score(tokenizer, scripted, name, args):
    probe = rollout(tokenizer, None, f"reasoning_gym:{name}", args)
    prompts = probe.task.prompts(0, 4)
    entries = {p.id: p.answer.answer for p in prompts}
    sampler = answering(scripted, {e["question"]: e["answer"] for e in entries.values()})
    run = rollout(tokenizer, sampler, f"reasoning_gym:{name}", args)
    batch = run.collect(0)
    own = reasoning_gym.create_dataset(name, seed=0, **args)  # the library itself, apart from treerl
    assert len(batch.sequences) == 12 and batch.stats.dropped == {}
    for seq in batch.sequences:
        entry = entries[seq.info["group"]]
        reply = run.chat.reply_text(seq.tokens[seq.fields["loss_mask"].bool()].tolist())
        assert reply == REPLIES[int(seq.name[-1])].format(answer=entry["answer"])  # the tokens sampled, recorded
        assert seq.info["reward"] == own.score_answer(extract_answer(reply), entry)
        assert seq.info["env"] == f"reasoning_gym:{name}"
        assert seq.info["env_metrics"] == {"answered": float(extract_answer(reply) is not None)}
    rewards = [seq.info["reward"] for seq in batch.sequences]
    assert rewards[0] == 1.0 and min(rewards) < 1.0  # the scorer tells right from wrong


def test_mixed_datasets_and_a_composite_log_per_environment(tokenizer, scripted):
    env = [{"env": "reasoning_gym:leg_counting", "weight": 3, "env_args": {"min_animals": 1, "max_animals": 2}},
           {"env": "reasoning_gym:composite", "env_args": {"datasets": [
               {"name": "basic_arithmetic", "weight": 1, "config": {"min_terms": 2, "max_terms": 2}},
               {"name": "spell_backward", "weight": 1}]}}]
    prompts = rollout(tokenizer, None, env).task.prompts(0, 4)
    sampler = answering(scripted, {p.answer.answer["question"]: p.answer.answer["answer"] for p in prompts})
    batch = rollout(tokenizer, sampler, env).collect(0)
    metrics = environment_metrics(batch.sequences)
    by_env: dict[str, list[float]] = {}
    for seq in batch.sequences:
        by_env.setdefault(seq.info["env"], []).append(seq.info["reward"])
        if seq.info["env"] == "reasoning_gym:composite":
            source = seq.info["env_metrics"].keys() - {"answered"}
            assert len(source) == 1 and seq.info["env_metrics"][source.pop()] == seq.info["reward"]
    assert set(by_env) == {"reasoning_gym:leg_counting", "reasoning_gym:composite"}  # 4 prompts of either, seeded
    for name, rewards in by_env.items():
        assert metrics[f"env/{name}/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert metrics[f"env/{name}/samples"] == len(rewards)


@pytest.mark.parametrize(("env", "env_args", "message"), [
    ("reasoning_gym:leg_countin", {}, "reasoning-gym has no dataset 'leg_countin'; did you mean leg_counting"),
    ("reasoning_gym:leg_counting", {"max_legs": 3}, ("'max_legs' is not an option of reasoning-gym's leg_counting "
                                                     "(its options: min_animals, max_animals")),
    ("reasoning_gym:leg_counting", {"min_animals": 5, "max_animals": 2}, "reasoning-gym refused env_args"),
    ("reasoning_gym:composite", {"datasets": [{"name": "leg_counting", "config": {"x": 1}}]},
     "'x' is not an option of reasoning-gym's leg_counting"),
    ("reasoning_gym:composite", {"datasets": "leg_counting"}, "composite needs a list of {name, weight, config}"),
])
def test_a_bad_name_or_argument_is_refused_before_sampling(tokenizer, scripted, env, env_args, message):
    sampler = scripted(lambda prompt, j: "")
    refused_before_sampling(lambda: rollout(tokenizer, sampler, env, env_args), sampler, message)


def test_without_the_library_the_error_names_its_extra(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    with pytest.raises(UserError, match=r"needs the reasoning_gym package: pip install 'treerl\[reasoning-gym\]'"):
        rollout(tokenizer, None, "reasoning_gym:leg_counting")


def test_a_scorer_that_raises_drops_the_sample_with_its_prompt(tokenizer, scripted):
    run = rollout(tokenizer, scripted(lambda prompt, j: "<answer>1</answer>"), "reasoning_gym:leg_counting")
    dataset = run.task.members["reasoning_gym:leg_counting"].task.dataset
    dataset.score_answer = lambda answer, entry: 1 / 0
    batch = run.collect(0)
    assert batch.sequences == [] and batch.stats.dropped == {"env_raised": 12}
    first = batch.stats.dropped_samples[0]
    assert first.reason == "environment raised ZeroDivisionError: division by zero"
    assert "how many legs" in first.prompt and first.completion == "<answer>1</answer>"

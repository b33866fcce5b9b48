"""Branching multi-turn episodes: one tree per episode, one sequence per model call, trajectory rewards."""

from __future__ import annotations

import math

import pytest

from treerl.rollout import MultiTurnWorkflow, SamplingParams
from treerl.rollout.tasks import EnvReply, GuessNumber, Prompt
from treerl.rollout.workflows.stats import RolloutStats
from treerl.tree import PrefixTree, validate_sequences


def _replies(text: str, j: int) -> str:
    """Sample j of a turn guesses 2 + j + (number of earlier tool answers)."""
    return str(2 + j + text.count("<tool>"))


def _workflow(chat, task, **kwargs):
    options = dict(group_size=2, branch_at=(2,), branch_factor=3, max_turns=3)
    options.update(kwargs)
    return MultiTurnWorkflow(task, chat, SamplingParams(max_new_tokens=3, stop_token_ids=(2,)), **options)


def _episodes(secrets):
    return [Prompt(f"e{i}", [{"role": "user", "content": "guess 1-9"}], answer=s) for i, s in enumerate(secrets)]


def test_episode_tree_shape_sequences_and_rewards(chat, scripted, tokenizer):
    sampler = scripted(_replies)
    stats = RolloutStats()
    task = GuessNumber(max_number=9, max_turns=3)
    sequences = _workflow(chat, task).run(sampler, _episodes([9]), stats)
    validate_sequences(sequences, vocab_size=len(tokenizer))
    # turn 0: 2 samples; turn 1: 1 each; turn 2: 3 each -> 6 trajectories of 3 calls, one sampler call per turn
    assert sampler.calls == [(1, 2), (2, 1), (2, 3)]
    trajectories = {s.info["trajectory"] for s in sequences}
    assert trajectories == {f"e0/{a}/{b}" for a in range(2) for b in range(3)}
    assert len(sequences) == 18 and stats.kept == 6 and stats.model_calls == 2 + 2 + 6
    by_trajectory = {t: sorted((s for s in sequences if s.info["trajectory"] == t), key=lambda s: s.info["turn"])
                     for t in trajectories}
    for calls in by_trajectory.values():
        # each call's sequence extends the previous one; only the last reply is trained in each
        for earlier, later in zip(calls, calls[1:]):
            n = len(earlier)
            assert later.tokens[:n].tolist() == earlier.tokens.tolist()
            assert later.fields["loss_mask"][:n].sum() == 0
        assert len({s.info["reward"] for s in calls}) == 1
        assert sum(s.info["env_reward"] for s in calls) == pytest.approx(calls[0].info["reward"])
        assert all(s.info["turns"] == 3 and s.info["group"] == "e0" for s in calls)
    # the calls before the fork appear once per branch, identical, so the prefix tree shares them
    assert PrefixTree.build(sequences).stats().compression > 2


def test_trajectory_rewards_follow_the_game(chat, scripted):
    """Secret 3: sample 0 guesses 2 then 3 (solved at turn 1); sample 1 guesses 3 at turn 0."""
    sequences = _workflow(chat, GuessNumber(max_turns=3)).run(scripted(_replies), _episodes([3]), RolloutStats())
    rewards = {s.info["trajectory"]: s.info["reward"] for s in sequences}
    assert rewards == {"e0/0": pytest.approx(0.05 + 0.05 + 0.9), "e0/1": pytest.approx(0.05 + 1.0)}
    last = next(s for s in sequences if s.info["trajectory"] == "e0/0" and s.info["turn"] == 1)
    assert "<tool>higher<eos><assistant>3<eos>" in chat.tokenizer.decode(last.tokens)


class _FlakyGame:
    """Answers "go on"; raises or returns NaN for some replies."""

    def __init__(self):
        self.turn = 0

    def step(self, reply: str) -> EnvReply:
        self.turn += 1
        if reply == "4":
            raise RuntimeError("tool crashed")
        return EnvReply([{"role": "tool", "content": "go on"}], math.nan if reply == "6" else 0.5, self.turn >= 3)


class _FlakyTask:
    name, max_new_tokens, max_turns = "flaky", 3, 3

    def prompts(self, step, count):
        return _episodes([0] * count)

    def environment(self, prompt):
        return _FlakyGame()


def test_failing_environment_drops_only_that_branch(chat, scripted):
    """Turn 2 branches reply 4 + b (b = 0..2): 4 raises, 6 is NaN, 5 is kept -> one of three survives per fork."""
    stats = RolloutStats()
    sampler = scripted(lambda text, j: str(2 + j + text.count("<tool>")) if text.count("<tool>") < 2 else str(4 + j))
    sequences = _workflow(chat, _FlakyTask()).run(sampler, _episodes([0]), stats)
    assert {s.info["trajectory"] for s in sequences} == {"e0/0/1", "e0/1/1"}
    assert stats.dropped == {"reward_raised": 2, "reward_not_finite": 2} and stats.kept == 2 and stats.samples == 6
    assert "environment raised RuntimeError: tool crashed" in str(stats.dropped_samples[0])
    assert all(s.info["reward"] == pytest.approx(1.5) for s in sequences)


def test_cut_off_replies_and_the_context_limit(chat, scripted, tokenizer):
    """A reply cut at max_new_tokens gets a stop token inserted (not trained); a too-long context ends the episode."""
    stats = RolloutStats()
    workflow = _workflow(chat, GuessNumber(max_turns=5), group_size=1, branch_at=(), max_turns=5,
                         max_context_tokens=40)
    sequences = workflow.run(scripted(lambda text, j: "1234567"), _episodes([5]), stats)
    assert stats.context_limit == 1 and stats.truncated_replies == len(sequences) == 3
    for seq in sequences:
        assert seq.info["truncated"] and seq.info["finish_reason"] == "length"
        assert tokenizer.decode(seq.tokens[seq.fields["loss_mask"] == 1]) == "123"
        assert len(seq) - 3 + workflow.sampling.max_new_tokens <= 40  # its context left room for a full reply
    text = tokenizer.decode(sequences[-1].tokens)
    assert text.count("<assistant>123<eos><tool>") == 2 and text.endswith("<assistant>123")


def test_an_episode_whose_first_prompt_is_over_the_context_limit_is_not_played(chat, scripted):
    """Its group_size trajectories are dropped as context_limit before any model call; the other episode plays."""
    stats = RolloutStats()
    episodes = _episodes([5, 5])
    episodes[1].messages[0]["content"] = "guess " * 30
    workflow = _workflow(chat, GuessNumber(max_turns=1), group_size=2, branch_at=(), max_turns=1,
                         max_context_tokens=40)
    sampler = scripted(lambda text, j: "5")
    sequences = workflow.run(sampler, episodes, stats)
    assert sampler.calls == [(1, 2)] and {s.info["group"] for s in sequences} == {"e0"}
    assert stats.dropped == {"context_limit": 2} and stats.prompts == 2

"""TextArena (the real package) through rollout.env: single-player games played as multi-turn episodes, branched by
deep copy (with the game's own random state), rewarded by the game's close(); a failing game is dropped and counted,
an unknown id names the games there are."""

from __future__ import annotations

import copy
import itertools
import random
import re
import time

import pytest
import textarena as ta
from refusals import refused_before_sampling

from treerl.rollout import Rollout, RolloutConfig
from treerl.rollout.environments.textarena_env import TextArenaGame, unwrapped

GUESS = "textarena:GuessTheNumber-v0"


def rollout(tokenizer, sampler, env=GUESS, env_args=None, **options) -> Rollout:
    settings = {"prompts_per_step": 2, "group_size": 2, "branch_at": [1], "branch_factor": 2, "max_new_tokens": 8,
                "max_turns": 3, "max_context_tokens": 4096, **options}
    env_args = {"max_number": 6} if env_args is None else env_args
    return Rollout(RolloutConfig(env=env, env_args=env_args, **settings), tokenizer, sampler)


def guess_by_turn(prompt: str, j: int) -> str:
    """A guess that depends on the turn (hints seen so far) and the sample: the branches play different games."""
    return f"[{1 + (prompt.count('[GAME]') + 2 * j) % 6}]"


def test_an_episode_is_the_games_own_play_and_branches_by_copy(tokenizer, scripted):
    run = rollout(tokenizer, scripted(guess_by_turn))
    batch = run.collect(0)
    assert batch.stats.dropped == {} and batch.sequences
    trajectories: dict[str, list] = {}
    for seq in batch.sequences:
        trajectories.setdefault(seq.info["trajectory"], []).append(seq)
    assert len({seq.info["trajectory"].rsplit("/", 1)[0] for seq in batch.sequences if seq.info["turns"] > 1}) >= 2
    for calls in trajectories.values():
        calls.sort(key=lambda seq: seq.info["turn"])
        for before, after in itertools.pairwise(calls):  # each call's context extends the one before, token for token
            assert after.tokens[: len(before.tokens)].tolist() == before.tokens.tolist()
        moves = [run.chat.reply_text(seq.tokens[seq.fields["loss_mask"].bool()].tolist()) for seq in calls]
        assert all(re.fullmatch(r"\[[1-6]\]", move) for move in moves)  # the sampled replies, recorded as sampled
        game = ta.make("GuessTheNumber-v0", max_number=6)  # the same game played apart from treerl
        seed = next(p.answer.answer for p in run.task.prompts(0, 2) if p.id == calls[0].info["group"])
        game.reset(num_players=1, seed=seed)
        done = False
        for move in moves:
            assert not done
            done, _ = game.step(move)
        reward = game.close()[0][0] if done else 0.0  # truncated by max_turns: no reward
        assert calls[-1].info["reward"] == reward and calls[-1].info["truncated"] == (not done)
        assert all(seq.info["env"] == GUESS for seq in calls)
        if done:
            assert calls[-1].info["env_metrics"]["turn_count"] == len(moves)


def test_a_copied_game_continues_as_the_original_whatever_else_drew_from_random():
    """2048 spawns its tiles from Python's global `random`: a plain deep copy continues differently once anything
    else drew in between; the episode's own random state keeps the copy on the original's course."""
    moves = ["[up]", "[left]", "[down]", "[right]"] * 3
    original = TextArenaGame(ta.make("2048-v0"), seed=1)
    original.step("[up]")
    copied = copy.deepcopy(original)
    played = [original.step(m) for m in moves]
    random.seed(12345)  # something else drew from Python's global generator meanwhile
    other = TextArenaGame(ta.make("2048-v0"), seed=2)
    other.step("[left]")
    assert [copied.step(m) for m in moves] == played
    plain = ta.make("2048-v0")
    plain.reset(num_players=1, seed=1)
    twin = copy.deepcopy(plain)
    for m in moves:
        plain.step(m)
    random.seed(12345)
    for m in moves:
        twin.step(m)
    assert unwrapped(plain).state.game_state != unwrapped(twin).state.game_state  # the control: it does diverge


class FlakyGuess(ta.Env):
    """A single-player game (SinglePlayerState) that fails as a move tells it: raise, a reward that is no number,
    NaN, or a step slower than rollout.env_timeout."""

    def reset(self, num_players, seed=None):
        if seed == -1:
            raise RuntimeError("no board")
        self.state = ta.SinglePlayerState(num_players=num_players, seed=seed, max_turns=5)
        self.state.reset(game_state={}, player_prompt_function=lambda player_id, game_state: "say a word")

    def step(self, action):
        word = re.sub(r"\W", "", action)
        if word == "raise":
            raise ValueError("bad move")
        if word == "slow":
            time.sleep(1)
        if word in ("text", "nan", "slow", "fine"):
            self.state.rewards = {0: {"text": "lots", "nan": float("nan")}.get(word, 1.0)}
            self.state.done = True
        return self.state.step()


ta.envs.registration.register(id="TreerlFlaky-v0", entry_point=FlakyGuess)


@pytest.mark.parametrize(("move", "kind", "reason"), [
    ("raise", "env_raised", "environment raised ValueError: bad move"),
    ("text", "env_not_a_number", "environment returned 'lots', not a number"),
    ("nan", "env_not_finite", "environment returned nan"),
    ("slow", "env_timeout", "environment did not return within 0.2 s (rollout.env_timeout)"),
])
def test_a_failing_game_drops_its_episode_with_its_prompt(tokenizer, scripted, move, kind, reason):
    run = rollout(tokenizer, scripted(lambda prompt, j: move if j == 0 else "fine"), "textarena:TreerlFlaky-v0", {},
                  branch_at=[], env_timeout=0.2)
    batch = run.collect(0)
    assert batch.stats.dropped == {kind: 2} and batch.stats.kept == 2
    assert all(seq.info["reward"] == 1.0 for seq in batch.sequences)  # the other sample of each episode goes on
    first = batch.stats.dropped_samples[0]
    assert first.reason == reason and first.prompt == "say a word" and first.completion == move


def test_a_game_that_fails_to_reset_drops_its_episodes(tokenizer, scripted):
    run = rollout(tokenizer, scripted(lambda prompt, j: "fine"), "textarena:TreerlFlaky-v0", {}, branch_at=[])
    task = run.task.members["textarena:TreerlFlaky-v0"].task
    task.prompts = lambda step, count: [p.__class__(p.id, p.messages, -1) for p in type(task).prompts(task, step, count)]
    batch = run.collect(0)
    assert batch.sequences == [] and batch.stats.dropped == {"env_raised": 4}
    assert batch.stats.dropped_samples[0].reason == "environment reset raised RuntimeError: no board"


@pytest.mark.parametrize(("env", "env_args", "message"), [
    ("textarena:GuessTheNumbr-v0", {}, ("TextArena has no game 'GuessTheNumbr-v0'; its single-player games (each "
                                        "also as -raw and -train): 2048-v0,")),
    ("textarena:Chess-v0", {}, "TextArena 'Chess-v0' is not a single-player game"),
    (GUESS, {"max_num": 3}, ("'max_num' is not an option of textarena:GuessTheNumber-v0 (its options: min_number, "
                             "max_number, max_turns")),
    ("textarena:Klondike-v0", {}, "the game does not start here (SyntaxError"),
])
def test_an_unknown_game_or_argument_is_refused_before_sampling(tokenizer, scripted, env, env_args, message):
    sampler = scripted(lambda prompt, j: "")
    refused_before_sampling(lambda: rollout(tokenizer, sampler, env, env_args), sampler, message)

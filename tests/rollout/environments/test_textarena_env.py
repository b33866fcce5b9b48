"""TextArena (the real package) through rollout.env: single-player games played as multi-turn episodes, branched by
deep copy (with the game's own random state), rewarded by the game's close(); a failing game is dropped and counted,
an unknown id names the games there are."""

from __future__ import annotations

import copy
import itertools
import logging
import random
import re
import socket
import time

import pytest
import textarena as ta
from refusals import refused_before_sampling

from treerl.rollout import Rollout, RolloutConfig
from treerl.rollout.environments.textarena_env import TextArenaGame, unwrapped

GUESS = "textarena:GuessTheNumber-v0"


def rollout(tokenizer, sampler, env=GUESS, env_args=None, **options) -> Rollout:
    settings = {"prompts_per_step": 2, "group_size": 2, "branch_at": [1], "branch_factor": 2, "max_new_tokens": 8,
                "max_context_tokens": 4096, **options}
    env_args = {"max_number": 6, "max_turns": 2} if env_args is None else env_args
    return Rollout(RolloutConfig(env=env, env_args=env_args, **settings), tokenizer, sampler)


def trajectories(batch) -> dict[str, list]:
    """Each trajectory's sequences, turn by turn."""
    out: dict[str, list] = {}
    for seq in batch.sequences:
        out.setdefault(seq.info["trajectory"], []).append(seq)
    return {name: sorted(calls, key=lambda seq: seq.info["turn"]) for name, calls in out.items()}


def played_apart(game_id: str, env_args: dict, seed: int, moves: list[str]) -> tuple[float, dict]:
    """The same game played apart from treerl, move by move: it must end exactly at the last move; its close()."""
    game = ta.make(game_id, **env_args)
    game.reset(num_players=1, seed=seed)
    for k, move in enumerate(moves):
        done, _ = game.step(move)
        assert done == (k == len(moves) - 1), (k, moves)
    rewards, info = game.close()
    return rewards[0], info[0]


def guess_by_turn(prompt: str, j: int) -> str:
    """A guess that depends on the turn (hints seen so far) and the sample: the branches play different games."""
    return f"[{1 + (prompt.count('[GAME]') + 2 * j) % 6}]"


def seed_of(run: Rollout, calls: list) -> int:
    """The seed the episode of these calls was reset with."""
    return next(p.answer.answer for p in run.task.prompts(0, 8) if p.id == calls[0].info["group"])


def test_an_episode_is_the_games_own_play_and_branches_by_copy(tokenizer, scripted):
    run = rollout(tokenizer, scripted(guess_by_turn))
    batch = run.collect(0)
    assert batch.stats.dropped == {} and batch.sequences
    assert len({seq.info["trajectory"].rsplit("/", 1)[0] for seq in batch.sequences if seq.info["turns"] > 1}) >= 2
    for calls in trajectories(batch).values():
        for before, after in itertools.pairwise(calls):  # each call's context extends the one before, token for token
            assert after.tokens[: len(before.tokens)].tolist() == before.tokens.tolist()
        moves = [run.chat.reply_text(seq.tokens[seq.fields["loss_mask"].bool()].tolist()) for seq in calls]
        assert all(re.fullmatch(r"\[[1-6]\]", move) for move in moves)  # the sampled replies, recorded as sampled
        reward, info = played_apart("GuessTheNumber-v0", {"max_number": 6, "max_turns": 2}, seed_of(run, calls), moves)
        assert calls[-1].info["reward"] == reward and not calls[-1].info["truncated"]
        assert all(seq.info["env"] == GUESS for seq in calls)
        assert calls[-1].info["env_metrics"]["turn_count"] == info["turn_count"]


def test_episodes_reach_the_games_own_limit_and_train_on_its_close(tokenizer, scripted):
    """GuessTheNumber with max_turns=2 scores at the third valid guess (TextArena checks its limit before it counts
    the turn), later where an invalid move was forgiven; treerl's bound (unset: the game's) never ends it first."""
    def guesses(prompt: str, j: int) -> str:
        played = prompt.count("[GAME]") + prompt.count("You attempted an invalid move")
        if j == 1 and played == 0:
            return "hello"  # an invalid move, forgiven once: no turn
        return f"[{prompt.count('The target number is') + 1}]"

    env_args = {"min_number": 1, "max_number": 5, "max_turns": 2}
    run = rollout(tokenizer, scripted(guesses), env_args=env_args, prompts_per_step=6, branch_at=[])
    assert run.workflow.max_turns == 6  # (max_turns + 1) replies, each after one forgiven invalid move at most
    batch = run.collect(0)
    assert batch.stats.dropped == {} and batch.stats.kept == 12
    limited = set()  # the replies of the episodes the game's limit ended
    for calls in trajectories(batch).values():
        moves = [run.chat.reply_text(seq.tokens[seq.fields["loss_mask"].bool()].tolist()) for seq in calls]
        reward, info = played_apart("GuessTheNumber-v0", env_args, seed_of(run, calls), moves)
        assert all(seq.info["reward"] == reward for seq in calls)  # what trains is close()'s reward
        if info["reason"].startswith("The turn limit has been reached"):  # scored by closeness, not 0
            assert 0 < reward < 1 and len(moves) - moves.count("hello") == 3
            limited.add(len(moves))
    assert limited == {3, 4}  # the limit reached at reply 3, and at reply 4 after a forgiven invalid move


def test_a_game_whose_limit_lives_only_in_its_state_ends_by_itself(tokenizer, scripted):
    """Bandit's limit is state.max_turns (its constructor calls it num_turns): the choice that ends the game comes at
    reply num_turns + 1, and that reward (1 or the regret) is what trains."""
    env_args = {"num_turns": 2}
    run = rollout(tokenizer, scripted(lambda prompt, j: ["[red]", "[blue]"][j]), "textarena:Bandit-v0", env_args)
    assert run.workflow.max_turns == 6
    batch = run.collect(0)
    assert batch.stats.dropped == {}
    for calls in trajectories(batch).values():
        moves = [run.chat.reply_text(seq.tokens[seq.fields["loss_mask"].bool()].tolist()) for seq in calls]
        assert len(moves) == 3
        reward, _ = played_apart("Bandit-v0", env_args, seed_of(run, calls), moves)
        assert calls[-1].info["reward"] == reward


def test_an_episode_cut_by_treerls_bound_is_dropped_and_named(tokenizer, scripted, caplog):
    """rollout.max_turns below the game's limit: said once at the start, and an episode still running at the bound
    is dropped (env_truncated) with the game's limit in its reason, never trained on 0."""
    with caplog.at_level(logging.WARNING, logger="treerl.rollout"):
        run = rollout(tokenizer, scripted(lambda prompt, j: "[1]" if "higher" not in prompt else "[2]"),
                      env_args={"min_number": 3, "max_number": 5, "max_turns": 2}, max_turns=2, branch_at=[])
    assert any("an episode still running after 2 replies (rollout.max_turns=2) is cut and dropped" in r.message
               and "max_turns=2 in its state" in r.message for r in caplog.records)
    batch = run.collect(0)  # "[1]" is out of range (invalid, forgiven), "[1]" again ends the game: 2 replies, done
    assert batch.stats.kept == 4
    cut = rollout(tokenizer, scripted(lambda prompt, j: "[3]" if "lower" in prompt or "higher" in prompt else "[4]"),
                  env_args={"min_number": 1, "max_number": 5, "max_turns": 2}, max_turns=2, branch_at=[]).collect(0)
    assert cut.stats.dropped["env_truncated"] + cut.stats.kept == 4 and cut.stats.dropped["env_truncated"] > 0
    first = cut.stats.dropped_samples[0]
    assert first.reason == ("environment episode cut at rollout.max_turns=2 replies before it ended (the game's own "
                            "limit: max_turns=2 in its state, checked before the turn counts, 1 invalid move(s) in a "
                            "row forgiven: at most 6 replies)")
    assert first.completion in ("[3]", "[4]") and "Guess The Number" in first.prompt


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
    NaN, or a step slower than rollout.env_timeout. It says its copies are independent (a user's game must)."""

    SUPPORTS_DEEPCOPY = True

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
    ("textarena:Hangman-v0", {}, "the game downloads nltk data (words) when it loads, which is not on this machine"),
])
def test_an_unknown_game_or_argument_is_refused_before_sampling(tokenizer, scripted, env, env_args, message,
                                                                monkeypatch):
    tried = []
    monkeypatch.setattr(socket.socket, "connect", lambda self, address: tried.append(address))
    sampler = scripted(lambda prompt, j: "")
    refused_before_sampling(lambda: rollout(tokenizer, sampler, env, env_args), sampler, message)
    assert tried == []  # nothing reached for the network (Hangman's module downloads nltk data when imported)


class UncopiedFlaky(FlakyGuess):
    SUPPORTS_DEEPCOPY = False


ta.envs.registration.register(id="TreerlUncopiedFlaky-v0", entry_point=UncopiedFlaky)


@pytest.mark.parametrize(("env", "trajectories"), [("textarena:TreerlUncopiedFlaky-v0", 2 * 2),
                                                   ("textarena:TreerlFlaky-v0", 2 * 2 * 2)])
def test_a_users_game_branches_only_where_it_says_it_copies(tokenizer, scripted, caplog, env, trajectories):
    """A game registered by a user, not one of TextArena's own: not branched (each trajectory its own reset, said
    once) unless its class sets SUPPORTS_DEEPCOPY."""
    with caplog.at_level(logging.WARNING, logger="treerl.rollout"):
        run = rollout(tokenizer, scripted(lambda prompt, j: "fine" if "wait" in prompt else "wait"), env, {})
    said = [r.message for r in caplog.records if "branching is off" in r.message]
    line = (f"rollout.env={env!r}: branching is off for it (rollout.branch_at): it is not one of TextArena's own "
            "games and its class does not set SUPPORTS_DEEPCOPY = True (a copy might share what it holds); each "
            "trajectory plays its own reset with the episode's seed")
    assert said == ([line] if "Uncopied" in env else [])
    batch = run.collect(0)
    assert batch.stats.dropped == {} and batch.stats.kept == trajectories

"""OpenEnv environments through treerl's rollout, against the real openenv-core: an Environment written in the tests
(openenv_counting.py) run in process and served by OpenEnv's own create_app + uvicorn, driven by its own client.

Each episode's reward must equal what the environment itself gives for the replies its trajectory made (replayed
here into a fresh instance with the same seed), branches must be played (copied in process, replayed when served),
and what fails (a step that raises, a replay that diverges, a server that goes away) is dropped and counted."""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from recorded import Recording, check_recorded, reply_of
from refusals import refused_before_sampling
from support import child_log, free_port, read_log

from treerl.errors import UserError
from treerl.rollout import Rollout, RolloutConfig
from treerl.rollout.sampling.embedded import EmbeddedSampler

HERE = Path(__file__).resolve().parent
ENV = "openenv:openenv_counting:CountingEnv"
COPYABLE = "openenv:openenv_counting:CopyableCountingEnv"


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def says(prompt_text: str, j: int) -> str:
    """A scripted policy: the number asked for on even samples, a wrong one on odd ones."""
    wanted = re.findall(r"say (\d)", prompt_text)[-1]
    return wanted if j % 2 == 0 else str(int(wanted) % 9 + 1)


def config(env, **overrides) -> RolloutConfig:
    values = {"env": env, "prompts_per_step": 2, "group_size": 2, "branch_at": [1], "branch_factor": 2,
              "max_turns": 3, "max_new_tokens": 4, "seed": 3, "env_timeout": 30}
    return RolloutConfig(**{**values, **overrides})


def trajectories(batch) -> dict[str, list]:
    """Each trajectory's sequences, turn by turn."""
    out = defaultdict(list)
    for seq in batch.sequences:
        out[seq.info["trajectory"]].append(seq)
    return {k: sorted(v, key=lambda s: s.info["turn"]) for k, v in out.items()}


def library_reward(tokenizer, prompt_text: str, seqs) -> float:
    """What the environment itself gives for this trajectory's replies: a fresh CountingEnv reset with the episode's
    number (shown in its prompt), stepped with the replies as the sequences hold them."""
    from openenv_counting import CountingEnv, SayAction

    env = CountingEnv()
    env.target = int(re.findall(r"say (\d)", prompt_text)[0])
    total = 0.0
    for seq in seqs:
        reply = tokenizer.decode(reply_of(seq), skip_special_tokens=True)
        total += env.step(SayAction(message=reply)).reward
    return total


def check_episodes(batch, tokenizer, expected_trajectories: int) -> None:
    """Every trajectory: its calls extend each other token for token, its reward is the environment's own."""
    paths = trajectories(batch)
    assert len(paths) == expected_trajectories, sorted(paths)
    for name, seqs in paths.items():
        for earlier, later in itertools.pairwise(seqs):
            assert later.tokens[: len(earlier.tokens)].tolist() == earlier.tokens.tolist(), name
        prompt = tokenizer.decode(seqs[0].tokens)
        assert seqs[0].info["reward"] == library_reward(tokenizer, prompt, seqs), name
        assert seqs[0].info["env"] == batch.sequences[0].info["env"]


def resets_in(rollout: Rollout) -> int:
    """The environment resets one step's rollout makes."""
    from openenv_counting import CountingEnv

    before = CountingEnv.resets
    rollout.collect(0)
    return CountingEnv.resets - before


@pytest.mark.parametrize(("env", "replayed"), [(COPYABLE, 0), (ENV, 2 * 2)])
def test_in_process_episodes_branch_by_copy_only_where_the_class_says_so(tokenizer, scripted, env, replayed):
    """A class that sets SUPPORTS_DEEPCOPY is copied where an episode branches; one that does not is replayed into a
    fresh instance (a reset more for each second branch), whether or not deepcopy would raise."""
    batch = Rollout(config(env), tokenizer, scripted(says)).collect(0)
    assert not batch.stats.dropped, batch.stats.dropped_samples
    check_episodes(batch, tokenizer, expected_trajectories=2 * 2 * 2)  # prompts x group x branches at turn 1
    rewards = {seq.info["reward"] for seq in batch.sequences}
    assert rewards == {0.0, 1.0, 2.0}, rewards  # right twice, once, never: the scripted replies differ by branch
    assert {seq.info["env_metrics"]["said_right"] for seq in batch.sequences} == {0.0, 1.0}
    # a prompt's reset and each of its group's first steps; then the replays
    assert resets_in(Rollout(config(env), tokenizer, scripted(says))) == 2 * (1 + 2) + replayed


def test_an_instance_that_shares_state_by_path_is_replayed_not_copied(tokenizer, scripted):
    """deepcopy copies the path of its working directory without an error, and a copy would count its steps in the
    original's file: not opted in, the branches are replayed and score as the environment itself does."""
    batch = Rollout(config(ENV, env_args={"workdir": True}), tokenizer, scripted(says)).collect(0)
    assert not batch.stats.dropped, batch.stats.dropped_samples
    check_episodes(batch, tokenizer, expected_trajectories=8)


def test_an_environment_that_ignores_its_seed_plays_its_own_resets(tokenizer, scripted, caplog):
    """Every reset picks another number: each trajectory plays a reset of its own (its first observation its own,
    none dropped as a diverged replay); branching is off for it, said once at the start; where its class says it
    copies, the group shares one reset and branches by copy."""
    unbranched = Rollout(config(ENV, env_args={"ignore_seed": True}, branch_at=[]), tokenizer,
                         scripted(says)).collect(0)
    assert not unbranched.stats.dropped, unbranched.stats.dropped_samples
    check_episodes(unbranched, tokenizer, expected_trajectories=2 * 2)
    with caplog.at_level(logging.WARNING, logger="treerl.rollout"):
        rollout = Rollout(config(ENV, env_args={"ignore_seed": True}, prompts_per_step=4), tokenizer, scripted(says))
    said = (f"rollout.env={ENV!r}: branching is off for it (rollout.branch_at): its reset ignores the seed (two "
            "resets with seed 0 showed different first observations) and it cannot be copied (its class does not set "
            "SUPPORTS_DEEPCOPY = True); each trajectory plays its own reset until done")
    assert [r.message for r in caplog.records if "branching is off" in r.message] == [said]
    batch = rollout.collect(0)
    assert not batch.stats.dropped, batch.stats.dropped_samples
    check_episodes(batch, tokenizer, expected_trajectories=4 * 2)  # no branches
    starts = {seq.info["trajectory"]: re.findall(r"say (\d)", tokenizer.decode(seq.tokens))[0]
              for seq in batch.sequences}
    assert len(set(starts.values())) > 1  # the trajectories start from resets of their own
    copied = Rollout(config(COPYABLE, env_args={"ignore_seed": True}), tokenizer, scripted(says)).collect(0)
    assert not copied.stats.dropped, copied.stats.dropped_samples
    check_episodes(copied, tokenizer, expected_trajectories=2 * 2 * 2)
    for group in {seq.info["group"] for seq in copied.sequences}:  # one reset a group, shared by its trajectories
        assert len({re.findall(r"say (\d)", tokenizer.decode(seq.tokens))[0] for seq in copied.sequences
                    if seq.info["group"] == group}) == 1


def test_the_real_sampler_records_what_it_sampled(tokenizer, policy):
    recording = Recording(EmbeddedSampler(policy))
    batch = Rollout(config(ENV, prompts_per_step=1), tokenizer, recording).collect(0)
    assert not batch.stats.dropped, batch.stats.dropped_samples
    check_episodes(batch, tokenizer, expected_trajectories=4)
    check_recorded(batch, recording)


def test_an_instance_that_cannot_be_copied_is_replayed_and_a_diverging_replay_is_dropped(tokenizer, scripted):
    replayed = Rollout(config(ENV, env_args={"locked": True}), tokenizer, scripted(says)).collect(0)
    assert not replayed.stats.dropped, replayed.stats.dropped_samples
    check_episodes(replayed, tokenizer, expected_trajectories=8)
    drifting = Rollout(config(ENV, env_args={"locked": True, "drift": True}), tokenizer, scripted(says)).collect(0)
    # at each fork the first branch keeps the live instance, the second replays turn 0 into a fresh one and differs
    assert drifting.stats.dropped == {"env_replay_diverged": 4}, drifting.stats.dropped
    assert "replaying turn 0" in drifting.stats.dropped_samples[0].reason
    check_episodes(drifting, tokenizer, expected_trajectories=4)


def test_failures_are_dropped_or_refused_before_sampling(tokenizer, scripted):
    broken = Rollout(config(ENV, env_args={"fail_at": 2}), tokenizer, scripted(says)).collect(0)
    assert broken.stats.dropped == {"env_raised": 8}, broken.stats.dropped  # every branch's second step raised
    assert "the counting environment broke" in broken.stats.dropped_samples[0].reason
    slow = Rollout(config(ENV, prompts_per_step=1, env_args={"slow": 0.6}, env_timeout=0.3), tokenizer,
                   scripted(says)).collect(0)
    assert slow.stats.dropped == {"env_timeout": 2}, slow.stats.dropped
    assert "rollout.env_timeout" in slow.stats.dropped_samples[0].reason
    for env_args, message in [({"colour": 1}, r"env_args \['colour'\] do not fit CountingEnv\(drift, locked"),
                              ({"action_field": "nope"}, None)]:
        if message is None:
            batch = Rollout(config(ENV, env_args=env_args), tokenizer, scripted(says)).collect(0)
            assert batch.stats.dropped == {"env_raised": 4}, batch.stats.dropped  # the action refuses the field
            continue
        with pytest.raises(UserError, match=message):
            Rollout(config(ENV, env_args=env_args), tokenizer, scripted(says))
    with pytest.raises(UserError, match="cannot import 'openenv_counting_missing'"):
        Rollout(config("openenv:openenv_counting_missing:CountingEnv"), tokenizer, scripted(says))
    with pytest.raises(UserError, match="is not an OpenEnv Environment class"):
        Rollout(config("openenv:openenv_counting:SayAction"), tokenizer, scripted(says))
    sampler = scripted(says)
    refused_before_sampling(lambda: Rollout(config("openenv:openenv_counting:NoResetEnv"), tokenizer, sampler),
                            sampler, "NoResetEnv(**env_args).reset(seed=0) raised TypeError: Can't instantiate "
                                     "abstract class NoResetEnv")


@contextlib.contextmanager
def served(cls: str = "CountingEnv"):
    """OpenEnv's own app for `cls` of openenv_counting.py under uvicorn on a free loopback port; stopped by its PID."""
    port = free_port()
    log = child_log()  # not a pipe: OpenEnv's server logs a traceback per client that closes, and would block on it
    process = subprocess.Popen([sys.executable, str(HERE / "openenv_counting.py"), str(port), cls],
                               stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, read_log(log)
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the OpenEnv server did not come up in 90 s"
                time.sleep(0.2)
        yield process, url
    finally:
        process.kill()
        process.wait()
        log.close()


def test_a_served_environment_is_driven_by_its_client_branches_replay_and_a_lost_server_drops_its_episodes(
        tokenizer, scripted):
    with served() as (process, url):
        rollout = Rollout(config(f"openenv+{url}"), tokenizer, scripted(says))
        batch = rollout.collect(0)
        assert not batch.stats.dropped, batch.stats.dropped_samples
        check_episodes(batch, tokenizer, expected_trajectories=8)  # the branches at turn 1 replayed turn 0
        assert {seq.info["reward"] for seq in batch.sequences} == {0.0, 1.0, 2.0}
        with pytest.raises(UserError, match=r"env_args colour are not for a served environment"):
            Rollout(config(f"openenv+{url}", env_args={"colour": 1}), tokenizer, scripted(says))
        process.kill()
        process.wait()
        lost = rollout.collect(1)
    assert lost.sequences == [] and sum(lost.stats.dropped.values()) == 2 * 2, lost.stats.dropped
    assert set(lost.stats.dropped) == {"env_raised"}, lost.stats.dropped
    assert "reset" in lost.stats.dropped_samples[0].reason
    with pytest.raises(UserError, match="cannot read the server's action schema"):
        Rollout(config(f"openenv+{url}"), tokenizer, scripted(says))


def test_a_served_environment_that_ignores_its_seed_plays_its_own_resets(tokenizer, scripted):
    with served("UnseededCountingEnv") as (_, url):
        batch = Rollout(config(f"openenv+{url}", branch_at=[]), tokenizer, scripted(says)).collect(0)
    assert not batch.stats.dropped, batch.stats.dropped_samples
    check_episodes(batch, tokenizer, expected_trajectories=2 * 2)

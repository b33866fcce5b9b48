"""verifiers 0.4 environments (verifiers.v1) through treerl's recording proxy, against the real package in its own
venv (tools/verifiers-venv.sh, built when missing: never skipped): tasksets written here (vf_spelling: single-turn
with a rubric of weighted rewards and a metric; vf_counting: multi-turn, an Env answering each reply), each episode
played by verifiers' own loop (its `null` chat program, its interception server) and scored by verifiers."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections import defaultdict
from pathlib import Path

import pytest
from recorded import Recording, check_recorded, reply_of
from refusals import refused_before_sampling
from vf_scoring import brief, correct, counted, spelled

from treerl.rollout import Rollout, RolloutConfig
from treerl.rollout.sampling.embedded import EmbeddedSampler
from treerl.rollout.workflows.stats import environment_metrics

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
FAILING = {"river": "RAISE", "stone": "NAN", "cloud": "SLEEP"}  # vf_spelling's rubric fails on these replies


@pytest.fixture(scope="module")
def python():
    """The verifiers venv's python, built by the project's script (CI starts it in the background)."""
    done = subprocess.run([str(ROOT / "tools" / "verifiers-venv.sh")], check=False, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    """The tasksets of this folder are environment ids to the worker (it imports from PYTHONPATH)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))


def collect(tokenizer, sampler, env: str, python: str, **overrides):
    values = {"env": env, "env_args": {"python": python}, "prompts_per_step": 1, "group_size": 2, "seed": 1,
              "max_new_tokens": 12, "env_timeout": 10}
    env_args = {**values["env_args"], **overrides.pop("env_args", {})}
    rollout = Rollout(RolloutConfig(**{**values, **overrides, "env_args": env_args}), tokenizer, sampler)
    try:
        return rollout.collect(0)
    finally:
        rollout.task.members[env].task.close()
        rollout.close()


def text_of(tokenizer, seq) -> str:
    """The reply as the proxy returned it (its stop token left out), stripped as verifiers reads it."""
    return tokenizer.decode(reply_of(seq), skip_special_tokens=True).strip()


def two_calls(batch, recording, episodes: int) -> dict:
    """Each episode's two model calls (first, second), checked: nothing dropped, the trained replies are what was
    sampled, and the second call extends the first token for token (one family in the tree)."""
    assert not batch.stats.dropped, batch.stats.dropped_samples
    check_recorded(batch, recording)
    calls = defaultdict(list)
    for seq in batch.sequences:
        calls[seq.info["trajectory"]].append(seq)
    assert len(calls) == episodes
    out = {name: tuple(sorted(each, key=lambda s: s.info["turn"])) for name, each in calls.items()}
    for name, (first, second) in out.items():
        assert second.tokens[: len(first.tokens)].tolist() == first.tokens.tolist(), name
    return out


def test_a_rubric_scores_what_was_sampled_and_its_failures_drop_their_episodes(tokenizer, scripted, python):
    def speller(prompt: str, j: int) -> str:
        word = re.findall(r"Write the word (\w+)", prompt)[-1]
        return FAILING.get(word, word if word == "apple" else f"surely it is {word}")

    recording = Recording(scripted(speller))
    batch = collect(tokenizer, recording, "verifiers:vf_spelling", python, prompts_per_step=5, env_timeout=8,
                    max_new_tokens=40, eval_fraction=0)  # all five words, each once
    check_recorded(batch, recording)
    for seq in batch.sequences:  # apple and grass, two episodes each
        reply = text_of(tokenizer, seq)
        answer = re.findall(r"Write the word (\w+)", tokenizer.decode(seq.tokens))[-1]
        assert seq.info["reward"] == correct(reply, answer) + 0.5 * brief(reply), seq.name  # verifiers' weights
        assert seq.info["env_metrics"] == {"reward/correct": correct(reply, answer),
                                           "reward/brief": 0.5 * brief(reply), "length": len(reply)}, seq.name
    assert sorted(seq.info["reward"] for seq in batch.sequences) == [1.0, 1.0, 1.5, 1.5]
    assert dict(batch.stats.dropped) == {"env_raised": 2, "env_not_finite": 2, "env_timeout": 2}
    reasons = " ".join(d.reason for d in batch.stats.dropped_samples)
    assert "the rubric broke" in reasons and "scoring_timeout" in reasons and "Write the word river." in str(
        batch.stats.dropped_samples)
    logged = environment_metrics(batch.sequences)
    assert logged["env/verifiers:vf_spelling/reward/correct"] == 1.0
    assert logged["env/verifiers:vf_spelling/samples"] == 4.0


def test_a_multi_turn_environment_continues_token_for_token_with_the_real_sampler(tokenizer, policy, python):
    recording = Recording(EmbeddedSampler(policy))
    batch = collect(tokenizer, recording, "verifiers:vf_counting", python, env_args={"rounds": 2})
    for name, (first, second) in two_calls(batch, recording, episodes=2).items():
        assert "Now say 2." in tokenizer.decode(second.tokens[len(first.tokens):]), name  # the env's next turn
        replies = [text_of(tokenizer, first), text_of(tokenizer, second)]
        assert first.info["reward"] == counted(replies), name
        assert first.info["env_metrics"] == {"reward/counted": counted(replies), "rounds": 2.0}, name


def test_a_tool_environment_serves_its_toolset_and_a_lost_worker_drops_its_episodes(tokenizer, scripted, python):
    def caller(prompt: str, j: int) -> str:
        """Calls the speller tool, then echoes its answer for cat and not for dog."""
        word = re.findall(r"Spell (\w+)", prompt)[-1]
        if "<tool>" not in prompt:
            return f'<tool_call>{{"name": "speller_spell", "arguments": {{"word": "{word}"}}}}</tool_call>'
        return f"It is {spelled(word)}" if word == "cat" else "done"

    recording = Recording(scripted(caller))
    config = RolloutConfig(env="verifiers:vf_speller", env_args={"python": python}, prompts_per_step=2, group_size=1,
                           max_new_tokens=80, env_timeout=10, episode_timeout=60)
    rollout = Rollout(config, tokenizer, recording)
    try:
        batch = rollout.collect(0)
        worker = rollout.task.members["verifiers:vf_speller"].task.worker
        threading.Timer(1.0, worker.process.kill).start()  # dies while its episodes start their tool servers
        lost = rollout.collect(1)
        after = rollout.collect(2)  # the run goes on: later episodes are dropped at once
    finally:
        rollout.close()
    for dropped in (lost, after):
        assert dict(dropped.stats.dropped) == {"env_raised": 2} and not dropped.sequences
        assert all("the verifiers worker exited" in d.reason for d in dropped.stats.dropped_samples)
    for name, (first, second) in two_calls(batch, recording, episodes=2).items():
        word = re.findall(r"Spell (\w+)", tokenizer.decode(first.tokens))[-1]
        assert '"name": "speller_spell"' in tokenizer.decode(first.tokens), name  # the toolset's schema, rendered
        assert f"<tool>{spelled(word)}<eos>" in tokenizer.decode(second.tokens[len(first.tokens):]), name
        reward = 1.0 if spelled(word) in text_of(tokenizer, second) else 0.0
        assert first.info["reward"] == reward == (word == "cat"), name
        assert first.info["env_metrics"] == {"reward/spelled": reward, "tool_calls": 1.0}, name


def test_a_bad_setup_is_refused_in_one_line_before_sampling(tokenizer, scripted, python, tmp_path):
    sampler = scripted(lambda prompt, j: "apple")
    for env, env_args, message in [
        ("verifiers:no_such_taskset", {}, "no verifiers taskset 'no_such_taskset': verifiers ships harbor, nemo_gym"),
        ("verifiers:vf_spelling", {"colour": 1}, "env_args key 'colour' is neither the taskset's (count, id"),
        ("verifiers:vf_spelling", {"python": str(tmp_path / "python")}, "no verifiers here: run tools/verifiers-venv"),
    ]:
        config = RolloutConfig(env=env, env_args={"python": python, **env_args})
        refused_before_sampling(lambda config=config: Rollout(config, tokenizer, sampler), sampler, message)

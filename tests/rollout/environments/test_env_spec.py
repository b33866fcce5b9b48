"""rollout.env's naming layer: specs parsed and refused in one line, several environments mixed by weight, the
per-environment metrics channel, and a missing library named by its extra. Built-in tasks stand in for the
libraries here (their adapters have tests of their own)."""

from __future__ import annotations

from collections import Counter

import pytest

from treerl.errors import UserError
from treerl.rollout import SamplingParams, SingleTurnWorkflow
from treerl.rollout.environments import EnvSpec, Member, Routed, import_library, parse_env_specs
from treerl.rollout.environments.mixture import MultiTurnMixture, SingleTurnMixture, mixture
from treerl.rollout.rewards.functions import Scored
from treerl.rollout.tasks import Arithmetic, GuessNumber
from treerl.rollout.workflows.stats import RolloutStats, environment_metrics
from treerl.trainer.core.config import ConfigError, load_config
from treerl.trainer.core.metrics import summarise_environments


def test_specs_as_a_user_writes_them():
    legs, served = parse_env_specs(["reasoning-gym:leg_counting@2", {"env": "openenv+http://127.0.0.1:8000/",
                                                                     "env_args": {"b": 2}}], {"a": 1, "b": 1})
    assert legs == EnvSpec("reasoning_gym", "leg_counting", 2.0, {"a": 1, "b": 1}, "reasoning_gym:leg_counting")
    assert served == EnvSpec("openenv", "http://127.0.0.1:8000/", 1.0, {"a": 1, "b": 2}, "openenv+127.0.0.1:8000")
    module = parse_env_specs("openenv:my_pkg.env:MyEnv")[0]  # the target keeps its own colon
    assert (module.target, module.module, module.extra) == ("my_pkg.env:MyEnv", "openenv_env", "openenv")
    assert parse_env_specs([{"env": "textarena:X-v0", "name": "a/b"}])[0].name == "a_b"  # no '/' in a metric name


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.env=gym:CartPole"], "unknown environment library 'gym'; known: reasoning_gym, textarena"),
    (["rollout.env=leg_counting"], "expected 'library:name'"),
    (["rollout.env=[]"], "rollout.env is an empty list"),
    (["rollout.env=reasoning_gym:a@0"], "its weight 0 must be a finite number > 0"),
    (["rollout.env=[{env: reasoning_gym:a, wieght: 2}]"], "rollout.env[0]: unknown key 'wieght'"),
    (["rollout.env=[reasoning_gym:a,reasoning_gym:a]"], "names 'reasoning_gym:a' twice"),
    (["rollout.env=5"], "rollout.env=5 must be a string"),
    (["rollout.task=env"], "rollout.task=env needs rollout.env"),
    (["rollout.env_args={a: 1}"], "rollout.env_args is set but rollout.env is not"),
    (["rollout.env=reasoning_gym:a", "rollout.task=guess_number"], "both say what to train on"),
    (["rollout.env_timeout=0"], "rollout.env_timeout=0.0 must be > 0"),
    (["rollout.env=reasoning_gym:a", "trainer.mode=async", "rollout.env_timeout=1000", "algo.advantage=group"],
     "rollout.env_timeout=1000.0 must be < trainer.worker_timeout"),
])
def test_bad_specs_are_refused_at_the_config_check(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_env_makes_the_task_env():
    config = load_config(None, ["rollout.env=textarena:GuessTheNumber-v0", "rollout.env_args={a: 1}"])
    assert (config.rollout.task, config.rollout.env_args) == ("env", {"a": 1})


def test_a_missing_library_names_its_extra():
    with pytest.raises(UserError, match=r"needs the no_such_library package: pip install 'treerl\[some-extra\]'"):
        import_library("no_such_library", "some-extra", "x:y")


def members(*weights: float) -> list[Member]:
    return [Member(EnvSpec("reasoning_gym", f"t{k}", w, {}, f"env{k}"), Arithmetic(max_operand=k + 1, seed=k))
            for k, w in enumerate(weights)]


def test_a_mixture_draws_by_weight_keeps_each_stream_and_routes_the_reward():
    task = mixture(members(3.0, 1.0))
    assert isinstance(task, SingleTurnMixture) and task.max_new_tokens == Arithmetic(max_operand=2).max_new_tokens
    prompts = task.prompts(5, 400)
    assert prompts == task.prompts(5, 400)  # the same for the same step (exact resume)
    counts = Counter(p.env for p in prompts)
    assert 260 < counts["env0"] < 340 and counts["env0"] + counts["env1"] == 400
    for name, k in (("env0", 0), ("env1", 1)):  # each environment's own prompts, in its own order
        own = Arithmetic(max_operand=k + 1, seed=k).prompts(5, 400)[: counts[name]]
        mine = [p for p in prompts if p.env == name]
        assert [p.messages for p in mine] == [p.messages for p in own]
        assert [p.answer for p in mine] == [Routed(name, p.answer) for p in own]
    assert len({p.id for p in prompts}) == 400
    first = prompts[0]
    assert task.reward_fn(prompt=first.text, completion=str(first.answer.answer), answer=first.answer) == 1.0


def test_a_mixture_of_kinds_is_refused_and_multi_turn_routes_its_environment():
    guess = Member(EnvSpec("textarena", "g", 1.0, {}, "guess"), GuessNumber(max_number=5, max_turns=3))
    with pytest.raises(UserError, match=r"mixes environments of different kinds: env0 \(single_turn\), guess "
                                        r"\(multi_turn\)"):
        mixture([*members(1.0), guess])
    task = mixture([guess])
    assert isinstance(task, MultiTurnMixture) and task.max_turns == 3
    prompt = task.prompts(0, 1)[0]
    assert task.environment(prompt).secret == prompt.answer.answer


def test_samples_carry_their_environment_and_its_metrics(chat, scripted):
    def scored(prompt, completion, answer):
        return Scored(float(completion == str(answer)), {"length": len(completion)})

    task = mixture(members(1.0, 1.0))
    for member in task.members.values():
        member.task.reward_fn = scored
    workflow = SingleTurnWorkflow(task, chat, SamplingParams(n=2, max_new_tokens=4, stop_token_ids=(2,)))
    sequences = workflow.run(scripted(lambda prompt, j: ["2", "10"][j]), task.prompts(0, 6), RolloutStats())
    assert {seq.info["env"] for seq in sequences} == {"env0", "env1"}
    assert all(seq.info["env_metrics"] == {"length": len(["2", "10"][int(seq.name[-1])])} for seq in sequences)
    metrics = environment_metrics(sequences)
    for env in ("env0", "env1"):
        mine = [seq.info["reward"] for seq in sequences if seq.info["env"] == env]
        assert metrics[f"env/{env}/reward_mean"] == pytest.approx(sum(mine) / len(mine))
        assert metrics[f"env/{env}/samples"] == len(mine) and metrics[f"env/{env}/length"] == 1.5
    summary = summarise_environments([metrics, metrics], {"start": {"env/env0/reward_mean": 0.25}})
    assert summary["env0"]["samples"] == 2 * metrics["env/env0/samples"]
    assert summary["env0"]["eval_reward_start"] == 0.25 and summary["env1"]["length"] == 1.5


def test_a_metric_that_is_not_a_number_drops_the_sample(chat, scripted):
    task = mixture(members(1.0))
    task.members["env0"].task.reward_fn = lambda prompt, completion, answer: Scored(1.0, {"x": float("nan")})
    workflow = SingleTurnWorkflow(task, chat, SamplingParams(n=1, max_new_tokens=4, stop_token_ids=(2,)),
                                  drop_prefix="env")
    stats = RolloutStats()
    assert workflow.run(scripted(lambda prompt, j: "1"), task.prompts(0, 2), stats) == []
    assert stats.dropped == {"env_not_finite": 2}
    assert stats.dropped_samples[0].reason == "environment metric 'x' returned nan"

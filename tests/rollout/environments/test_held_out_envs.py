"""Held-out evaluation for every environment library, against the real libraries: evaluation's items (reasoning-gym's
questions, TextArena's and OpenEnv's episode seeds, TRL's rows, verifiers' tasks) are never among training's, are the
same for the same config, and a held-out episode plays."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_held_out import EVALUATED, STEPS, assert_held_out
from test_verifiers_env import python  # noqa: F401 (the verifiers venv's interpreter, a fixture)

from treerl.errors import UserError
from treerl.rollout import Rollout, RolloutConfig
from treerl.rollout.environments import build_environments
from treerl.rollout.tasks.heldout import HELD_OUT_SEED

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))


def built(**options):
    return lambda: build_environments(RolloutConfig(**options))


def test_reasoning_gym_evaluates_on_questions_no_training_item_asks():
    """A small item space (one animal, one or two of it: questions repeat across seeds): evaluation's items come from
    the seeds after training's, less those asking a training question, which it counts."""
    make = built(env="reasoning_gym:leg_counting", env_args={"min_animals": 1, "max_animals": 1, "max_instances": 2,
                                                              "size": 30})
    assert_held_out(make, lambda p: p.answer.answer["question"])
    task = make()
    task.held_out_prompts(EVALUATED)
    held = task.held_out
    assert held.held_out and "items of seeds 30 on (training's: 0 to 29)" in held.how
    assert "skipped: a training item asks their question" in held.how  # the small space repeats questions
    everything = built(env="reasoning_gym:leg_counting", env_args={"min_animals": 1, "max_animals": 1,
                                                                   "max_instances": 1})()
    with pytest.raises(UserError, match=r"only \d+ of 256 held-out items ask a question none of the 500 training "
                                        r"items asks; its item space is too small for trainer.eval_prompts=48"):
        everything.held_out_prompts(EVALUATED)


def test_textarena_and_openenv_evaluate_on_seeds_training_never_uses(tokenizer, scripted):
    seed_of = lambda p: getattr(p.answer.answer, "seed", p.answer.answer)
    for make in (built(env="textarena:GuessTheNumber-v0", env_args={"max_number": 6, "max_turns": 2}),
                 built(env="openenv:openenv_counting:CountingEnv")):
        held = assert_held_out(make, seed_of, steps=4)  # seeds: any two draws differ, a few steps show the ranges
        task = make()
        assert min(held) >= HELD_OUT_SEED > max(seed_of(p) for s in range(STEPS) for p in task.prompts(s, 1))
        assert f"seeds >= {HELD_OUT_SEED}" in task.held_out.how
    evaluation = Rollout(RolloutConfig(env="textarena:GuessTheNumber-v0", env_args={"max_number": 6, "max_turns": 2},
                                       prompts_per_step=2, group_size=2, max_new_tokens=8), tokenizer,
                         scripted(lambda prompt, j: f"[{j + 1}]"), held_out=True)
    batch = evaluation.collect(10**9)  # held-out games reset with their seeds and play to the game's end
    assert batch.stats.kept == 8 and not batch.stats.dropped and all(s.info["group"].startswith("eval/") for s in batch.sequences)


def test_trl_rows_and_a_mixture_hold_out_rows_of_their_own():
    rows = [{"prompt": "Open the vault.", "code": k} for k in range(20)]
    make = built(env="trl:trl_vault:Vault", env_args={"rows": rows})
    assert len(assert_held_out(make, lambda p: p.answer.answer["code"])) == 2
    mixed = built(env=["trl:trl_vault:Vault@2", {"env": "trl:trl_vault:Vault", "name": "other"}],
                  env_args={"rows": rows}, seed=4)
    prompts = mixed().held_out_prompts(EVALUATED)
    assert {p.env for p in prompts} == {"trl:trl_vault:Vault", "other"}
    assert_held_out(mixed, lambda p: (p.env, p.answer.answer["code"]))
    assert not built(env="trl:trl_vault:Vault")().held_out.held_out  # one empty row: nothing to hold out, said


@pytest.mark.slow  # ~20 s: three verifiers workers start
def test_verifiers_tasks_held_out(python):  # noqa: F811
    make = built(env="verifiers:vf_spelling", env_args={"python": python})
    tasks = []
    try:
        held = assert_held_out(lambda: tasks.append(make()) or tasks[-1], lambda p: p.text)
    finally:
        for task in tasks:
            task.members["verifiers:vf_spelling"].task.close()
    assert len(held) == 1 and tasks[0].held_out.of == 5  # one of its five words

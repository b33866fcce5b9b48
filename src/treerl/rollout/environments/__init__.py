"""Environments as the ecosystem writes them: `rollout.env=library:name` builds a task from that library.

Step 1 (docs/architecture.md): prompts, rewards and episodes from reasoning-gym, TextArena, OpenEnv, TRL's
environment_factory and verifiers (docs/environments.md).

The contract every adapter keeps (parts A and B of issue 46 build on it):

- Naming (`spec.py`): `rollout.env` is "library:target" ("reasoning_gym:leg_counting", "textarena:GuessTheNumber-v0",
  "openenv:my_pkg.my_env:MyEnvironment", "trl:my_pkg.mod:MyEnvClass", "verifiers:ENV_ID"), "library+URL" for a
  running server ("openenv+http://127.0.0.1:8000": library "openenv", target "http://127.0.0.1:8000"), "spec@weight",
  a mapping {env, weight, env_args, name}, or a list of these, mixed by weight. `rollout.env_args` (a mapping) goes to
  every environment's constructor (an entry's own env_args win key by key); `rollout.env_timeout` (seconds) bounds
  each reset, step and score call. Setting `rollout.env` makes the task `env` (`rollout.task` must be left out or set
  to `env`; rollout.data_path and rollout.reward_fn are refused beside it but for a TRL class, which reads them);
  `rollout.system_prompt` is the system message where the library has none of its own.
  The syntax is checked at the config check (`parse_env_specs`, a ValueError naming the
  key); the target and env_args when the rollout is built, before any sampling.
- Adapters: module `<library>_env.py` beside this file (LIBRARIES in `spec.py`: reasoning_gym_env, textarena_env,
  openenv_env, trl_env, verifiers_env), each with

      def build(target: str, env_args: dict[str, Any], config: RolloutConfig) -> task

  returning a task of a kind treerl trains (`treerl.rollout.tasks.base`): single-turn (`prompts(step, count)`,
  `reward_fn(prompt=, completion=, answer=)`, `max_new_tokens`), multi-turn (`prompts`, `environment(prompt)` ->
  an `Environment` whose `step(reply)` returns an `EnvReply`, and whose optional `opening` messages (what it says at
  reset) follow the prompt's; deep-copied where an episode branches, or branched by `replay.py`'s wrapper;
  `max_turns`, `max_new_tokens`), or an agent driven through the recording proxy (`prompts`,
  `agent`: an `async def episode(client, task)` or its "module:function"; `max_turns`, `max_new_tokens`). An unknown
  target or a bad env_args key is a UserError of one line naming what exists. Import the library with
  `extras.import_library(module, extra, spec)`: a missing one is one line naming the pip extra.
- Metrics channel: a reward function may return `treerl.rollout.rewards.Scored(reward, metrics)`, an `EnvReply`
  carries `metrics` (the trajectory keeps each name's latest value), an agent episode may return {"reward": r,
  "metrics": {...}}. Every sample's sequences carry info["env"] (the environment's name, `EnvSpec.name`) and
  info["env_metrics"]; the trainer logs env/<name>/reward_mean, env/<name>/samples and env/<name>/<metric> per step
  (`treerl.rollout.workflows.stats.environment_metrics`; metrics.jsonl, TensorBoard, summary.json's "environments").
- Failures: a reset, step or score that raises, times out (rollout.env_timeout) or gives a reward or metric that is
  not a finite number drops that episode or sample, counted as rollout/dropped_env_<kind> (env_raised, env_timeout,
  env_not_a_number, env_not_finite, env_too_large) and reported with its prompt (dropped.jsonl).
- Episode ends and limits are the library's (docs/environments.md): an episode a bound of treerl's cuts first
  (rollout.max_turns, rollout.max_context_tokens) is dropped as env_truncated, its reason naming the library's limit
  (an Environment's optional `limit`), never trained on the reward it had so far.
- Branching: an Environment is deep-copied only where the library's class says copies are independent
  (`replay.COPY_OPT_IN`) or the project checked it; one whose `copies` is false is never forked (each trajectory gets
  its own from `environment(prompt)`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from treerl.errors import UserError
from treerl.rollout.environments.extras import import_library
from treerl.rollout.environments.mixture import Member, Mixture, Routed, mixture, task_kind
from treerl.rollout.environments.spec import LIBRARIES, EnvSpec, parse_env_specs

if TYPE_CHECKING:
    from treerl.rollout.config import RolloutConfig


def build_environments(config: RolloutConfig) -> Mixture:
    """The task of `rollout.env`: every environment built by its library's adapter, mixed by weight (one as well)."""
    specs = parse_env_specs(config.env, config.env_args)
    members = [Member(spec, build_one(spec, config)) for spec in specs]
    return mixture(members, seed=config.seed)


def build_one(spec: EnvSpec, config: RolloutConfig) -> Any:
    """One environment's task, built by its library's adapter module."""
    try:
        adapter = importlib.import_module(f"treerl.rollout.environments.{spec.module}")
    except ModuleNotFoundError as e:
        if e.name != f"treerl.rollout.environments.{spec.module}":
            raise
        raise UserError(f"rollout.env: this treerl has no adapter for {spec.library} environments yet") from None
    return adapter.build(spec.target, dict(spec.env_args), config)


__all__ = ["LIBRARIES", "EnvSpec", "Member", "Mixture", "Routed", "build_environments", "import_library",
           "parse_env_specs", "task_kind"]

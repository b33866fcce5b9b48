"""TRL's `environment_factory` contract: `trl:my_pkg.my_env:MyEnv`, played as a tool-calling episode through the proxy.

Step 1 (docs/architecture.md): the episodes of an environment class written for TRL's GRPOTrainer.

TRL 1.x (`GRPOTrainer(environment_factory=MyEnv)`, PR #5093) takes a class whose instances have `reset(**row)`
(returning None or text), public methods that become the model's tools (their JSON schemas from type hints and
docstrings, transformers' `get_json_schema`), and optionally `get_reward()`, which scores the finished episode. treerl
plays it the way TRL's trainer does, with the model behind treerl's recording proxy:

- one instance per episode (env_args go to its constructor); `reset(**row)` with the task's row: a JSONL row of
  rollout.data_path, an item of env_args.rows, or {} when neither is given (the environment owns its data);
- the prompt is the row's `prompt` (text or chat messages; none: an empty user message) with reset's text appended
  to its last user message, and rollout.system_prompt before it if set;
- each model call offers the tools; the calls it makes are parsed in the model's tool-call format (rollout.
  tool_parser) and run, their results shown as tool messages (a tool that raises, an unknown tool or arguments
  that are not JSON answer {"error": ...}, as in TRL); a reply without a tool call ends the episode, as does
  rollout.max_turns model calls (TRL's max_tool_calling_iterations);
- the reward is `get_reward()` (required: treerl has no other reward for it); async methods are awaited.

An instance lives in this process and its episode is one conversation through the proxy: it is not branched (the
group_size episodes of a row each have their own instance). reset, each tool and get_reward run with
rollout.env_timeout each; an episode whose reset or get_reward raises or times out is dropped (env_raised,
env_timeout), and a reward that is not a finite number too (env_not_a_number ...).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from dataclasses import dataclass
from typing import Any

from treerl.errors import UserError
from treerl.rollout.config import RolloutConfig
from treerl.rollout.rewards import NamedFailure, check_reward, import_object
from treerl.rollout.tasks.base import Prompt
from treerl.rollout.tasks.dataset import DatasetTask, load_agent_tasks

OWN_KEYS = ("rows",)  # treerl's; the other env_args go to the class's constructor
MAX_TURNS = 4
MAX_NEW_TOKENS = 128


class EnvCallFailed(NamedFailure):
    """An environment's reset, tool or get_reward that raised or ran out of time: its episode is dropped."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class TrlEnvironmentTask:
    """Episodes of a TRL environment class, one instance each, driven through the recording proxy."""

    name: str
    cls: type
    kwargs: dict[str, Any]
    tools: list[dict[str, Any]]  # the public methods' JSON schemas
    rows: DatasetTask  # the rows, in a seeded order epoch after epoch; each prompt's answer is its row
    system_prompt: str | None = None
    timeout: float | None = 60.0  # rollout.env_timeout, per reset, tool and get_reward call
    max_turns: int = MAX_TURNS
    max_new_tokens: int = MAX_NEW_TOKENS

    def prompts(self, step: int, count: int) -> list[Prompt]:
        """Rows step*count ... of the seeded endless stream of rows (a DatasetTask's order); each answer is its row."""
        return self.rows.prompts(step, count)

    async def agent(self, client: Any, row: dict[str, Any]) -> float:
        """One episode as TRL plays it: reset(**row), tool calls until a reply has none, then get_reward()."""
        env = await self.call(self.cls, "the constructor", **self.kwargs)
        observation = await self.call(env.reset, "reset", **row)
        messages = first_messages(row, observation, self.system_prompt)
        methods = {tool["function"]["name"]: getattr(env, tool["function"]["name"]) for tool in self.tools}
        for _ in range(self.max_turns):
            response = await client.chat.completions.create(model="policy", messages=messages, tools=self.tools)
            reply = response.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                result = await self.tool_result(methods, call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                 "content": result})
        reward = await self.call(env.get_reward, "get_reward")
        checked = check_reward(reward)
        if not isinstance(checked, float):
            raise EnvCallFailed(f"get_reward() {checked.message}", f"env_{checked.kind}")
        return checked

    async def tool_result(self, methods: dict[str, Any], name: str, arguments: str) -> str:
        """What a tool call answers: the method's result as text, or {"error": ...} as TRL shows a failed call."""
        try:
            if name not in methods:
                raise ValueError(f"Tool {name} not found.")
            parsed = json.loads(arguments or "{}")
            if not isinstance(parsed, dict):
                raise TypeError(f"arguments {arguments!r} are not a JSON object")
            result = await self.call(methods[name], f"tool {name}", **parsed)
        except EnvCallFailed:  # out of time: the episode ends (dropped)
            raise
        except Exception as e:  # noqa: BLE001 (the model's call failed: the model sees why, as in TRL)
            result = {"error": str(e)}
        return result if isinstance(result, str) else str(result)

    async def call(self, fn: Any, what: str, *args: Any, **kwargs: Any) -> Any:
        """`fn(...)` off the event loop (awaited if it is async), within rollout.env_timeout; its failure, named."""
        try:
            if inspect.iscoroutinefunction(fn):
                return await asyncio.wait_for(fn(*args, **kwargs), self.timeout)
            return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kwargs), self.timeout)
        except TimeoutError:
            raise EnvCallFailed(f"{what} did not return within {self.timeout:g} s (rollout.env_timeout)",
                                "env_timeout") from None
        except EnvCallFailed:
            raise
        except Exception as e:
            if what.startswith("tool "):
                raise
            raise EnvCallFailed(f"{what} raised {type(e).__name__}: {e}", "env_raised") from None


def first_messages(row: dict[str, Any], observation: Any, system_prompt: str | None) -> list[dict[str, Any]]:
    """The episode's prompt: the row's prompt with reset's text appended to its last user message (TRL's rule)."""
    prompt = row.get("prompt")
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
                [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": ""}])
    if isinstance(observation, str):
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def tool_schemas(cls: type, spec: str) -> list[dict[str, Any]]:
    """The JSON schema of each public method but reset and get_reward, as TRL lists them (from the class)."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, method in inspect.getmembers(cls, predicate=inspect.isfunction):
        if name in ("reset", "get_reward") or name.startswith("_"):
            continue
        try:
            schema = get_json_schema(method)
        except Exception as e:  # noqa: BLE001 (transformers' docstring parser: one line naming the method)
            raise UserError(f"rollout.env={spec!r}: the tool {cls.__name__}.{name} has no schema transformers can "
                            f"read ({type(e).__name__}: {e}); give it type hints and a docstring with Args:") from None
        schema["function"]["parameters"]["properties"].pop("self", None)
        schema["function"]["parameters"]["required"] = [
            r for r in schema["function"]["parameters"].get("required", []) if r != "self"]
        schemas.append(schema)
    return schemas


def build(target: str, env_args: dict[str, Any], config: RolloutConfig) -> TrlEnvironmentTask:
    """The task of `trl:module:Class`: the class, its tools and rows checked now, before any sampling."""
    spec = f"trl:{target}"
    cls = import_object(target, f"rollout.env={spec!r}: the environment class", "my_pkg.my_env:MyEnv")
    if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)):
        raise UserError(f"rollout.env={spec!r}: {target} is not an environment class with a reset method (TRL's "
                        "environment_factory contract)")
    if not callable(getattr(cls, "get_reward", None)):
        raise UserError(f"rollout.env={spec!r}: {cls.__name__} has no get_reward(); treerl takes the reward from it")
    own = {key: env_args.pop(key) for key in OWN_KEYS if key in env_args}
    try:
        inspect.signature(cls).bind(**env_args)
    except TypeError as e:
        raise UserError(f"rollout.env={spec!r}: env_args {sorted(env_args)} do not fit {cls.__name__}"
                        f"{inspect.signature(cls)} ({e}); treerl's own keys: {', '.join(OWN_KEYS)}") from None
    rows = task_rows(own.get("rows"), config, spec)
    shown = [([{"role": "user", "content": row["prompt"] if isinstance(row.get("prompt"), str)
                else json.dumps(row, default=str)[:500]}], row) for row in rows]  # shown in reports only
    return TrlEnvironmentTask(spec, cls, env_args, tool_schemas(cls, spec),
                              DatasetTask(shown, None, seed=config.seed, shuffle=config.shuffle, name=spec),  # type: ignore[arg-type]
                              config.system_prompt, config.env_timeout)


def task_rows(rows: Any, config: RolloutConfig, spec: str) -> list[dict[str, Any]]:
    """The rows reset(**row) is called with: env_args.rows, else rollout.data_path's, else one empty row."""
    if rows is not None and config.data_path:
        raise UserError(f"rollout.env={spec!r}: both env_args.rows and rollout.data_path give rows: set one")
    if config.data_path:
        return [answer for _, answer in load_agent_tasks(config.data_path).prompts_data]
    if rows is None:
        return [{}]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"rollout.env={spec!r}: env_args.rows must be a non-empty list of mappings (one reset(**row) "
                        "each)")
    return [dict(r) for r in rows]

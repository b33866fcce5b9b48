"""TRL's `environment_factory` contract: `trl:my_pkg.my_env:MyEnv`, played as a tool-calling episode through the proxy.

Step 1 (docs/architecture.md): the episodes of an environment class written for TRL's GRPOTrainer.

TRL 1.x (`GRPOTrainer(environment_factory=MyEnv)`, PR #5093) takes a class whose instances have `reset(**row)`
(returning None or text), public methods that become the model's tools (their JSON schemas from type hints and
docstrings, transformers' `get_json_schema`), and optionally `get_reward()`, which scores the finished episode. treerl
plays it the way TRL's trainer does (read against TRL's `_tool_call_loop` and `_calculate_rewards`), with the model
behind treerl's recording proxy:

- one instance per episode (env_args go to its constructor); `reset(**row)` with the task's row: a JSONL row of
  rollout.data_path, an item of env_args.rows, or {} when neither is given (the environment owns its data);
- the prompt is the row's `prompt` (text or chat messages; none: an empty user message) with reset's text appended
  to its last user message, and rollout.system_prompt before it if set (a row whose prompt has a system message of
  its own is refused with it, in one line);
- each model call offers the tools; the calls it makes are parsed in the model's tool-call format (rollout.
  tool_parser) and run, their results shown as tool messages (a tool that raises, an unknown tool or arguments
  that are not JSON answer {"error": ...}, as in TRL); a reply without a tool call ends the episode. As TRL
  (max_tool_calling_iterations=None) there is no other end unless rollout.max_turns is set: then its N-th model
  call is the last, and that reply's tool calls are not run (TRL's max_tool_calling_iterations = N - 1);
- the reward is TRL's sum over its reward sources, weight 1 each: `get_reward()` (async: awaited) and, when
  rollout.reward_fn is set, that function called as TRL calls its reward_funcs, for a batch of this one episode:
  fn(prompts=[prompt messages], completions=[the episode's messages after them], completion_ids=[the token ids after
  the prompt], environments=[the instance], trainer_state=None, log_extra=..., log_metric=..., **{column: [value]})
  returning [reward] (its log_metric values are logged per environment). A source that gives None is left out, as
  TRL leaves it out; an episode every source gave None is dropped (env_not_a_number). One of the two is required.

An instance lives in this process and its episode is one conversation through the proxy: it is not branched (the
group_size episodes of a row each have their own instance). reset, each tool, get_reward and the reward function run
with rollout.env_timeout each, a synchronous one in a daemon thread of its own: a call past its limit is abandoned
there (it holds neither the step nor the process's exit), and its episode is dropped (env_timeout); one that raises
too (env_raised), and a reward that is not a finite number (env_not_a_number ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
from dataclasses import dataclass
from typing import Any

from treerl.errors import UserError
from treerl.rollout.config import RolloutConfig
from treerl.rollout.rewards.functions import NamedFailure, check_reward, import_object
from treerl.rollout.tasks.dataset import DatasetTask, FromRows, agent_rows

OWN_KEYS = ("rows",)  # treerl's; the other env_args go to the class's constructor
REWARD_KWARGS = ("prompts", "completions", "completion_ids", "environments", "trainer_state", "log_extra",
                 "log_metric")  # what TRL's _calculate_rewards hands every reward function, beside the row's columns
MAX_NEW_TOKENS = 128


class EnvCallFailed(NamedFailure):
    """An environment's reset, tool or get_reward that raised or ran out of time: its episode is dropped."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class TrlEnvironmentTask(FromRows):
    """Episodes of a TRL environment class, one instance each, driven through the recording proxy; its rows (reset's
    arguments) held out as a dataset's are."""

    name: str
    cls: type
    kwargs: dict[str, Any]
    tools: list[dict[str, Any]]  # the public methods' JSON schemas
    rows: DatasetTask  # the rows, in a seeded order epoch after epoch; each prompt's answer is its row
    system_prompt: str | None = None
    timeout: float | None = 60.0  # rollout.env_timeout, per reset, tool and reward call
    max_turns: int | None = None  # rollout.max_turns: model calls per episode at most (None: until no tool call)
    reward_fn: Any = None  # rollout.reward_fn, called as TRL calls its reward_funcs (with the environments)
    max_new_tokens: int = MAX_NEW_TOKENS

    async def agent(self, client: Any, row: dict[str, Any]) -> dict[str, Any]:
        """One episode as TRL plays it: reset(**row), tool calls until a reply has none (or the N-th call of
        rollout.max_turns, whose tool calls are not run), then its reward sources."""
        env = await self.call(self.cls, "the constructor", **self.kwargs)
        observation = await self.call(env.reset, "reset", **row)
        messages = first_messages(row, observation, self.system_prompt)
        prompt = [dict(m) for m in messages]
        methods = {tool["function"]["name"]: getattr(env, tool["function"]["name"]) for tool in self.tools}
        calls, ids = 0, []  # model calls so far; the first call's prompt ids and the last call's ids after them
        while True:
            response = await client.chat.completions.create(model="policy", messages=messages, tools=self.tools,
                                                            extra_body={"return_token_ids": True})
            calls += 1
            reply = response.choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            ids = token_ids(response, ids)
            if not reply.tool_calls or (self.max_turns is not None and calls >= self.max_turns):
                break
            for call in reply.tool_calls:
                result = await self.tool_result(methods, call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                 "content": result})
        metrics: dict[str, float] = {}
        rewards = {}  # reward source -> what it gave
        if callable(getattr(env, "get_reward", None)):
            rewards["get_reward()"] = await self.call(env.get_reward, "get_reward")
        if self.reward_fn is not None:
            rewards["rollout.reward_fn"] = await self.trl_reward(row, prompt, messages[len(prompt):], ids[1:], env,
                                                                 metrics)
        return {"reward": reward_sum(rewards), "metrics": metrics}

    async def trl_reward(self, row: dict[str, Any], prompt: list[dict[str, Any]], completion: list[dict[str, Any]],
                         completion_ids: list[int], env: Any, metrics: dict[str, float]) -> Any:
        """rollout.reward_fn's reward for this episode, called as TRL's _calculate_rewards calls a reward function
        (a batch of one, the environment instance included); None where it gives none."""
        columns = {key: [value] for key, value in row.items() if key not in ("prompt", "completion", "completion_ids")}
        given = await self.call(self.reward_fn, "rollout.reward_fn", prompts=[prompt], completions=[completion],
                                completion_ids=[completion_ids], environments=[env], trainer_state=None,
                                log_extra=lambda column, values: None,
                                log_metric=lambda name, value: metrics.__setitem__(str(name), value), **columns)
        if not isinstance(given, (list, tuple)) or len(given) != 1:
            raise EnvCallFailed(f"rollout.reward_fn returned {str(given)[:200]}, not a list of one reward (TRL's "
                                "reward_funcs give one per completion)", "env_not_a_number")
        return given[0]

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
            return await asyncio.wait_for(in_daemon_thread(fn, *args, **kwargs), self.timeout)
        except TimeoutError:
            raise EnvCallFailed(f"{what} did not return within {self.timeout:g} s (rollout.env_timeout)",
                                "env_timeout") from None
        except EnvCallFailed:
            raise
        except Exception as e:
            if what.startswith("tool "):
                raise
            raise EnvCallFailed(f"{what} raised {type(e).__name__}: {e}", "env_raised") from None


async def in_daemon_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(...)` in a daemon thread of its own: a call abandoned at rollout.env_timeout runs on there, holding neither
    the step (asyncio.to_thread's executor is joined when the episodes' event loop closes) nor the process's exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: tuple[bool, Any]) -> None:
        if not future.done():  # not abandoned
            future.set_result(outcome[1]) if outcome[0] else future.set_exception(outcome[1])

    def run() -> None:
        try:
            outcome = (True, fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 (the caller sees whatever the environment's code raised)
            outcome = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for it any more
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name="treerl-env-call", daemon=True).start()
    return await future


def token_ids(response: Any, ids: list[Any]) -> list[Any]:
    """[the first call's prompt ids, then every token after them up to the end of this call's reply] (TRL's
    completion_ids: replies and tool results alike), from the proxy's token ids (return_token_ids)."""
    prompt, reply = getattr(response, "prompt_token_ids", None), getattr(response.choices[0], "token_ids", None)
    if prompt is None or reply is None:
        return ids or [[]]
    first = ids[0] if ids else prompt
    return [first, *(prompt + reply)[len(first):]]


def reward_sum(rewards: dict[str, Any]) -> float:
    """TRL's sum over reward sources (weight 1 each), a source that gave None left out; every one None: dropped."""
    given = {source: reward for source, reward in rewards.items() if reward is not None}
    if not given:
        raise EnvCallFailed(f"every reward source returned None ({', '.join(rewards)}): the episode has no reward",
                            "env_not_a_number")
    total = 0.0
    for source, reward in given.items():
        checked = check_reward(reward)
        if not isinstance(checked, float):
            raise EnvCallFailed(f"{source} {checked.message}", f"env_{checked.kind}")
        total += checked
    return total


def first_messages(row: dict[str, Any], observation: Any, system_prompt: str | None) -> list[dict[str, Any]]:
    """The episode's prompt: the row's prompt with reset's text appended to its last user message (TRL's rule)."""
    prompt = row.get("prompt")
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
                [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": ""}])
    if isinstance(observation, str):
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
    if system_prompt:  # a row with a system message of its own was refused at build (check_system_prompts)
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
    if not callable(getattr(cls, "get_reward", None)) and not config.reward_fn:
        raise UserError(f"rollout.env={spec!r}: {cls.__name__} has no get_reward() and rollout.reward_fn is not set: "
                        "no reward source (TRL needs one of the two too)")
    own = {key: env_args.pop(key) for key in OWN_KEYS if key in env_args}
    try:
        inspect.signature(cls).bind(**env_args)
    except TypeError as e:
        raise UserError(f"rollout.env={spec!r}: env_args {sorted(env_args)} do not fit {cls.__name__}"
                        f"{inspect.signature(cls)} ({e}); treerl's own keys: {', '.join(OWN_KEYS)}") from None
    rows = task_rows(own.get("rows"), config, spec)
    check_system_prompts(rows, config.system_prompt, spec)
    shown = [([{"role": "user", "content": row["prompt"] if isinstance(row.get("prompt"), str)
                else json.dumps(row, default=str)[:500]}], row) for row in rows]  # shown in reports only
    return TrlEnvironmentTask(spec, cls, env_args, tool_schemas(cls, spec),
                              DatasetTask.split(shown, None, config.eval_fraction, by_answer=True, seed=config.seed,  # type: ignore[arg-type]
                                                shuffle=config.shuffle, name=spec),
                              config.system_prompt, config.env_timeout, config.max_turns,
                              trl_reward_fn(config.reward_fn, rows[0], spec))


def trl_reward_fn(name: str | None, row: dict[str, Any], spec: str) -> Any:
    """rollout.reward_fn as one of TRL's reward_funcs: a function that takes what _calculate_rewards hands it (the
    environments among it) and the row's columns, checked against the first row; None where it is not set."""
    if not name:
        return None
    fn = import_object(name, f"rollout.reward_fn (for {spec})", "my_rewards:solved")
    columns = [key for key in row if key not in ("prompt", "completion", "completion_ids")]
    try:
        inspect.signature(fn).bind(**dict.fromkeys([*REWARD_KWARGS, *columns]))
    except (TypeError, ValueError) as e:
        raise UserError(f"rollout.reward_fn={name!r} is called as TRL calls its reward_funcs with an environment "
                        f"class: fn({', '.join(REWARD_KWARGS)}, **row columns) -> [reward]; its signature does not "
                        f"take them ({e}); e.g. def reward(environments, **kwargs): return [e.score for e in "
                        "environments]") from None
    return fn


def check_system_prompts(rows: list[dict[str, Any]], system_prompt: str | None, spec: str) -> None:
    """rollout.system_prompt and a row whose prompt has its own system message: one line (which would win is not
    treerl's to guess)."""
    if not system_prompt:
        return
    for k, row in enumerate(rows):
        prompt = row.get("prompt")
        if isinstance(prompt, list) and any(isinstance(m, dict) and m.get("role") == "system" for m in prompt):
            raise UserError(f"rollout.system_prompt is set and row {k} of {spec}'s rows has a system message of its "
                            "own in its prompt: remove one of the two (treerl does not pick which wins)")


def task_rows(rows: Any, config: RolloutConfig, spec: str) -> list[dict[str, Any]]:
    """The rows reset(**row) is called with: env_args.rows, else rollout.data_path's, else one empty row."""
    if rows is not None and config.data_path:
        raise UserError(f"rollout.env={spec!r}: both env_args.rows and rollout.data_path give rows: set one")
    if config.data_path:
        return [answer for _, answer in agent_rows(config.data_path)]
    if rows is None:
        return [{}]
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"rollout.env={spec!r}: env_args.rows must be a non-empty list of mappings (one reset(**row) "
                        "each)")
    return [dict(r) for r in rows]

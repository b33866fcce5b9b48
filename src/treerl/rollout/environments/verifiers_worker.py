"""A verifiers 0.4 environment served to treerl: run by the verifiers venv's Python, not imported by treerl.

Step 1 (docs/architecture.md): the episodes of a verifiers environment, played by verifiers' own loop.

verifiers 0.4 pins openai<3 and mcp==2.0.0, so it lives in a venv of its own (tools/verifiers-venv.sh), the way
prime-rl runs it beside a trainer; this script is that venv's side of `verifiers_env.py`. It imports nothing of
treerl (treerl is not installed there) and talks JSON lines:

    argv[1]  {"target": taskset id, "env_args": {...}, "timeout": s, "tasks": n}
    stdout   {"error": "one line"}  (the environment could not be built: the worker exits)
             {"ready": true, "prompts": [text of task 0, 1, ...]}
             {"id": k, "reward": r, "rewards": {...}, "metrics": {...}} or {"id": k, "error": ...,
              "reason": "env_timeout" | "env_raised"}, one per request, in the order episodes end
    stdin    {"id": k, "task": i, "base_url": "http://127.0.0.1:PORT/episodes/e7/v1"}: play task i against that
             endpoint (treerl's recording proxy); end of input: finish the episodes asked for, then stop

The environment is built as verifiers' own CLI builds it (`resolve_env_config`, `load_environment`) and served
by it (`env.serving()`: verifiers' interception server in front of the endpoint); each episode is
`env.run_episode(task, ModelContext(...))`, its harness program run in the local subprocess runtime.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from typing import Any

MODEL = "policy"  # the proxy's one model
OUT = sys.stdout  # the protocol's channel; anything else printed goes to stderr
sys.stdout = sys.stderr


def emit(message: dict[str, Any]) -> None:
    """One protocol line to treerl."""
    OUT.write(json.dumps(message, default=str) + "\n")
    OUT.flush()


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and the first lines of its message, joined."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:600]}"


def available_tasksets() -> list[str]:
    """The taskset ids verifiers ships (an installed package or a module on the path is an id too)."""
    import pkgutil

    from verifiers.v1 import tasksets

    return sorted(m.name for m in pkgutil.iter_modules(tasksets.__path__))


def env_config(target: str, env_args: dict[str, Any], timeout: float | None) -> Any:
    """verifiers' EnvConfig for the taskset `target`: each env_args key goes to the taskset's config if it has that
    field, else to the environment's; the agents run locally (subprocess runtime), `null` chat loop by default."""
    import verifiers.v1 as vf

    try:
        taskset_fields = vf.taskset_config_type(target).model_fields
    except ModuleNotFoundError:
        raise LookupError(f"no verifiers taskset {target!r}: verifiers ships {', '.join(available_tasksets())}; "
                          "any other id is a package installed in the verifiers venv or a module on its path "
                          "(the working directory, PYTHONPATH)") from None
    env_fields = vf.env_config_type(target).model_fields
    taskset = {"id": target}
    env: dict[str, Any] = {}
    for key, value in env_args.items():
        if key in taskset_fields and key != "id":
            taskset[key] = value
        elif key in env_fields and key not in ("id", "taskset"):
            env[key] = value
        else:
            raise KeyError(f"env_args key {key!r} is neither the taskset's ({', '.join(sorted(taskset_fields))}) "
                           f"nor the environment's ({', '.join(sorted(set(env_fields) - {'taskset'}))})")
    roles = [name for name, field in env_fields.items() if field.annotation is vf.AgentConfig]
    own_harness = vf.default_harness_id(target) != "bash"  # the taskset ships its program
    for role in roles:
        agent = dict(env.get(role) or {})
        agent.setdefault("runtime", {"type": "subprocess"})
        if not own_harness:
            agent.setdefault("harness", {"id": "null"})
        if timeout is not None:
            agent.setdefault("timeout", {"setup": timeout, "finalize": timeout, "scoring": timeout})
        env[role] = agent
    if timeout is not None:
        env.setdefault("timeout", {"finalize": timeout})
    return vf.resolve_env_config({"taskset": taskset, **env})


def load_tasks(env: Any, count: int) -> list[Any]:
    """The taskset's tasks in its own order (the first `count` of an endless one)."""
    import itertools

    return list(itertools.islice(iter(env.taskset), count))


def prompt_text(task: Any) -> str:
    """A task's prompt as text, for treerl's reports."""
    return task.data.prompt_text or ""


def episode_result(episode: Any) -> dict[str, Any]:
    """An episode's reward (verifiers' own: its trace's weighted rewards summed), its named rewards and metrics,
    or why it failed (an error, or a deadline that expired: verifiers scores such a trace as far as it got)."""
    timed_out = [t.stop_condition for t in episode.traces if t.is_timeout]
    if episode.is_timeout or timed_out:
        return {"error": f"a verifiers deadline expired ({', '.join(map(str, timed_out)) or 'the episode'}; "
                         "rollout.env_timeout bounds setup, finalize and scoring)", "reason": "env_timeout"}
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        last = errors[-1] if errors else None
        message = f"{last.type}: {' '.join(last.message.split())[:600]}" if last else "the episode did not finish"
        return {"error": message, "reason": "env_raised"}
    if len(episode.traces) != 1:
        return {"error": f"the episode has {len(episode.traces)} agent traces; treerl trains one",
                "reason": "env_raised"}
    trace = episode.traces[0]
    rewards = {name: r.value for name, r in trace.rewards.items() if r is not None}
    metrics = {name: value for name, value in trace.metrics.items() if value is not None}
    return {"reward": trace.reward, "rewards": rewards, "metrics": metrics}


async def play(env: Any, tasks: list[Any], request: dict[str, Any]) -> None:
    """One episode of task `request["task"]` against the endpoint it names; its result emitted."""
    import verifiers.v1 as vf

    context = vf.ModelContext(model=MODEL, client=vf.EvalClientConfig(base_url=request["base_url"],
                                                                        api_key_var="TREERL_PROXY_KEY"))
    try:
        episode = await env.run_episode(tasks[request["task"]], context)
        result = episode_result(episode)
    except Exception as e:  # noqa: BLE001 (verifiers' own failure: the episode is dropped, the worker goes on)
        result = {"error": one_line(e), "reason": "env_raised"}
    emit({"id": request["id"], **result})


async def serve(spec: dict[str, Any]) -> None:
    """Build the environment, hold its serving resources, and play every request until stdin ends."""
    try:
        import verifiers.v1 as vf

        env = vf.load_environment(env_config(spec["target"], spec["env_args"], spec.get("timeout")))
        tasks = load_tasks(env, spec.get("tasks", 1000))
        if not tasks:
            raise ValueError(f"the taskset {spec['target']!r} has no tasks")
    except Exception as e:  # noqa: BLE001 (any failure to build is the run's one-line error, before sampling)
        emit({"error": one_line(e)})
        return
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with env.serving():
        emit({"ready": True, "prompts": [prompt_text(t) for t in tasks]})
        running: set[asyncio.Task] = set()
        while line := await reader.readline():
            job = asyncio.create_task(play(env, tasks, json.loads(line)))
            running.add(job)
            job.add_done_callback(running.discard)
        await asyncio.gather(*running)  # end of input: the episodes asked for still finish


def main() -> None:
    """`python verifiers_worker.py SPEC_JSON`: the working directory's modules are environment ids too."""
    sys.path.insert(0, os.getcwd())
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")  # the venv's uv
    os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")  # the chat program runs on the venv's own Python
    spec = json.loads(sys.argv[1])
    if spec.get("timeout") is not None and not math.isfinite(spec["timeout"]):
        spec["timeout"] = None
    asyncio.run(serve(spec))


if __name__ == "__main__":
    main()

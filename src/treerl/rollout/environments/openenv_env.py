"""OpenEnv environments: `openenv:my_pkg.my_env:MyEnvironment` in process, `openenv+http://HOST:PORT` on its server.

Step 1 (docs/architecture.md): the episodes of an OpenEnv `Environment` (openenv-core), turn by turn.

An OpenEnv environment is a class with `reset(seed=, episode_id=) -> Observation` and `step(action) -> Observation`
(pydantic models; the observation carries `done` and `reward`), served by OpenEnv's `create_app` and reached by its
`EnvClient` (a websocket session per episode: reset / step / state). treerl plays it as a multi-turn task:

- the prompt is the observation `reset(seed=...)` returns (the seed drawn from rollout.seed, the step and the prompt's
  index), shown as a user message after rollout.system_prompt (if set);
- each reply becomes the action: the action class's one required text field (`message` in OpenEnv's echo template)
  set to the reply's text (env_args.action_field names another; in process, env_args.action_class "module:Class"
  names the class when `step`'s annotation does not);
- the observation's fields but done, reward and metadata are shown next: the one text field as it is, or
  env_args.observation_field, else all of them as JSON; the observation's reward (None: 0) is the turn's reward, its
  done ends the episode; in process, its metadata's numbers are logged per environment (env/<name>/<key>).

In process, the other env_args keys go to the class's constructor (a key it does not take is refused at build);
an instance is deep-copied where an episode branches only when its class says a copy is independent
(`SUPPORTS_DEEPCOPY = True`, checked to copy at build); otherwise, and served, a branch replays the episode into a
fresh session with the same seed (`replay.py`); a replay that answers differently drops that branch
(replay_diverged). Served, the episode's session is a websocket on the server (OpenEnv's GenericEnvClient: nothing
of the environment's package is needed here). OpenEnv lets reset ignore its seed: two resets with seed 0 are compared
at build, and an environment whose first observations differ is played as TRL's OpenEnv integration plays it (each
trajectory its own reset, steps until done; its first observation is its opening, not the prompt's), branched only
where it copies, else not branched at all (said once at the start of a run that branches). The server must allow as many
sessions as trajectories are live at once (create_app(..., max_concurrent_envs=N), an environment marked
SUPPORTS_CONCURRENT_SESSIONS). A server that fails or disconnects ends the episodes it serves (dropped, counted, with
the error); the run goes on, and stops (trainer.max_failed_steps) when every episode of several steps was lost.
"""

from __future__ import annotations

import copy
import inspect
import json
import typing
import urllib.request
from dataclasses import dataclass
from typing import Any

from treerl.errors import UserError
from treerl.rollout.config import RolloutConfig
from treerl.rollout.conversations.chat import Message
from treerl.rollout.environments.extras import import_library, say_once
from treerl.rollout.environments.replay import (
    COPY_OPT_IN,
    Opener,
    ReplayedEnvironment,
    branches,
    close_quietly,
    copy_opt_in,
)
from treerl.rollout.rewards.functions import RewardFailure, UserCode, import_object
from treerl.rollout.tasks.base import EnvReply, Prompt, rng_for
from treerl.rollout.tasks.heldout import EVAL_FRACTION, SeededEpisodes

OWN_KEYS = ("action_field", "observation_field", "action_class")  # treerl's; the rest: constructor
SHOWN_EXCLUDES = {"done", "reward", "metadata"}  # what an OpenEnv server never puts in the observation it sends
MAX_TURNS = 8
MAX_NEW_TOKENS = 64
CONNECT_SECONDS = 30.0  # the handshake's limit (OpenEnv's own is 10 s): room for a server busy with many sessions;
# a dead one refuses at once


@dataclass(frozen=True)
class Start:
    """A prompt's answer: the seed its episodes reset with, and why the reset failed (None: it did not)."""

    seed: int
    failure: str | None = None


@dataclass
class Sessions:
    """How an environment's sessions open (seed -> a reset session and its first observation), and whether its reset
    follows the seed (two resets with seed 0 showed the same first observation at build)."""

    open: Any
    seeded: bool
    copyable: bool = False  # an in-process instance whose class says its deep copies are independent

    def __call__(self, seed: int) -> tuple[Any, list[Message]]:
        return self.open(seed)


@dataclass
class TextActions:
    """How a reply becomes an action and an observation becomes what the model reads next."""

    action_field: str
    observation_field: str | None = None

    def shown(self, observation: dict[str, Any]) -> list[Message]:
        """The observation's fields (done, reward and metadata left out) as the user's next message."""
        if self.observation_field is not None:
            if self.observation_field not in observation:
                raise KeyError(f"the observation has no field {self.observation_field!r} "
                               f"(env_args.observation_field); it has {', '.join(observation) or 'none'}")
            text = observation[self.observation_field]
        else:
            texts = [value for value in observation.values() if isinstance(value, str)]
            text = texts[0] if len(texts) == 1 and len(observation) == 1 else None
            if text is None:
                text = json.dumps(observation, sort_keys=True, default=str)
        return [{"role": "user", "content": text if isinstance(text, str) else json.dumps(text, default=str)}]

    def answer(self, observation: dict[str, Any], reward: Any, done: Any, metrics: dict[str, Any]) -> EnvReply:
        """The observation as treerl's EnvReply (the reward checked by the workflow)."""
        return EnvReply(self.shown(observation), 0.0 if reward is None else reward, bool(done), metrics)


@dataclass
class InProcessSession:
    """One instance of the Environment class, stepped in this process."""

    env: Any
    action_class: type
    actions: TextActions
    copyable: bool  # its class says it copies (SUPPORTS_DEEPCOPY, checked at build); else a branch replays

    def step(self, reply: str) -> EnvReply:
        observation = self.env.step(self.action_class(**{self.actions.action_field: reply}))
        return reply_of(observation, self.actions)

    def close(self) -> None:
        self.env.close()

    def fork(self) -> InProcessSession:
        """A branch's own instance: a deep copy (the class was checked to copy at build)."""
        return InProcessSession(copy.deepcopy(self.env), self.action_class, self.actions, self.copyable)


@dataclass
class ServedSession:
    """One websocket session on an OpenEnv server, through OpenEnv's own client."""

    client: Any  # openenv.core.SyncEnvClient over a GenericEnvClient
    actions: TextActions
    url: str

    def step(self, reply: str) -> EnvReply:
        result = self.client.step({self.actions.action_field: reply})
        return self.actions.answer(result.observation, result.reward, result.done, {})

    def close(self) -> None:
        self.client.close()


def reply_of(observation: Any, actions: TextActions) -> EnvReply:
    """An in-process Observation as an EnvReply: what its server would send, plus its metadata's numbers."""
    from openenv.core.env_server.serialization import serialize_observation

    sent = serialize_observation(observation)
    metadata = getattr(observation, "metadata", None) or {}
    metrics = {k: v for k, v in metadata.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return actions.answer(sent["observation"], sent["reward"], sent["done"], metrics)


@dataclass
class OpenEnvTask(SeededEpisodes):
    """A multi-turn task over an OpenEnv environment: its reset observation is the prompt, its steps the turns;
    evaluation's episodes reset with seeds training never uses."""

    name: str
    open_session: Any  # seed -> (session, first observation as messages)
    system_prompt: str | None
    user_code: UserCode  # the prompts' resets, with rollout.env_timeout
    seed: int = 0
    max_turns: int = MAX_TURNS
    max_new_tokens: int = MAX_NEW_TOKENS
    eval_fraction: float = EVAL_FRACTION  # rollout.eval_fraction: > 0 evaluates on seeds training never uses

    def prompts(self, step: int, count: int) -> list[Prompt]:
        """One episode per prompt, reset with its own seed; a reset that fails gives a prompt whose episode drops."""
        return [self.opened(f"s{step}/p{i}", rng_for(self.name, self.seed, step, i).randrange(2**31))
                for i in range(count)]

    def held_out_prompts(self, count: int) -> list[Prompt]:
        """The evaluation set: `count` episodes reset with seeds training never uses (`SeedSplit`)."""
        return [self.opened(f"eval/p{i}", self.seeds.held_out_seed(i)) for i in range(count)]

    def opened(self, prompt_id: str, seed: int) -> Prompt:
        """The prompt of the episode reset with `seed`: its first observation (a failed reset drops the episode)."""
        opened = self.user_code.call(lambda: self.open_session(seed)) if self.seeded else (None, [])  # unseeded: each
        # trajectory's own reset shows its first observation (`environment`)
        if isinstance(opened, RewardFailure):
            first, start = [{"role": "user", "content": ""}], Start(seed, f"reset {opened.message}")
        else:
            if opened[0] is not None:
                close_quietly(opened[0])
            first, start = opened[1], Start(seed)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return Prompt(prompt_id, system + first, answer=start)

    @property
    def seeded(self) -> bool:
        """Whether the environment's reset follows the seed (else every trajectory plays a reset of its own)."""
        return getattr(self.open_session, "seeded", True)

    def environment(self, prompt: Prompt) -> ReplayedEnvironment:
        """The episode's environment: a session opened at its first step, checked to show the prompt's observation;
        one that ignores its seed, a session opened now, whose first observation is the episode's opening."""
        start: Start = prompt.answer
        if start.failure is not None:
            raise RuntimeError(start.failure)
        if not self.seeded:
            session, first = self.open_session(start.seed)
            return ReplayedEnvironment(self.opener(start.seed), first, session=session, replayable=False)
        first = prompt.messages[1:] if self.system_prompt else prompt.messages
        return ReplayedEnvironment(self.opener(start.seed), first)

    def opener(self, seed: int) -> Opener:
        """Opens a fresh session reset with `seed` (a branch's replay starts from one)."""
        return lambda: self.open_session(seed)


def build(target: str, env_args: dict[str, Any], config: RolloutConfig) -> OpenEnvTask:
    """The task of `openenv:module:Class` (in process) or `openenv+http://host:port` (a running server)."""
    served = target.startswith(("http://", "https://"))
    spec = f"openenv+{target}" if served else f"openenv:{target}"
    import_library("openenv.core", "openenv", spec)
    own = {key: env_args.pop(key) for key in OWN_KEYS if key in env_args}
    open_session = (served_opener(target, own, env_args, spec, config) if served
                    else in_process_opener(target, own, env_args, spec))
    if not open_session.seeded and not open_session.copyable and branches(config):
        say_once(f"rollout.env={spec!r}: branching is off for it (rollout.branch_at): its reset ignores the seed (two "
                 f"resets with seed 0 showed different first observations) and it cannot be copied (its class does "
                 f"not set {COPY_OPT_IN} = True); each trajectory plays its own reset until done")
    user_code = UserCode(config.env_timeout, "rollout.env_timeout")
    return OpenEnvTask(spec, open_session, config.system_prompt, user_code, seed=config.seed,
                       eval_fraction=config.eval_fraction)


def in_process_opener(target: str, own: dict[str, Any], kwargs: dict[str, Any], spec: str) -> Any:
    """seed -> (an instance of the class reset with it, its first observation); the class, its constructor's
    arguments, its action class and text field checked now."""
    from openenv.core.env_server.interfaces import Environment

    cls = import_object(target, f"rollout.env={spec!r}: the environment", "my_pkg.my_env:MyEnvironment")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UserError(f"rollout.env={spec!r}: {target} is not an OpenEnv Environment class (a subclass of "
                        "openenv.core.env_server.interfaces.Environment)")
    check_arguments(cls, kwargs, spec)
    action_class = (import_object(own["action_class"], "env_args.action_class", "my_pkg.models:MyAction")
                    if "action_class" in own else action_class_of(cls, spec))
    actions = TextActions(own.get("action_field") or text_field(action_class.model_json_schema(), spec),
                          own.get("observation_field"))

    copyable = copy_opt_in(cls)

    def open_session(seed: int) -> tuple[InProcessSession, list[Message]]:
        env = cls(**kwargs)
        observation = env.reset(seed=seed)
        return InProcessSession(env, action_class, actions, copyable), reply_of(observation, actions).messages

    seeded = probe(open_session, f"{cls.__name__}(**env_args).reset(seed=0)", spec)
    return Sessions(open_session, seeded, copyable)


def probe(open_session: Any, what: str, spec: str) -> bool:
    """Whether two sessions reset with seed 0 show the same first observation (a reset that follows the seed); where
    the class says it copies, that a reset instance deep-copies. A session that fails to open is refused now."""
    sessions = []
    try:
        for _ in range(2):
            sessions.append(open_session(0))
        if getattr(sessions[0][0], "copyable", False):
            copy.deepcopy(sessions[0][0].env)
    except Exception as e:  # noqa: BLE001 (the user's class or server: whatever it raises, in one line)
        doing = "a deep copy of it (its class sets SUPPORTS_DEEPCOPY)" if len(sessions) == 2 else what
        raise UserError(f"rollout.env={spec!r}: {doing} raised {type(e).__name__}: {e}") from None
    finally:
        for session, _ in sessions:
            close_quietly(session)
    return sessions[0][1] == sessions[1][1]


def served_opener(url: str, own: dict[str, Any], rest: dict[str, Any], spec: str, config: RolloutConfig) -> Any:
    """seed -> (a websocket session on the server reset with it, its first observation); the server asked for its
    action schema now (one that cannot be reached is refused before any sampling)."""
    if rest or "action_class" in own:
        unknown = sorted([*rest, *(["action_class"] if "action_class" in own else [])])
        raise UserError(f"rollout.env={spec!r}: env_args {', '.join(unknown)} are not for a served environment (its "
                        f"constructor runs on the server); it takes {', '.join(k for k in OWN_KEYS if k != 'action_class')}")
    base = url.rstrip("/")
    try:
        with urllib.request.urlopen(f"{base}/schema", timeout=CONNECT_SECONDS) as response:
            schema = json.load(response)["action"]
    except Exception as e:  # noqa: BLE001 (unreachable, not an OpenEnv server: one line either way)
        raise UserError(f"rollout.env={spec!r}: cannot read the server's action schema at {base}/schema "
                        f"({type(e).__name__}: {e}); is an OpenEnv server running there?") from None
    actions = TextActions(own.get("action_field") or text_field(schema, spec), own.get("observation_field"))
    from openenv.core import GenericEnvClient

    def open_session(seed: int) -> tuple[ServedSession, list[Message]]:
        client = GenericEnvClient(base_url=base, connect_timeout_s=CONNECT_SECONDS,
                                  message_timeout_s=config.env_timeout or 3600.0).sync()
        try:
            result = client.reset(seed=seed)
        except BaseException:
            close_quietly(client)
            raise
        return ServedSession(client, actions, base), actions.shown(result.observation)

    return Sessions(open_session, probe(open_session, f"a session on {base} reset with seed 0", spec))


def check_arguments(cls: type, kwargs: dict[str, Any], spec: str) -> None:
    """The constructor takes these env_args (a key it does not take is named, with the ones it does)."""
    signature = inspect.signature(cls.__init__)
    try:
        signature.bind(None, **kwargs)
    except TypeError as e:
        takes = [p for p in list(signature.parameters)[1:] if p not in ("args", "kwargs")]
        raise UserError(f"rollout.env={spec!r}: env_args {sorted(kwargs)} do not fit {cls.__name__}({', '.join(takes)}) "
                        f"({e}); treerl's own keys: {', '.join(OWN_KEYS)}") from None


def action_class_of(cls: type, spec: str) -> type:
    """The action class `step` is annotated with (or the Environment[Action, ...] the class derives from)."""
    from openenv.core.env_server.types import Action

    hinted = typing.get_type_hints(cls.step).get("action")
    candidates = [hinted] + [arg for base in getattr(cls, "__orig_bases__", ()) for arg in typing.get_args(base)]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, Action) and candidate is not Action:
            return candidate
    raise UserError(f"rollout.env={spec!r}: cannot tell {cls.__name__}'s action class from its step() annotation; "
                    "name it: rollout.env_args.action_class=my_pkg.models:MyAction")


def text_field(schema: dict[str, Any], spec: str) -> str:
    """The action's one required text field (JSON schema), which the reply fills."""
    properties = schema.get("properties", {})
    texts = [name for name in schema.get("required", []) if properties.get(name, {}).get("type") == "string"]
    if len(texts) != 1:
        raise UserError(f"rollout.env={spec!r}: the action has {len(texts)} required text fields "
                        f"({', '.join(texts) or 'none'}; fields: {', '.join(properties) or 'none'}); name the one the "
                        "reply goes in: rollout.env_args.action_field=...")
    return texts[0]

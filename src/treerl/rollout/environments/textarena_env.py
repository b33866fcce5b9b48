"""TextArena's single-player games as multi-turn episodes: the game's observations in, the model's moves out.

Step 1 (docs/architecture.md): episodes from `rollout.env=textarena:<id>`.

    rollout.env=textarena:GuessTheNumber-v0 rollout.env_args={max_number: 10}

Each episode is `ta.make(id, **env_args)` reset with `reset(num_players=1, seed=s)` (s drawn from rollout.seed, the
step and the episode, so an episode replays exactly). The game's messages to the player are the user messages: its
prompt opens the conversation (after rollout.system_prompt, if set), and after each reply the messages it sent
since (hints, boards, invalid-move notices), each "[GAME] text" on its own line; the player's own move, which the
game echoes back, is not repeated. The reply goes to `step` through the id's own action wrappers (most add the
[brackets] a move needs when the reply has none). The game ends the episode: at `done`, `close()` gives the reward
(rewards[0], the trajectory's return) and its info (turn_count, invalid_move: logged per environment).

The game's own turn limit lives in its state after reset (`state.max_turns`; Bandit and FrozenLake have it nowhere
else). TextArena checks it before it counts the turn, and an invalid move it forgives (`state.error_allowance` in a
row) is no turn, so the game's end arrives at reply max_turns + 1 or later: GuessTheNumber with max_turns=2 scores
the third valid guess. treerl's own bound, rollout.max_turns, defaults to the most replies the game can take
((max_turns + 1) x (error_allowance + 1); 100 for a game that sets no limit) and only guards against a game that
never ends: an episode it cuts is dropped (env_truncated, its reason naming the game's limit), never scored 0, and a
bound below the game's is said once at the start.

Branching: an episode forks by deep copy (the library's wrappers define __deepcopy__) where the game is TextArena's
own (its state is plain Python, checked by the tests) or its class says copies are independent
(`SUPPORTS_DEEPCOPY = True`); a game registered by a user that does not say so is not branched (each trajectory
plays its own reset with the episode's seed), said once at the start. The games draw from Python's
global `random` (reset seeds it), so each episode keeps its own generator state and every reset and step runs with
it: a copy continues exactly as the original would, whatever other episodes drew in between. An unknown id lists
TextArena's single-player games; env_args the game's constructor does not take are refused, and a game that cannot
start here (one whose module downloads nltk data that is not on this machine, before anything imports it; one that
asks an LLM judge) is refused in one line, all before any sampling.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treerl.errors import UserError
from treerl.rollout.conversations.chat import Message
from treerl.rollout.environments.extras import import_library, say_once
from treerl.rollout.environments.replay import COPY_OPT_IN, branches, copy_opt_in
from treerl.rollout.tasks.base import EnvReply, Prompt, rng_for
from treerl.rollout.tasks.heldout import EVAL_FRACTION, SeededEpisodes

if TYPE_CHECKING:
    from treerl.rollout.config import RolloutConfig

MAX_NEW_TOKENS = 64  # one move's reply budget unless rollout.max_new_tokens says otherwise
DEFAULT_MAX_TURNS = 100  # treerl's bound on an episode's replies when neither rollout.max_turns nor the game sets one
VARIANTS = ("-raw", "-train")  # each game id's versions without TextArena's wrappers and with its training ones
SINGLE_PLAYER = "SinglePlayerState"  # how a single-player game's source starts its state
RANDOM_OWNER: list[object | None] = [None]  # the call whose game's generator state is in Python's global `random`


@dataclass(frozen=True)
class GameLimit:
    """A game's own turn limit, as its state holds it after reset."""

    turns: int | None  # state.max_turns: the valid moves it allows (None: it sets no limit)
    forgiven: int  # state.error_allowance: invalid moves in a row it forgives (they count as no turn)

    @classmethod
    def of(cls, game: Any) -> GameLimit:
        """The limit of a reset game (through its wrappers)."""
        state = unwrapped(game).state
        return cls(getattr(state, "max_turns", None), getattr(state, "error_allowance", None) or 0)

    @property
    def replies(self) -> int | None:
        """The most replies an episode can take before the game ends it: the limit is checked before the turn is
        counted (the end comes at valid move turns + 1), and each valid move may follow `forgiven` invalid ones."""
        return None if self.turns is None else (self.turns + 1) * (self.forgiven + 1)

    def __str__(self) -> str:
        if self.turns is None:
            return "the game sets no turn limit of its own"
        return (f"the game's own limit: max_turns={self.turns} in its state, checked before the turn counts, "
                f"{self.forgiven} invalid move(s) in a row forgiven: at most {self.replies} replies")


@dataclass
class TextArenaGame:
    """One episode: the game (with its wrappers), its own random state, what it said at reset."""

    game: Any  # what ta.make returned
    seed: int
    random_state: Any = None  # Python's `random` state as this game left it
    opening: list[Message] = field(default_factory=list)  # the game's prompt, shown before the first reply
    copies: bool = True  # a branch may deep-copy it (TextArena's own game, or one that says it copies)

    def __post_init__(self) -> None:
        with self.own_random():
            self.game.reset(num_players=1, seed=self.seed)
        self.opening = [{"role": "user", "content": self.observation()}]

    @contextlib.contextmanager
    def own_random(self) -> Iterator[None]:
        """Run the game's code with its own state of Python's global `random`, and keep what it leaves.

        Environment calls run one at a time (`treerl.rollout.rewards.functions.UserCode`), so no lock is needed, and none is
        taken: a call abandoned after rollout.env_timeout may still be running when the next one starts, and would
        hold a lock for as long as it hangs. The latest call owns the generator; one that finds, at its end, that a
        later call took it over leaves the global state to that one (its own episode was dropped)."""
        token = object()
        RANDOM_OWNER[0] = token
        outside = random.getstate()
        if self.random_state is not None:
            random.setstate(self.random_state)
        try:
            yield
        finally:
            if RANDOM_OWNER[0] is token:
                self.random_state = random.getstate()
                random.setstate(outside)
                RANDOM_OWNER[0] = None

    def observation(self) -> str:
        """What the game told the player since the last call, as text (its own echo of the player's move left out)."""
        _, messages = unwrapped(self.game).get_observation()
        lines = []
        for sender, text, kind in messages:
            if kind.name == "PLAYER_ACTION":
                continue  # the model's own reply, already in the conversation
            lines.append(text if kind.name == "PROMPT" else f"[{'GAME' if sender < 0 else 'Player'}] {text}")
        return "\n".join(lines)

    @property
    def limit(self) -> str:
        """The game's own turn limit, for the reason of an episode treerl's bound cut."""
        return str(GameLimit.of(self.game))

    def step(self, reply: str) -> EnvReply:
        """Play the reply as the move; at the end, the game's reward and info from close()."""
        with self.own_random():
            done, _ = self.game.step(reply)
            if not done:
                return EnvReply([{"role": "user", "content": self.observation()}])
            rewards, info = self.game.close()
        player = (info or {}).get(0, {})
        metrics = {k: float(v) for k, v in player.items() if isinstance(v, (int, float))}  # turn_count, invalid_move
        return EnvReply([], reward=(rewards or {}).get(0), done=True, metrics=metrics)


@dataclass
class TextArenaTask(SeededEpisodes):
    """Episodes of one TextArena game id; evaluation's reset with seeds training never uses."""

    make: Any  # () -> a fresh game, as ta.make(id, **env_args)
    max_turns: int
    system_prompt: str | None = None
    seed: int = 0
    name: str = "textarena"
    max_new_tokens: int = MAX_NEW_TOKENS
    copies: bool = True  # its games may be deep-copied where an episode branches
    eval_fraction: float = EVAL_FRACTION  # rollout.eval_fraction: > 0 evaluates on seeds training never uses

    def prompts(self, step: int, count: int) -> list[Prompt]:
        """The `count` episodes of step `step`: each a game seed (its messages come from the game at reset)."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [Prompt(f"s{step}/p{i}", list(system), answer=rng_for(self.name, self.seed, step, i).getrandbits(31))
                for i in range(count)]

    def held_out_prompts(self, count: int) -> list[Prompt]:
        """The evaluation set: `count` games reset with seeds training never uses (`SeedSplit`)."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [Prompt(f"eval/p{i}", list(system), answer=self.seeds.held_out_seed(i)) for i in range(count)]

    def environment(self, prompt: Prompt) -> TextArenaGame:
        """A fresh game, reset with the episode's seed."""
        return TextArenaGame(self.make(), prompt.answer, copies=self.copies)


def unwrapped(game: Any) -> Any:
    """The game under TextArena's wrappers (its observations as they come, not an observation wrapper's text)."""
    while hasattr(game, "env") and game.__class__.__name__.endswith("Wrapper"):
        game = game.env
    return game


def build(target: str, env_args: dict[str, Any], config: RolloutConfig) -> TextArenaTask:
    """The task of `textarena:<target>`: the id and env_args checked, and one game started, before any sampling."""
    spec = f"textarena:{target}"
    ta = import_library("textarena", "textarena", spec)
    registry = ta.envs.registration.ENV_REGISTRY
    if target not in registry or not single_player(registry[target].entry_point):
        single = sorted(i for i, s in registry.items() if single_player(s.entry_point) and not i.endswith(VARIANTS))
        what = f"{target!r} is not a single-player game" if target in registry else f"has no game {target!r}"
        raise UserError(f"rollout.env={spec!r}: TextArena {what}; its single-player games (each also as "
                        f"{' and '.join(VARIANTS)}): {', '.join(single)}")

    def make() -> Any:
        return ta.make(target, **env_args)

    check_offline_data(registry[target].entry_point, spec)
    try:
        check_args(registry[target], env_args, spec)
        game = TextArenaGame(make(), config.seed)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 (a game that needs nltk data, an LLM judge, a network ...)
        message = " ".join(str(e).replace("*", "").split())[:300] or type(e).__name__
        raise UserError(f"rollout.env={spec!r}: the game does not start here ({type(e).__name__}: {message})") from None
    copies = copy_checked(registry[target].entry_point, unwrapped(game.game), spec, branches(config))
    return TextArenaTask(make, max_turns=reply_bound(GameLimit.of(game.game), config.max_turns, spec),
                         system_prompt=config.system_prompt, seed=config.seed, name=spec, copies=copies,
                         eval_fraction=config.eval_fraction)


def copy_checked(entry_point: Any, game: Any, spec: str, branching: bool) -> bool:
    """Whether the game's episodes may branch by deep copy: one of TextArena's own games, or a class that sets
    SUPPORTS_DEEPCOPY; another is not branched, said once where the run would branch."""
    if (isinstance(entry_point, str) and entry_point.startswith("textarena.")) or copy_opt_in(game):
        return True
    if branching:
        say_once(f"rollout.env={spec!r}: branching is off for it (rollout.branch_at): it is not one of TextArena's "
                 f"own games and its class does not set {COPY_OPT_IN} = True (a copy might share what it holds); "
                 "each trajectory plays its own reset with the episode's seed")
    return False


def check_offline_data(entry_point: Any, spec: str) -> None:
    """A game whose module downloads nltk data when it is imported: refused in one line before it is imported where
    that data is not on this machine (the download would try the network first)."""
    path = module_path(entry_point)
    if path is None:
        return
    wanted = sorted(set(re.findall(r"""['"](\w+)['"]""", " ".join(re.findall(r"nltk\.download\(([^)]*)\)",
                                                                            path.read_text())))))
    missing = [name for name in wanted if not nltk_has(name)]
    if missing:
        raise UserError(f"rollout.env={spec!r}: the game downloads nltk data ({', '.join(missing)}) when it loads, which "
                        "is not on this machine (treerl downloads nothing at run time); install it first: "
                        f"python -m nltk.downloader {' '.join(missing)}")


def nltk_has(name: str) -> bool:
    """Whether nltk finds the resource `name` (a corpus, a tagger ...) on this machine, without downloading."""
    import nltk

    for kind in ("corpora", "taggers", "tokenizers", "chunkers", "models", "misc", "sentiment", "stemmers", "grammars"):
        for suffix in ("", ".zip"):
            try:
                nltk.data.find(f"{kind}/{name}{suffix}")
                return True
            except LookupError:
                continue
    return False


def reply_bound(limit: GameLimit, max_turns: int | None, spec: str) -> int:
    """treerl's bound on an episode's replies: rollout.max_turns, else the most the game's own limit allows (said once
    at the start where it may cut an episode the game would still score)."""
    bound = max_turns or limit.replies or DEFAULT_MAX_TURNS
    if limit.replies is None or bound < limit.replies:
        why = f"rollout.max_turns={max_turns}" if max_turns else "treerl's default; rollout.max_turns sets it"
        say_once(f"rollout.env={spec!r}: an episode still running after {bound} replies ({why}) is cut and dropped, "
                 f"not scored (rollout/dropped_env_truncated); {limit}")
    return bound


def single_player(entry_point: Any) -> bool:
    """Whether a registry entry's game is single-player: its module builds a SinglePlayerState (read from its source
    file, without importing every game: some do not import on this Python)."""
    path = module_path(entry_point)
    return path is not None and SINGLE_PLAYER in path.read_text()


def module_path(entry_point: Any) -> Path | None:
    """The source file of a registry entry's game, found without importing it (None where there is none)."""
    if not isinstance(entry_point, str):  # a class registered by a user
        source = inspect.getsourcefile(entry_point)
        return Path(source) if source is not None else None
    module = entry_point.split(":")[0]
    top = importlib.util.find_spec(module.split(".")[0])
    if top is None or not top.submodule_search_locations:
        return None
    path = Path(next(iter(top.submodule_search_locations))).joinpath(*module.split(".")[1:]).with_suffix(".py")
    return path if path.is_file() else None


def check_args(entry: Any, env_args: dict[str, Any], spec: str) -> None:
    """env_args the game's constructor does not take: one line naming those it does."""
    point = entry.entry_point
    if isinstance(point, str):
        module, name = point.split(":")
        point = getattr(importlib.import_module(module), name)
    parameters = inspect.signature(point.__init__).parameters
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return
    options = [name for name in parameters if name != "self"]
    if unknown := sorted(set(env_args) - set(options)):
        raise UserError(f"rollout.env_args: {unknown[0]!r} is not an option of {spec} (its options: "
                        f"{', '.join(options)}; its defaults for this id: {entry.kwargs})")

"""Branching an environment that cannot be deep-copied (a server's session, a client): replay into a fresh instance.

Step 1 (docs/architecture.md): where an episode branches, each branch needs its own environment.

treerl branches an episode by deep-copying its environment (`multi_turn.Trajectory.fork`). A session on an
environment server cannot be copied: `ReplayedEnvironment` holds one live `Session` and the episode's history (each
reply and what the environment answered). A deep copy shares no live session: a session that can be copied (`copyable`, an
in-process instance) is copied; otherwise the first copy takes the live one over, every other copy opens a fresh session with the same seed when it is first stepped, replays the recorded replies into
it and checks that every answer (the first observation, then each turn's messages, reward and done) equals the
recorded one. A replay that differs (the environment is not deterministic under its seed, or its server changed)
raises `ReplayDiverged`: that branch is dropped and counted (`replay_diverged`), its siblings go on. A replay costs
one session and the earlier turns again, inside the step's time limit (rollout.env_timeout).

An environment whose reset ignores the seed cannot be replayed (`replayable=False`): its session is opened when the
episode starts, its first observation is the episode's `opening`, and it branches only where its session copies
(`copies`); otherwise each trajectory plays its own session from its own reset, as TRL's OpenEnv integration plays
it (multi_turn: an environment whose `copies` is false is never forked). An environment known to be
non-deterministic may refuse branching instead (`refuse_branching`): one line at build time, before any sampling.

Copying is opt-in (`copy_opt_in`): a deep copy of an object that holds anything by path, id or connection (a working
directory, a container, a socket) shares it with the original even where `deepcopy` does not raise, so treerl copies
a library's instance only when its class says a copy is independent (`SUPPORTS_DEEPCOPY = True`) or the project has
checked it (TextArena's own games).

Used by: OpenEnv served (`openenv+http://...`, its own EnvClient), and any adapter whose instances cannot be copied.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from treerl.errors import UserError
from treerl.rollout.config import RolloutConfig
from treerl.rollout.conversations.chat import Message
from treerl.rollout.rewards.functions import NamedFailure
from treerl.rollout.tasks.base import EnvReply

REASON = "replay_diverged"
COPY_OPT_IN = "SUPPORTS_DEEPCOPY"  # a class attribute: True says a deep copy of an instance is an independent one


def copy_opt_in(obj: Any) -> bool:
    """Whether `obj` (an instance or its class) says its deep copies are independent environments."""
    return getattr(obj, COPY_OPT_IN, False) is True


class Session(Protocol):
    """One live instance of an environment, reset with its episode's seed: steps replies, holds a connection. One
    whose `copyable` is true also has `fork()` (an independent copy, e.g. a deep copy of an in-process instance)."""

    def step(self, reply: str) -> EnvReply:
        """The environment's answer to the model's reply."""
        ...

    def close(self) -> None:
        """Let go of the instance (a server's session, a connection)."""
        ...


Opener = Callable[[], tuple[Session, list[Message]]]  # a fresh session, reset with the seed, and its first observation


class ReplayDiverged(NamedFailure):
    """A replayed branch's environment answered differently from the recorded episode: the branch is dropped."""

    reason = REASON


@dataclass(frozen=True)
class Turn:
    """One recorded step: the reply sent and the environment's answer."""

    reply: str
    answer: EnvReply


class ReplayedEnvironment:
    """The Environment protocol over sessions of an environment that cannot be copied; deep-copying branches it."""

    def __init__(self, opener: Opener, first: list[Message], history: tuple[Turn, ...] = (),
                 session: Session | None = None, replayable: bool = True):
        """`first`: the first observation every fresh session must show (the prompt the episode started from);
        `replayable` false: the environment ignores its seed, `session` is the episode's own, `first` its opening."""
        self.opener = opener
        self.first = first
        self.replayable = replayable
        self.opening = None if replayable else first  # shown after the prompt (multi_turn.with_opening)
        self.history = list(history)
        self.session: Session | None = None
        self._closer: weakref.finalize | None = None
        if session is not None:
            self._own(session)

    def step(self, reply: str) -> EnvReply:
        """The answer of the live session (opened and replayed first if this branch has none); closed when done."""
        if self.session is None:
            self._own(self._replayed())
        answer = self.session.step(reply)  # type: ignore[union-attr]
        self.history.append(Turn(reply, answer))
        if answer.done:
            self.close()
        return answer

    def close(self) -> None:
        """Close the live session now (also done when this environment is garbage-collected)."""
        if self._closer is not None:
            self._closer()
        self.session, self._closer = None, None

    @property
    def copies(self) -> bool:
        """Whether a branch can have its own copy: by replay, or by copying the live session."""
        return self.replayable or self.session is not None and getattr(self.session, "copyable", False)

    def __deepcopy__(self, memo: dict[int, Any]) -> ReplayedEnvironment:
        """A branch: the same history and a copy of the live session where it copies (`fork`); else it takes the
        live session over (and this one replays if stepped again)."""
        forks = self.session is not None and getattr(self.session, "copyable", False)
        if not (forks or self.replayable):
            raise RuntimeError("an environment that ignores its seed and cannot be copied was branched")
        session = self.session.fork() if forks else self._release()  # type: ignore[union-attr]
        return ReplayedEnvironment(self.opener, self.first, tuple(self.history), session, self.replayable)

    def _own(self, session: Session) -> None:
        self.session = session
        self._closer = weakref.finalize(self, close_quietly, session)

    def _release(self) -> Session | None:
        """Hand the live session over: it is no longer closed with this environment."""
        session = self.session
        if self._closer is not None:
            self._closer.detach()
        self.session, self._closer = None, None
        return session

    def _replayed(self) -> Session:
        """A fresh session brought to this branch's state by replaying its history, each answer checked."""
        session, first = self.opener()
        try:
            if first != self.first:
                raise ReplayDiverged(f"a fresh session's first observation {short(first)} differs from the "
                                     f"episode's {short(self.first)} (the environment is not deterministic under "
                                     "its seed)")
            for k, turn in enumerate(self.history):
                answer = session.step(turn.reply)
                if not same_answer(answer, turn.answer):
                    raise ReplayDiverged(f"replaying turn {k} ({turn.reply[:80]!r}) answered {short(answer)}, the "
                                         f"episode had {short(turn.answer)}")
        except BaseException:
            close_quietly(session)
            raise
        return session


def same_answer(a: EnvReply, b: EnvReply) -> bool:
    """Whether two answers show the model the same thing and score it the same."""
    return a.messages == b.messages and a.reward == b.reward and a.done == b.done


def short(value: Any) -> str:
    """A value for an error line, at most 200 characters."""
    text = repr(value.messages if isinstance(value, EnvReply) else value)
    return text if len(text) <= 200 else text[:197] + "..."


def close_quietly(session: Session) -> None:
    """Close a session; one that fails to close (its server is gone) is already closed for our purposes."""
    with contextlib.suppress(Exception):  # a lost connection, a dead server: nothing left to release
        session.close()


def branches(config: RolloutConfig) -> bool:
    """Whether a run forks episodes after their first turn (rollout.branch_at with branch_factor > 1)."""
    return bool(config.branch_at) and config.branch_factor > 1


def refuse_branching(config: RolloutConfig, spec: str, why: str) -> None:
    """One line, before any sampling, when the run would branch an environment that can be neither copied nor
    replayed (`why` says which it is)."""
    if branches(config):
        raise UserError(f"rollout.env={spec!r} cannot branch ({why}): set rollout.branch_at=[] (or "
                        f"rollout.branch_factor=1); rollout.group_size still plays {config.group_size} episodes "
                        "of each prompt")

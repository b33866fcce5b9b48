"""The errors a user can fix: each is one line naming the file, row, key or path that is wrong.

Beside the steps (docs/architecture.md): what any step raises for input a user can fix.

    raise DataError(f"{path}:{line}: not valid JSON (...)")

The CLI catches `UserError` in one place (`treerl.cli.main`) and prints `error: <message>` with exit
code 2; every other exception is a bug in treerl and keeps its traceback. Any layer may raise
these (this module imports nothing of treerl).
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input the user can fix (config, data, reward, model or checkpoint path); the message says what and where."""


class DataError(UserError):
    """A data file that cannot be used: names the file and the line or row (and the field)."""


class ModelPathError(UserError):
    """A model or tokenizer path that is not a usable local transformers checkpoint."""


class CheckpointError(UserError):
    """A checkpoint that is incomplete, corrupt, or does not fit this run; names the checkpoint and what differs."""


class TrainingStopped(RuntimeError):
    """The run stopped itself on purpose (a non-finite loss, gradient or weight, or steps whose every sample was
    dropped); nothing non-finite was written."""

    exit_code = 3


class ServerError(RuntimeError):
    """An inference server could not be reached, refused a request, or answered in a shape treerl cannot read; the
    message names the server, the endpoint, its answer and `rollout.server_type`. A training run stops on it with
    its last checkpoint whole, and says how to continue."""

    exit_code = 4

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status of the answer, if there was one


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM sent to the run (a real Ctrl-C, never one an agent or reward raised); the CLI exits with
    128 + the signal's number and this one line."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

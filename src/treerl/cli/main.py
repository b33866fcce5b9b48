"""The `treerl` command.

Beside the steps (docs/architecture.md): the command line.

Every command runs through `reported`: a user's mistake (`treerl.errors.UserError`: a config key, a
data row, a reward import, a model or checkpoint path) is one line, `error: ...`, and exit code 2; a
run that stopped itself (a NaN/inf, `TrainingStopped`) is one line and exit code 3; an inference server
that failed (`ServerError`, after the last complete step is checkpointed) is one line and exit code 4; a SIGINT / SIGTERM
outside the training steps (`treerl.cli.signals`) is one line and exit code 130 / 143; anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations

from treerl.cli import signals

_importing = signals.install(signals.exit_at_once)  # a signal while the modules below import: one line, 130 / 143

import functools
from collections.abc import Callable
from typing import Any

import typer

from treerl.cli import bench_cmd, eval_cmd, export_cmd, inspect_cmd, serve_cmd, train_cmd
from treerl.errors import Interrupted, ServerError, TrainingStopped, UserError

app = typer.Typer(
    help="treerl: RL post-training that never computes a shared prefix twice.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def reported(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with user errors as one line and exit code 2 (TrainingStopped: exit code 3; ServerError: exit code
    4; a signal: 128 + its number)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            with signals.stop_on_signals():
                return command(*args, **kwargs)
        except Interrupted as e:
            typer.echo(str(e), err=True)
            raise typer.Exit(e.exit_code) from None
        except UserError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except TrainingStopped as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(TrainingStopped.exit_code) from None
        except ServerError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(ServerError.exit_code) from None
        except EOFError as e:  # click would print only "Aborted."
            raise RuntimeError(f"unexpected end of input: {e}") from e

    return run


@app.callback()
def main() -> None:
    """treerl: RL post-training that never computes a shared prefix twice."""


app.command("bench")(reported(bench_cmd.bench))
app.command("eval")(reported(eval_cmd.evaluate))
app.command("export")(reported(export_cmd.export))
app.command("inspect")(reported(inspect_cmd.inspect))
app.command("serve")(reported(serve_cmd.serve))
app.command("train")(reported(train_cmd.train))
app.command("sft")(reported(train_cmd.sft))
signals.restore(_importing)  # from here on `reported` handles them, for the command's whole run


if __name__ == "__main__":
    app()

"""The `treerl` command."""

from __future__ import annotations

import typer

from treerl.cli import bench_cmd, inspect_cmd, serve_cmd, train_cmd

app = typer.Typer(
    help="treerl: RL post-training that never computes a shared prefix twice.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def main() -> None:
    """treerl: RL post-training that never computes a shared prefix twice."""


app.command("bench")(bench_cmd.bench)
app.command("inspect")(inspect_cmd.inspect)
app.command("serve")(serve_cmd.serve)
app.command("train")(train_cmd.train)
app.command("sft")(train_cmd.sft)


if __name__ == "__main__":
    app()

"""`treerl train` and `treerl sft`: read the config (YAML + key=value overrides), call the trainer.

Beside the steps (docs/architecture.md): the command that runs them.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

import typer

from treerl.trainer.core.config import packaged_configs

ARGS = "CONFIG (a YAML file or a packaged config name), then key=value overrides"
TRAIN_ARGS_HELP = (f"{ARGS}; e.g. guess_number trainer.steps=100. Packaged configs: "
                   f"{', '.join(sorted(packaged_configs()))}")
SFT_ARGS_HELP = f"{ARGS}; e.g. sft.data_path=conversations.jsonl trainer.steps=50 (no CONFIG: sft_example)"


def _split(args: list[str] | None) -> tuple[str | None, list[str]]:
    """The first argument is the config file unless it is a key=value override."""
    args = list(args or [])
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _load(args: list[str] | None, base: tuple[str, ...] = ()):
    from treerl.trainer.core.config import load_config

    path, overrides = _split(args)
    return load_config(path, overrides, base=base)


def _run(config, print_config: bool, loop: Callable) -> None:
    """Run `loop(config)`; a run a signal stopped (after its checkpoint) exits with 128 + the signal's number."""
    from treerl.trainer.core.config import to_yaml

    if print_config:
        typer.echo(to_yaml(config), nl=False)
        return
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from treerl.distributed import close_distributed, exit_process

    try:
        result = loop(config)
    except BaseException:
        close_distributed(wait_for_all=False)  # under torchrun: the other ranks may never reach a barrier
        raise
    code = 128 + signal.Signals[result.stopped_by].value if result.stopped_by else 0
    if close_distributed() == "gloo":  # under torchrun on CPU: the end of a gloo rank, see exit_process
        exit_process(code)
    if code:
        raise typer.Exit(code)


def train(
    args: list[str] = typer.Argument(None, help=TRAIN_ARGS_HELP, show_default=False),
    print_config: bool = typer.Option(False, "--print-config", help="print the resolved config and exit"),
) -> None:
    """RL-train a policy (no config: the built-in CPU demo, a tiny model learning arithmetic).

    Under `torchrun --nproc-per-node K` it trains data-parallel with no other change.
    """
    from treerl.trainer import train as train_loop

    _run(_load(args), print_config, train_loop)


def sft(
    args: list[str] = typer.Argument(None, help=SFT_ARGS_HELP, show_default=False),
    print_config: bool = typer.Option(False, "--print-config", help="print the resolved config and exit"),
) -> None:
    """Fine-tune on branching conversations (no config: the shipped example of agent trajectories)."""
    from treerl.trainer import SFT_DEFAULTS
    from treerl.trainer import sft as sft_loop

    path, overrides = _split(args)
    _run(_load([path or "sft_example", *overrides], base=SFT_DEFAULTS), print_config, sft_loop)

"""Checks of command-line options: a value out of range is one `error: --name=value ...` line, before any work.

Beside the steps (docs/architecture.md): the command line.
"""

from __future__ import annotations

from treerl.errors import UserError


def check_positive(options: dict[str, float]) -> None:
    """Every option named here must be > 0; the first that is not is a UserError naming it."""
    for name, value in options.items():
        if not value > 0:
            raise UserError(f"{name}={value} must be > 0")

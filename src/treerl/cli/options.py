"""Checks of command-line options: a value out of range is one `error: --name=value ...` line, before any work.

Beside the steps (docs/architecture.md): the command line.
"""

from __future__ import annotations

from pathlib import Path

from treerl.errors import UserError


def check_positive(options: dict[str, float]) -> None:
    """Every option named here must be > 0; the first that is not is a UserError naming it."""
    for name, value in options.items():
        if not value > 0:
            raise UserError(f"{name}={value} must be > 0")


def check_among(name: str, values: list[str], allowed: list[str] | tuple[str, ...]) -> None:
    """Each of a comma-separated option's `values` is one of `allowed` (and there is at least one)."""
    unknown = [v for v in values if v not in allowed]
    if unknown or not values:
        if len(values) == 1:
            raise UserError(f"{name}={values[0]!r} is not one of: {', '.join(allowed)}")
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "empty"
        raise UserError(f"{name}={','.join(values)!r}: {what}; choose among {', '.join(allowed)}")


def integers(name: str, text: str, least: int | None = None) -> list[int]:
    """A comma-separated list of integers (each >= `least`), or a UserError naming the option and an example."""
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or (least is not None and min(values) < least):
        bound = f" >= {least}" if least is not None else ""
        raise UserError(f"{name}={text!r} must be comma-separated integers{bound}, e.g. {name} 1,2,4")
    return values


def check_existing(name: str, path: str | None) -> None:
    """A local path that exists (nothing is downloaded: a name that is not a path is not looked up anywhere)."""
    if path is not None and not Path(path).exists():
        raise UserError(f"{name}={path!r} does not exist (treerl only reads local files; nothing is downloaded)")

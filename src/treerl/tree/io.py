"""Token sequences on disk: one JSON object per line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from treerl.tree.sequence import BatchError, Sequence


def json_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; a bad line is an error naming file and line."""
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise BatchError(f"{path}:{line_no}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise BatchError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            yield line_no, row


def read_jsonl(path: str | Path) -> list[Sequence]:
    """Each line: {"tokens": [...]} plus optional per-token lists (same length) and per-sequence values."""
    sequences = []
    for line_no, row in json_lines(path):
        tokens = row.pop("tokens", None)
        if tokens is None:
            tokens = row.pop("input_ids", None)
        if not isinstance(tokens, list):
            raise BatchError(f"{path}:{line_no}: field 'tokens' (a list of token ids) is missing")
        name = str(row.pop("name", f"line{line_no}"))
        fields = {k: v for k, v in row.items() if isinstance(v, list)}
        info = {k: v for k, v in row.items() if not isinstance(v, list)}
        sequences.append(Sequence(tokens, fields=fields, info=info, name=name))
    return sequences


def write_jsonl(sequences: list[Sequence], path: str | Path) -> None:
    """The inverse of `read_jsonl`."""
    with open(path, "w") as f:
        for seq in sequences:
            row = {"name": seq.name, "tokens": seq.tokens.tolist()}
            row.update({k: v.tolist() for k, v in seq.fields.items()})
            row.update(seq.info)
            f.write(json.dumps(row) + "\n")

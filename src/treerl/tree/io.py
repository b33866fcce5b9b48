"""Token sequences on disk: one JSON object per line, read as a stream with a bound on each line.

Beside the steps (docs/architecture.md): sequences to and from disk (`treerl inspect`, your own batches).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from treerl.errors import DataError
from treerl.tree.sequence import ROUTED_EXPERTS, TokenSequence

MAX_LINE_BYTES = 16 * 2**20  # a longer line is refused before it is read whole (a 100 MB line is a broken file)
MAX_TOKEN_ID = 2**63 - 1  # token ids are stored as int64
# The per-token fields treerl's losses and engines read (treerl.algo.checks): each must be a list, one value a token.
PER_TOKEN_FIELDS = ("loss_mask", "advantages", "old_logprobs", "prox_logprobs", "ref_logprobs", "returns", "values",
                    "versions")


def json_lines(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES,
               limit_option: str = "max_line_bytes") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line, read one line at a time; a bad line (not UTF-8, not a JSON
    object, longer than `max_line_bytes`, which `limit_option` sets) is a DataError naming file and line."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; opening is the only step that may name a missing file)
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None
    with f:
        line_no = 0
        while raw := f.readline(max_line_bytes + 1):
            line_no += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise DataError(f"{path}:{line_no}: line longer than {max_line_bytes} bytes (raise {limit_option} "
                                "if it really is one record)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start} of "
                                "the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            yield line_no, row


def read_jsonl(path: str | Path, max_line_bytes: int = MAX_LINE_BYTES,
               limit_option: str = "max_line_bytes") -> list[TokenSequence]:
    """Each line: {"tokens": [...]} plus optional per-token lists (same length) and per-sequence values."""
    sequences = []
    for line_no, row in json_lines(path, max_line_bytes, limit_option):
        tokens = row.pop("tokens", None)
        if tokens is None:
            tokens = row.pop("input_ids", None)
        if tokens is None:
            raise DataError(f"{path}:{line_no}: field 'tokens' (a list of token ids) is missing")
        if not isinstance(tokens, list):
            raise DataError(f"{path}:{line_no}: field 'tokens' must be a list of token ids, not {json.dumps(tokens)}")
        bad = next((i for i, t in enumerate(tokens) if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID), None)
        if bad is not None:  # a bool is not an id
            raise DataError(f"{path}:{line_no}: field 'tokens' holds {json.dumps(tokens[bad])} at position {bad}; "
                            "token ids are integers >= 0 and < 2**63")
        name = str(row.pop("name", f"line{line_no}"))
        fields = {k: v for k, v in row.items() if isinstance(v, list)}
        info = {k: v for k, v in row.items() if not isinstance(v, list)}
        check_fields(fields, info, f"{path}:{line_no}")
        sequences.append(TokenSequence(tokens, fields=fields, info=info, name=name))
    return sequences


def check_fields(fields: dict[str, list[Any]], info: dict[str, Any], where: str) -> None:
    """A list is a per-token field and holds one number a token; a field the losses read per token must be a list
    (as a single value it would be taken for a per-sequence one, and silently not be the field)."""
    for key, values in fields.items():
        if key == ROUTED_EXPERTS:  # a token's experts: [decoder layers][top_k] integers (treerl.engine.routing)
            bad = next((i for i, v in enumerate(values) if not (isinstance(v, list) and all(
                isinstance(layer, list) and all(type(e) is int for e in layer) for layer in v))), None)
            if bad is not None:
                raise DataError(f"{where}: field {key!r} holds {json.dumps(values[bad])[:100]} at position {bad}; it "
                                "holds a token's experts as one list of integers a decoder layer")
            continue
        bad = next((i for i, v in enumerate(values) if not _is_number(v)), None)
        if bad is not None:
            raise DataError(f"{where}: field {key!r} holds {json.dumps(values[bad])} at position {bad}; a per-token "
                            "field holds one number a token")
    for key in PER_TOKEN_FIELDS:
        if key in info:
            raise DataError(f"{where}: field {key!r} must be a list of numbers, one a token, not "
                            f"{json.dumps(info[key])[:100]}")


def _is_number(value: Any) -> bool:
    """A JSON number torch can hold: a float, or an int within int64 (not a bool)."""
    return type(value) is float or (type(value) is int and -(2**63) <= value <= MAX_TOKEN_ID)


def write_jsonl(sequences: list[TokenSequence], path: str | Path) -> None:
    """The inverse of `read_jsonl`. A sequence that shows images is refused before anything is written: a line holds
    tokens and fields, and the pixels would be lost."""
    for i, seq in enumerate(sequences):
        if seq.images:
            raise DataError(f"{path}: {seq.label(i)} shows {len(seq.images)} image(s); JSON lines hold tokens and "
                            "fields only, so its pixels would be lost")
    with open(path, "w") as f:
        for seq in sequences:
            row = {"name": seq.name, "tokens": seq.tokens.tolist()}
            row.update({k: v.tolist() for k, v in seq.fields.items()})
            row.update(seq.info)
            f.write(json.dumps(row) + "\n")

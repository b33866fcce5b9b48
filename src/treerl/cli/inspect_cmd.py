"""`treerl inspect`: what a batch's prefix tree looks like and what sharing would save.

Beside the steps (docs/architecture.md): shows the tree step 5 would build from a batch.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from treerl.cli.options import check_positive
from treerl.tree import PrefixTree, validate_sequences
from treerl.tree.io import MAX_LINE_BYTES, read_jsonl


def inspect(
    path: Path = typer.Argument(..., exists=True, dir_okay=False, help="JSONL file, one {'tokens': [...]} per line"),
    chunk_tokens: int = typer.Option(2048, help="chunk size of the DFS engine's plan"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    max_line_bytes: int = typer.Option(MAX_LINE_BYTES, help="longest line accepted (a longer one is an error)"),
) -> None:
    """Print the prefix-tree stats of a batch of token sequences."""
    check_positive({"--chunk-tokens": chunk_tokens, "--max-line-bytes": max_line_bytes})
    sequences = read_jsonl(path, max_line_bytes, "--max-line-bytes")
    validate_sequences(sequences)
    tree = PrefixTree.build(sequences)
    stats = asdict(tree.stats())
    stats["compression"] = round(tree.stats().compression, 4)
    stats["chunks"] = tree.chunked(chunk_tokens).stats().nodes
    if as_json:
        print(json.dumps(stats))
        return
    table = Table(title=f"prefix tree of {path.name}")
    table.add_column("stat")
    table.add_column("value", justify="right")
    labels = {
        "sequences": "sequences",
        "flat_tokens": "flat tokens T",
        "unique_tokens": "unique tokens U",
        "compression": "compression T/U",
        "nodes": "nodes",
        "leaves": "leaves",
        "max_depth": "longest sequence (tokens)",
        "max_path_nodes": "deepest path (nodes)",
        "mean_branching": "children per internal node",
        "max_branching": "most children",
        "chunks": f"DFS chunks (<= {chunk_tokens} tokens)",
    }
    for key, label in labels.items():
        value = stats[key]
        table.add_row(label, f"{value:.2f}" if isinstance(value, float) else f"{value:,}")
    Console().print(table)

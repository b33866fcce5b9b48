"""examples/grpo_minimal.py runs as a user runs it, and uses only treerl's public API (names a package exports)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_minimal.py"


def test_grpo_minimal_trains_two_steps_and_prints_the_reward(capsys):
    spec = importlib.util.spec_from_file_location("grpo_minimal", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # in this process: no second interpreter importing torch
    example.main(steps=2)
    printed = capsys.readouterr().out
    assert "step 0: mean reward" in printed and "step 1: mean reward" in printed, printed


def test_grpo_minimal_imports_only_public_names():
    for node in ast.walk(ast.parse(EXAMPLE.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("treerl"):
            module = importlib.import_module(node.module)
            public = getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")])
            for alias in node.names:
                assert alias.name in public, f"{node.module}.{alias.name} is not exported (__all__)"

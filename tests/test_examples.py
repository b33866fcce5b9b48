"""examples/: grpo_minimal.py runs as a user runs it and uses only treerl's public API (names a package exports);
format_sft_data.py writes the reasoning-gym recipe's SFT conversations from its training items."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
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


FORMAT = ROOT / "examples" / "format_sft_data.py"


def test_format_sft_data_answers_training_items_in_tags(tmp_path):
    """examples/format_sft_data.py: SFT conversations of the recipe's TRAINING items (none evaluation holds out), each
    the prompt as the run shows it and its answer in answer tags; `treerl sft` reads them."""
    from treerl.rollout import ChatFormat, builtin_tokenizer
    from treerl.rollout.tasks import build_task
    from treerl.trainer import load_config
    from treerl.trainer.sft.data import load_conversations

    spec = importlib.util.spec_from_file_location("format_sft_data", FORMAT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = example.conversations("smollm2_reasoning", 120)
    task = build_task(load_config("smollm2_reasoning").rollout)
    trained = [p for step in range(15) for p in task.prompts(step, 8)]
    assert [r["messages"][:-1] for r in rows] == [p.messages for p in trained]
    assert [r["messages"][-1]["content"] for r in rows] == [f"<answer>{p.answer.answer['answer']}</answer>"
                                                            for p in trained]
    held = {p.messages[-1]["content"] for p in task.held_out_prompts(64)}
    assert not held & {r["messages"][-2]["content"] for r in rows}
    path = tmp_path / "format.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(load_conversations(path, ChatFormat(builtin_tokenizer()))) == 120

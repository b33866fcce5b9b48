"""SFT conversations that teach a model an environment's answer format, from the items the run trains on.

    python examples/format_sft_data.py smollm2_reasoning runs/smollm2_reasoning_format.jsonl --rows 16

For each of the first ROWS training prompts of the config's task (its training stream: never an item evaluation holds
out), one conversation for `treerl sft`: the prompt's messages as the run shows them (reasoning-gym's system prompt
and the question) and the reply the scorer reads, the item's answer between answer tags (`<answer>7</answer>`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from treerl.rollout.tasks import build_task
from treerl.trainer import load_config


def conversations(config_name: str, rows: int) -> list[dict]:
    """The first `rows` training prompts of the config's task, each with its answer in answer tags as the reply."""
    config = load_config(config_name)
    task = build_task(config.rollout)
    out = []
    for prompt in task.prompts(0, rows):
        answer = getattr(prompt.answer, "answer", prompt.answer)  # a mixture's prompt routes its item's entry
        reply = {"role": "assistant", "content": f"<answer>{answer['answer']}</answer>"}
        out.append({"id": prompt.id, "messages": [*prompt.messages, reply]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the RL config whose task's training items to use (a file or packaged name)")
    parser.add_argument("out", type=Path, help="the JSONL file to write (sft.data_path)")
    parser.add_argument("--rows", type=int, default=16, help="conversations to write")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = conversations(args.config, args.rows)
    args.out.write_text("".join(json.dumps(c) + "\n" for c in written))
    print(f"wrote {len(written)} conversations to {args.out}")


if __name__ == "__main__":
    main()

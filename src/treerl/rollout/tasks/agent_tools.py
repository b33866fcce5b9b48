"""Built-in agent task: a tiny tau2-like tool world, played by an OpenAI-SDK agent through the proxy.

Step 1 (docs/architecture.md): a built-in task's prompts, tools and reward.

Each task is a table of records `{"id": i, "code": digit}` for ids 0-9 and a question "code of
7?". The agent (`agent_tools_agent.py` beside this file, also `examples/agent_tools_agent.py`)
asks the model to call `lookup` (a named tool choice: the model writes the arguments), runs the
lookup, shows the record as the tool's answer, asks for the code and checks it (0.8 for the right
code; small credits for the right lookup, well-written arguments and a numeric answer, so that a
random-init model has something to learn from). Two model calls per episode, the second
extending the first token for token; every episode shares the tool definitions at the top of the
prompt and the episodes of one task share the question, so a batch compresses ~9x as a prefix
tree. The tiny model learns to look up the right id, then to copy the code from the tool's answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from treerl.rollout.tasks.base import Prompt
from treerl.rollout.tasks.heldout import EVAL_FRACTION, Generated, ItemSplit

AGENT = f"{Path(__file__).with_name('agent_tools_agent.py')}:episode"  # the built-in task's agent


@dataclass
class AgentTools(Generated):
    """Look up a record by id with a tool, answer with its code; evaluation asks about held-out tables."""

    seed: int = 0
    records: int = 10  # ids 0 .. records - 1
    max_new_tokens: int = 10  # reply budget of one call (the agent asks for at most this)
    max_turns: int = 4  # model calls per episode at most (the agent makes 2)
    name: str = "agent_tools"
    agent: str = AGENT
    eval_fraction: float = EVAL_FRACTION  # share of the tasks (table and question) held out for evaluation
    what = "tasks"

    def __post_init__(self) -> None:
        if not 1 <= self.records <= 10:
            raise ValueError(f"agent_tools: records must be in [1, 10], got {self.records}")

    @property
    def split(self) -> ItemSplit:
        """The tasks, by table and question (a seeded hash of each)."""
        return ItemSplit(self.name, self.seed, self.eval_fraction)

    def item(self, rng) -> tuple[str, Prompt]:
        """One task drawn from `rng`; the prompt's `answer` is the task dict the agent gets."""
        table = {str(k): {"id": k, "code": rng.randrange(10)} for k in range(self.records)}
        wanted = rng.randrange(self.records)
        task = {"question": f"code of {wanted}?", "id": wanted, "answer": str(table[str(wanted)]["code"]),
                "records": table}
        key = repr(([record["code"] for record in table.values()], wanted))
        return key, Prompt("", [{"role": "user", "content": task["question"]}], answer=task)

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

from treerl.rollout.tasks.base import Prompt, rng_for

AGENT = f"{Path(__file__).with_name('agent_tools_agent.py')}:episode"  # the built-in task's agent


@dataclass
class AgentTools:
    """Look up a record by id with a tool, answer with its code."""

    seed: int = 0
    records: int = 10  # ids 0 .. records - 1
    max_new_tokens: int = 10  # reply budget of one call (the agent asks for at most this)
    max_turns: int = 4  # model calls per episode at most (the agent makes 2)
    name: str = "agent_tools"
    agent: str = AGENT

    def __post_init__(self) -> None:
        if not 1 <= self.records <= 10:
            raise ValueError(f"agent_tools: records must be in [1, 10], got {self.records}")

    def prompts(self, step: int, count: int) -> list[Prompt]:
        """`count` tasks of step `step` (the same for the same step); each prompt's `answer` is the task dict."""
        out = []
        for i in range(count):
            rng = rng_for(self.name, self.seed, step, i)
            table = {str(k): {"id": k, "code": rng.randrange(10)} for k in range(self.records)}
            wanted = rng.randrange(self.records)
            task = {"question": f"code of {wanted}?", "id": wanted, "answer": str(table[str(wanted)]["code"]),
                    "records": table}
            out.append(Prompt(f"s{step}/p{i}", [{"role": "user", "content": task["question"]}], answer=task))
        return out

"""A verifiers 0.4 taskset written in the tests: a tool environment, as `vf init --add-tool` writes one (a Toolset
served over MCP per episode); the reward is 1 when the final reply holds what the tool answered."""

import verifiers.v1 as vf
from vf_scoring import spelled


class SpellerToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "speller"

    @vf.tool
    def spell(self, word: str) -> str:
        """Spell a word letter by letter."""
        return spelled(word)


class SpellerData(vf.TaskData):
    answer: str


class SpellerTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class SpellerTask(vf.Task[SpellerData, vf.State, SpellerTaskConfig]):
    @classmethod
    def toolsets(cls, config: SpellerTaskConfig) -> list[vf.Toolset]:
        return [SpellerToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def spelled(self, trace: vf.Trace) -> float:
        return 1.0 if spelled(self.data.answer) in trace.last_reply else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class SpellerConfig(vf.TasksetConfig):
    task: SpellerTaskConfig = SpellerTaskConfig()


class SpellerTaskset(vf.Taskset[SpellerTask, SpellerConfig]):
    def load(self) -> list[SpellerTask]:
        return [SpellerTask(SpellerData(prompt=f"Spell {w} with the tool.", answer=w), self.config.task)
                for w in ("cat", "dog")]


__all__ = ["SpellerTaskset"]

if __name__ == "__main__":
    SpellerToolset.run()

"""A verifiers 0.4 taskset written in the tests: single-turn, scored by a rubric of two weighted rewards and a
metric. A reply that says RAISE, NAN or SLEEP makes the rubric raise, give NaN or outlast its deadline."""

import asyncio

import verifiers.v1 as vf
from vf_scoring import brief, correct

WORDS = ["apple", "river", "stone", "cloud", "grass"]


class SpellingData(vf.TaskData):
    answer: str


class SpellingTask(vf.Task[SpellingData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if "RAISE" in trace.last_reply:
            raise RuntimeError("the rubric broke")
        if "SLEEP" in trace.last_reply:
            await asyncio.sleep(30)
        return float("nan") if "NAN" in trace.last_reply else correct(trace.last_reply, self.data.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return brief(trace.last_reply)

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SpellingConfig(vf.TasksetConfig):
    count: int = 5


class SpellingTaskset(vf.Taskset[SpellingTask, SpellingConfig]):
    def load(self) -> list[SpellingTask]:
        return [SpellingTask(SpellingData(prompt=f"Write the word {w}.", answer=w), self.config.task)
                for w in WORDS[: self.config.count]]


__all__ = ["SpellingTaskset"]

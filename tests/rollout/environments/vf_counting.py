"""A verifiers 0.4 environment written in the tests: multi-turn, as verifiers' own TextArena env is written (an
`Env` whose run() answers each reply with the next user turn), scored after the exchange by `counted`."""

import verifiers.v1 as vf
from vf_scoring import counted


class CountingData(vf.TaskData):
    rounds: int


class CountingTask(vf.Task[CountingData]):
    pass


class CountingConfig(vf.TasksetConfig):
    rounds: int = 3


class CountingEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class CountingEnv(vf.Env[CountingEnvConfig]):
    async def run(self, task, agents):
        replies = []
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                replies.append(segment.last_reply)
                if len(replies) == task.data.rounds:
                    break
                segment = await interaction.turn(f"Now say {len(replies) + 1}.")
        interaction.trace.record_reward("counted", counted(replies), 1.0)
        interaction.trace.record_metric("rounds", float(len(replies)))


class CountingTaskset(vf.Taskset[CountingTask, CountingConfig]):
    def load(self) -> list[CountingTask]:
        return [CountingTask(CountingData(prompt="Say 1.", rounds=self.config.rounds), self.config.task)]


__all__ = ["CountingEnv", "CountingTaskset"]

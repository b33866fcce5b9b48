"""Training loops: RL (`train`: synchronous or asynchronous) and SFT on branching conversations (`sft`), one config.

Drives steps 1 to 6 (docs/architecture.md).

    from treerl.trainer import load_config, train
    result = train(load_config("guess_number", ["trainer.steps=100"]))
    print(result.reward_start, result.reward_end)

Layout, bottom to top (docs/architecture.md): `core` (what every loop shares: the config tree, `Run`,
`update`, checkpoints and resume, metrics, precision, export), `rl` (`learn`: one batch -> optimizer
steps and the step loop, shared by both RL modes; `sync`: sample then learn), `asynchronous` (rollout
workers sample while the trainer learns) and `sft`. `sync`, `asynchronous` and `sft` import only `core`
and `rl.learn`, never each other; only `train` below sees both RL modes. See docs/training.md.
"""

from treerl.trainer.asynchronous.loop import train_async
from treerl.trainer.core.config import Config, ConfigError, load_config, to_yaml
from treerl.trainer.rl.learn import TrainResult
from treerl.trainer.rl.sync import train_sync
from treerl.trainer.sft.loop import SFT_DEFAULTS, SFTResult, sft


def train(config: Config) -> TrainResult:
    """Run RL as configured: `trainer.mode=async` trains from rollout workers, otherwise sample-then-learn."""
    return train_async(config) if config.trainer.mode == "async" else train_sync(config)


__all__ = ["SFT_DEFAULTS", "Config", "ConfigError", "SFTResult", "TrainResult", "load_config", "sft", "to_yaml", "train"]

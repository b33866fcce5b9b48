"""Training loops: synchronous RL (`train`) and SFT on branching conversations (`sft`), one config tree.

    from treerl.trainer import load_config, train
    result = train(load_config("guess_number", ["trainer.steps=100"]))
    print(result.reward_start, result.reward_end)

Pieces, top to bottom: `config` (the dataclass tree and YAML loading), `run` (ranks, policy,
optimizer, engine, one optimizer step), `update` (epochs x minibatches on a batch), `rl` and `sft`
(the loops), `checkpoint` (exact resume), `metrics` (JSONL + TensorBoard), `sft_data` (the
branching-conversation format). See docs/training.md.
"""

from treerl.trainer.config import Config, ConfigError, load_config, to_yaml
from treerl.trainer.rl import TrainResult, train
from treerl.trainer.sft import SFT_DEFAULTS, SFTResult, sft

__all__ = ["SFT_DEFAULTS", "Config", "ConfigError", "SFTResult", "TrainResult", "load_config", "sft", "to_yaml", "train"]

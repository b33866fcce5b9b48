"""Trainer test helpers: tiny, fast configs (a few samples, 1-3 steps) written under a temporary directory."""

from __future__ import annotations

import pytest

from treerl.trainer import load_config

FAST = [
    "trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_prompts=0", "trainer.warmup_steps=0",
    "rollout.prompts_per_step=2", "rollout.group_size=4",
]


@pytest.fixture
def tiny_config(tmp_path):
    """`tiny_config(*overrides, name=...)`: a checked Config that trains in about a second per step."""

    def make(*overrides: str, config: str | None = None, name: str = "run", base: tuple[str, ...] = ()):
        return load_config(config, [*FAST, f"trainer.output_dir={tmp_path / name}", *overrides], base=base)

    return make

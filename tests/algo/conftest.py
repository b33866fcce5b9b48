"""Fixtures of the algo tests: tiny float64 policy and critic models."""

from __future__ import annotations

import pytest
import torch

from treerl.algo import build_critic
from treerl.models import build_model


@pytest.fixture(scope="session")
def policy() -> torch.nn.Module:
    return build_model(shape="tiny-qwen3", dtype=torch.float64, seed=0)


@pytest.fixture(scope="session")
def critic() -> torch.nn.Module:
    return build_critic(shape="tiny-qwen3", dtype=torch.float64, seed=1)


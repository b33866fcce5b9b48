"""Fixtures of the algo tests: tiny float64 policy and critic models."""

from __future__ import annotations

import pytest
import torch
from algo_testing import VOCAB
from support import tiny_model

from treerl.algo import build_critic


@pytest.fixture(scope="session")
def policy() -> torch.nn.Module:
    """The shared float64 tiny-qwen3 of the test suite (RMSNorm kept in float64: no 1e-7 noise floor)."""
    return tiny_model("tiny-qwen3", vocab_size=VOCAB)


@pytest.fixture(scope="session")
def critic() -> torch.nn.Module:
    """A stock float64 critic (transformers' float32 RMSNorm: comparisons land near 1e-7)."""
    return build_critic(shape="tiny-qwen3", vocab_size=VOCAB, dtype=torch.float64, seed=1)


@pytest.fixture(autouse=True)
def _leave_policy_gradients_as_found(policy):
    """The policy is shared by the whole suite: no test may leave .grad behind."""
    yield
    policy.zero_grad(set_to_none=True)

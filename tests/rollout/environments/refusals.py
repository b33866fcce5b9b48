"""What the environment adapters' tests share: a setup refused in one line before anything is sampled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from treerl.errors import UserError


def refused_before_sampling(build: Callable[[], Any], sampler: Any, message: str) -> None:
    """`build()` raises a one-line UserError holding `message`, and `sampler` was never asked for a sample."""
    with pytest.raises(UserError) as error:
        build()
    assert message in str(error.value) and "\n" not in str(error.value)
    assert sampler.calls == []

"""Shared fixtures."""

from __future__ import annotations

import pytest
from support import ARCHS, tiny_model


@pytest.fixture(params=ARCHS)
def model(request):
    """Each test that takes `model` runs once per architecture."""
    return tiny_model(request.param)

"""tools/mutate.py still fits the code: each mutation's text occurs once in its file, the mutated file compiles and
its tests exist, so the exercise of CONTRIBUTING.md runs as written. The mutations themselves run by hand
(`python tools/mutate.py`)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "tools" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


mutate = _load_tool()


@pytest.mark.parametrize("mutation", mutate.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_and_names_tests_that_exist(mutation):
    assert mutate.applies(mutation) is None, f"{mutation.name}: {mutate.applies(mutation)}; update tools/mutate.py"
    for target in mutation.tests:
        path, _, test = target.partition("::")
        assert (ROOT / path).exists(), f"{mutation.name}: no {path}"
        defined = not test or re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.MULTILINE)
        assert defined, f"{mutation.name}: no {target}"


def test_mutation_names_are_unique():
    names = [m.name for m in mutate.MUTATIONS]
    assert len(names) == len(set(names))

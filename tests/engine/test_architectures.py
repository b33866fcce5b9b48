"""Every causal LM in the installed transformers: each engine is exact or refuses, never a third outcome.

For each model type in transformers' causal-LM mapping a tiny random float64 model is built
(tests/zoo.py; the few that cannot be built are listed there with the reason, as are those that need
an optional package). On a small tree (a shared prompt, branches, a prefix of another sequence, a
lone sequence) every engine either
- matches the model's own forward on each sequence alone (log-probs and entropy) and the flat
  reference's gradients, or
- raises UnsupportedModel, leaving every `.grad` as it was.
Any other exception, or a mismatch, fails. docs/models.md is generated from these outcomes:
`python tests/engine/test_architectures.py` rewrites it; a test fails when it is stale.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":  # run as a script to rewrite docs/models.md
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import TopKSeen, indexer_top_k
from test_images import multimodal_section
from test_refusals import reason_errors
from zoo import CAUSAL_LM_TYPES, OPTIONAL_PACKAGES, WINDOW_KEYS, ZooSkip, arch_info, build_tiny, ordinary_ids

from treerl.attention import UnsupportedModel
from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.engine.recurrent import find_mixers
from treerl.testing import compare_runs, model_outputs, relative_error, run_engine
from treerl.tree import TokenSequence

pytestmark = pytest.mark.slow  # every causal-LM type of transformers, three engines each: ~70 s on 2 cores

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"
ENGINES = {"FlatEngine": FlatEngine(), "DfsEngine": DfsEngine(chunk_tokens=4), "PackedEngine": PackedEngine()}
TOL = 1e-6  # log-probs, entropy and the whole gradient (all parameters as one vector)
# Each parameter's gradient on its own: transformers computes norms, routers, activations and eager softmax in
# float32 even in float64 models, which puts the small gradients of some parameters (router weights, activation
# scalars) at ~1e-6 relative; a real error in a small parameter (a sink, a norm) is O(1).
PARAMETER_TOL = 1e-4
# Rounding noise at the whole gradient's scale: transformers' recurrent mixers (the delta rule, the Mamba2 scan)
# compute in float32 even in float64 models, and a tree node continuing its parent's state rounds differently
# from one call over the whole sequence (measured: <= 1.2e-9 of the gradient's norm on Qwen3.5's A_log).
NOISE = {"attention": 1e-10, "recurrent": 1e-8}
# docs/models.md shows a bound on each exact engine's worst error, not the error: its last digit changes with the CPU
# (3e-16 on one, 4e-16 on another) and the page is compared byte for byte. Errors cluster far from the first bound:
# ~1e-16 where the model computes in float64 throughout, 1e-9 to 2e-7 where transformers computes norms, routers or
# eager softmax in float32; anything above TOL fails the test.
BOUNDS = (1e-12, TOL)


@dataclass(frozen=True)
class Outcome:
    kind: str  # "exact", "refused" or "skipped"
    detail: str  # a bound on the worst error (BOUNDS), or the reason


def _batch(model: torch.nn.Module) -> list[TokenSequence]:
    """A shared prompt with three branches (one of them a chain), a prefix of the prompt, a lone sequence."""
    seeds = iter(range(100))
    tokens = lambda n: ordinary_ids(model, (n,), next(seeds)).tolist()
    prompt = tokens(9)
    lists = [prompt + tokens(4), prompt + tokens(7), prompt + tokens(3) + tokens(6), prompt[:6], tokens(11)]
    g = torch.Generator().manual_seed(0)
    return [TokenSequence(torch.tensor(t), fields={"advantages": torch.randn(len(t), generator=g, dtype=torch.float64)})
            for t in lists]


def _loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum() - 0.1 * view.entropy.sum()


@functools.cache
def outcomes(model_type: str) -> dict[str, Outcome]:
    """Run every engine on one architecture; assert the outcome is exact or a clean refusal."""
    torch.set_num_threads(1)  # tiny ops: threads only add contention
    try:
        model = build_tiny(model_type)
    except ZooSkip as reason:
        return {name: Outcome("skipped", str(reason)) for name in ENGINES}
    batch = _batch(model)
    results: dict[str, Outcome] = {}
    reference, reference_seen = None, TopKSeen()
    for name, engine in ENGINES.items():
        try:
            with indexer_top_k(model, earliest=False) if name == "FlatEngine" else contextlib.nullcontext() as seen:
                run = run_engine(engine, model, batch, _loss)  # the reference counts what its indexers met
        except UnsupportedModel as refusal:
            assert all(p.grad is None for p in model.parameters()), f"{name} wrote gradients before refusing"
            results[name] = Outcome("refused", str(refusal))
            continue
        worst = 0.0
        for sequence, out in zip(batch, run.outputs):
            for key, expected in _own_forward(model, sequence).items():
                error = relative_error(out[key], expected)
                assert error <= TOL, f"{name}: {key} differs from {model_type}'s own forward by {error:.3g}"
                worst = max(worst, error)
        if name == "FlatEngine":
            reference, reference_seen = run, seen
            alone = run_engine(FlatEngine(max_tokens=1), model, batch, _loss)  # each sequence in its own call
            errors = compare_runs(run, alone)
        else:
            assert reference is not None, "the flat reference refused a model a tree engine accepts"
            errors = compare_runs(run, reference)
        assert errors["gradient"] <= TOL, f"{name}: the gradient differs from the flat reference by {errors['gradient']:.3g}"
        noise = NOISE["recurrent" if _recurrent(model) else "attention"]
        _assert_each_parameter(name, run.grads, (reference if name != "FlatEngine" else alone).grads, noise)
        results[name] = Outcome("exact", bound(max(worst, errors["gradient"])))
    if any(o.kind == "exact" for name, o in results.items() if name != "FlatEngine"):  # a tree engine claims it
        _assert_reaches_its_paths(model, batch, reference_seen)
    return results


def _assert_reaches_its_paths(model: torch.nn.Module, batch: list[TokenSequence], seen: TopKSeen) -> None:
    """docs/design.md, invariant 6, for a type a tree engine is exact on: on this batch a sparse-attention indexer's
    top-k leaves keys out; a sliding window, attention chunk, compression window (DeepSeek-V4), relative-bias extent or
    log-scaling floor (Inkling) is shorter than the longest sequence; looped layers (Inkling2-loop) are built."""
    if any(type(m).__name__.endswith("Indexer") for m in model.modules()):
        assert seen.binding > 0, "the indexer's top-k keeps every key of the batch: sparse attention is not tested"
    config = model.config.get_text_config()
    longest = max(len(s) for s in batch)
    spans = {key: getattr(config, key, None) for key in (*WINDOW_KEYS, "attention_chunk_size", "rel_extent",
                                                         "log_scaling_n_floor")}
    rates = getattr(config, "compress_rates", None) or {}
    spans |= {f"compress_rates[{kind!r}]": rate for kind, rate in rates.items()}
    for key, span in spans.items():
        assert not isinstance(span, int) or span < longest, f"config.{key}={span} never fills on {longest} tokens"
    loop_end = getattr(config, "loop_layer_index_end", None)
    assert loop_end is None or loop_end <= config.num_hidden_layers, f"the loop layers end at {loop_end}: never built"


def _own_forward(model: torch.nn.Module, sequence: TokenSequence) -> dict[str, torch.Tensor]:
    """The model's own forward on one sequence alone, a sparse-attention indexer's keys tied at its k-th score going to
    the earlier by the test's own stable sort, as on CUDA (on CPU torch.topk's choice among them changes with the
    call's width: support.indexer_top_k; every engine takes the earlier too, treerl.engine.recurrent.earliest_topk)."""
    with indexer_top_k(model):
        return model_outputs(model, sequence)


def page_outcomes(model_type: str) -> dict[str, Outcome]:
    """A type's row of docs/models.md: its outcomes, or "not built" for a type whose build needs an optional package,
    whether or not the package is installed here, so that the page is the same on every machine."""
    if model_type not in OPTIONAL_PACKAGES:
        return outcomes(model_type)
    package = OPTIONAL_PACKAGES[model_type]
    reason = (f"needs {package}, an optional package that the test extras do not install: listed as not built on "
              f"every machine, so that this page does not depend on what is installed (the tests check it where "
              f"{package} is installed)")
    return {name: Outcome("skipped", reason) for name in ENGINES}


def bound(error: float) -> str:
    """The smallest of BOUNDS the error is within, as the page shows it ("<= 1e-12")."""
    return f"<= {next(b for b in BOUNDS if error <= b):g}"


def _recurrent(model: torch.nn.Module) -> bool:
    """Whether the model has a token mixer with a state (known to treerl or refused by it)."""
    try:
        return bool(find_mixers(model))
    except UnsupportedModel:
        return True


def _assert_each_parameter(engine: str, grads: dict, expected: dict, noise: float) -> None:
    """Every parameter within PARAMETER_TOL of its own norm, plus rounding noise at the whole gradient's scale
    (a gradient that is zero in exact arithmetic, e.g. of a key bias, comes out as ~1e-16 noise)."""
    scale = torch.cat([g.flatten() for g in expected.values()]).norm().item() if expected else 0.0
    for name in set(grads) | set(expected):
        ours, ref = grads.get(name), expected.get(name)
        ours = torch.zeros_like(ref) if ours is None else ours
        ref = torch.zeros_like(ours) if ref is None else ref
        diff, norm = (ours - ref).norm().item(), ref.norm().item()
        assert diff <= PARAMETER_TOL * norm + noise * scale, f"{engine}: grad.{name} off by {diff:.3g} (norm {norm:.3g})"


@pytest.mark.parametrize("model_type", CAUSAL_LM_TYPES)
def test_every_architecture_is_exact_or_refused(model_type):
    result = outcomes(model_type)
    if result["FlatEngine"].kind == "refused":  # a model the reference refuses, no tree engine may accept
        assert all(o.kind == "refused" for o in result.values())


@pytest.mark.parametrize("model_type", CAUSAL_LM_TYPES)
def test_every_refusal_names_the_obstacle_the_model_has(model_type):
    """Each engine's refusal read against the model, by the zoo's own facts (tests/engine/test_refusals.py,
    `reason_errors`): a module it names is there, of that class, below the body; position_ids blamed only where the
    attention runs through transformers' AttentionInterface, attention computed in the model's own code only where it
    does not; a recurrent model refused by DfsEngine for its state, not for its attention."""
    refused = {name: o.detail for name, o in outcomes(model_type).items() if o.kind == "refused"}
    if not refused:
        return
    model = build_tiny(model_type)
    info = arch_info(model_type, model)
    for name, reason in refused.items():
        assert reason_errors(model, reason, info, name) == [], (name, reason)


def support_table() -> str:
    """docs/models.md: the outcome of every engine on every causal-LM type."""
    rows = {t: page_outcomes(t) for t in CAUSAL_LM_TYPES}
    count = lambda engine, kind: sum(r[engine].kind == kind for r in rows.values())
    lines = [
        "# Model support",
        "",
        "Generated by `python tests/engine/test_architectures.py` from the test of the same name; do not edit.",
        "Every causal-LM type in the installed transformers, built tiny and random in float64 (tests/zoo.py), on a",
        "small tree (a shared prompt with branches, a prefix, a lone sequence). **exact**: log-probs and entropy equal",
        "the model's own forward on each sequence alone (keys tied at a DeepSeek sparse-attention indexer's or Doge's",
        "dynamic mask's k-th score going to the earliest, as on CUDA and in every engine: on CPU the model's own top-k",
        "picks among them by the width of the call; docs/hybrid-models.md), and the whole gradient equals the flat",
        f"reference's (which equals each sequence in its own call), relative error <= {TOL:g}, every parameter's <=",
        f"{PARAMETER_TOL:g}. The figure bounds the worst error seen: <= {BOUNDS[0]:g} where the model computes in float64",
        f"throughout (errors near 1e-16), <= {BOUNDS[1]:g} where transformers computes norms, routers or eager softmax in",
        "float32 even in float64 models (errors near 1e-7); a bound, not the error, whose last digit changes with the CPU.",
        "**refused**: the engine raises `UnsupportedModel` with the reason below, before any output or gradient. No",
        "third outcome. DfsEngine refuses " + _between(rows) + " each for the reason its row gives.",
        "",
        "| engine | exact | refused | not built |",
        "|---|---|---|---|",
    ]
    for engine in ENGINES:
        lines.append(f"| {engine} | {count(engine, 'exact')} | {count(engine, 'refused')} | {count(engine, 'skipped')} |")
    lines += ["", "| model type | " + " | ".join(ENGINES) + " |", "|---|" + "---|" * len(ENGINES)]
    reasons: dict[str, int] = {}
    for model_type, result in rows.items():
        cells = []
        for outcome in result.values():
            if outcome.kind == "exact":
                cells.append(f"exact ({outcome.detail})")
            else:
                reason = re.sub(r"^\w+( \([\w.-]+\))?: ", "", outcome.detail)  # the model's name: in the row
                reason = re.sub(r"layers \[[\d, ]*\] of \[[\d, ]*\]", "some layers", reason)
                reason = re.sub(r"layer \d+ calls", "a layer calls", reason)
                reason = re.sub(r"off by [\d.e+-]+|off by inf", "off by far", reason)
                reason = re.sub(r"(attention module|the) [\w.]+( \(\w+\))? has no", r"\1 ... has no", reason)
                number = reasons.setdefault(reason, len(reasons) + 1)
                cells.append(f"{outcome.kind} [{number}]")
        lines.append(f"| {model_type} | " + " | ".join(cells) + " |")
    lines += ["", "Reasons:", ""]
    lines += [f"{number}. {reason.replace('|', '/')}" for reason, number in reasons.items()]
    lines += multimodal_section()
    return "\n".join(lines) + "\n"


def _between(rows: dict[str, dict[str, Outcome]]) -> str:
    """The types FlatEngine is exact on and DfsEngine refuses, as a sentence's object."""
    types = [t for t, r in rows.items() if r["FlatEngine"].kind == "exact" and r["DfsEngine"].kind == "refused"]
    return f"{len(types)} of the types FlatEngine is exact on ({', '.join(types)}),"


def test_models_doc_is_current():
    """The page is compared byte for byte, so nothing on it depends on the machine: bounds on the errors (BOUNDS),
    not the errors, and a type that needs an optional package (zoo.OPTIONAL_PACKAGES) "not built" whether or not
    the package is installed here. Where it is installed, test_every_architecture_is_exact_or_refused still builds
    and checks that type; one that newly needs a package fails tests/test_zoo.py until it is declared there too."""
    assert DOC.read_text() == support_table(), "docs/models.md is stale: run python tests/engine/test_architectures.py"


def test_the_page_builds_no_type_that_needs_an_optional_package(monkeypatch):
    """The control: where the package is installed (and a build would succeed), the row still says not built."""
    monkeypatch.setattr(sys.modules[__name__], "outcomes", lambda model_type: pytest.fail(f"{model_type} was built"))
    for model_type, package in OPTIONAL_PACKAGES.items():
        row = page_outcomes(model_type)
        assert all(o.kind == "skipped" and o.detail.startswith(f"needs {package},") for o in row.values()), row


if __name__ == "__main__":
    DOC.write_text(support_table())
    print(f"wrote {DOC}")

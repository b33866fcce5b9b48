"""A scan split into pieces that each run from zero with their transfer, chained piece by piece, gives the one scan
over the whole sequence: outputs, final state and gradients (float64, one process; the ranks' version is
tests/engine/test_context_parallel.py's hybrids). Each function of treerl.engine.parallel_scan.LINEAR_SCANS, as
transformers ships it."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from support import float64_throughout
from transformers.models.bamba import modeling_bamba
from transformers.models.kimi_linear import modeling_kimi_linear
from transformers.models.qwen3_5 import modeling_qwen3_5

from treerl.engine.parallel_scan import LINEAR_SCANS, carry, scan_from_zero

T, CUTS = 150, (0, 37, 38, 101, 150)  # pieces across the functions' 64-token chunks, one of a single token


def delta_rule_inputs(g: torch.Generator, kda: bool) -> dict:
    """Two rows, 2 key heads serving 4 value heads (Gated DeltaNet; KDA: 4 and 4, a decay per key channel), K = 8,
    V = 6."""
    k_heads = 4 if kda else 2
    return {"query": torch.randn(2, T, k_heads, 8, generator=g), "key": torch.randn(2, T, k_heads, 8, generator=g),
            "value": torch.randn(2, T, 4, 6, generator=g),
            "g": -torch.rand(2, T, 4, *((8,) if kda else ()), generator=g),
            "beta": torch.rand(2, T, 4, generator=g), "use_qk_l2norm_in_kernel": True,
            "initial_state": torch.randn(2, 4, 8, 6, generator=g), "output_final_state": True}


def ssd_inputs(g: torch.Generator) -> dict:
    """Two rows, 4 heads of 6 channels, 2 groups of state size 8, chunks of 16 tokens, a skip term."""
    return {"hidden_states": torch.randn(2, T, 4, 6, generator=g), "dt": torch.randn(2, T, 4, generator=g),
            "A": -torch.rand(4, generator=g), "B": torch.randn(2, T, 2, 8, generator=g),
            "C": torch.randn(2, T, 2, 8, generator=g), "chunk_size": 16, "D": torch.randn(4, generator=g),
            "dt_bias": torch.randn(4, generator=g), "dt_softplus": True, "return_final_states": True,
            "initial_states": torch.randn(2, 4, 6, 8, generator=g)}


FUNCTIONS = {
    "torch_chunk_gated_delta_rule": (modeling_qwen3_5, lambda g: delta_rule_inputs(g, kda=False)),
    "chunk_kimi_delta_attention": (modeling_kimi_linear, lambda g: delta_rule_inputs(g, kda=True)),
    "mamba2_chunk_scan": (modeling_bamba, ssd_inputs),
}


def test_every_linear_scan_is_tested():
    assert set(FUNCTIONS) == set(LINEAR_SCANS)


def _pieces(function, scan, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over CUTS' pieces: the first from the initial state, the others from zero with their transfer,
    each corrected by the state the one before ended in."""
    outputs, state = [], inputs[scan.initial]
    signature = inspect.signature(function)
    for lo, hi in itertools.pairwise(CUTS):
        piece = {k: v[:, lo:hi] if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == T else v
                 for k, v in inputs.items()}
        bound = signature.bind(**piece)
        bound.apply_defaults()
        out, state = scan_from_zero(function, scan, bound).started_from(state)
        outputs.append(out)
    return torch.cat(outputs, dim=1), state


@pytest.mark.parametrize("name", FUNCTIONS)
def test_pieces_from_zero_corrected_by_their_transfers_are_the_whole_scan(name):
    module, make = FUNCTIONS[name]
    function, scan = getattr(module, name), LINEAR_SCANS[name]
    with float64_throughout():
        inputs = {k: v.double().requires_grad_() if isinstance(v, torch.Tensor) else v
                  for k, v in make(torch.Generator().manual_seed(0)).items()}
        whole, whole_final = function(**inputs)
        split, split_final = _pieces(function, scan, inputs)
        weights = torch.randn_like(whole), torch.randn_like(whole_final)
        grads = lambda out, final: torch.autograd.grad(
            (out * weights[0]).sum() + (final * weights[1]).sum(),
            [v for v in inputs.values() if isinstance(v, torch.Tensor)])
        expected, got = grads(whole, whole_final), grads(split, split_final)
    assert split.dtype == whole.dtype
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-10)
    torch.testing.assert_close(split_final, whole_final, rtol=0, atol=1e-10)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-9)


def test_a_transfer_carries_a_state_as_the_layout_says():
    """Columns (the delta rule's [K, V]): M S; rows (Mamba2's [P, N]): S M; diagonal (Mamba's [d, N]): entry by
    entry."""
    m, s = torch.randn(1, 1, 3, 3), torch.randn(1, 1, 3, 2)
    assert torch.allclose(carry(m, s, "columns"), m @ s)
    s = torch.randn(1, 1, 2, 3)
    assert torch.allclose(carry(m, s, "rows"), s @ m)
    assert torch.allclose(carry(s, m[..., :2, :], "diagonal"), s * m[..., :2, :])

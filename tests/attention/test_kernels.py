"""The attention kernels against a naive softmax: every backend, every score feature, values and gradients."""

from __future__ import annotations

import pytest
import torch

from treerl.attention.kernels import AttentionSpec, Part, attend, attend_backward, backend, fused_backend, merge
from treerl.testing import relative_error


def naive(q, k, v, spec: AttentionSpec, part: Part, sink: torch.Tensor | None = None):
    """softmax over visible keys (and a sink logit per head) by plain autograd ops."""
    scores = (q @ k.transpose(-1, -2)) * spec.scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~spec.visible(part, q.shape[-2], k.shape[-2]), float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num()
    if sink is not None:
        probs = probs[..., :-1]
    return probs @ v


SPECS = [
    AttentionSpec(scale=0.3),
    AttentionSpec(scale=0.3, softcap=2.0),
    AttentionSpec(scale=0.3, window=3),
    AttentionSpec(scale=0.3, chunk=4),
    AttentionSpec(scale=0.3, softcap=1.5, window=5, chunk=6),
]
PARTS = [Part(q_start=7, k_start=7, causal=True), Part(q_start=7, k_start=2, causal=False, q_period=3)]


@pytest.mark.parametrize("kind", ["cpu-flash", "math"])
@pytest.mark.parametrize("spec", SPECS, ids=repr)
@pytest.mark.parametrize("part", PARTS, ids=["own", "ancestors"])
@pytest.mark.parametrize("value_dim", [8, 5])
def test_attend_and_backward_equal_naive_softmax(kind, spec, part, value_dim):
    torch.manual_seed(0)
    length = 6
    keys = length if part.causal else 5
    q = torch.randn(2, 3, length, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, keys, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, keys, value_dim, dtype=torch.float64, requires_grad=True)
    plain = spec.softcap is None and not spec.binds(part, length, keys)
    if kind == "cpu-flash" and not plain:
        pytest.skip("flash kernels only compute plain scores")
    if kind == "math" and spec.chunk is None and spec.window is None and spec.softcap is None:
        assert backend(q, spec, part, keys) == "cpu-flash"  # the default picks flash for plain scores
    out, lse, saved = attend(q, k, v, spec, part, kind=kind)
    reference = naive(q, k, v, spec, part)
    visible_rows = spec.visible(part, length, keys).any(-1)
    assert torch.allclose(out[..., visible_rows, :], reference[..., visible_rows, :], atol=1e-12)
    dout = torch.randn_like(out)
    dq, dk, dv = attend_backward(dout, q, k, v, out, lse, saved, spec, part, kind=kind)
    expected = torch.autograd.grad(reference, (q, k, v), dout)
    for ours, theirs in zip((dq, dk, dv), expected):
        assert torch.allclose(ours, theirs, atol=1e-10)


def test_merged_parts_with_a_sink_equal_one_softmax():
    """Own + ancestor parts merged by log-sum-exp, with a sink logit per head, equal one softmax over all keys."""
    torch.manual_seed(1)
    spec = AttentionSpec(scale=0.5)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    sink = torch.randn(2, dtype=torch.float64)
    whole = naive(q, k, v, spec, Part(q_start=6, k_start=0, causal=True), sink)
    own = attend(q, k[:, :, 6:], v[:, :, 6:], spec, Part(q_start=6, k_start=6, causal=True))
    anc = attend(q, k[:, :, :6], v[:, :, :6], spec, Part(q_start=6, k_start=0, causal=False))
    out, _ = merge([own[:2], anc[:2]], sink.view(1, 2, 1))
    assert torch.allclose(out, whole, atol=1e-12)


def test_each_device_and_dtype_gets_a_fused_kernel_where_pytorch_has_one():
    """CUDA float32 runs the memory-efficient kernel (no [L, S] score matrix), not the math version."""
    assert fused_backend("cuda", torch.float32) == "cuda-efficient"
    assert fused_backend("cuda", torch.bfloat16) == fused_backend("cuda", torch.float16) == "cuda-flash"
    assert fused_backend("cpu", torch.float64) == fused_backend("cpu", torch.bfloat16) == "cpu-flash"
    assert fused_backend("cuda", torch.float64) == "math"  # no fused CUDA kernel takes float64


def test_the_math_version_computes_in_float32_under_autocast():
    """autocast would run its matmuls in bfloat16; the exact version keeps its own (float32) precision."""
    torch.manual_seed(2)
    spec, part = AttentionSpec(scale=0.3, softcap=2.0), PARTS[0]
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    reference = naive(q.double(), k.double(), v.double(), spec, part)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse, saved = attend(q, k, v, spec, part, kind="math")
        dq, dk, dv = attend_backward(torch.ones_like(out), q, k, v, out, lse, saved, spec, part, kind="math")
    assert out.dtype == torch.float32 and torch.allclose(out.double(), reference, atol=1e-5)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    expected = torch.autograd.grad(naive(qd, kd, vd, spec, part).sum(), (qd, kd, vd))
    for ours, theirs in zip((dq, dk, dv), expected):
        assert torch.allclose(ours.double(), theirs, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("part", PARTS, ids=["own", "ancestors"])
def test_cuda_float32_efficient_kernel_equals_the_math_version(part):
    torch.manual_seed(3)
    spec = AttentionSpec(scale=0.125)
    length, keys = 40, 40 if part.causal else 70
    q = torch.randn(2, 4, length, 64, device="cuda")
    k, v = torch.randn(2, 4, keys, 64, device="cuda"), torch.randn(2, 4, keys, 64, device="cuda")
    assert backend(q, spec, part, keys) == "cuda-efficient"
    out, lse, saved = attend(q, k, v, spec, part)
    ref_out, ref_lse, _ = attend(q, k, v, spec, part, kind="math")
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    dout = torch.randn_like(out)
    grads = attend_backward(dout, q, k, v, out, lse, saved, spec, part)
    expected = attend_backward(dout, q, k, v, ref_out, ref_lse, (), spec, part, kind="math")
    for ours, theirs in zip(grads, expected):
        assert torch.allclose(ours, theirs, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("part", PARTS, ids=["own", "ancestors"])
def test_cuda_bfloat16_flash_kernel_equals_the_math_version_on_row_slices(part):
    """The engines pass row slices (views) of their q, k, v and of their running (out, lse) to the kernels."""
    torch.manual_seed(4)
    spec = AttentionSpec(scale=0.125)
    length, keys = 40, 40 if part.causal else 70
    rows = lambda n, dtype=torch.bfloat16: torch.randn(2, 4, n + 9, 64, device="cuda", dtype=dtype)[:, :, 5 : 5 + n]
    q, k, v = rows(length), rows(keys), rows(keys)
    assert backend(q, spec, part, keys) == "cuda-flash"
    out, lse, saved = attend(q, k, v, spec, part)
    ref_out, ref_lse, _ = attend(q, k, v, spec, part, kind="math")
    assert relative_error(out, ref_out) < 1e-2 and relative_error(lse, ref_lse) < 1e-3
    kept_out, kept_lse = rows(length), rows(length, torch.float32)
    kept_out.copy_(out)
    kept_lse[..., 0].copy_(lse)
    dout = rows(length)
    grads = attend_backward(dout, q, k, v, kept_out, kept_lse[..., 0], saved, spec, part)
    expected = attend_backward(dout, q, k, v, ref_out, ref_lse, (), spec, part, kind="math")
    for ours, theirs in zip(grads, expected):
        assert relative_error(ours, theirs) < 2e-2

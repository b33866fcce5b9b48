"""The chunked log-prob/entropy head: right values, right gradients, any chunk size."""

from __future__ import annotations

import pytest
import torch

from treerl.engine.head import LogitTransform, logprobs_and_entropy

PLAIN = LogitTransform()
TRANSFORMS = [PLAIN, LogitTransform(scale=0.25), LogitTransform(softcap=1.5), LogitTransform(scale=3.0, softcap=2.0)]


def _reference(hidden, weight, bias, targets, t, transform=PLAIN):
    logits = transform.apply(torch.nn.functional.linear(hidden, weight, bias)) / t
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None])[:, 0], entropy


@pytest.mark.parametrize("transform", TRANSFORMS, ids=repr)
def test_values_and_gradients_match_plain_log_softmax(transform):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)
    w_lp, w_ent = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
    for t in (1.0, 0.6):
        lp, ent = _reference(hidden, weight, bias, targets, t, transform)
        expected = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), [hidden, weight, bias])
        for chunk in (1, 3, 100):
            lp2, ent2 = logprobs_and_entropy(hidden, weight, bias, targets, transform, t, chunk)
            torch.testing.assert_close(lp2, lp, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ent2, ent, rtol=1e-12, atol=1e-12)
            got = torch.autograd.grad((lp2 * w_lp).sum() + (ent2 * w_ent).sum(), [hidden, weight, bias])
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("transform", TRANSFORMS, ids=repr)
def test_gradcheck(transform):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 6, (4,), generator=g)
    assert torch.autograd.gradcheck(lambda h, w: logprobs_and_entropy(h, w, None, targets, transform, 0.8, 3), (hidden, weight))


def test_low_precision_hidden_computes_in_float32():
    hidden = torch.randn(3, 4).bfloat16()
    weight = torch.randn(9, 4).bfloat16()
    lp, ent = logprobs_and_entropy(hidden, weight, None, torch.tensor([0, 1, 2]), PLAIN, 1.0, 2)
    assert lp.dtype == ent.dtype == torch.float32

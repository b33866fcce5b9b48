"""LoRA adapters (peft) on the tree engines: exact against the flat reference, gradients only for the adapters."""

from __future__ import annotations

import pytest
import torch
from support import fresh_model

from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.models import add_lora
from treerl.testing import assert_engines_agree, run_engine
from treerl.tree import TokenSequence

pytest.importorskip("peft")


def _lora_model(target_modules: str = "all-linear"):
    """A float64 tiny model with rank-4 adapters whose B is non-zero (peft starts B at 0: a no-op adapter)."""
    model = add_lora(fresh_model(), rank=4, alpha=8.0, target_modules=target_modules)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _batch(vocab: int = 64) -> list[TokenSequence]:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (9,), generator=g)
    tokens = [torch.cat([prompt, torch.randint(0, vocab, (n,), generator=g)]) for n in (4, 6, 3, 5)]
    return [TokenSequence(t, fields={"advantages": torch.randn(len(t), generator=g, dtype=torch.float64)}) for t in tokens]


def _loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum() - 0.1 * view.entropy.sum()


@pytest.mark.parametrize("engine", [DfsEngine(chunk_tokens=4), DfsEngine(recompute="never", batch_tokens=0),
                                    PackedEngine()], ids=["dfs", "dfs-never", "packed"])
def test_tree_engines_with_adapters_equal_flat(engine):
    """float64: log-probs, loss and every adapter gradient as FlatEngine's; the frozen base gets none."""
    model = _lora_model()
    errors = assert_engines_agree(model, _batch(), _loss, engine, FlatEngine(), tol=1e-10)
    grads = [k for k in errors if k.startswith("grad.")]
    assert grads and all("lora_" in k for k in grads)
    assert len(grads) == sum(1 for _, p in model.named_parameters() if p.requires_grad)


def test_the_adapters_change_what_the_engines_compute():
    """(So the test above compares adapted models: with B != 0 the log-probs differ from the base's.)"""
    model = _lora_model("q_proj,v_proj")
    adapted = run_engine(DfsEngine(), model, _batch(), _loss).outputs
    with model.disable_adapter():
        base = run_engine(DfsEngine(), model, _batch(), _loss).outputs
    assert max((a["logprobs"] - b["logprobs"]).abs().max().item() for a, b in zip(adapted, base)) > 1e-3

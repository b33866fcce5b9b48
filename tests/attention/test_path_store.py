"""The path's K/V store sharded over context-parallel ranks: each holds every R-th position, together every position
once, and what a shard reads, masks and sends back is the whole store's at its positions (one process, no ranks)."""

from __future__ import annotations

import pytest
import torch

from treerl.attention.kernels import AttentionSpec, Part
from treerl.attention.tree_attention import PathKV, Segment, UnitKV

LAYER = (0, 0)


def unit(rows: int) -> UnitKV:
    """A unit of `rows` whose K/V say which row they come from."""
    k = torch.arange(rows, dtype=torch.float64).view(1, 1, rows, 1).expand(1, 2, rows, 3).clone()
    return UnitKV(keys={LAYER: k}, values={LAYER: -k})


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_shards_hold_every_position_once_and_read_what_the_whole_store_holds(ranks):
    """Two chains pushed (the second below the first's 7th token, as a sibling's branch is); every shard's reads
    and the gradients it collects on pop are the whole store's at the positions it holds."""
    capacity = 23
    whole = PathKV(capacity, with_grads=True)
    shards = [PathKV(capacity, with_grads=True, rank=r, ranks=ranks) for r in range(ranks)]
    first, second = unit(12), unit(9)
    segments_first = [Segment(row=0, length=4, position=0), Segment(row=5, length=7, position=4)]  # row 4: a sibling
    segments_second = [Segment(row=0, length=9, position=11)]
    for store in [whole, *shards]:
        store.push(first, segments_first)
        store.push(second, segments_second)
    assert sum(store.keys[LAYER].shape[2] for store in shards) == capacity
    for lo, end in [(0, 20), (3, 17), (5, 6), (19, 20), (7, 7)]:
        whole_k, _ = whole.ancestors(LAYER, lo, end)
        held = []
        for store in shards:
            k, v = store.ancestors(LAYER, lo, end)
            _, position = store.held(lo, end)
            positions = list(range(position, position + k.shape[2] * ranks, ranks))
            assert all(lo <= p < end and p % ranks == store.rank for p in positions)
            torch.testing.assert_close(k, whole_k[:, :, [p - lo for p in positions]], rtol=0, atol=0)
            torch.testing.assert_close(v, -k, rtol=0, atol=0)
            held += positions
        assert sorted(held) == list(range(lo, end))
    # gradients sent to positions 0..19 come back to the rows that hold them, summed over the shards
    grads = torch.randn(1, 2, 20, 3, dtype=torch.float64)
    whole.add_ancestor_grads(LAYER, 0, 20, grads, 2 * grads)
    for store in shards:
        _, position = store.held(0, 20)
        store.add_ancestor_grads(LAYER, 0, 20, grads[:, :, position::ranks], 2 * grads[:, :, position::ranks])
    for target, segments in ((second, segments_second), (first, segments_first)):
        target.key_grads = None
        whole.pop(target, segments)
        expected = target.key_grads[LAYER].clone()
        summed = torch.zeros_like(expected)
        for store in shards:
            target.key_grads = None
            store.pop(target, segments)
            summed += target.key_grads[LAYER]
            torch.testing.assert_close(target.value_grads[LAYER], 2 * target.key_grads[LAYER])
        torch.testing.assert_close(summed, expected, rtol=0, atol=1e-15)
    assert all(not store.key_grads[LAYER].any() for store in [whole, *shards])  # collected: the store is clear


def test_a_strided_parts_mask_is_the_whole_parts_at_its_keys():
    """A shard's keys sit every R-th position: its window and chunk masks are the columns of the whole part's."""
    spec = AttentionSpec(scale=1.0, window=5, chunk=8)
    queries = torch.tensor([9, 10, 14, 17])
    whole = spec.visible(Part(q_start=0, k_start=2, causal=False, q_positions=queries, q_max=17), 4, 15)
    strided = spec.visible(Part(q_start=0, k_start=3, causal=False, q_positions=queries, q_max=17, k_stride=3), 4, 5)
    torch.testing.assert_close(strided, whole[:, 1::3])

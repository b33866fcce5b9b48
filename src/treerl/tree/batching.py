"""Which sibling nodes run together as one batched call of the DFS engine."""

from __future__ import annotations


def group_siblings(lengths: list[int], max_tokens: int, max_padding: float = 0.25) -> list[list[int]]:
    """Group sibling indices of similar length: rows x longest <= max_tokens, padding <= max_padding.

    Longest first, so each group's first member sets its padded length. `max_tokens <= 0`
    turns batching off (every sibling on its own). Zero-length siblings (nothing to run) form
    their own group.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and lengths[i] == 0 and lengths[groups[-1][0]] == 0:
            groups[-1].append(i)
            continue
        if groups and max_tokens > 0 and lengths[i] > 0:
            width = lengths[groups[-1][0]]
            padded = (len(groups[-1]) + 1) * width
            if padded <= max_tokens and padded - (total + lengths[i]) <= max_padding * padded:
                groups[-1].append(i)
                total += lengths[i]
                continue
        groups.append([i])
        total = lengths[i]
    return groups

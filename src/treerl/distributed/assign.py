"""Assign a global batch to K data-parallel ranks and, within a rank, to micro-batches.

Step 4 (docs/architecture.md): the trees of a minibatch to ranks and micro-batches.

Goal: the slowest rank (the makespan) as fast as possible, where a rank's time is the sum of its
micro-batches' estimated costs (treerl.distributed.cost), while every shared prefix is computed on as
few ranks as possible.

The treerl balancer works on the batch in trie order (treerl.distributed.order), where every tree is a
contiguous run and a cut between two neighbours recomputes exactly their common prefix. It
builds candidate plans of contiguous runs per rank:
- whole trees: LPT by estimated cost (trees over the micro-batch budget cut into budget-sized
  pieces first), no tree split;
- LPT with splitting under a cap: an item that does not fit under the cap on the least-loaded
  rank is cut in two along the trie order (among the cuts that fill a share `fill` of the room,
  the one that recomputes the shortest prefix) and the rest goes back in the queue; bisection
  finds the smallest cap that places everything (one plan per cut policy in FILLS);
- the trie order cut into K contiguous runs of least maximal cost (only K-1 prefixes recomputed);
each followed by a local search that moves or swaps pieces off the most loaded rank. Each rank's
sequences are then cut into micro-batches by dynamic programming over its own trie order
(cheapest contiguous micro-batches under the token budget). Every candidate, and the two
baselines' assignments, is priced exactly (each micro-batch as the tree the engine will build)
and the least makespan wins, so the result is never worse than a baseline under the cost
model; among equal makespans the one that recomputes least. Trees stay whole unless splitting
lowers the makespan by more than `keep_together`.

Baselines a user would write: `first_fit` (sequences in batch order, ranks filled by flat token
count) and `lpt` (whole prefix groups, longest first by unique tokens, to the least-loaded rank).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from treerl.distributed.cost import CostModel
from treerl.distributed.order import FEATURES, TrieOrder
from treerl.tree import BatchError, TokenSequence

Range = tuple[int, int]  # positions [a, b) in a trie order
FILLS = (1.0, 0.8, 0.5)  # cut policies tried: fill the rank, or recompute a shorter prefix and leave room


@dataclass
class Assignment:
    """Which rank runs which sequences: `ranks[r]` lists rank r's micro-batches of batch indices."""

    ranks: list[list[list[int]]]
    method: str

    def micro_batches(self, rank: int) -> list[list[int]]:
        """Rank `rank`'s micro-batches, each a list of indices into the global batch."""
        return self.ranks[rank]

    def sequences(self, rank: int) -> list[int]:
        return [i for batch in self.ranks[rank] for i in batch]


@dataclass(frozen=True)
class BalanceStats:
    """How good an assignment is under a cost model."""

    rank_costs: tuple[float, ...]
    ideal: float  # cost of the whole batch as one tree, divided by the ranks: no duplication, perfect balance
    computed_tokens: int  # unique tokens summed over every rank's micro-batches: what is actually run
    unique_tokens: int  # U of the global tree
    flat_tokens: int  # T
    micro_batches: int

    @property
    def makespan(self) -> float:
        return max(self.rank_costs)

    @property
    def imbalance(self) -> float:
        """max / mean cost across ranks (1.0 = perfectly balanced)."""
        mean = sum(self.rank_costs) / len(self.rank_costs)
        return self.makespan / mean if mean > 0 else 1.0

    @property
    def vs_ideal(self) -> float:
        """makespan / ideal: imbalance and duplicated prefixes together (1.0 = nothing lost)."""
        return self.makespan / self.ideal if self.ideal > 0 else 1.0

    @property
    def compression(self) -> float:
        """T / computed tokens: the compression kept after assignment."""
        return self.flat_tokens / self.computed_tokens

    @property
    def compression_kept(self) -> float:
        """Global unique tokens / computed tokens (1.0 = every shared prefix still computed once)."""
        return self.unique_tokens / self.computed_tokens


def evaluate(assignment: Assignment, sequences: Sequence[TokenSequence], cost: CostModel) -> BalanceStats:
    """Exact estimated cost per rank: each micro-batch priced as the prefix tree the engine will build."""
    order = TrieOrder(sequences)
    w = cost.vector
    unique = np.eye(len(FEATURES))[FEATURES.index("unique_tokens")]
    rank_costs = _rank_costs(assignment.ranks, order, w)
    computed = int(sum(_rank_costs(assignment.ranks, order, unique)))
    everything = order.features(np.arange(len(order)))
    return BalanceStats(
        rank_costs=tuple(rank_costs),
        ideal=float(w @ everything) / len(assignment.ranks),
        computed_tokens=computed,
        unique_tokens=int(everything[FEATURES.index("unique_tokens")]),
        flat_tokens=int(order.length.sum()),
        micro_batches=sum(len(rank) for rank in assignment.ranks),
    )


def _rank_costs(ranks: list[list[list[int]]], order: TrieOrder, weights: np.ndarray) -> list[float]:
    """Each rank's cost: its micro-batches priced as the prefix trees the engine will build."""
    return [sum(float(weights @ order.features(np.sort(order.position[b]))) for b in rank) for rank in ranks]


# ------------------------------------------------------------------ pricing runs in trie order
class _Run:
    """O(1) cost and unique tokens of any contiguous run [i, j) of a trie-ordered list."""

    def __init__(self, length: np.ndarray, lcp: np.ndarray, weights: np.ndarray) -> None:
        w = dict(zip(FEATURES, weights))
        n = len(length)
        self.n = n
        self.length = length
        self.lcp = lcp
        tri = lambda x: x.astype(np.float64) * (x + 1) / 2
        per_sequence = w["sequences"] + w["flat_tokens"] * length
        added = (length - lcp).astype(np.float64)
        # A member's cost when it opens a run (all its tokens) and when it follows its predecessor.
        self.first = w["calls"] + w["unique_tokens"] * length + w["attention"] * tri(length) + per_sequence
        increment = w["unique_tokens"] * added + w["attention"] * (tri(length) - tri(lcp)) + per_sequence
        self.increment_sum = np.concatenate([[0.0], np.cumsum(increment)])
        self.unique_sum = np.concatenate([[0], np.cumsum(length - lcp)])
        # prefix_sum[k] = members among the first k that are a prefix of their successor (not leaves).
        is_prefix = np.zeros(n, dtype=np.int64)
        is_prefix[:-1] = lcp[1:] == length[:-1]
        self.prefix_sum = np.concatenate([[0], np.cumsum(is_prefix)])
        self.leaf_weight = w["leaves"]

    def cost(self, i: int | np.ndarray, j: int | np.ndarray) -> float | np.ndarray:
        """Estimated cost of the tree of members [i, j), j > i."""
        leaves = (j - i) - (self.prefix_sum[j - 1] - self.prefix_sum[i])
        return self.first[i] + self.increment_sum[j] - self.increment_sum[i + 1] + self.leaf_weight * leaves

    def unique(self, i: int | np.ndarray, j: int | np.ndarray) -> int | np.ndarray:
        return self.length[i] + self.unique_sum[j] - self.unique_sum[i + 1]

    def micro_batches(self, a: int, b: int, budget: int | None) -> list[Range]:
        """Cheapest cut of [a, b) into contiguous runs of at most `budget` unique tokens (dynamic programming)."""
        if budget is None or self.unique(a, b) <= budget:
            return [(a, b)]
        best = np.full(b - a + 1, np.inf)
        best[0] = 0.0
        back = np.zeros(b - a + 1, dtype=np.int64)
        lo = a
        for j in range(a + 1, b + 1):
            while self.unique(lo, j) > budget:  # shrinks as lo grows; a single member always fits
                lo += 1
            starts = np.arange(lo, j)
            totals = best[starts - a] + self.cost(starts, j)
            k = int(np.argmin(totals))
            best[j - a], back[j - a] = totals[k], starts[k]
        cuts, j = [], b
        while j > a:
            cuts.append((int(back[j - a]), j))
            j = int(back[j - a])
        return cuts[::-1]


# ------------------------------------------------------------------ the treerl balancer
def _place(items: list[Range], ranks: int, run: _Run, cap: float, fill: float) -> list[list[Range]] | None:
    """LPT with splitting: each item to the least-loaded rank, cut where it would exceed `cap`; None if stuck.

    The cut recomputes the shortest common prefix among the cuts that fill at least `fill` of the room.
    """
    queue = [(-float(run.cost(a, b)), a, b) for a, b in items]
    heapq.heapify(queue)
    loads = np.zeros(ranks)
    plan: list[list[Range]] = [[] for _ in range(ranks)]
    while queue:
        negative, a, b = heapq.heappop(queue)
        k = int(np.argmin(loads))
        if loads[k] - negative <= cap:
            loads[k] -= negative
            plan[k].append((a, b))
            continue
        room = cap - loads[k]
        ends = np.arange(a + 1, b)  # cut points: [a, c) stays here, [c, b) goes back to the queue
        fits = ends[run.cost(a, ends) <= room]
        if len(fits) == 0:
            return None
        filled = run.cost(a, fits)
        candidates = fits[filled >= min(fill * room, filled.max())]
        c = int(candidates[np.argmin(run.lcp[candidates] * len(run.lcp) - candidates)])  # ties: latest cut
        loads[k] += run.cost(a, c)
        plan[k].append((a, c))
        heapq.heappush(queue, (-float(run.cost(c, b)), c, b))
    return plan


def _planned(plan: list[list[Range]], run: _Run) -> float:
    """Makespan if every piece were its own tree (an upper bound: pieces of one tree on one rank share)."""
    return max(sum(float(run.cost(a, b)) for a, b in pieces) for pieces in plan)


def _smallest_cap(place, run: _Run, start: list[list[Range]]) -> list[list[Range]]:
    """Bisect the smallest cap under which `place(cap)` places everything; its plan."""
    ranks = len(start)
    lo = max(float(run.cost(0, run.n)) / ranks, float(run.first.max()))
    best, hi = start, _planned(start, run)
    while hi - lo > 1e-4 * hi:
        cap = (lo + hi) / 2
        plan = place(cap)
        if plan is None:
            lo = cap
        else:
            best, hi = plan, min(cap, _planned(plan, run))
    return best


def _linear_partition(run: _Run, ranks: int) -> list[list[Range]]:
    """The whole trie order cut into `ranks` contiguous runs of least maximal cost: only K-1 prefixes recomputed."""

    def place(cap: float) -> list[list[Range]] | None:
        plan: list[list[Range]] = []
        a = 0
        while a < run.n:
            ends = np.arange(a + 1, run.n + 1)
            fits = ends[run.cost(a, ends) <= cap]
            if len(fits) == 0 or len(plan) == ranks:
                return None
            plan.append([(a, int(fits[-1]))])
            a = int(fits[-1])
        return plan + [[] for _ in range(ranks - len(plan))]

    return _smallest_cap(place, run, [[(0, run.n)]] + [[] for _ in range(ranks - 1)])


def _improve(plan: list[list[Range]], run: _Run, rounds: int = 100) -> list[list[Range]]:
    """Local search on LPT's result: move or swap a piece off the most loaded rank while that lowers it."""
    plan = [list(pieces) for pieces in plan]
    costs = [np.array([float(run.cost(a, b)) for a, b in pieces]) for pieces in plan]
    loads = np.array([c.sum() for c in costs])
    for _ in range(rounds):
        m = int(np.argmax(loads))
        best = (loads[m] * (1 - 1e-9), None)  # (max of the two ranks after the change, change)
        for i, x in enumerate(costs[m]):
            for r in range(len(plan)):
                if r == m:
                    continue
                if max(loads[r] + x, loads[m] - x) < best[0]:
                    best = (max(loads[r] + x, loads[m] - x), (i, r, None))
                if len(costs[r]):
                    pair = np.maximum(loads[m] - x + costs[r], loads[r] + x - costs[r])
                    j = int(np.argmin(pair))
                    if pair[j] < best[0]:
                        best = (float(pair[j]), (i, r, j))
        if best[1] is None:
            break
        i, r, j = best[1]
        moved, cost = plan[m].pop(i), costs[m][i]
        costs[m] = np.delete(costs[m], i)
        if j is not None:
            plan[m].append(plan[r].pop(j))
            costs[m] = np.append(costs[m], costs[r][j])
            costs[r] = np.delete(costs[r], j)
        plan[r].append(moved)
        costs[r] = np.append(costs[r], cost)
        loads = np.array([c.sum() for c in costs])
    return plan


def _realise(plan: list[list[Range]], order: TrieOrder, weights: np.ndarray, budget: int | None):
    """Micro-batches of each rank, cut from its own trie order: (rank -> batches of indices, rank costs)."""
    ranks, costs = [], []
    for pieces in plan:
        positions = np.sort(np.concatenate([np.arange(a, b) for a, b in pieces])) if pieces else np.zeros(0, int)
        if len(positions) == 0:
            ranks.append([])
            costs.append(0.0)
            continue
        run = _Run(*order.subset(positions), weights)
        cuts = run.micro_batches(0, len(positions), budget)
        ranks.append([order.order[positions[i:j]].tolist() for i, j in cuts])
        costs.append(float(sum(run.cost(i, j) for i, j in cuts)))
    return ranks, costs


def balance(
    sequences: Sequence[TokenSequence],
    ranks: int,
    micro_batch_tokens: int | None = None,
    cost: CostModel | None = None,
    keep_together: float = 0.0,
) -> Assignment:
    """Assign `sequences` to `ranks` ranks and micro-batches of at most `micro_batch_tokens` unique tokens.

    `cost` prices a micro-batch (default: unfitted, its unique tokens).
    Deterministic: every rank computes the same assignment from the same batch, with no communication.
    """
    _check(sequences, ranks, micro_batch_tokens)
    order = TrieOrder(sequences)
    weights = (cost or CostModel()).vector
    run = _Run(order.length, order.lcp, weights)
    items = [piece for a, b in order.trees() for piece in run.micro_batches(a, b, micro_batch_tokens)]

    whole = _place(items, ranks, run, cap=math.inf, fill=1.0)  # plain LPT by cost: no tree is split
    plans = {"whole trees": _improve(whole, run), "trie-order partition": _improve(_linear_partition(run, ranks), run)}
    for fill in FILLS:
        place = functools.partial(_place, items, ranks, run, fill=fill)  # place(cap)
        plans[f"LPT+split (fill {fill:g})"] = _improve(_smallest_cap(place, run, whole), run)
    candidates = {name: _realise(plan, order, weights, micro_batch_tokens)[0] for name, plan in plans.items()}
    # The baselines' assignments are candidates too: the result is never worse than either under `cost`.
    for baseline in (first_fit, lpt):
        assignment = baseline(sequences, ranks, micro_batch_tokens)
        candidates[assignment.method] = assignment.ranks
    priced = {name: _rank_costs(batches, order, weights) for name, batches in candidates.items()}
    names = list(candidates)
    # Least makespan; among equals, least total work (fewest recomputed prefixes), then the earlier candidate.
    best = min(names, key=lambda n: (max(priced[n]), sum(priced[n]), names.index(n)))
    if max(priced[names[0]]) <= max(priced[best]) * (1 + keep_together):
        best = names[0]
    return Assignment(ranks=candidates[best], method=f"treerl ({best})")


@dataclass(frozen=True)
class ContextSplit:
    """A data-parallel group's share of a minibatch under context parallelism: the micro-batches its ranks split
    together (each call's rows over all of them), and each rank's micro-batches it trains alone."""

    together: list[list[int]]
    alone: list[list[list[int]]]  # alone[r]: context rank r's


def split_over_context(sequences: Sequence[TokenSequence], share: list[int], ranks: int, min_tokens: int,
                       micro_batch_tokens: int | None = None, cost: CostModel | None = None) -> ContextSplit:
    """Which of a group's sequences (`share`: indices into `sequences`) its `ranks` context-parallel ranks split, and
    which each rank trains alone: split a sequence of `min_tokens` or more (a path one device may not hold) or one
    that costs more under `cost` than a rank's even share of the group (no rank could take it alone and keep the
    group balanced); balance the rest over the ranks like data-parallel ones (`balance`). Short sequences then pay
    no collectives and run whole calls. Deterministic, like `balance`."""
    cost = cost or CostModel()
    even = cost([sequences[i] for i in share]) / ranks if share else 0.0
    split = [i for i in share if len(sequences[i]) >= min_tokens or cost([sequences[i]]) > even]
    chosen = frozenset(split)
    rest = [i for i in share if i not in chosen]
    together = _pieces(sequences, split, 1, micro_batch_tokens, cost)[0]
    return ContextSplit(together, _pieces(sequences, rest, ranks, micro_batch_tokens, cost))


def _pieces(sequences: Sequence[TokenSequence], chosen: list[int], ranks: int, micro_batch_tokens: int | None,
            cost: CostModel) -> list[list[list[int]]]:
    """`balance` of the `chosen` sequences, its micro-batches as indices into `sequences`."""
    if not chosen:
        return [[] for _ in range(ranks)]
    assignment = balance([sequences[i] for i in chosen], ranks, micro_batch_tokens, cost)
    return [[[chosen[j] for j in batch] for batch in assignment.micro_batches(r)] for r in range(ranks)]


# ------------------------------------------------------------------ baselines
def first_fit(sequences: Sequence[TokenSequence], ranks: int, micro_batch_tokens: int | None = None) -> Assignment:
    """Baseline: sequences in batch order to the first rank with room for a fair share of flat tokens."""
    _check(sequences, ranks, micro_batch_tokens)
    lengths = [len(s) for s in sequences]
    share = math.ceil(sum(lengths) / ranks)
    loads = [0] * ranks
    members: list[list[int]] = [[] for _ in range(ranks)]
    for i, n in enumerate(lengths):
        k = next((r for r in range(ranks) if loads[r] + n <= share), int(np.argmin(loads)))
        loads[k] += n
        members[k].append(i)
    return Assignment([_first_fit_bins([[i] for i in m], [lengths[i] for i in m], micro_batch_tokens) for m in members],
                      method="first-fit (flat tokens)")


def lpt(sequences: Sequence[TokenSequence], ranks: int, micro_batch_tokens: int | None = None) -> Assignment:
    """Baseline: whole prefix groups, largest unique-token count first, each to the least-loaded rank.

    The groups are the trees of the batch; when every sequence shares one prefix (a system
    prompt), the subtrees below it (e.g. one per task), as a user grouping by prompt or task would.
    """
    _check(sequences, ranks, micro_batch_tokens)
    order = TrieOrder(sequences)
    run = _Run(order.length, order.lcp, np.array(CostModel().weights))
    groups = order.trees(below=order.common_prefix())
    # Micro-batches: a group over the budget is cut greedily in trie order; pieces packed first-fit decreasing.
    pieces_of = {g: _greedy_pieces(run, *g, micro_batch_tokens) for g in groups}
    loads = np.zeros(ranks)
    members: list[list[Range]] = [[] for _ in range(ranks)]
    for g in sorted(groups, key=lambda g: (-run.unique(*g), g)):
        k = int(np.argmin(loads))
        loads[k] += run.unique(*g)
        members[k].extend(pieces_of[g])
    assignment = []
    for pieces in members:
        pieces = sorted(pieces, key=lambda p: (-run.unique(*p), p))
        batches = [[int(i) for i in order.order[a:b]] for a, b in pieces]
        assignment.append(_first_fit_bins(batches, [int(run.unique(*p)) for p in pieces], micro_batch_tokens))
    return Assignment(assignment, method="LPT (unique tokens)")


def _greedy_pieces(run: _Run, a: int, b: int, budget: int | None) -> list[Range]:
    """Cut [a, b) in trie order whenever the next member would exceed the budget."""
    if budget is None:
        return [(a, b)]
    pieces, start = [], a
    for j in range(a + 1, b):
        if run.unique(start, j + 1) > budget:
            pieces.append((start, j))
            start = j
    return pieces + [(start, b)]


def _first_fit_bins(items: list[list[int]], sizes: list[int], budget: int | None) -> list[list[int]]:
    """Each item into the first micro-batch with room for its size, a new one if none has."""
    if budget is None:
        return [[i for item in items for i in item]] if items else []
    bins: list[list[int]] = []
    used: list[int] = []
    for item, size in zip(items, sizes):
        k = next((b for b in range(len(bins)) if used[b] + size <= budget), None)
        if k is None:
            bins.append([])
            used.append(0)
            k = len(bins) - 1
        bins[k].extend(item)
        used[k] += size
    return bins


def _check(sequences: Sequence[TokenSequence], ranks: int, micro_batch_tokens: int | None) -> None:
    """Reject what no assignment can satisfy, naming the sequence."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if len(sequences) == 0:
        raise BatchError("the batch holds no sequences")
    if micro_batch_tokens is not None:
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        for i, seq in enumerate(sequences):
            if len(seq) == 0:
                raise BatchError(f"{seq.label(i)}: field 'tokens' is empty")
            if len(seq) > micro_batch_tokens:
                raise BatchError(
                    f"{seq.label(i)}: field 'tokens' has {len(seq)} tokens, more than "
                    f"micro_batch_tokens={micro_batch_tokens}; raise the budget (a sequence cannot be split)"
                )

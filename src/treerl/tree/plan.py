"""How the DFS engine walks a prefix tree: which nodes run together in one model call, and what is kept.

Step 5 (docs/architecture.md): which nodes each DfsEngine call runs, and what it keeps.

A *unit* is one model call: nodes of the forest hanging below one node of the walk's path (its
`parent`), packed one after another in a single row without padding. A unit is an upper part of
that forest (a node's parent is in the unit or is `parent`): whole small subtrees, and the top
nodes of subtrees too large to fit, whose remaining children are *open* and get their own units
below. So one call can hold siblings (a GRPO group), cousins at the same depth, and small
subtrees whole (a random tree's many short nodes), each attending only to its ancestors.

Memory: a unit's autograd graph costs about the same per token whatever the unit, so the planner
counts *graph tokens*: what is held at once (the running unit plus the kept graphs of open units
on the path) stays within `capacity`. An open unit either keeps its graph while its descendants
run (they get the capacity it leaves) or is run again on the way up (recomputed: one more forward
of it, the full capacity below). A cost model in token-equivalents (`PlanCost`: a call's fixed
cost, a recomputation's forward) chooses each unit: the forest filled up to the capacity, or only
the part of that fill its descendants attend to, and for each keep or recompute.

*Row units* (`rows=True`, for models whose layers carry a recurrent state beside attention: state-space,
linear attention, short convolutions): a layer's own code runs each row of a call from one initial state
to one final state, so a unit is a batch of *rows*, each a chain of nodes hanging below `parent` (they
all start from its state), padded on the right to the longest. A row ends at a node whose children
get their own units (it is open: its final state is what they start from, so it must be a row
without padding) or at a node with nothing below it that runs. Rows are grouped into calls by
length: a row shorter than its call's longest computes padding, which the cost model counts. A row's
graph tokens come from `row_tokens` (the layers may pad each row further, to a chunk: treerl.engine.memory).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from treerl.tree.prefix_tree import ROOT, PrefixTree

Recompute = Literal["auto", "always", "never"]


def check_recompute(recompute: str) -> None:
    """Refuse a recompute mode the planner does not know, before any work."""
    if recompute not in ("auto", "always", "never"):
        raise ValueError(f"recompute must be 'auto', 'always' or 'never', got {recompute!r}")


@dataclass(frozen=True)
class PlanCost:
    """Relative costs the planner weighs, in units of one token's forward + backward.

    `call`: the fixed cost of one forward + backward model call (small GEMMs and kernel launches
    under-use the device; every call reads all weights and writes every weight gradient);
    `forward_call` the same for a forward without a graph (a unit run on the way down that will be
    recomputed); `forward_token` one token's forward alone, LM head excluded. Measured on a 2-core
    CPU with small-qwen3 (one sequence per call, 9 to 1,200 tokens: about 15 ms a call plus 0.36 ms a
    token, so a call costs about 42 tokens); the CUDA figures are estimates until measured on a GPU.
    """

    call: float = 48.0
    forward_call: float = 14.0
    forward_token: float = 0.25  # the body's forward: a recomputation skips the LM head (`Head.replay`)

    @classmethod
    def for_device(cls, device_type: str) -> PlanCost:
        """The default for a device type ("cpu", "cuda", ...)."""
        if device_type == "cpu":
            return cls()
        return cls(call=1024.0, forward_call=384.0, forward_token=0.25)


@dataclass
class Unit:
    """Nodes (preorder) run as one call below the path node `parent`; `below[o]`: the units under open node `o`."""

    parent: int
    nodes: list[int]
    tokens: int  # rows of the call (run tokens)
    open: list[int] = field(default_factory=list)  # nodes with children in later units, preorder
    keep: bool = False  # keep the graph while `below` runs (else recompute it on the way up)
    below: dict[int, list[Unit]] = field(default_factory=dict)
    rows: list[list[int]] | None = None  # row units: each row's chain of nodes (the call is rows x width)
    width: int = 0  # row units: the longest row, to which every row is padded


class WalkPlan:
    """The units of one walk over `tree`, in order (a tree of units: `Unit.below`), and what it holds at once."""

    def __init__(self, tree: PrefixTree, run: list[int], capacity: int, unit_tokens: int, recompute: Recompute,
                 cost: PlanCost, rows: bool = False, row_tokens: Callable[[int], int] | None = None):
        """`run[n]`: rows node n needs; `capacity`: graph tokens held at once (clamped to the largest node: one
        node always runs); `unit_tokens`: most rows of one call (0: one node per call); `rows`: row units
        (a recurrent state beside attention, see the module docstring), a row of w tokens holding
        `row_tokens(w)` graph tokens (default: w)."""
        check_recompute(recompute)
        self.tree, self.run, self.cost = tree, run, cost
        row_tokens = row_tokens if rows and row_tokens is not None else _same
        self.capacity = max(capacity, max(map(row_tokens, run[1:]), default=0))
        if rows:
            planner: _Planner = _RowPlanner(tree, run, self.capacity, recompute, cost, row_tokens)
            plans = [planner.plan(unit_tokens, spines=False)]
        else:
            planner = _Planner(tree, run, self.capacity, recompute, cost)
            plans = [planner.plan(unit_tokens, spines=False), planner.plan(unit_tokens, spines=True)]
        if unit_tokens > 0:  # one node per call: no call recomputes a node whose subtree merely shared it
            plans.append(planner.plan(0, spines=False))
        self.units = min(plans, key=lambda units: estimate(units, cost))  # the first (plain fills) on a tie

    # ------------------------------------------------------------------ reading the plan
    def walk(self):
        """Events in walk order: ("enter", unit, None), ("push" / "pop", unit, open node), ("exit", unit, None)."""
        stack: list[tuple[str, Unit, int | None]] = [("visit", u, None) for u in reversed(self.units)]
        while stack:
            event, unit, node = stack.pop()
            if event != "visit":
                yield event, unit, node
                continue
            yield "enter", unit, None
            stack.append(("exit", unit, None))
            for o in reversed(unit.open):
                stack.append(("pop", unit, o))
                stack.extend(("visit", u, None) for u in reversed(unit.below[o]))
                stack.append(("push", unit, o))

    def all_units(self) -> list[Unit]:
        """Every unit, in walk order."""
        return [unit for event, unit, _ in self.walk() if event == "enter"]

    def chain(self, unit: Unit, node: int) -> list[int]:
        """The unit's nodes from its top down to `node` (what the path must hold below `node`)."""
        out = []
        while node != unit.parent:
            out.append(node)
            node = self.tree.nodes[node].parent
        return out[::-1]

    def peak_graph_tokens(self) -> int:
        """Most graph tokens held at once over the walk (the running unit and kept graphs on the path)."""
        kept, peak = 0, 0
        for event, unit, _ in self.walk():
            if event == "enter":
                peak = max(peak, kept + unit.tokens)
                if unit.open and unit.keep:
                    kept += unit.tokens
            elif event == "exit" and unit.open:
                if unit.keep:
                    kept -= unit.tokens
                peak = max(peak, kept + unit.tokens)  # a recomputed unit's graph on the way up
        return peak

    def estimated_cost(self) -> float:
        """The cost model's estimate of the walk, in token-equivalents."""
        return estimate(self.units, self.cost)


def _same(width: int) -> int:
    return width


def estimate(units: list[Unit], cost: PlanCost) -> float:
    """The cost model's estimate of a walk over `units` (and every unit below them), in token-equivalents."""
    total = 0.0
    stack = list(units)
    while stack:
        unit = stack.pop()
        stack.extend(u for below in unit.below.values() for u in below)
        total += unit.tokens + cost.call
        if unit.open and not unit.keep:
            total += cost.forward_call + cost.forward_token * unit.tokens
    return total


class _Planner:
    """Chooses units top-down for one tree, capacity and mode; `plan` returns the units of one policy."""

    def __init__(self, tree: PrefixTree, run: list[int], capacity: int, recompute: Recompute, cost: PlanCost):
        self.tree, self.run, self.capacity, self.recompute, self.cost = tree, run, capacity, recompute, cost
        self.unit_tokens = 0  # most rows of one call in the plan being built (set by `plan`)
        self.size = list(run)  # run tokens of each node's subtree
        self.largest = list(run)  # largest single node in each subtree
        for node in reversed(tree.nodes[1:]):  # preorder reversed: children before parents
            if node.parent > ROOT:
                self.size[node.parent] += self.size[node.index]
                self.largest[node.parent] = max(self.largest[node.parent], self.largest[node.index])

    # ------------------------------------------------------------------ planning
    def plan(self, unit_tokens: int, spines: bool) -> list[Unit]:
        """Top-down: choose each forest's next unit and whether it keeps its graph, then plan below its open nodes.

        `spines`: also weigh a fill's spine alone at each unit. That choice is local (its cost estimate
        of what runs below is rough), so the walk is planned both ways and the cheaper plan is taken."""
        self.unit_tokens = unit_tokens
        top: list[Unit] = []
        work = [(ROOT, list(self.tree.nodes[ROOT].children), self.capacity, top)]
        while work:
            parent, roots, room, into = work.pop()
            later = []
            while roots:
                unit, roots, outside = self._next_unit(parent, roots, room, spines)
                for o in unit.open:
                    unit.below[o] = []
                    later.append((o, outside[o], room - unit.tokens if unit.keep else room, unit.below[o]))
                into.append(unit)
            work.extend(reversed(later))
        return top

    def _next_unit(self, parent: int, roots: list[int], room: int,
                   spines: bool) -> tuple[Unit, list[int], dict[int, list[int]]]:
        """The cheapest of two units, each keeping or recomputing its graph: the forest filled up to `room`, or
        only that fill's *spine* (its open nodes and their in-unit ancestors: what descendants still attend to).

        A unit run again on the way up recomputes every row in it; closed subtrees carried along cost a
        forward each time, so the spine alone wins when its subtrees fit into calls below anyway (a GRPO
        prompt alone, its samples three to a call, rather than the prompt with one sample and the other
        seven three to a call). Returns the unit, the roots left for the forest's next unit, and the
        children of each open node that were left out of it.
        """
        nodes, rest = self._fill(roots, room)
        candidates = [(nodes, rest)]
        spine = self._spine(nodes) if spines else nodes
        if len(spine) < len(nodes):
            dropped_nodes = set(nodes) - set(spine)
            dropped = [r for r in roots if r in dropped_nodes]  # whole subtrees: back to the forest
            candidates.append((spine, rest + dropped))
        best = None
        for candidate, left in candidates:
            unit, outside = self._unit(parent, candidate)
            below = [c for o in unit.open for c in outside[o]]
            rest_tokens = sum(self.size[r] for r in left)
            for keep in self._keep_choices(unit.tokens, below, room):
                cost = self._estimate(unit.tokens, below, keep, room, rest_tokens)
                if best is None or cost < best[0]:
                    best = (cost, unit, keep, left, outside)
        _, unit, keep, left, outside = best
        unit.keep = keep
        return unit, left, outside

    def _unit(self, parent: int, nodes: list[int]) -> tuple[Unit, dict[int, list[int]]]:
        """The unit of `nodes` below `parent`, and the children of each of its nodes left out of it."""
        unit = Unit(parent, sorted(nodes), sum(self.run[i] for i in nodes))
        taken = set(unit.nodes)
        outside = {o: [c for c in self.tree.nodes[o].children if c not in taken] for o in unit.nodes}
        unit.open = [o for o in unit.nodes if outside[o]]
        return unit, outside

    def _spine(self, nodes: list[int]) -> list[int]:
        """The nodes of a fill that are open or above an open node (whole subtrees dropped)."""
        taken = set(nodes)
        keep: set[int] = set()
        for n in nodes:
            if any(c not in taken for c in self.tree.nodes[n].children):
                while n in taken and n not in keep:
                    keep.add(n)
                    n = self.tree.nodes[n].parent
        return [n for n in nodes if n in keep] or nodes

    def _fill(self, roots: list[int], room: int) -> tuple[list[int], list[int]]:
        """One unit: an upper part of the forest under `roots`, shallow first, of at most `room` rows.

        A subtree that fits goes in whole; else its top node does (if it fits) and its children
        compete for what is left. The first node goes in whatever its size. Returns the unit's nodes
        and the roots left for the next unit.
        """
        room = min(room, self.unit_tokens)
        taken: list[int] = []
        left: list[int] = []
        is_root = set(roots)
        queue = deque(roots)
        while queue:
            x = queue.popleft()
            if self.size[x] <= max(room, 0):  # one-token leaves (no rows) always join their parent's unit
                taken.extend(self._subtree(x))
                room -= self.size[x]
            elif self.run[x] <= room or not taken:
                taken.append(x)
                room -= self.run[x]
                queue.extend(self.tree.nodes[x].children)
            elif x in is_root:
                left.append(x)
        return taken, left

    def _subtree(self, x: int) -> list[int]:
        out, stack = [], [x]
        while stack:
            i = stack.pop()
            out.append(i)
            stack.extend(self.tree.nodes[i].children)
        return out

    def _keep_choices(self, tokens: int, below: list[int], room: int) -> list[bool]:
        """Keep the graph while `below` runs in what it leaves, or recompute it: what the budget and mode allow."""
        if not below or self.recompute == "always":
            return [False]  # a unit with nothing below runs its backward at once: nothing to keep
        if self.recompute == "never":
            return [True]
        fits = room - tokens >= max(self.largest[c] for c in below)  # else no room for a node below: over budget
        return [True, False] if fits else [False]

    def _estimate(self, tokens: int, below: list[int], keep: bool, room: int, rest_tokens: int) -> float:
        """Cost of a unit, what runs below it and the rest of its forest, less the rows (the same for every choice)."""
        cost = self.cost.call
        if below and not keep:
            cost += self.cost.forward_call + self.cost.forward_token * tokens
        below_tokens = sum(self.size[c] for c in below)
        if below_tokens:
            cost += self.cost.call * self._calls(below_tokens, room - tokens if keep else room)
        if rest_tokens:
            cost += self.cost.call * self._calls(rest_tokens, room)
        return cost

    def _calls(self, tokens: int, room: int) -> int:
        """About how many calls `tokens` rows take with `room` rows per call."""
        per_call = max(1, min(room, self.unit_tokens))
        return max(1, math.ceil(tokens / per_call))


class _RowPlanner(_Planner):
    """Row units: sibling chains below one node, grouped by length into calls padded to their longest row."""

    def __init__(self, tree: PrefixTree, run: list[int], capacity: int, recompute: Recompute, cost: PlanCost,
                 row_tokens: Callable[[int], int]):
        super().__init__(tree, run, capacity, recompute, cost)
        self.row_tokens = row_tokens
        self.largest = [row_tokens(n) for n in self.largest]  # what the largest node's row holds

    def _next_unit(self, parent: int, roots: list[int], room: int,
                   spines: bool) -> tuple[Unit, list[int], dict[int, list[int]]]:
        """The forest's first call: its rows and the nodes with nothing to run that hang on them (one-token
        leaves, whose outputs come from their parent's last row), and whether it keeps its graph."""
        cap = max(1, min(room, self.unit_tokens)) if self.unit_tokens > 0 else 0  # 0: one node per call
        chains = sorted((self._chain(r, cap) for r in roots if self.run[r] > 0), key=lambda chain: -self._length(chain))
        group = self._first_group(chains, cap)
        taken = [n for chain in group for n in chain]
        taken += [c for n in [parent, *taken] for c in self.tree.nodes[n].children
                  if self.run[c] == 0 and (n != parent or c in roots)]  # one-token leaves: no rows of their own
        unit, outside = self._unit(parent, taken)
        unit.rows = group
        unit.width = max((self._length(chain) for chain in group), default=0)
        unit.tokens = self.row_tokens(unit.width) * len(group)
        left = [r for r in roots if r not in set(unit.nodes)]
        below = [c for o in unit.open for c in outside[o]]
        rest_tokens = sum(self.size[r] for r in left)
        choices = self._keep_choices(unit.tokens, below, room)
        unit.keep = min(choices, key=lambda keep: self._estimate(unit.tokens, below, keep, room, rest_tokens))
        return unit, left, outside

    def _chain(self, node: int, room: int) -> list[int]:
        """The row from `node` down: a node whose only child with rows still fits continues it (0: one node)."""
        chain, length = [node], self.run[node]
        while True:
            kids = [c for c in self.tree.nodes[chain[-1]].children if self.run[c] > 0]
            if len(kids) != 1 or self.row_tokens(length + self.run[kids[0]]) > room:
                return chain
            chain.append(kids[0])
            length += self.run[kids[0]]

    def _length(self, chain: list[int]) -> int:
        return sum(self.run[n] for n in chain)

    def _open(self, chain: list[int]) -> bool:
        """Whether the row's last node has children that run in calls below it (it hands them its state)."""
        return any(self.run[c] > 0 for c in self.tree.nodes[chain[-1]].children)

    def _first_group(self, chains: list[list[int]], cap: int) -> list[list[int]]:
        """The first call of the cheapest split of `chains` (longest first) into calls of consecutive rows.

        A call of k rows padded to its longest, L, costs `call + k * row_tokens(L)`; an open row must be a
        longest row (its final state is read after its last token, padding would run past it); the call's graph
        tokens stay within `cap` unless one row alone is more. Consecutive groups of rows sorted by length are
        optimal for this cost.
        """
        n = len(chains)
        if n == 0:
            return []
        lengths = [self._length(c) for c in chains]
        held = [self.row_tokens(length) for length in lengths]
        best = [0.0] * (n + 1)  # best[i]: cost of chains[i:]
        first = [n] * (n + 1)  # first[i]: end of the first group of chains[i:]
        for i in range(n - 1, -1, -1):
            best[i] = math.inf
            for j in range(i + 1, n + 1):
                too_big = held[i] * (j - i) > cap
                if j - i > 1 and (too_big or (self._open(chains[j - 1]) and lengths[j - 1] < lengths[i])):
                    break  # sorted longest first: a larger group has the same fault
                cost = self.cost.call + held[i] * (j - i) + best[j]
                if cost < best[i]:
                    best[i], first[i] = cost, j
        return chains[: first[0]]

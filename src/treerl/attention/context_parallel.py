"""Context parallelism: each DFS call's rows split over R ranks, attention over the gathered keys, exact.

Step 5 (docs/architecture.md): DfsEngine's calls when one path is too long for one device.

A unit's rows (treerl.attention.tree_attention) are dealt to the R ranks of a group in 2R chunks, zigzag: rank r
holds chunks r and 2R - 1 - r, so that on one long causal run every rank has as many query-key pairs as the others
(the early chunk sees few keys, the late one many). Everything but attention is per token: each rank runs the
model's layers on its own rows only. Attention gathers the unit's K/V from all ranks (one all-gather per layer and
K/V, `gather_keys`), and each rank computes its own queries against them: every part of the tree attention (own
causal runs, in-unit ancestors, both-ways image runs) clipped to its rows (`ShardLayout`), and the path. Backward:
each rank's gradient to the gathered K/V (its queries' share, and what its descendants' queries sent through the path
store) is summed over the ranks, each receiving its rows' (one reduce-scatter, `gather_keys`' backward).

The path's K/V (`ContextParallel.path`): `sharded` (the default), each rank keeps every R-th position of the unit's
gathered K/V when it joins the path (treerl.attention.tree_attention.PathKV), 1/R of the store and of its gradient
store; on a long trajectory they are what fills a device (Qwen3-8B at 128K tokens: 54 GiB with their float32
gradients). Then the queries go to the keys: each rank gathers the unit's queries (`gather_rows`), attends all of them
to its share of the path, and the partials are merged by log-sum-exp onto their queries' ranks (`merge_over_ranks`:
an all-reduce of the rows' largest log-sum-exp, one reduce-scatter of the weighted outputs and weights); backward
gathers the queries, output gradients, outputs and log-sum-exps, each rank's share of the path's K/V gradient stays
in its store, and the query gradients are reduce-scattered. What travels is O(call), never O(path) (a ring over the
path's shards would send the path's K/V every call). `replicated`: each rank keeps the whole path and sends none of
that (the unit's K/V are gathered anyway), for paths that fit. The head runs on each rank's own rows; its outputs are gathered
(`gather_outputs`: every rank then evaluates the same losses, and each sends back only its rows' gradient). So each
rank's parameter gradients are its rows' share: their sum over the group is the single-process gradient (the
trainer's gradient sync sums them, as it sums data-parallel ranks').

A recurrent model's calls are rows (each a chain of nodes from the parent's state, padded to one width): their
columns are dealt contiguously instead (`ContextParallel.columns`), the same columns of every row to a rank, so that
each rank's piece of a row continues the state of the rank before it (treerl.engine.state_passing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from treerl.attention.kernels import Part

PATH_LAYOUTS = ("sharded", "replicated")
MIXER_ORDERS = ("side-by-side", "in-turn")  # how a hybrid's mixer layers run their pieces (treerl.engine.state_passing)


@dataclass(frozen=True)
class ContextParallel:
    """The ranks (a torch.distributed group; None: the default one) that split every call's rows, how they hold
    the path's K/V: `sharded` (each every R-th position; the call's queries travel to the keys) or `replicated`
    (each the whole path: no traffic for it, R times the memory), and how a hybrid's mixer layers run their pieces:
    `side-by-side` (every rank at once, each scan corrected by the earlier pieces' states; where every mixer allows
    it) or `in-turn` (each rank after the previous one has passed its states on)."""

    rank: int
    size: int
    group: object = None
    path: str = "sharded"
    mixers: str = "side-by-side"

    def __post_init__(self):
        if self.path not in PATH_LAYOUTS:
            raise ValueError(f"context-parallel path layout must be one of {PATH_LAYOUTS}, got {self.path!r}")
        if self.mixers not in MIXER_ORDERS:
            raise ValueError(f"context-parallel mixers must be one of {MIXER_ORDERS}, got {self.mixers!r}")

    @property
    def path_ranks(self) -> int:
        """Ranks that share the path's K/V store (1: each holds it whole)."""
        return self.size if self.path == "sharded" else 1

    @classmethod
    def over(cls, group=None, path: str = "sharded", mixers: str = "side-by-side") -> ContextParallel:
        """This process's place in `group` (the default group: every rank of torchrun)."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group, path, mixers)

    def ranges(self, rows: int, rank: int | None = None) -> list[tuple[int, int]]:
        """The rows `[lo, hi)` of a call of `rows` that `rank` (default: this one) holds: chunks r and 2R - 1 - r of
        2R nearly equal chunks (zigzag), in order; empty ones left out."""
        r = self.rank if rank is None else rank
        cuts = [rows * i // (2 * self.size) for i in range(2 * self.size + 1)]
        chunks = [(cuts[r], cuts[r + 1]), (cuts[2 * self.size - 1 - r], cuts[2 * self.size - r])]
        return [(lo, hi) for lo, hi in chunks if hi > lo]

    def largest(self, values: list[int], device: torch.device | str = "cpu") -> list[int]:
        """Each of `values`, the largest over the ranks (what every rank must agree on to walk the same plan); the
        tensor goes by `device` (NCCL's: the GPU)."""
        tensor = torch.tensor(values, dtype=torch.long, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor.tolist()

    def columns(self, width: int) -> list[tuple[int, int]]:
        """Each rank's columns `[lo, hi)` of rows `width` long, contiguous and in rank order, so that a state passes
        from each rank to the next. Only the first `width // 2` ranks get columns (at least two each: a one-token call
        takes a layer's in-place step, whose state is written after the forward); the rest get none."""
        active = max(1, min(self.size, width // 2))
        cuts = [width * i // active for i in range(active + 1)]
        return [(cuts[r], cuts[r + 1]) if r < active else (width, width) for r in range(self.size)]


class ShardLayout:
    """How a unit's rows are dealt (`held`: each rank's rows, in the order its calls hold them; `owner`: each row's
    rank) and this rank's queries of it: which parts of the unit's attention they compute, each as (rows of the local
    queries, rows of the unit's keys, the part), and their positions. Built once per unit.

    `width`: a unit of rows that many tokens wide (a recurrent model's), dealt by columns (`ContextParallel.columns`):
    this rank's call is then `rows x columns`, and `active` ranks hold columns (the last of them each row's end)."""

    def __init__(self, layout, cp: ContextParallel, width: int | None = None):
        device = layout.positions.device
        self.cp, self.unit_rows = cp, layout.rows
        self.row_count = None if width is None else layout.rows // width  # a row unit's rows, on every rank
        if width is None:
            ranges = [cp.ranges(layout.rows, r) for r in range(cp.size)]
            self.active = cp.size
        else:
            columns = cp.columns(width)
            ranges = [[(row + lo, row + hi) for row in range(0, layout.rows, width) if hi > lo] for lo, hi in columns]
            self.active = sum(hi > lo for lo, hi in columns)
        self.held = [torch.cat([torch.arange(lo, hi) for lo, hi in ranges[r]]
                               or [torch.zeros(0, dtype=torch.long)]).to(device) for r in range(cp.size)]
        self.owner = torch.empty(layout.rows, dtype=torch.long, device=device)
        for rank, rows in enumerate(self.held):
            self.owner[rows] = rank
        local = self.held[cp.rank]
        self.rows = len(local)
        self.where = torch.full((layout.rows,), -1, dtype=torch.long, device=device)  # each row's local index
        self.where[local] = torch.arange(len(local), device=device)
        # the rows this rank's model call runs: its own, or (a call of fewer rows than ranks left it none) the first
        # row as a stand-in, since the rank must still take part in every layer's gather; its keys and outputs are
        # never read
        self.runs = local if len(local) else torch.zeros(1, dtype=torch.long, device=device)
        # a row unit's call: rows x this rank's columns (a stand-in: one token)
        self.shape = None if width is None else (layout.rows // width, len(local) * width // layout.rows) \
            if len(local) else (1, 1)
        self.positions = layout.positions[local]
        self.parts: list[tuple[slice, slice, Part]] = []
        offset = 0
        for lo, hi in ranges[cp.rank]:
            self._clip(layout, lo, hi, offset)
            offset += hi - lo
        self._folded: dict[int, torch.Tensor] = {}

    def _clip(self, layout, lo: int, hi: int, offset: int) -> None:
        """The parts of queries `[lo, hi)` (held from local row `offset` on)."""
        local = lambda a, b: slice(offset + a - lo, offset + b - lo)
        for s in layout.segments:  # own causal runs: the keys before the first query fully, then a causal square
            a, b = max(s.row, lo), min(s.end, hi)
            if a >= b:
                continue
            first = s.position + a - s.row
            if a > s.row:
                self.parts.append((local(a, b), slice(s.row, a), Part(q_start=first, k_start=s.position, causal=False)))
            self.parts.append((local(a, b), slice(a, b), Part(q_start=first, k_start=first, causal=True)))
        for block in layout.blocks:  # in-unit ancestors, fully
            a, b = max(block.q_lo, lo), min(block.q_hi, hi)
            if a < b:
                key = block.key
                self.parts.append((local(a, b), slice(key.row, key.end),
                                   Part(q_start=0, k_start=key.position, causal=False,
                                        q_positions=layout.positions[a:b], q_max=block.q_max)))
        for s in layout.both_ways:  # runs whose tokens see their later tokens too (Gemma 3's images)
            a, b = max(s.row, lo), min(s.end, hi)
            if a < b:
                self.parts.append((local(a, b), slice(s.row, s.end),
                                   Part(q_start=s.position + a - s.row, k_start=s.position, causal=False, later=True)))

    def folded_positions(self, groups: int) -> torch.Tensor:
        """Positions of the local rows repeated `groups` times (queries folded per K/V head)."""
        if groups not in self._folded:
            self._folded[groups] = self.positions.repeat(groups)
        return self._folded[groups]


def gather_rows(x: torch.Tensor, shard: ShardLayout) -> torch.Tensor:
    """Every rank's rows `[1, heads, local, ...]` -> the unit's `[1, heads, rows, ...]` in order (one all-gather)."""
    widest = max(len(rows) for rows in shard.held)
    out = x.new_empty((*x.shape[:2], shard.unit_rows, *x.shape[3:]))
    for rows, piece in zip(shard.held, _gather_padded(x, shard.cp, widest, dim=2)):
        out.index_copy_(2, rows, piece[:, :, : len(rows)])
    return out


def scatter_rows(x: torch.Tensor, shard: ShardLayout) -> torch.Tensor:
    """The unit's rows `[1, heads, rows, D]` summed over the ranks, each receiving its own `[1, heads, local, D]` (one
    reduce-scatter)."""
    widest = max(len(rows) for rows in shard.held)
    rows_first = x[0].transpose(0, 1)  # [rows, heads, D]: reduce_scatter_single splits the first dimension
    pieces = [torch.nn.functional.pad(rows_first.index_select(0, rows), (0, 0, 0, 0, 0, widest - len(rows)))
              for rows in shard.held]
    mine = rows_first.new_empty((widest, *rows_first.shape[1:]))
    dist.reduce_scatter_single(mine, torch.cat(pieces).contiguous(), group=shard.cp.group)
    return mine[: shard.rows].transpose(0, 1)[None]


def merge_over_ranks(out: torch.Tensor, lse: torch.Tensor, shard: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's partial attention of all the unit's queries over its keys (`out [1, heads, rows, Dv]`, `lse`) ->
    the attention over every rank's keys of this rank's queries: the log-sum-exp merge as sums (the rows' largest
    log-sum-exp agreed by an all-reduce, then one reduce-scatter of the weighted outputs and weights)."""
    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=shard.cp.group)
    top = top.nan_to_num(neginf=0.0)  # rows no rank's keys reach: weight 0 everywhere
    weight = torch.exp(lse - top)[..., None]
    summed = scatter_rows(torch.cat([out.to(lse.dtype) * weight, weight], dim=-1), shard)
    total = summed[..., -1]
    safe = total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    merged = torch.where(total[..., None] > 0, summed[..., :-1] / safe, 0.0)
    return merged, torch.log(total) + top[:, :, shard.held[shard.cp.rank]]


class _GatherKeys(torch.autograd.Function):
    """All ranks' rows of a call's K/V `[1, heads, local, D]` -> the call's `[1, heads, rows, D]`; backward: the
    gradient summed over the ranks, each rank receiving its rows' (one reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, shard: ShardLayout):
        ctx.shard, ctx.held = shard, x.shape[2]
        return gather_rows(x, shard)

    @staticmethod
    def backward(ctx, grad):
        mine = scatter_rows(grad, ctx.shard)
        if ctx.shard.rows < ctx.held:  # a stand-in row (`ShardLayout.runs`): no gradient
            return grad.new_zeros((*grad.shape[:2], ctx.held, grad.shape[3])), None
        return mine, None


def gather_keys(x: torch.Tensor, shard: ShardLayout) -> torch.Tensor:
    """The call's K/V from every rank's rows (differentiable: see `_GatherKeys`)."""
    return _GatherKeys.apply(x, shard)


class _GatherOutputs(torch.autograd.Function):
    """Every rank's head outputs `[local]` -> the call's `[N]` in its order (`owner`: the rank of each); backward:
    this rank's entries of the gradient, which every rank computed alike from the same losses."""

    @staticmethod
    def forward(ctx, x, cp: ContextParallel, owner: torch.Tensor):
        ctx.mine = (owner == cp.rank).nonzero()[:, 0]
        counts = torch.bincount(owner, minlength=cp.size).tolist()
        pieces = _gather_padded(x, cp, max(counts), dim=0)
        out = x.new_empty(owner.shape[0])
        for rank, (piece, count) in enumerate(zip(pieces, counts)):
            out[(owner == rank).nonzero()[:, 0]] = piece[:count]
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.mine], None, None


def gather_outputs(outputs: dict[str, torch.Tensor], cp: ContextParallel, owner: torch.Tensor
                   ) -> dict[str, torch.Tensor]:
    """The head's outputs of the whole call, on every rank (differentiable: see `_GatherOutputs`)."""
    return {name: _GatherOutputs.apply(value, cp, owner) for name, value in outputs.items()}


def _gather_padded(x: torch.Tensor, cp: ContextParallel, size: int, dim: int) -> list[torch.Tensor]:
    """Every rank's `x` (padded along `dim` to `size`, as an all-gather needs one shape)."""
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, size - x.shape[dim]]
    padded = torch.nn.functional.pad(x, pad).contiguous()
    pieces = [torch.empty_like(padded) for _ in range(cp.size)]
    dist.all_gather(pieces, padded, group=cp.group)
    return pieces

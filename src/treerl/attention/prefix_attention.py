"""Attention of generation over stored prefixes: each prefix's K/V read once by every query below it.

Step 1 (docs/architecture.md): the embedded sampler's attention (treerl.rollout.sampling.prefix_sharing).

The sampler keeps the K/V of every prefix it has computed as *runs*: a run holds the K/V of a stretch of tokens at
consecutive positions (a trie node of the call's prompts, or a node of the cross-call prefix cache), per attention
slot, stored once. A query sees the runs on its path from the root, then its own tokens:
- each run it descends from: one kernel call per run, with the queries of every row below that run folded into one
  block of queries per K/V head (broadcast, never copied per row: the cascade / Hydragen form);
- its own tokens: in a prefill call, the call's segment (a trie node) causally; in a decoding call, the row's own
  generated tokens (every row of a decoding call has generated as many, so they are one batched kernel call).
The parts are merged by log-sum-exp (treerl.attention.kernels), exactly as the tree engines merge theirs; sinks are
one more term, a sliding window narrows each part to the keys its queries can still see. What the parts do not
compute (an indexer's choice of keys, a bias per key, chunked attention) is refused at the layer's first call, so a
one-call probe tells the sampler to generate another way before anything is sampled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from treerl.attention.dispatch import LayerAttention, UnsupportedModel
from treerl.attention.kernels import AttentionSpec, Part, attend
from treerl.attention.tree_attention import Segment, Slot, _expand_heads, _fold, _merge_into, _merge_sinks, _unfold


@dataclass
class KVRun:
    """K/V of `length` tokens at positions [start, start + length): per slot `[1, kv_heads, length, head_dim]`."""

    start: int
    length: int
    keys: dict[Slot, torch.Tensor] = field(default_factory=dict)
    values: dict[Slot, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.keys.values(), *self.values.values()))

    def piece(self, lo: int, hi: int) -> KVRun:
        """Positions [lo, hi) of this run, as views."""
        a, b = lo - self.start, hi - self.start
        return KVRun(lo, hi - lo, {s: k[:, :, a:b] for s, k in self.keys.items()},
                     {s: v[:, :, a:b] for s, v in self.values.items()})


def joined(runs: list[KVRun]) -> KVRun:
    """Consecutive runs as one run that owns its memory (a copy)."""
    first = runs[0]
    return KVRun(first.start, sum(r.length for r in runs),
                 {s: torch.cat([r.keys[s] for r in runs], dim=2) for s in first.keys},
                 {s: torch.cat([r.values[s] for r in runs], dim=2) for s in first.values})


@dataclass(frozen=True)
class Read:
    """Queries `[lo, hi)` of a call see the first `used` tokens of `run` (their ancestors); their positions lie in
    `[q_min, q_max]`."""

    run: KVRun
    used: int
    lo: int
    hi: int
    q_min: int
    q_max: int


class RowKV:
    """Each decoding row's own tokens: per slot `[rows, kv_heads, width + capacity, head_dim]`, its generated tokens
    from column `width` on (`length` filled), and before them, right-aligned, the K/V of the end of its prompt that no
    other row reads (`own`: a multi-turn row's history since its branch), so that every row's own stretch is one
    batched kernel call (masked where a row's is shorter), not a call a row."""

    def __init__(self, rows: int, capacity: int, own: list[KVRun | None] | None = None):
        own = own or [None] * rows
        self.rows, self.capacity, self.length, self.own = rows, capacity, 0, own
        self.width = max((run.length for run in own if run is not None), default=0)
        self.keys: dict[Slot, torch.Tensor] = {}
        self.values: dict[Slot, torch.Tensor] = {}
        self.visible: torch.Tensor | None = None  # [rows, width]: which of the first `width` columns a row holds
        self._mask: torch.Tensor | None = None
        if self.width:
            lengths = torch.tensor([run.length if run is not None else 0 for run in own])
            self.visible = torch.arange(self.width)[None, :] >= (self.width - lengths)[:, None]

    def write(self, slot: Slot, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's K/V (`[rows, kv_heads, 1, D]`) after the filled columns; every filled column of each row."""
        if slot not in self.keys:
            self.keys[slot], self.values[slot] = self._allocate(slot, k), self._allocate(slot, v, values=True)
        keys, values = self.keys[slot], self.values[slot]
        column = self.width + self.length
        keys[:, :, column] = k[:, :, 0]
        values[:, :, column] = v[:, :, 0]
        return keys[:, :, : column + 1], values[:, :, : column + 1]

    def _allocate(self, slot: Slot, x: torch.Tensor, values: bool = False) -> torch.Tensor:
        buffer = x.new_zeros(self.rows, x.shape[1], self.width + self.capacity, x.shape[3])
        for row, run in enumerate(self.own):
            if run is not None:
                stored = (run.values if values else run.keys)[slot]
                buffer[row, :, self.width - run.length : self.width] = stored[0].to(buffer.dtype)
        return buffer

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows go on (indices into the current rows)."""
        self.rows = len(rows)
        self.keys = {s: k[rows] for s, k in self.keys.items()}
        self.values = {s: v[rows] for s, v in self.values.items()}
        rows_cpu = rows.cpu().tolist()
        self.own = [self.own[r] for r in rows_cpu]
        if self.visible is not None:
            self.visible = self.visible[rows_cpu]
        self._mask = None

    def run(self, row: int, start: int) -> KVRun:
        """Row `row`'s generated tokens (those run so far) as a run at positions from `start` (views)."""
        cols = slice(self.width, self.width + self.length)
        return KVRun(start, self.length, {s: k[row : row + 1, :, cols] for s, k in self.keys.items()},
                     {s: v[row : row + 1, :, cols] for s, v in self.values.items()})

    def mask(self, columns: int, device: torch.device) -> torch.Tensor | None:
        """`[rows, columns]`: the filled columns each row holds (None: all of them); made once a step, not a layer."""
        if self.visible is None:
            return None
        if self._mask is None or self._mask.shape[1] != columns:
            tail = torch.ones(self.rows, columns - self.width, dtype=torch.bool)
            self._mask = torch.cat([self.visible, tail], dim=1).to(device)
        return self._mask


class PrefixCall:
    """One model call of generation, handed to every attention layer (`treerl_call=`): a prefill of `segments` (trie
    nodes packed in one row at `positions`) or a decoding step of `rows` (one token each at `positions`), each query
    also seeing the runs its `reads` name. A prefill keeps each slot's K/V (`kept`) for the runs it makes.

    A plain class, as TreeCall: wrappers rebuild dataclasses found in a forward's kwargs."""

    def __init__(self, reads: list[Read], positions: torch.Tensor, segments: list[Segment] | None = None,
                 rows: RowKV | None = None):
        self.reads, self.positions, self.segments, self.rows = reads, positions, segments, rows
        self.kept: dict[Slot, tuple[torch.Tensor, torch.Tensor]] = {}
        self.calls: dict[int | None, int] = {}
        self.layers_called: set[int | None] = set()
        self._folded: dict[tuple[int, int, int], torch.Tensor] = {}
        self.wants_mask = False

    def slot(self, module: torch.nn.Module) -> Slot:
        """The layer's n-th attention call of this forward (a layer may attend more than once)."""
        index = getattr(module, "layer_idx", None)
        if index is not None and not isinstance(index, int):
            raise UnsupportedModel(f"{type(module).__name__}: its layer_idx {index!r} is no layer index")
        self.layers_called.add(index)
        n = self.calls.get(index, 0)
        self.calls[index] = n + 1
        return index, n

    def __call__(self, module, query, key, value, layer: LayerAttention) -> torch.Tensor:
        slot = self.slot(module)
        _check_layer(slot, layer)
        if self.rows is None:
            self.kept[slot] = (key, value)
            out, lse = self._segments(query, key, value, layer.spec)
        else:
            own_k, own_v = self.rows.write(slot, key, value)
            query = query.transpose(0, 2)  # [rows, H, 1, D] -> [1, H, rows, D]: the rows as one row of queries
            out, lse = _own_rows(query, own_k, own_v, layer.spec, self.rows.mask(own_k.shape[2], query.device))
        for read in self.reads:
            self._read(query, out, lse, read, slot, layer.spec)
        _merge_sinks(out, lse, layer.sinks)
        out = out.to(query.dtype)
        if self.rows is None:
            return out.transpose(1, 2).contiguous()  # [1, tokens, H, Dv]
        return out[0].transpose(0, 1)[:, None].contiguous()  # [rows, 1, H, Dv]

    def _segments(self, q, k, v, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """Each segment over itself, causally."""
        groups = q.shape[1] // k.shape[1]
        ke, ve = _expand_heads(k, groups), _expand_heads(v, groups)
        parts = [attend(q[:, :, s.row : s.end], ke[:, :, s.row : s.end], ve[:, :, s.row : s.end], spec,
                        Part(q_start=s.position, k_start=s.position, causal=True)) for s in self.segments]
        lse = torch.cat([lse for _, lse, _ in parts], dim=2)
        return torch.cat([o.to(lse.dtype) for o, _, _ in parts], dim=2), lse

    def _read(self, q, out, lse, read: Read, slot: Slot, spec: AttentionSpec) -> None:
        """Queries [lo, hi) over the run's first `used` tokens (those a window leaves them), merged in place."""
        end = read.run.start + read.used
        first = read.run.start
        if spec.window is not None:
            first = max(first, read.q_min - spec.window + 1)
        if first >= end:
            return
        a, b = first - read.run.start, end - read.run.start
        k, v = read.run.keys[slot][:, :, a:b], read.run.values[slot][:, :, a:b]
        groups = q.shape[1] // k.shape[1]
        part = Part(q_start=0, k_start=first, causal=False, q_positions=self._folded_positions(read, groups),
                    q_max=read.q_max)
        o, l, _ = attend(_fold(q[:, :, read.lo : read.hi], k.shape[1]), k, v, spec, part)
        _merge_into(out, lse, slice(read.lo, read.hi), _unfold(o, q.shape[1]), _unfold(l, q.shape[1]))

    def _folded_positions(self, read: Read, groups: int) -> torch.Tensor:
        key = (read.lo, read.hi, groups)
        if key not in self._folded:
            self._folded[key] = self.positions[read.lo : read.hi].repeat(groups)
        return self._folded[key]


def _own_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
              mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's query (`q [1, H, rows, D]`) over its own columns (`[rows, kv_heads, S, D]`, the query's own last;
    `mask [rows, S]`: the columns a row holds, None: all): one batched call, every row's query heads folded per K/V
    head. A column's distance from the last is its key's distance from the query: a window keeps the last `window`."""
    rows, kv_heads, width, _ = k.shape
    if spec.window is not None and width > spec.window:
        k, v = k[:, :, width - spec.window :], v[:, :, width - spec.window :]
        mask = None if mask is None else mask[:, width - spec.window :]
    heads = q.shape[1]
    per_row = q[0].transpose(0, 1).reshape(rows, kv_heads, heads // kv_heads, q.shape[-1])
    if mask is None:
        o, l, _ = attend(per_row, k, v, dataclasses.replace(spec, window=None), Part(q_start=0, k_start=0, causal=False))
    else:
        o, l = _masked(per_row, k, v, spec, mask)
    lse = l.reshape(rows, heads).transpose(0, 1)[None]
    return o.reshape(rows, heads, -1).transpose(0, 1)[None].to(lse.dtype), lse


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec,
            mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the columns `mask [rows, S]` shows, in at least float32: a decoding step's one query a row."""
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) * spec.scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v.to(compute), lse


def _check_layer(slot: Slot, layer: LayerAttention) -> None:
    """What the parts compute: scale, soft-cap, a sliding window, sinks per head. Anything else is refused (at the
    layer's first call, whatever the data, so that a probe finds it)."""
    if layer.dense:
        raise UnsupportedModel(f"layer {slot[0]}: attention with an indexer's choice of keys, a bias per key, a sink "
                               "per query or appended keys, which generation over shared prefixes does not compute")
    if layer.spec.chunk is not None:
        raise UnsupportedModel(f"layer {slot[0]}: chunked attention, whose chunks start at absolute positions that "
                               "differ between the rows of a decoding step")

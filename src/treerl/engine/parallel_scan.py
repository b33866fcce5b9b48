"""A mixer layer's scan split over context-parallel ranks, side by side: each rank scans its piece from a zero state,
then corrects it with the state the earlier ranks' pieces end in (Megatron-LM's Mamba state passing, #6808).

Step 5 (docs/architecture.md): DfsEngine's calls of a recurrent model split over a context-parallel group.

The scans treerl splits this way (`LINEAR_SCANS`: the delta rules of Gated DeltaNet and KDA, Mamba2's SSD) are affine
in the state they start from: started from S instead of zero, a piece's outputs gain a term linear in S and its final
state is T(S) + F, where F is the zero-start final state and T the piece's transfer. Their state has independent
columns (the delta rule's [K, V] state: each of the V columns evolves alone, read by the queries) or rows (Mamba2's
[P, N]: each of the P rows alone, read by C): the values fill the columns (rows) from zero, the rest of the scan acts
on each one the same way. So one call of the layer's own function, with K (N) more value columns (rows) set to zero and
started from [S | identity], returns at once

  - the zero-start outputs and final state F (the first columns), and
  - the transfer: the identity carried through the piece, i.e. T as a K x K (N x N) matrix M per head, and each
    token's read of it, Q (the outputs of the added columns),

with which the outputs started from S are `out + Q S` (`S M` for rows) and the final state `M S + F` (`S M + F`).
The arithmetic of each column is the layer's own, so the result is exact.

A layer then runs on every rank at once: rank 0 scans its piece from the parent's state (it has it), the others from
zero with the transfer columns; one all-gather shares every rank's (F, M) (`_ShareTransfers`: the state and a K x K
matrix per head and row, never tokens); rank r chains them, S_r = M_{r-1} S_{r-1} + F_{r-1} from rank 0's final state
on, and corrects its outputs and final state. The all-gather's backward sums each rank's (F, M) gradient over the
ranks and gives it to its owner (a reduce-scatter). Mamba's selective scan (a decay per state entry, its transfer the
total decay) is split the same way by treerl.engine.selective_scan. The price of running side by side is the transfer
columns: K (N) more value columns in the piece's scan, about twice its work, against R pieces one after another for
the state passed rank by rank (treerl.engine.state_passing).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class LinearScan:
    """A module function that scans a multi-token call from an initial state, affine in it: which of its arguments
    are the values and the initial state, and whether the values fill the state's columns (`layout="columns"`: the
    delta rule's [.., K, V]) or rows ("rows": Mamba2's [.., P, N])."""

    values: str  # the values' argument ([B, T, H, V] or [B, T, H, P])
    width_from: str  # the argument whose last dim is the state's other side (K: the keys; N: B)
    initial: str  # the initial state's argument
    final_flag: str  # the argument that asks for the final state
    layout: str  # "columns" | "rows"
    pair: bool  # returns (outputs, None) when not asked for the final state (else the outputs alone)
    upcast: str | None = None  # an argument whose dtype sets the outputs' (passed as float32 at least: the outputs
    # are corrected before they are rounded to it)


LINEAR_SCANS: dict[str, LinearScan] = {
    "torch_chunk_gated_delta_rule": LinearScan("value", "key", "initial_state", "output_final_state", "columns",
                                               True, "query"),
    "chunk_kimi_delta_attention": LinearScan("value", "key", "initial_state", "output_final_state", "columns",
                                             True, "query"),
    "mamba2_chunk_scan": LinearScan("hidden_states", "B", "initial_states", "return_final_states", "rows", False),
}


class Pieces(Protocol):
    """What a split scan needs of the running call: this rank's place, how many ranks hold pieces, the rows of the
    call on those that do, where the links that must run in backward go, and the collectives
    (treerl.engine.state_passing.StatePassing)."""

    rank: int
    active: int  # ranks with pieces of the call (the rest run a one-token stand-in)
    rows: int  # the call's rows on the ranks with pieces
    links: list[torch.Tensor]
    scanned: set[int]  # the mixer layers (module ids) whose scan was split so far in the running call
    layer: torch.nn.Module | None  # the mixer layer running now

    def gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `mine` (an all-gather)."""

    def summed_row(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's row of `grad` [R, n], summed over the ranks (a reduce-scatter)."""


class LaterPiece:
    """The second of two ranks, alone: what the memory probe measures a rank's graph by (the first rank's piece ends in
    a zero state; nothing is sent)."""

    rank, active, rows, layer = 1, 2, 1, None

    def __init__(self):
        self.links, self.scanned = [], set()

    def gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        return [torch.zeros_like(mine), mine]

    def summed_row(self, grad: torch.Tensor) -> torch.Tensor:
        return grad[self.rank]


_running: list[Pieces | None] = [None]  # the call whose layers scan side by side (one walk runs at a time)


@contextlib.contextmanager
def split_scans(pieces: Pieces, functions: Iterable[tuple[str, str]]) -> Iterator[None]:
    """While the block runs, each (module, function) of `LINEAR_SCANS` scans this rank's piece side by side with the
    other ranks' (`pieces`: the running call), as does Mamba's selective scan (treerl.engine.selective_scan)."""
    replaced = []
    for module_name, name in sorted(set(functions)):
        module = sys.modules[module_name]
        original = getattr(module, name)
        setattr(module, name, _split(original, LINEAR_SCANS[name]))
        replaced.append((module, name, original))
    _running[0] = pieces
    try:
        yield
    finally:
        _running[0] = None
        for module, name, original in replaced:
            setattr(module, name, original)


def running() -> Pieces | None:
    """The call whose pieces scan side by side, when other ranks hold pieces of it (else None: a scan of its own);
    the layer that asks is counted as split."""
    pieces = _running[0]
    if pieces is None:
        return None
    if pieces.layer is not None:
        pieces.scanned.add(id(pieces.layer))
    return pieces if pieces.active > 1 else None


def scan_of(module: torch.nn.Module) -> str | None:
    """The function of `LINEAR_SCANS` the module's forward calls (read off its source), or None."""
    return _scan_of_class(type(module))


@functools.cache
def _scan_of_class(cls: type) -> str | None:
    """`scan_of` for a class: its source is read once, not at every walk."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    namespace = vars(sys.modules[cls.__module__])
    return next((name for name in LINEAR_SCANS if name + "(" in source and name in namespace), None)


def _split(original: Callable, scan: LinearScan) -> Callable:
    signature = inspect.signature(original)

    def split(*args, **kwargs):
        pieces = running()
        if pieces is None:  # a call no other rank holds pieces of: the layer's own scan
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        wants_final = bound.arguments[scan.final_flag]
        if 0 < pieces.rank < pieces.active:
            piece = scan_from_zero(original, scan, bound)
            out, final = piece.started_from(start_of_piece(pieces, piece.final, piece.transfer, scan.layout))
        else:  # rank 0 (from the parent's state: exact) or a stand-in
            bound.arguments[scan.final_flag] = True
            out, final = original(*bound.args, **bound.kwargs)
            start_of_piece(pieces, final, None, scan.layout, width=bound.arguments[scan.width_from].shape[-1])
        if wants_final:
            return out, final
        return (out, None) if scan.pair else out  # as the function answers (the memory probe runs without a cache)

    split.treerl_original = original
    return split


def start_of_piece(pieces: Pieces, final: torch.Tensor, transfer: torch.Tensor | None, layout: str,
                   width: int | None = None) -> torch.Tensor | None:
    """Share this rank's piece's (zero-start final state, transfer) with every rank; the state its piece starts
    from: rank 0's final state carried through the pieces between (None on rank 0 and on a stand-in, whose own
    `final` (rank 0's: from the parent's state) goes instead, with no transfer; `width`: the transfer's side)."""
    if pieces.rank >= pieces.active:  # a stand-in: its outputs are never read; it takes part in the all-gather
        final = final.new_zeros(pieces.rows, *final.shape[1:])
    if transfer is None:
        transfer = torch.zeros_like(final) if layout == "diagonal" else final.new_zeros(*final.shape[:2], width, width)
    states, transfers = _share(pieces, final, transfer)
    if not 0 < pieces.rank < pieces.active:
        return None
    start = states[0]
    for r in range(1, pieces.rank):
        start = carry(transfers[r], start, layout) + states[r]
    return start


@dataclass
class Piece:
    """One piece's scan from zero, with its transfer: what it reads of, and makes of, any state it starts from."""

    out: torch.Tensor  # the outputs from a zero state (float32 at least)
    read: torch.Tensor  # each token's read of the start state (Q [.., T, H, K]; for rows, C's [.., L, H, N])
    final: torch.Tensor  # the final state from a zero state
    transfer: torch.Tensor  # M [.., H, K, K] (rows: [.., H, N, N])
    layout: str
    dtype: torch.dtype  # the outputs' own dtype

    def started_from(self, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The outputs and final state had the piece started from `start`: exact, the scan being affine in it."""
        with torch.autocast(self.out.device.type, enabled=False):
            out = self.out + _read(self.read, start.to(self.read.dtype), self.layout)
            final = carry(self.transfer, start, self.layout) + self.final
        return out.to(self.dtype), final


def scan_from_zero(original: Callable, scan: LinearScan, bound: inspect.BoundArguments) -> Piece:
    """One call of the layer's scan with `width` more value columns (rows), zero, started from [zero | identity]."""
    arguments = bound.arguments
    values = arguments[scan.values]
    width = arguments[scan.width_from].shape[-1]
    dtype = None
    if scan.upcast is not None:  # the outputs in float32 (or wider) until corrected: the scan computes in it anyway
        dtype = arguments[scan.upcast].dtype
        arguments[scan.upcast] = arguments[scan.upcast].to(torch.promote_types(dtype, torch.float32))
    arguments[scan.values] = torch.cat([values, values.new_zeros(*values.shape[:-1], width)], dim=-1)
    arguments[scan.initial] = _with_identity(values, width, scan.layout)
    arguments[scan.final_flag] = True
    out, final = original(*bound.args, **bound.kwargs)
    own = values.shape[-1]
    if scan.layout == "columns":
        zero_start, transfer = final[..., :own], final[..., own:]
    else:
        zero_start, transfer = final[:, :, :own], final[:, :, own:]
    return Piece(out[..., :own], out[..., own:], zero_start, transfer, scan.layout, dtype or out.dtype)


def _with_identity(values: torch.Tensor, width: int, layout: str) -> torch.Tensor:
    """[zero | identity]: the initial state of a piece that scans from zero and carries its transfer beside."""
    batch, heads, own = values.shape[0], values.shape[2], values.shape[-1]
    dtype = torch.promote_types(values.dtype, torch.float32)
    eye = torch.eye(width, dtype=dtype, device=values.device).expand(batch, heads, width, width)
    if layout == "columns":  # [.., K, V + K]
        return torch.cat([eye.new_zeros(batch, heads, width, own), eye], dim=-1)
    return torch.cat([eye.new_zeros(batch, heads, own, width), eye], dim=2)  # [.., P + N, N]


def carry(transfer: torch.Tensor, state: torch.Tensor, layout: str) -> torch.Tensor:
    """The state a piece ends in when it starts from `state`, less its zero-start final state: M S (columns), S M
    (rows), or entry by entry (`diagonal`: Mamba's selective scan, a decay per state entry)."""
    state = state.to(transfer.dtype)
    if layout == "columns":
        return torch.einsum("bhkj,bhjv->bhkv", transfer, state)
    if layout == "rows":
        return torch.einsum("bhpn,bhnm->bhpm", state, transfer)
    return transfer * state


def _read(read: torch.Tensor, state: torch.Tensor, layout: str) -> torch.Tensor:
    """What each token of a piece reads of the state it starts from: Q S (columns), C's read (rows)."""
    if layout == "columns":
        return torch.einsum("bthk,bhkv->bthv", read, state)
    return torch.einsum("blhn,bhpn->blhp", read, state)


def _share(pieces: Pieces, state: torch.Tensor, transfer: torch.Tensor
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's (zero-start final state, transfer), gathered; in the call's graph as a link that must run in
    backward (rank 0 and the stand-ins read none of it, yet their peers' gradients wait for theirs)."""
    flat = _ShareTransfers.apply(pieces, _DIFFERENTIABLE, state.reshape(-1), transfer.reshape(-1))
    if torch.is_grad_enabled():
        pieces.links.append(flat)
    n = state.numel()
    return ([piece[:n].view_as(state) for piece in flat], [piece[n:].view_as(transfer) for piece in flat])


_DIFFERENTIABLE = torch.zeros((), requires_grad=True)  # puts a stand-in's share (zeros) in the graph too


class _ShareTransfers(torch.autograd.Function):
    """Each rank's flattened (state, transfer) -> every rank's, stacked [R, n]; backward: each rank's row of the
    gradient summed over the ranks (a reduce-scatter) to its own tensors."""

    @staticmethod
    def forward(ctx, pieces: Pieces, _flag, state: torch.Tensor, transfer: torch.Tensor):
        ctx.pieces, ctx.n = pieces, state.numel()
        return torch.stack(pieces.gather(torch.cat([state, transfer.to(state.dtype)]).contiguous()))

    @staticmethod
    def backward(ctx, grad):
        mine = ctx.pieces.summed_row(grad.contiguous())
        return None, None, mine[: ctx.n], mine[ctx.n :]

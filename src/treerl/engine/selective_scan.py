"""Mamba's selective scan continued from a tree node's parent state, in chunks of bounded memory.

Step 5 (docs/architecture.md): a hybrid model's recurrent state, for the mixers whose scan starts from zero.

transformers' Mamba layers (Mamba, Falcon-Mamba, Jamba, Zamba) run every multi-token call through the module function
`mamba_selective_scan`, which starts from a zero SSM state whatever the cache holds. The scan is linear in its state:
started from h0 instead, the state after token t gains

    exp(A * sum_{s<=t} dt_s) (elementwise) h0

and the output at t gains C_t . that, gated as the layer gates its output (`* silu(z_t)`; the skip term D * x_t does
not depend on the state). So treerl runs the layer's own scan from zero and adds the state carried in on top, exactly.

It does so in chunks of `SCAN_CHUNK` tokens: each chunk runs the layer's own zero-start scan on its tokens and adds
the state carried into it (the parent's final state at the first chunk, the previous chunk's final state after), so
no tensor of a whole node's length times the state ([rows, d_inner, L, N], which transformers' scan builds for
the whole call) is ever allocated. Each chunk runs under `torch.utils.checkpoint`: the forward keeps only the chunk's
inputs, and the backward recomputes one chunk at a time. Peak memory of one layer's scan: the inputs of every chunk
(O(rows * d_inner * L), the size of the layer's own activations) plus one chunk's graph, a few tensors of
rows * d_inner * SCAN_CHUNK * N elements, whatever the node's length L.

`continued_scans` installs the continuing scan in the layers' modules while DfsEngine walks; the state each layer
continues comes from its call's `TreeStateCache`, which hands it here (`hand`) when the layer asks for its recurrent
state, instead of to the layer (whose one-token step would write it in place): every call of such a layer, one
token or many, runs the scan.

Under context parallelism with the mixers side by side (treerl.engine.parallel_scan), a rank's piece after the first
scans from zero, shares its final state and its transfer (the total decay exp(A * sum dt), entry by entry) with the
other ranks, and adds what the state its piece starts from contributes: the same continued scan, of zero inputs
from that state (`_over_ranks`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from treerl.attention import UnsupportedModel
from treerl.engine import parallel_scan

SCAN_CHUNK = 64
"""Tokens of one chunk of the continued scan: what one layer holds of its [rows, d_inner, tokens, N] tensors at once."""


class ScanStart:
    """The state a Mamba layer's next scans continue: its parent's final state, or None at the root (zero).

    Zamba scans its heads one by one (state [rows, heads, head_dim, N]): each call takes the next head's state."""

    def __init__(self, layer: int, state: torch.Tensor | None, on_read: Callable[[], None]):
        self.layer, self.state, self.on_read, self.calls = layer, state, on_read, 0

    def next(self, channels: int) -> torch.Tensor | None:
        """The state of the layer's next scan, of `channels` channels (None at the root)."""
        self.calls += 1
        if self.state is None:
            return None
        state = self.state[:, self.calls - 1] if self.state.dim() == 4 and self.calls <= self.state.shape[1] else None
        state = self.state if self.state.dim() == 3 and self.calls == 1 else state
        if state is None or state.shape[1] != channels:
            raise UnsupportedModel(f"layer {self.layer}'s selective scan {self.calls} of {channels} channels does not "
                                   f"match the SSM state {tuple(self.state.shape)} it was handed")
        self.on_read()
        return state


_pending: list[ScanStart | None] = [None]  # the state the next scans continue (one layer runs at a time)


def hand(start: ScanStart | None) -> None:
    """The state the layer's coming scans continue (TreeStateCache, when the layer asks for its recurrent state);
    None once it gave back its final state."""
    _pending[0] = start


def continued_scan(original: Callable, start: torch.Tensor | None, hidden_states: torch.Tensor, dt: torch.Tensor,
                   A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                   z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
                   **options) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's scan (`original`, zero-start) continued from `start` ([rows, d, N], None: zero), chunk by chunk.

    Shapes as transformers' `mamba_selective_scan`: x, dt, z [rows, d, L], A [d, N], B, C [rows, N, L]. Returns the
    outputs [rows, d, L] and the final state [rows, d, N]."""
    outputs, state = [], start
    for begin in range(0, hidden_states.shape[-1], SCAN_CHUNK):
        piece = slice(begin, begin + SCAN_CHUNK)
        inputs = (hidden_states[..., piece], dt[..., piece], B[..., piece], C[..., piece],
                  None if z is None else z[..., piece])
        output, state = _checkpointed(original, state, A, D, delta_bias, delta_softplus, options, *inputs)
        outputs.append(output)
    return torch.cat(outputs, dim=-1), state


def _checkpointed(original: Callable, start: torch.Tensor | None, *args) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk, recomputed in backward (its graph exists only while it is back-propagated)."""
    if not torch.is_grad_enabled():
        return _scan_chunk(original, start, *args)
    return checkpoint(_scan_chunk, original, start, *args, use_reentrant=False, preserve_rng_state=False)


def _scan_chunk(original: Callable, start: torch.Tensor | None, A: torch.Tensor, D: torch.Tensor | None,
                delta_bias: torch.Tensor | None, delta_softplus: bool, options: dict, hidden_states: torch.Tensor,
                dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                z: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's own zero-start scan of one chunk, plus the state carried into it, decayed and read out."""
    output, end = original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                           return_last_state=True, **options)
    if start is None:
        return output, end
    carried = _decayed(start, dt, A, delta_bias, delta_softplus)  # [rows, d, chunk, N]
    read = torch.einsum("bdln,bnl->bdl", carried.to(hidden_states.dtype), C)
    if z is not None:
        read = read * F.silu(z)
    return output + read, end + carried[:, :, -1]


def _decayed(start: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, delta_bias: torch.Tensor | None,
             delta_softplus: bool) -> torch.Tensor:
    """exp(A * sum_{s<=t} dt_s) * start for every t of the chunk: the carried state, dt discretised as the scan does."""
    dt = _discretised(dt, delta_bias, delta_softplus)
    return torch.exp(A[None, :, None, :] * dt.cumsum(dim=-1)[..., None]) * start[:, :, None, :]


def _discretised(dt: torch.Tensor, delta_bias: torch.Tensor | None, delta_softplus: bool) -> torch.Tensor:
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    return F.softplus(dt) if delta_softplus else dt


def _over_ranks(pieces: parallel_scan.Pieces, original: Callable, output: torch.Tensor, state: torch.Tensor,
                hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None = None, z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
                delta_softplus: bool = False, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """A context-parallel rank's piece (scanned from zero, unless it is rank 0's), started from the state the earlier
    ranks' pieces end in: their final states and total decays shared, chained, and read as the scan reads a
    continued state (treerl.engine.parallel_scan, layout "diagonal")."""
    if not 0 < pieces.rank < pieces.active:  # rank 0 (from the parent's state) or a stand-in: shares only
        parallel_scan.start_of_piece(pieces, state, None, "diagonal")
        return output, state
    decay = torch.exp(A[None] * _discretised(dt, delta_bias, delta_softplus).sum(dim=-1)[..., None])  # [rows, d, N]
    start = parallel_scan.start_of_piece(pieces, state, decay.to(state.dtype), "diagonal")
    read, carried = continued_scan(original, start, torch.zeros_like(hidden_states), dt, A, B, C, D=None, z=z,
                                   delta_bias=delta_bias, delta_softplus=delta_softplus, **options)
    return output + read, state + carried


def _continuing(original: Callable) -> Callable:
    """`original` (a module's zero-start scan) continuing the state its layer was handed (`hand`)."""

    def scan(hidden_states: torch.Tensor, *args, return_last_state: bool = False, **kwargs):
        pending = _pending[0]
        if pending is None:  # a call without treerl's cache: the layer's own scan
            return original(hidden_states, *args, return_last_state=return_last_state, **kwargs)
        output, state = continued_scan(original, pending.next(hidden_states.shape[1]), hidden_states, *args, **kwargs)
        pieces = parallel_scan.running()
        if pieces is not None:  # context parallelism, side by side: continued from the earlier ranks' pieces
            output, state = _over_ranks(pieces, original, output, state, hidden_states, *args, **kwargs)
        return (output, state) if return_last_state else output

    scan.treerl_original = original
    return scan


@contextlib.contextmanager
def continued_scans(functions: Iterable[tuple[str, str]]) -> Iterator[None]:
    """While the block runs, each (module, function) zero-start scan continues the state its layer is handed."""
    replaced = []
    for module_name, name in sorted(set(functions)):
        module = sys.modules[module_name]
        original = getattr(module, name)
        if not hasattr(original, "treerl_original"):  # not already continuing (a walk inside a walk)
            setattr(module, name, _continuing(original))
            replaced.append((module, name, original))
    try:
        yield
    finally:
        for module, name, original in replaced:
            setattr(module, name, original)
        hand(None)

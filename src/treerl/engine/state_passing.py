"""Context parallelism for hybrid models: each rank's columns of a row continue the state of the rank before it.

Step 5 (docs/architecture.md): DfsEngine's calls of a recurrent model split over a context-parallel group.

A hybrid model's call is rows (each a chain of nodes from the parent's final state, treerl.engine.recurrent); under
context parallelism every row is cut into contiguous columns, rank r holding the r-th piece of each
(`ContextParallel.columns`). Attention gathers the pieces' K/V as for any call (treerl.attention.context_parallel).
A token mixer's state is a chain instead: rank r's piece starts from the state rank r - 1's piece ended in, exactly
as a tree node starts from its parent's. So each mixer layer runs as a wavefront over the ranks: rank 0 starts from
the parent's state; when a rank's layer has run, its final states (convolution window, recurrent state, whatever the
layer kept through the cache) go to the next rank (`isend`), which waits for them before that layer runs. Backward
goes the other way: when rank r + 1's layer has sent back its gradient of the state it started from, rank r's layer
takes it as its final state's gradient. Both links are autograd Functions in the call's graph (`_SendState` on the
layer's output, `_ReceiveState` on the states it reads), so they run in backward where the layer's backward runs,
whichever plan (kept graph, recomputation) the walk follows.

The state's own arithmetic is untouched (the layers run as transformers wrote them), so the result is the
single-process one; the price is time: a mixer layer's pieces run one rank after another, not side by side. Memory is
split: each rank holds its columns' activations, and of the path only the attention K/V (sharded or replicated, as for
attention models).

Side by side (`StatePassing.side_by_side`, for models whose every mixer allows it: MixerKind.side_by_side), as
Megatron-LM's Mamba state passing (NVIDIA/Megatron-LM#6808) runs them: a layer's pieces run on every rank at once.
Its convolution window is all that goes from rank to rank in the layer (the halo: `receive_window` / `send_window`,
when the cache is asked for it, right after the inputs are projected), and its scan runs from zero on every rank but
the first, corrected after one all-gather of the pieces' final states and transfers (treerl.engine.parallel_scan).

The last rank with columns ends every row, so it holds the unit's final states: the walk shares them with every rank
for the children (`share_states`, a broadcast), and the gradient the children send back, collected on rank 0 (whose
pieces read the parent's state), goes to it (`share_grads`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from treerl.attention import UnsupportedModel
from treerl.attention.context_parallel import ContextParallel, ShardLayout
from treerl.engine.parallel_scan import scan_of, split_scans
from treerl.engine.recurrent import MIXERS, StateKey, TreeStateCache, mixer_kind
from treerl.engine.support import text_modules

_NAMES = ("conv", "recurrent", "linear")  # the state kinds a mixer hands on through the cache (StateKey's second)
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_MOST_KEYS, _MOST_DIMS = 8, 6  # a header has room for this many states of a layer, each of at most this many dims
_FIELDS = 5 + _MOST_DIMS  # layer, name, state index, dtype, dims, then the dims
_PASSED = {cls for kind in MIXERS if not kind.in_attention and kind.refused is None for cls in kind.classes}


class StatePassing:
    """The mixer layers' states of one walk's calls, passed from each context-parallel rank to the next."""

    def __init__(self, model: torch.nn.Module, cp: ContextParallel):
        self.cp = cp
        self.device = next(model.parameters()).device  # where states and headers travel from (NCCL: the GPU)
        self.mixers = passed_mixers(model)  # the outermost known mixers: each runs once per call
        self.scans = side_by_side_scans(model, cp)
        self.side_by_side = self.scans is not None
        self.scanned: set[int] = set()  # the mixer layers (module ids) whose scan was split in this call
        self.layer: torch.nn.Module | None = None  # the mixer layer running now
        self.cache: TreeStateCache | None = None
        self.shard: ShardLayout | None = None
        self.sent: set[StateKey] = set()  # the states of this call already sent on
        self.links: list[torch.Tensor] = []  # this call's outputs of the links: each must run in its backward
        self.pending: list = []  # isend handles (and their buffers) not yet waited for

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """While the walk runs: each mixer waits for the previous rank's states before it runs and sends its own on;
        side by side, the scans are split over the ranks instead, and windows pass when the cache is asked for them."""
        if self.side_by_side:
            handles = [m.register_forward_pre_hook(self._now) for m in self.mixers]
            scans = split_scans(self, self.scans)
        else:
            handles = [m.register_forward_pre_hook(self._before) for m in self.mixers]
            handles += [m.register_forward_hook(self._after) for m in self.mixers]
            scans = contextlib.nullcontext()
        try:
            with scans:
                yield
        finally:
            for handle in handles:
                handle.remove()
            self.wait()

    def begin(self, cache: TreeStateCache, shard: ShardLayout) -> None:
        """A call starts: its cache (on ranks after the first, its initial states arrive layer by layer)."""
        self.cache, self.shard, self.sent, self.links, self.scanned = cache, shard, set(), [], set()
        if self.side_by_side:
            cache.neighbours = self

    # -- what treerl.engine.parallel_scan reads of the running call (`Pieces`)
    @property
    def rank(self) -> int:
        return self.cp.rank

    @property
    def active(self) -> int:
        return 1 if self.shard is None else self.shard.active

    @property
    def rows(self) -> int:
        return self.shard.row_count

    def gather(self, mine: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.empty_like(mine) for _ in range(self.cp.size)]
        dist.all_gather(gathered, mine, group=self.cp.group)
        return gathered

    def summed_row(self, grad: torch.Tensor) -> torch.Tensor:
        mine = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(mine, grad.reshape(-1), group=self.cp.group)  # rows of the flat input, in order
        return mine

    def starts_from_parent(self, shard: ShardLayout) -> bool:
        """Whether this rank's pieces of a call read the parent's states: rank 0's; side by side, only rank 0's (a
        stand-in's one token is never read), else every rank's but those the previous rank's states reach."""
        return self.cp.rank == 0 if self.side_by_side else not self.receives(shard)

    def _now(self, module: torch.nn.Module, args: tuple) -> None:
        self.layer = module

    def check_scanned(self) -> None:
        """Side by side, each mixer with a scan split it (a layer that scanned some other way would leave its pieces
        uncorrected): on every rank alike, after the call's forward."""
        if not self.side_by_side or self.shard.active < 2:
            return
        missed = [m for m in self.mixers if mixer_kind(m).side_by_side != "window" and id(m) not in self.scanned]
        if missed:
            raise UnsupportedModel(f"under context parallelism the mixer layer {type(missed[0]).__name__} "
                                   f"{getattr(missed[0], 'layer_idx', '?')} did not scan through a function treerl "
                                   "splits over the ranks (a fused kernel?), so its pieces would not continue each "
                                   "other; set trainer.context_parallel_mixers=in-turn")

    def receive_window(self, key: StateKey) -> torch.Tensor | None:
        """Side by side: the previous rank's piece's convolution window of this layer, this piece's start (a link
        in the graph: its gradient goes back)."""
        if not self.receives():
            return None
        keys, received = self._receive()
        if keys != [key]:
            raise RuntimeError(f"context-parallel ranks out of step: expected the window of {key}, got {keys}")
        if torch.is_grad_enabled():
            received = _ReceiveState.apply(self, _DIFFERENTIABLE, *received)
            self.links.extend(received)
        return received[0]

    def send_window(self, key: StateKey, full: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """Side by side: this piece's convolution window (`window`, the end of `full`) to the next rank; `full`
        carries the link its gradient comes back by."""
        if not self.sends():
            return full
        self._send([key], [window])
        if not torch.is_grad_enabled():
            return full
        linked = _SendState.apply(self, full, window)
        self.links.append(linked)
        return linked

    @contextlib.contextmanager
    def replaying(self, cache: TreeStateCache, shard: ShardLayout) -> Iterator[None]:
        """A call's backward: gradient checkpointing replays its layers' forward there, which (side by side) split
        their scans and pass their windows as the forward did; what the replay links is not the backward's (the
        forward's graph is), so it is dropped."""
        self.cache, self.shard, self.links, self.scanned = cache, shard, [], set()
        try:
            yield
        finally:
            self.cache, self.shard, self.links = None, None, []

    def end(self) -> list[torch.Tensor]:
        """The call is done: the outputs of its links (the walk's backward starts from them too, with a zero gradient,
        so that every link's backward runs and its peer's never waits for a message that does not come)."""
        links, self.cache, self.shard, self.links = self.links, None, None, []
        return links

    def receives(self, shard: ShardLayout | None = None) -> bool:
        """Whether this rank's pieces of the call (`shard`, default: the running one's) start from the previous
        rank's states rather than the parent's."""
        shard = shard or self.shard
        return shard is not None and 0 < self.cp.rank < shard.active

    def sends(self) -> bool:
        return self.shard is not None and self.cp.rank < self.shard.active - 1

    def _before(self, module: torch.nn.Module, args: tuple) -> None:
        """The previous rank's final states of this layer, as this call's initial ones (a link in the graph)."""
        if not self.receives():
            return
        keys, received = self._receive()
        if torch.is_grad_enabled():
            received = _ReceiveState.apply(self, _DIFFERENTIABLE, *received)
            self.links.extend(received)
        self.cache.initial.update(zip(keys, received))

    def _after(self, module: torch.nn.Module, args: tuple, output):
        """Send this layer's final states to the next rank; its output carries the link their gradient returns by."""
        if not self.sends():
            return None
        keys = [key for key in self.cache.final if key not in self.sent]
        self.sent.update(keys)
        states = [self.cache.final[key] for key in keys]
        self._send(keys, states)
        if not torch.is_grad_enabled():
            return None
        linked = _SendState.apply(self, output[0] if isinstance(output, tuple) else output, *states)
        self.links.append(linked)
        return (linked, *output[1:]) if isinstance(output, tuple) else linked

    # -- messages: a header naming the states, then each state; gradients come back without a header
    def _peer(self, rank: int) -> int:
        return rank if self.cp.group is None else dist.get_global_rank(self.cp.group, rank)

    def _send(self, keys: list[StateKey], states: list[torch.Tensor]) -> None:
        self._isend([_header(keys, states).to(self.device)] + [s.detach() for s in states], self.cp.rank + 1)

    def _receive(self) -> tuple[list[StateKey], list[torch.Tensor]]:
        header = self._recv([_empty_header().to(self.device)], self.cp.rank - 1)[0]
        keys, buffers = _parse(header, self.device)
        return keys, self._recv(buffers, self.cp.rank - 1)

    def _isend(self, tensors: list[torch.Tensor], rank: int) -> None:
        for tensor in tensors:
            tensor = tensor.contiguous()
            self.pending.append((dist.isend(tensor, self._peer(rank), group=self.cp.group), tensor))

    def _recv(self, buffers: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
        for buffer in buffers:
            dist.recv(buffer, self._peer(rank), group=self.cp.group)
        return buffers

    def send_grads(self, grads: tuple[torch.Tensor, ...]) -> None:
        self._isend(list(grads), self.cp.rank - 1)

    def receive_grads(self, like: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
        return self._recv([torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in like],
                          self.cp.rank + 1)

    def wait(self) -> None:
        """Every state and gradient this rank sent has left (before its buffers go)."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()

    # -- the unit's final states, which the last rank with columns holds, for the children on every rank
    def share_states(self, states: dict[StateKey, torch.Tensor] | None, shard: ShardLayout
                     ) -> dict[StateKey, torch.Tensor]:
        """A row's final states (`states`, on the last rank with columns; None elsewhere) on every rank."""
        source = self._peer(shard.active - 1)
        if states is not None:
            keys = sorted(states, key=str)
            tensors = [states[key].detach().contiguous() for key in keys]
            dist.broadcast(_header(keys, tensors).to(self.device), source, group=self.cp.group)
        else:
            header = _empty_header().to(self.device)
            dist.broadcast(header, source, group=self.cp.group)
            keys, tensors = _parse(header, self.device)
        for tensor in tensors:
            dist.broadcast(tensor, source, group=self.cp.group)
        return dict(zip(keys, tensors))

    def share_grads(self, grads: dict[StateKey, torch.Tensor], states: dict[StateKey, torch.Tensor]
                    ) -> dict[StateKey, torch.Tensor]:
        """The gradient the children sent to a node's final states, which rank 0's pieces received, on every rank
        (a state no child's loss reached stays without one, as in one process)."""
        keys = sorted(states, key=str)
        present = torch.tensor([key in grads for key in keys], dtype=torch.long, device=self.device)
        dist.broadcast(present, self._peer(0), group=self.cp.group)
        shared = {}
        for key, there in zip(keys, present.tolist()):
            if there:
                grad = grads[key].contiguous() if self.cp.rank == 0 else torch.empty_like(states[key])
                dist.broadcast(grad, self._peer(0), group=self.cp.group)
                shared[key] = grad
        return shared


def passed_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's outermost mixer layers whose states pass from rank to rank (each runs once per call)."""
    mixers: list[torch.nn.Module] = []
    outer: list[str] = []
    for path, module in text_modules(model):
        if type(module).__name__ in _PASSED and not any((path + ".").startswith(o) for o in outer):
            mixers.append(module)
            outer.append(path + ".")
    return mixers


def side_by_side_scans(model: torch.nn.Module, cp: ContextParallel) -> frozenset[tuple[str, str]] | None:
    """The (module, function) scans the model's mixer layers split over the ranks when they run side by side: when
    `cp` asks for it and every mixer can (a window alone, a scan of treerl.engine.parallel_scan.LINEAR_SCANS its
    forward calls, or the selective scan treerl continues); None: they run in turn, or the model has none."""
    if cp.mixers != "side-by-side":
        return None
    mixers = passed_mixers(model)
    if not mixers or not all(mixer_kind(m).side_by_side for m in mixers):
        return None
    scans = {(type(m).__module__, scan_of(m)) for m in mixers if mixer_kind(m).side_by_side == "scan"}
    return None if any(name is None for _, name in scans) else frozenset(scans)


def _header(keys: list[StateKey], states: list[torch.Tensor]) -> torch.Tensor:
    """What a receiver needs to allocate `states`: their keys, dtypes and shapes, in one integer tensor."""
    if len(keys) > _MOST_KEYS or any(s.dim() > _MOST_DIMS for s in states):
        raise ValueError(f"a mixer layer kept {len(keys)} states of up to {max(s.dim() for s in states)} dims; "
                         f"context parallelism passes at most {_MOST_KEYS} of at most {_MOST_DIMS}")
    header = _empty_header()
    header[0] = len(keys)
    for i, (key, state) in enumerate(zip(keys, states)):
        fields = [key[0], _NAMES.index(key[1]), key[2], _DTYPES.index(state.dtype), state.dim(), *state.shape]
        header[1 + i * _FIELDS : 1 + i * _FIELDS + len(fields)] = torch.tensor(fields)
    return header


def _empty_header() -> torch.Tensor:
    return torch.zeros(1 + _MOST_KEYS * _FIELDS, dtype=torch.long)


def _parse(header: torch.Tensor, device: torch.device) -> tuple[list[StateKey], list[torch.Tensor]]:
    """The keys `_header` names and an empty tensor for each state."""
    keys, buffers = [], []
    for i in range(int(header[0])):
        layer, name, index, dtype, dims, *shape = header[1 + i * _FIELDS : 1 + (i + 1) * _FIELDS].tolist()
        keys.append((layer, _NAMES[name], index))
        buffers.append(torch.empty(shape[:dims], dtype=_DTYPES[dtype], device=device))
    return keys, buffers


_DIFFERENTIABLE = torch.zeros((), requires_grad=True)  # an input that puts the received states in the graph


class _ReceiveState(torch.autograd.Function):
    """The previous rank's final states as this rank's initial ones; backward sends their gradient back to it."""

    @staticmethod
    def forward(ctx, passing: StatePassing, _flag, *received):
        ctx.passing = passing
        return tuple(r.view_as(r) for r in received)

    @staticmethod
    def backward(ctx, *grads):
        ctx.passing.send_grads(grads)
        return (None, None, *[None] * len(grads))


class _SendState(torch.autograd.Function):
    """A mixer's output, unchanged; backward also gives its final states (sent to the next rank) the gradient the
    next rank sends back: the link that makes this rank's backward wait for the next one's at this layer."""

    @staticmethod
    def forward(ctx, passing: StatePassing, output, *states):
        ctx.passing, ctx.like = passing, [(s.shape, s.dtype) for s in states]
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return (None, grad, *ctx.passing.receive_grads(ctx.like))

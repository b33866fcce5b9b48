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
single-process one; the price is time: a mixer layer's pieces run one rank after another, not side by side
(Megatron-LM's Mamba state passing, NVIDIA/Megatron-LM#6808, runs them side by side from a zero state and corrects
each with the previous ranks' state summaries, which needs each layer's scan opened up). Memory is split: each rank
holds its columns' activations, and of the path only the attention K/V (sharded or replicated, as for attention
models).

The last rank with columns ends every row, so it holds the unit's final states: the walk shares them with every rank
for the children (`share_states`, a broadcast), and the gradient the children send back, collected on rank 0 (whose
pieces read the parent's state), goes to it (`share_grads`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from treerl.attention.context_parallel import ContextParallel, ShardLayout
from treerl.engine.recurrent import MIXERS, StateKey, TreeStateCache
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
        self.mixers: list[torch.nn.Module] = []  # the outermost known mixers: each runs once per call
        outer: list[str] = []
        for path, module in text_modules(model):
            if type(module).__name__ in _PASSED and not any((path + ".").startswith(o) for o in outer):
                self.mixers.append(module)
                outer.append(path + ".")
        self.cache: TreeStateCache | None = None
        self.shard: ShardLayout | None = None
        self.sent: set[StateKey] = set()  # the states of this call already sent on
        self.links: list[torch.Tensor] = []  # this call's outputs of the links: each must run in its backward
        self.pending: list = []  # isend handles (and their buffers) not yet waited for

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """While the walk runs: each mixer waits for the previous rank's states before it runs and sends its own on."""
        handles = [m.register_forward_pre_hook(self._before) for m in self.mixers]
        handles += [m.register_forward_hook(self._after) for m in self.mixers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.wait()

    def begin(self, cache: TreeStateCache, shard: ShardLayout) -> None:
        """A call starts: its cache (on ranks after the first, its initial states arrive layer by layer)."""
        self.cache, self.shard, self.sent, self.links = cache, shard, set(), []

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

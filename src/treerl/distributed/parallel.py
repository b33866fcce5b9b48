"""Data-parallel training with the tree engines under torchrun: DDP or FSDP2, one gradient sync per step.

Step 6 (docs/architecture.md): the gradient sync across ranks, and the model's wrapping for it.

Two facts shape this module:
- The engines need the transformers model itself: they call `model.base_model` and
  `model.get_output_embeddings()` and switch `model.config._attn_implementation`. So engines get
  `DistributedModel.model` (for DDP the wrapped module; for FSDP2 the same object, whose class
  `fully_shard` swapped in place) and the wrapper only handles gradients.
- The DFS engine calls backward once per tree node. Wrappers sync inside backward, so left alone
  they would communicate once per node (FSDP2), or, since the engine never calls the wrapper's
  forward, not at all (DDP's reducer only fires after a forward through DDP).

`DistributedModel.gradient_step()` brackets any number of engine calls. On entry FSDP2 stops syncing
(`set_requires_gradient_sync(False)`), gathers every parameter once (`unshard`) and keeps it
gathered for the whole step (`reshard_after_forward=False` on the layers,
`set_reshard_after_backward(False)`) instead of all-gathering each layer for every node. On exit
one zero-weighted one-token forward/backward through the wrapper fires the wrapper's own
gradient reduction exactly once over the accumulated gradients (a parameter that only some calls used, e.g. a
vision tower on the ranks whose calls showed images, still takes part: `gradient_step`): DDP all-reduces its buckets,
FSDP2 reduce-scatters each group and reshards. Gradients are SUMMED over ranks (a DDP comm hook;
FSDP2's divide factor 1 with a plain SUM, which gloo supports in every dtype): with each rank's loss
divided by the global denominator (e.g. the loss tokens of the whole global batch), the summed
gradient is exactly the single-process one.
Memory under FSDP2 during a step is therefore that of full parameters and full (unsharded)
gradients, accumulated over the step's engine calls, with only the optimizer state sharded
(ZeRO-1-like); parameters and gradients are sharded again after the step's one reduce-scatter.

Mixed precision (`mixed_precision=torch.bfloat16`, trainer.precision=bf16-mixed): the parameters
the optimizer steps stay float32 (the master weights). FSDP2 gathers them as bfloat16
(`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`), so the full parameters held
during a step take half the memory, and accumulates and reduces gradients in float32. DDP and a
single process have no such policy: the trainer runs every engine call under `torch.autocast`
instead (treerl.engine.AutocastEngine), which computes the same matmuls in bfloat16 from the
float32 parameters, and gradients land, and are all-reduced, in float32. The two differ only in
rounding: under FSDP2 the elementwise parts (norms, residual stream) also see bfloat16 weights.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, NoReturn

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel

from treerl.attention.context_parallel import ContextParallel
from treerl.engine.images import blank_image_inputs

Strategy = Literal["none", "ddp", "fsdp2"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: its rank among `world_size`, and the device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes metrics and saves checkpoints."""
        return self.rank == 0


def init_distributed(backend: str | None = None) -> DistEnv:
    """Join the process group that torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    nccl on CUDA (one GPU per local rank), gloo on CPU. Run without torchrun, a single process:
    rank 0 of 1 and no process group.
    """
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistEnv(0, 1, 0, device)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"), device_id=device if cuda else None)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device)


@dataclass(frozen=True)
class Mesh:
    """The ranks as a 2-D grid, data parallel x context parallel: each data-parallel group (`data_rank` of
    `data_size`) trains its share of the batch, its `context` ranks (None: one) splitting every call's rows."""

    data_rank: int
    data_size: int
    context: ContextParallel | None = None


def build_mesh(env: DistEnv, context_parallel: int = 1, path: str = "sharded", mixers: str = "side-by-side") -> Mesh:
    """torch's DeviceMesh ("dp", "cp") over the run's ranks: ranks `d * cp ... (d + 1) * cp - 1` form data-parallel
    group d, holding the path's K/V as `path` says (`ContextParallel.path`) and running a hybrid's mixers as `mixers`
    says. One process (no torchrun): a mesh of one."""
    if context_parallel == 1:
        return Mesh(env.rank, env.world_size)
    if env.world_size % context_parallel:
        raise ValueError(f"trainer.context_parallel={context_parallel} does not divide the {env.world_size} ranks "
                         "torchrun started")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(env.device.type, (env.world_size // context_parallel, context_parallel),
                            mesh_dim_names=("dp", "cp"))
    return Mesh(env.rank // context_parallel, env.world_size // context_parallel,
                ContextParallel.over(mesh.get_group("cp"), path, mixers))


def close_distributed(wait_for_all: bool = True) -> str | None:
    """Leave the process group; returns its backend (None: there was none, e.g. without torchrun).

    `wait_for_all`: a barrier first, so that no rank closes a connection another still uses; off on a rank that
    failed, whose peers may never reach it."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = dist.get_backend()
    if wait_for_all:
        dist.barrier()
    dist.destroy_process_group()
    return backend


def exit_process(code: int = 0) -> NoReturn:
    """End a rank whose work is saved and whose gloo group is closed, skipping the interpreter's shutdown.

    A gloo worker thread frees a finished collective's tensors after the caller stopped waiting for it, and FSDP2
    keeps the group (so its threads) alive past `destroy_process_group`. A thread still freeing one when the
    interpreter shuts down takes the GIL from a dying interpreter: the process aborts after a finished run
    (torch 2.13: SIGABRT, about 1 two-rank run in 20 on 2 CPU cores). No barrier or wait rules that out; not
    shutting the interpreter down does. Output is flushed first; files must be closed by the caller."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def global_sum(value: float | torch.Tensor) -> float:
    """Sum of a per-rank number over all ranks (a loss denominator when ranks only see their own sequences)."""
    if not (dist.is_available() and dist.is_initialized()):
        return float(value)
    total = torch.tensor(float(value), dtype=torch.float64, device=_comm_device())
    dist.all_reduce(total)
    return float(total)


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _sum_hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP comm hook: SUM gradients over ranks (DDP's default averages)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class DistributedModel:
    """A transformers model trained across ranks (DDP, FSDP2 or one process): engines get `.model`, the optimizer
    `.parameters()`. Named apart from `torch.nn.DataParallel`, which it is not."""

    def __init__(self, model: PreTrainedModel, strategy: Strategy = "ddp", mixed_precision: torch.dtype | None = None,
                 **fsdp_kwargs) -> None:
        if strategy not in ("none", "ddp", "fsdp2"):
            raise ValueError(f"strategy must be 'none', 'ddp' or 'fsdp2', got {strategy!r}")
        if strategy != "none" and not dist.is_initialized():
            raise RuntimeError(f"strategy {strategy!r} needs a process group: call treerl.distributed.init_distributed() first")
        self.model = model
        self.strategy = strategy
        self.wrapper: torch.nn.Module = model
        if strategy == "ddp":
            device = next(model.parameters()).device
            self.wrapper = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
            self.wrapper.register_comm_hook(None, _sum_hook)
        elif strategy == "fsdp2":
            if mixed_precision is not None:
                from torch.distributed.fsdp import MixedPrecisionPolicy

                fsdp_kwargs.setdefault("mp_policy", MixedPrecisionPolicy(param_dtype=mixed_precision,
                                                                         reduce_dtype=torch.float32))
            self._fully_shard(**fsdp_kwargs)

    def _fully_shard(self, **fsdp_kwargs) -> None:
        """One FSDP2 group per decoder layer plus the root (embeddings, final norm, LM head)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        layer_classes = set(getattr(self.model, "_no_split_modules", None) or [])
        layers = [m for m in self.model.modules() if type(m).__name__ in layer_classes]
        if not layers:
            raise NotImplementedError(f"{type(self.model).__name__}: no decoder layers found to shard")
        for layer in layers:
            fully_shard(layer, reshard_after_forward=False, **fsdp_kwargs)
        fully_shard(self.model, **fsdp_kwargs)
        self._fsdp_modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for module in self._fsdp_modules:
            module.set_gradient_divide_factor(1.0)  # sum, not mean, over ranks
            # ... as a plain SUM: for float32/bfloat16 FSDP2 would otherwise scale inside the collective with
            # ReduceOp.PREMUL_SUM, which only NCCL has (gloo: "Cannot use ReduceOp.PREMUL_SUM with Gloo")
            module.set_force_sum_reduction_for_comms(True)
        # FSDP2 picks its root at the first forward; the engines never call the root's forward.
        with torch.no_grad():
            self._sync_forward()
        self._reshard()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """What the optimizer steps (FSDP2: this rank's shards). Build the optimizer after wrapping."""
        return self.wrapper.parameters()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[PreTrainedModel]:
        """Full parameters for engine calls without gradients (e.g. old log-probs); a no-op unless FSDP2."""
        if self.strategy != "fsdp2":
            yield self.model
            return
        self._unshard()
        try:
            yield self.model
        finally:
            self._reshard()

    @contextlib.contextmanager
    def gradient_step(self, images: bool = False) -> Iterator[PreTrainedModel]:
        """Any number of engine.forward_backward calls inside; on exit `.grad` holds the sum over ranks.

        `images`: whether any rank's calls showed images (the same on every rank): FSDP2 reduces a vision tower only
        when every rank holds a gradient for it, so the sync's forward then shows the tower a blank image."""
        if self.strategy == "none":
            yield self.model
            return
        if self.strategy == "ddp":
            with self.wrapper.no_sync():
                yield self.model
            self._ddp_sync()
            return
        self.model.set_requires_gradient_sync(False)
        self.model.set_reshard_after_backward(False)
        self._unshard()
        try:
            yield self.model
        finally:
            self.model.set_requires_gradient_sync(True)
            self.model.set_reshard_after_backward(True)
        # One forward through the root arms its reduction; the zero loss adds nothing to the gradients.
        (self._sync_forward(images).sum() * 0.0).backward()

    def _ddp_sync(self) -> None:
        """DDP all-reduces once every parameter's gradient hook fired after a forward through it; a parameter only some
        calls use (a vision tower, an unused layer, an expert) would leave its bucket waiting. So the zero loss touches
        every trained parameter; a parameter no rank's calls gave a gradient gets None back, as in one process (the
        optimizer then skips it, weight decay included)."""
        trained = [p for p in self.model.parameters() if p.requires_grad]
        used = torch.tensor([p.grad is not None for p in trained], dtype=torch.int32, device=_comm_device())
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        touch = sum(p.reshape(-1)[0] for p in trained)
        (self._sync_forward().sum() * 0.0 + touch * 0.0).backward()
        for parameter, took in zip(trained, used.tolist()):
            if not took:
                parameter.grad = None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters on CPU on rank 0 (empty elsewhere). Collective under FSDP2: call on every rank."""
        if self.strategy != "fsdp2":
            main = not dist.is_initialized() or dist.get_rank() == 0
            return {k: v.detach().cpu() for k, v in self.model.state_dict().items()} if main else {}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _sync_forward(self, images: bool = False) -> torch.Tensor:
        """Logits of a forward through the wrapper (the engines call the model, so the wrapper's reduction fires only
        after this): one token, or `images`: a vision-language model's blank image and a token (its tower takes part)."""
        inputs = blank_image_inputs(self.model) if images else None
        if inputs is None:
            device = self.model.get_input_embeddings().weight.device
            inputs = {"input_ids": torch.zeros(1, 1, dtype=torch.long, device=device)}
        return self.wrapper(**inputs, use_cache=False).logits

    def _unshard(self) -> None:
        for module in self._fsdp_modules:
            module.unshard()

    def _reshard(self) -> None:
        for module in self._fsdp_modules:
            module.reshard()

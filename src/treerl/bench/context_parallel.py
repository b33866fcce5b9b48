"""`treerl bench --cp 1,2,4`: one long agent trajectory trained with context parallelism over R gloo processes on this
machine (per-rank peak memory, bytes each rank sends, step time), and the step-time model that says when CP pays on
a GPU cluster.

Beside the steps (docs/architecture.md): step 5 split over ranks (treerl.attention.context_parallel), measured.

What a rank sends, per step: every layer's K and V of every call are all-gathered in the forward (each rank sends its
rows to the R - 1 others: (R - 1) / R of the path's K/V with a ring) and their gradient is reduce-scattered in the
backward ((R - 1) / R of it again); the head's outputs are all-gathered (a few bytes a token). With the path's K/V
sharded (the default; `ContextParallel.path`), each call's queries travel to the path's shards too: gathered in the
forward, the partial outputs merged back, and in the backward the queries, output gradients and outputs gathered and
the query gradients reduce-scattered. Replicated, every rank holds the whole path and sends none of that.
What CP divides by R is each call's activations, and (sharded) the path's K/V with their gradient stores.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.multiprocessing as mp
from transformers import PretrainedConfig

from treerl.attention.context_parallel import MIXER_ORDERS, PATH_LAYOUTS
from treerl.bench.flops import MixerRates, flop_rates, mixer_rates
from treerl.bench.peak import peak_memory
from treerl.errors import UserError
from treerl.models import build_model, model_config, model_geometry
from treerl.tree import TokenSequence


@dataclass
class CpBenchConfig:
    shape: str = "small-qwen3"
    vocab_size: int | None = 4096
    tokens: int = 32768  # one trajectory this long
    chunk_tokens: int = 2048  # DfsEngine's longest call (the path's K/V grow call by call)
    ranks: list[int] = field(default_factory=lambda: [1, 2, 4])
    paths: list[str] = field(default_factory=lambda: ["sharded", "replicated"])  # the path's K/V layouts (R > 1)
    mixers: list[str] = field(default_factory=lambda: ["side-by-side"])  # a hybrid's mixer layers (R > 1)
    memory: bool = True  # also the per-rank peak (one more, untimed, profiled step)

    def __post_init__(self):
        if not self.paths or set(self.paths) - set(PATH_LAYOUTS):
            raise UserError(f"--cp-paths: {','.join(self.paths)}; choose among {', '.join(PATH_LAYOUTS)}")
        if not self.mixers or set(self.mixers) - set(MIXER_ORDERS):
            raise UserError(f"--cp-mixers: {','.join(self.mixers)}; choose among {', '.join(MIXER_ORDERS)}")


def trajectory(tokens: int, vocab: int) -> TokenSequence:
    """One agent trajectory of `tokens` random tokens, every token trained with a random advantage."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (tokens,), generator=g)
    return TokenSequence(ids, {"advantages": torch.randn(tokens, generator=g)})


def _loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum() / view.logprobs.numel()


def _count_bytes(sent: dict[str, float], world: int) -> None:
    """Count what this rank sends in torch.distributed's all_gather / reduce_scatter_single / all_reduce, as ring
    algorithms send it, and (a hybrid) the states and their gradients it sends its neighbours (isend; the broadcast of
    a node's final states and their gradient, as a tree sends it)."""
    import torch.distributed as dist

    gather, scatter, isend, broadcast = dist.all_gather, dist.reduce_scatter_single, dist.isend, dist.broadcast
    reduce = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        sent["all_reduce"] += tensor.numel() * tensor.element_size() * 2 * (world - 1) / world
        return reduce(tensor, *args, **kwargs)

    def all_gather(pieces, tensor, *args, **kwargs):
        sent["all_gather"] += tensor.numel() * tensor.element_size() * (world - 1)
        return gather(pieces, tensor, *args, **kwargs)

    def reduce_scatter_single(output, tensor, *args, **kwargs):
        sent["reduce_scatter"] += tensor.numel() * tensor.element_size() * (world - 1) / world
        return scatter(output, tensor, *args, **kwargs)

    def send(tensor, *args, **kwargs):
        sent["state"] += tensor.numel() * tensor.element_size()
        return isend(tensor, *args, **kwargs)

    def broadcast_(tensor, src, *args, **kwargs):
        if src == dist.get_rank():
            sent["state"] += tensor.numel() * tensor.element_size() * (world - 1)
        return broadcast(tensor, src, *args, **kwargs)

    dist.all_gather, dist.reduce_scatter_single, dist.isend, dist.broadcast = all_gather, reduce_scatter_single, send, \
        broadcast_
    dist.all_reduce = all_reduce


def _worker(rank: int, world: int, port: int, config: CpBenchConfig, path: str, mixers: str, out: str) -> None:
    """One rank: a warm-up step, a timed one, a profiled one for the peak; rank 0 writes every rank's figures."""
    import torch.distributed as dist

    from treerl.attention.context_parallel import ContextParallel
    from treerl.engine import DfsEngine
    from treerl.engine.memory import path_bytes_per_token

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cp, sent = None, {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0, "state": 0.0}
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        cp = ContextParallel.over(path=path, mixers=mixers)
    model = build_model(shape=config.shape, vocab_size=config.vocab_size, dtype=torch.float32)
    holders = world if path == "sharded" else 1  # ranks that share the path's K/V store
    batch = [trajectory(config.tokens, model.config.vocab_size)]
    engine = DfsEngine(chunk_tokens=config.chunk_tokens, batch_tokens=config.chunk_tokens, context_parallel=cp)
    engine.forward_backward(model, batch, _loss)  # warm-up
    if world > 1:
        _count_bytes(sent, world)
        dist.barrier()
    started = time.perf_counter()
    engine.forward_backward(model, batch, _loss)
    seconds = time.perf_counter() - started
    row = {"rank": rank, "seconds": seconds, "sent_bytes": sum(sent.values()),
           **{f"sent_{k}": v for k, v in sent.items()},
           "path_store_bytes": path_bytes_per_token(model) * -(-config.tokens // holders)}
    if config.memory:
        model.zero_grad(set_to_none=True)
        row["peak_bytes"] = peak_memory(lambda: engine.forward_backward(model, batch, _loss))
    rows = [row]
    if world > 1:
        rows = [None] * world
        dist.all_gather_object(rows, row)
        dist.destroy_process_group()
    if rank == 0:
        torch.save(rows, out)


def measure(config: CpBenchConfig) -> list[dict]:
    """Per CP size and path layout: the ranks' step seconds, bytes sent and peak memory (each its own processes)."""
    table = []
    for world in config.ranks:
        # one rank: the whole path, the mixers' own scans
        for path, mixers in itertools.product(*((config.paths, config.mixers) if world > 1 else (["sharded"], ["-"]))):
            with tempfile.TemporaryDirectory() as scratch:
                out = os.path.join(scratch, "rows.pt")
                mp.spawn(_worker, args=(world, _free_port(), config, path, mixers, out), nprocs=world, join=True)
                rows = torch.load(out)
            table.append({"cp": world, "path": path if world > 1 else "-", "mixers": mixers, "tokens": config.tokens,
                          "seconds": max(r["seconds"] for r in rows),
                          "sent_mib_per_rank": max(r["sent_bytes"] for r in rows) / 2**20,
                          "path_store_mib_per_rank": rows[0]["path_store_bytes"] / 2**20,
                          "peak_mib_per_rank": max(r.get("peak_bytes", 0) for r in rows) / 2**20,
                          "ranks": rows})
    return table


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- the GPU cluster model
@dataclass(frozen=True)
class Cluster:
    """The constants of the step-time model, each with its source."""

    name: str
    flops: float  # dense BF16 FLOP/s of one GPU: H100 SXM5, 989 TFLOP/s (NVIDIA H100 Tensor Core GPU datasheet)
    mfu: float  # fraction of it a long-context training step reaches: 0.38-0.43 for Llama 3 405B's BF16 training
    #              (Llama 3 paper, Dubey et al. 2024, Table 4); 0.40 here
    bandwidth: float  # bytes/s one GPU sends to its peers, one direction
    latency: float  # seconds of one small collective: the order nccl-tests' all_gather_perf reports for 8 GPUs
    #                 (about 10-20 us inside an NVLink node, a few times that across an InfiniBand fabric)


CLUSTERS = (
    Cluster("H100 SXM, CP inside a node (NVLink 4: 900 GB/s both ways, 450 one way; NVIDIA)", 989e12, 0.40, 450e9,
            15e-6),
    Cluster("H100 SXM, CP across nodes (InfiniBand NDR: 400 Gb/s = 50 GB/s a GPU; NVIDIA ConnectX-7)", 989e12, 0.40,
            50e9, 50e-6),
)


def predicted_step(config: PretrainedConfig, tokens: int, cp: int, cluster: Cluster, chunk_tokens: int = 2048,
                   dtype_bytes: int = 2, path: str = "sharded", rates: tuple[int, int] | None = None,
                   mixers: str = "side-by-side", mixer: MixerRates | None = None) -> dict[str, float]:
    """Seconds of one training step (forward + backward, 3x the forward FLOPs) on one trajectory of `tokens` in calls
    of `chunk_tokens`, split over `cp` GPUs: compute / cp, plus the traffic and the collectives' latency, unhidden
    (no overlap with compute: an upper bound); and the GiB a rank's path K/V store holds (K/V in `dtype_bytes`, their
    gradients in float32), whole or sharded (`path`). `rates`: `flop_rates(config)`, if known.

    A hybrid (`mixer`: `mixer_rates(config)`): side by side, a rank after the first also computes its pieces' transfer
    columns, and each mixer layer of each call all-gathers the pieces' states and transfers (reduce-scattered in the
    backward); in turn, a run of m consecutive mixer layers is a wavefront over the ranks, m + cp - 1 pieces long
    instead of m (the attention layer after it waits for every rank), and each piece passes its final states on."""
    per_token, per_key = rates or flop_rates(config)
    forward = tokens * per_token + tokens * (tokens + 1) // 2 * per_key
    work = forward  # a rank's forward FLOPs, times cp
    g = model_geometry(config)
    calls = math.ceil(tokens / chunk_tokens)
    mixer_comm, mixer_collectives = 0.0, 0
    if mixer is not None and cp > 1:
        layers = sum(mixer.runs)
        if mixers == "side-by-side":
            work += tokens * mixer.transfer_per_layer * layers
            mixer_comm = 2 * (cp - 1) * mixer.shared_bytes * layers * calls
            mixer_collectives = 2 * layers * calls
        else:
            work += tokens * mixer.per_layer * (cp - 1) * len(mixer.runs)
            mixer_comm = 2 * mixer.passed_bytes * layers * calls
            mixer_collectives = 2 * calls * sum(m + cp - 1 for m in mixer.runs)  # the hops on the wavefront's path
    compute = 3 * work / (cp * cluster.flops * cluster.mfu)
    sharded = cp > 1 and path == "sharded"
    attention = g.layers - (sum(mixer.runs) if mixer is not None else 0)  # the layers with K/V
    store = tokens * attention * 2 * g.kv_heads * g.head_dim * (dtype_bytes + 4) / (cp if sharded else 1)
    comm = 0.0
    if cp > 1:
        share = (cp - 1) / cp
        # every layer's K and V of every call: all-gathered forward, reduce-scattered backward; 4 collectives a layer
        sent = share * 2 * tokens * attention * 2 * g.kv_heads * g.head_dim * dtype_bytes
        collectives = 4 * attention * calls
        if sharded:  # the queries of every call after the first go to the path's shards (_sharded_path)
            queries = tokens - min(tokens, chunk_tokens)
            per_query = g.heads * (4 * g.head_dim * dtype_bytes  # q forward; q, dout, out backward
                                   + 4 * (2 * g.head_dim + 1) + 4 + 2 * 4)  # fp32: partials and weights, dq, lse, max
            sent += share * queries * attention * per_query
            collectives += 6 * attention * (calls - 1)
        sent += mixer_comm
        collectives += mixer_collectives
        comm = sent / cluster.bandwidth + collectives * cluster.latency
    return {"compute_s": compute, "comm_s": comm, "step_s": compute + comm, "path_gib": store / 2**30}


def cluster_table(config: PretrainedConfig, lengths: list[int], sizes: list[int]) -> list[dict]:
    """The model's predicted step time, speedup over one GPU and path store, per cluster, length, CP size, path
    layout and (a hybrid) how its mixer layers run."""
    rows, rates, mixer = [], flop_rates(config), mixer_rates(config)  # read off a meta model once
    orders = MIXER_ORDERS if mixer is not None else ("-",)
    for cluster in CLUSTERS:
        for tokens in lengths:
            one = predicted_step(config, tokens, 1, cluster, rates=rates)["step_s"]
            for cp, path, mixers in itertools.product(sizes, PATH_LAYOUTS, orders):
                if cp == 1 and (path, mixers) != (PATH_LAYOUTS[0], orders[0]):
                    continue
                step = predicted_step(config, tokens, cp, cluster, path=path, rates=rates, mixers=mixers,
                                      mixer=mixer)
                rows.append({"cluster": cluster.name, "tokens": tokens, "cp": cp, "path": path if cp > 1 else "-",
                             "mixers": mixers if cp > 1 else "-", **step, "speedup": one / step["step_s"],
                             "efficiency": one / step["step_s"] / cp})
    return rows


def qwen3_8b() -> PretrainedConfig:
    """Qwen3-8B's published sizes (its config.json), built locally: nothing is downloaded."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144)


def qwen3_5_text() -> PretrainedConfig:
    """A Qwen3.5 text body of transformers' default sizes (Qwen3_5TextConfig(): 32 layers of hidden 4096, three Gated
    DeltaNet layers to each attention layer), built locally: nothing is downloaded."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig()


def markdown(measured: list[dict], predicted: dict[str, list[dict]]) -> str:
    """The measured table, then each model's predicted one, as markdown."""
    lines = ["| CP ranks | path K/V | mixers | tokens | step s (this machine) | sent MiB / rank | path store MiB / rank | "
             + "peak MiB / rank |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['cp']} | {r['path']} | {r['mixers']} | {r['tokens']} | {r['seconds']:.1f} | "
              f"{r['sent_mib_per_rank']:.1f} | "
              f"{r['path_store_mib_per_rank']:.1f} | {r['peak_mib_per_rank']:.1f} |" for r in measured]
    for model, rows in predicted.items():
        lines += ["", f"Predicted: {model}", "",
                  "| cluster | tokens | CP | path K/V | mixers | compute s | traffic s | speedup | efficiency | "
                  "path store GiB / rank |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['cluster']} | {r['tokens']} | {r['cp']} | {r['path']} | {r['mixers']} | "
                  f"{r['compute_s']:.3f} | {r['comm_s']:.3f} | {r['speedup']:.2f} | {r['efficiency']:.2f} | "
                  f"{r['path_gib']:.1f} |" for r in rows]
    return "\n".join(lines)


def describe(config: CpBenchConfig) -> dict:
    return {**asdict(config), "model": model_config(config.shape).to_dict() if config.shape else None,
            "cpus": os.cpu_count(), "note": "ranks share this machine's cores: step seconds compare CP sizes only "
                                            "roughly; memory and bytes are per rank"}


def lengths_for(tokens: int) -> list[int]:
    """Trajectory lengths for the cluster table: powers of two from 8K up to `tokens` x 8, at least 256K."""
    top = max(tokens * 8, 262144)
    return [2**k for k in range(13, int(math.log2(top)) + 1)]

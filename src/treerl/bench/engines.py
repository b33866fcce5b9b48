"""`treerl bench`: every engine on the same trees, side by side in one process.

Beside the steps (docs/architecture.md): measures step 5, engine against engine.

For each workload: flat tokens T, unique tokens U, the FLOP-ideal speedup (treerl.bench.flops),
then for each engine the median wall time of `forward_backward` over rounds that run every engine once
(interleaved, after a warm-up), its speedup over the flat engine (the faster of its layouts in the run) and over `dta` (the published design's
schedule), its peak memory (a separate, untimed run) and, for DfsEngine rows, the memory contract's
figure from the peaks beside it (flagged where the peak is above it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from treerl.attention import UnsupportedModel
from treerl.bench.flops import image_flops, tree_flops
from treerl.bench.peak import peak_memory
from treerl.bench.profile import profile_step
from treerl.bench.workloads import (
    AgentShape,
    ImageShape,
    agent_screenshots,
    agent_trees,
    grpo_groups,
    image_grpo,
    random_trees,
)
from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.engine.base import Engine, SequenceView
from treerl.engine.images import VISION_LANGUAGE
from treerl.engine.memory import ONE_PATH_SLACK
from treerl.models import build_model
from treerl.tree import PrefixTree, TokenSequence

ENGINES: dict[str, Callable[[], Engine]] = {
    "flat": FlatEngine,  # the dense baseline every engine is compared with: the faster layout on the device
    "flat-packed": lambda: FlatEngine(layout="packed"),  # packed rows without padding: the micro-batch of the contract
    "packed": PackedEngine,
    "dfs": DfsEngine,  # defaults: memory="micro-batch"
    "dfs-memory-one-path": lambda: DfsEngine(memory="one-path"),  # the strict contract: 1.5x the one-path walk
    # The published dynamic-tree-attention design's schedule inside treerl: one node per call (no sibling batching),
    # every graph recomputed on the way up. The baseline of "vs dta", and the one-path walk of the contract.
    "dta": lambda: DfsEngine(batch_tokens=0, recompute="always"),
    # Opt-in (not in DEFAULT_ENGINES): the levers one at a time, and no memory cap at all.
    "flat-sequences": lambda: FlatEngine(layout="sequences"),  # one call per sequence (flat's choice on CPU)
    "dfs-one-node-per-call": lambda: DfsEngine(batch_tokens=0),
    "dfs-always-recompute": lambda: DfsEngine(recompute="always"),
    "dfs-unbounded-memory": lambda: DfsEngine(memory_budget_tokens=1 << 40),
}
FLAT_LAYOUTS = ("flat", "flat-packed", "flat-sequences")  # "speedup vs flat" is over the fastest of these in the run
OPT_IN_ENGINES = ("flat-sequences", "dfs-one-node-per-call", "dfs-always-recompute", "dfs-unbounded-memory")
DEFAULT_ENGINES = [name for name in ENGINES if name not in OPT_IN_ENGINES]


@dataclass
class BenchConfig:
    """What to measure; sizes are full (GPU) sizes times `scale`."""

    shape: str = "small-qwen3"
    vocab_size: int | None = 4096  # None: the shape's own vocabulary
    model_path: str | None = None  # a local checkpoint directory instead of the shape (its own weights and vocabulary)
    device: str = "cpu"
    dtype: str = "float32"
    scale: float = 1 / 16
    repeats: int = 5  # rounds; each runs every engine once
    warmup: int = 1
    memory: bool = True
    engines: list[str] = field(default_factory=lambda: list(DEFAULT_ENGINES))
    workloads: list[str] = field(default_factory=lambda: list(workload_names()))
    seed: int = 0
    threads: int | None = None  # torch threads (None: torch's default)


def workload_names() -> list[str]:
    return ["grpo", "agent", "agent-long", "sharing-1", "sharing-2", "sharing-4", "sharing-8"]


IMAGE_WORKLOADS = ("grpo-image", "agent-screenshots")  # opt-in, with a vision-language shape (small-qwen2.5-vl)


def make_workload(name: str, scale: float, vocab: int, seed: int = 0, config=None) -> list[TokenSequence]:
    """The named synthetic batch (docs/design.md, "Measurement") at `scale` times its full size; an image workload
    takes its images' shape from the model's `config`."""
    s = lambda n: max(2, round(n * scale))
    if name in IMAGE_WORKLOADS:
        if config is None or vision_family_of(config) is None:
            raise ValueError(f"workload {name!r} shows images: it needs a vision-language shape (small-qwen2.5-vl)")
        shape, text = ImageShape.of(config), vocab - 4  # the top four ids are the image and vision ids
        if name == "grpo-image":  # G = 8 samples of each of 4 visual questions (an image inside the prompt)
            return image_grpo(shape, prompts=4, group_size=8, prompt_len=s(2048), response_len=s(4096), vocab=text,
                              seed=seed)
        return agent_screenshots(shape, samples=4, turns=6, system_len=s(4800), reply_len=s(1200), tool_len=s(1200),
                                 vocab=text, seed=seed)
    if name == "grpo":  # G = 8 samples of each of 4 prompts
        return grpo_groups(prompts=4, group_size=8, prompt_len=s(8192), response_len=s(4096), vocab=vocab, seed=seed)
    if name == "agent":  # tau2-bench-like multi-turn episodes, ~9.4x compression at full size
        return agent_trees(AgentShape(tasks=1, samples_per_task=4).scaled(scale), vocab=vocab, seed=seed)
    if name == "agent-long":  # chains of ~30 short turns (each call the last one plus a tool result), 3 forks
        shape = AgentShape(system_len=2400, task_len=300, context_len=16384, reply_len=150, tool_len=300, tasks=1,
                           samples_per_task=1, branch_at=(8, 16), branches=2)
        return agent_trees(shape.scaled(scale), vocab=vocab, seed=seed)
    if name.startswith("sharing-"):
        return random_trees(sequences=32, length=s(4096), sharing=float(name.split("-")[1]), vocab=vocab, seed=seed)
    raise ValueError(f"unknown workload {name!r}; known: {', '.join(workload_names() + list(IMAGE_WORKLOADS))}")


def vision_family_of(config) -> object | None:
    return VISION_LANGUAGE.get(getattr(config, "model_type", None))


def _loss(view: SequenceView) -> torch.Tensor:
    """A token-level policy-gradient loss: the same work for every engine."""
    logp = view.logprobs
    weights = (view.fields["advantages"] * view.fields["loss_mask"]).to(logp)
    return -(logp * weights).sum() - 0.01 * (view.entropy * view.fields["loss_mask"].to(logp)).sum()


def timed_step(engine: Engine, model, batch: list[TokenSequence], device: torch.device) -> float:
    """Seconds of one forward_backward (device synchronised), gradients cleared after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    engine.forward_backward(model, batch, _loss)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds


def _interleaved_times(engines: dict[str, Engine], model, batch: list[TokenSequence], device: torch.device,
                       config: BenchConfig, tick: Callable[[str], None]
                       ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each engine's step times, wall and the process's CPU time, in rounds that run every engine once (in a rotating
    order) after a warm-up.

    Interleaving spreads a slow spell of the machine over every engine instead of one: the medians
    of engines measured side by side stay comparable even when single steps vary by 10-20 %. CPU time is what a
    shared machine changes least: on one thread, the time this process computed, not the time it waited for a core.
    """
    names = list(engines)
    for name in names:
        for _ in range(config.warmup):
            timed_step(engines[name], model, batch, device)
            tick(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(config.repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.process_time()
            times[name].append(timed_step(engines[name], model, batch, device))
            cpu[name].append(time.process_time() - started)
            tick(name)
    return times, cpu


def run_bench(config: BenchConfig) -> list[dict]:
    """One row per (workload, engine), measured side by side on the same model and batch."""
    device = torch.device(config.device)
    model, batches = _model_and_batches(config)
    rows = []
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    steps = len(batches) * len(config.engines) * (config.warmup + config.repeats + int(config.memory))
    text_refused = _refusals(config.engines, model)
    with Progress(*columns) as progress:
        task = progress.add_task("bench", total=steps)
        for workload, batch in batches.items():
            tree = PrefixTree.build(batch)
            stats = tree.stats()
            flat_flops, tree_flops_ = tree_flops(tree, model.config)
            flat_vision, tree_vision = image_flops(tree, model.config)  # 0, 0 without images
            base = dict(
                workload=workload, sequences=stats.sequences, flat_tokens=stats.flat_tokens,
                unique_tokens=stats.unique_tokens, compression=stats.compression,
                ideal=(flat_flops + flat_vision) / (tree_flops_ + tree_vision),
                vision_flops_flat=flat_vision, vision_flops_tree=tree_vision,
            )
            refused = _refusals(config.engines, model, batch[:1]) if flat_vision else text_refused
            for name in refused:  # a row saying so, not a hole in the table
                rows.append(dict(base, engine=name, refused=refused[name], seconds=None, times=[], peak_bytes=None))
                progress.advance(task, config.warmup + config.repeats + int(config.memory))
            engines = {name: ENGINES[name]() for name in config.engines if name not in refused}
            times, cpu = _interleaved_times(engines, model, batch, device, config, lambda name: progress.update(
                task, description=f"{workload}: {name}", advance=1))
            for name, engine in engines.items():
                peak = None
                if config.memory:
                    progress.update(task, description=f"{workload}: {name} (memory)")
                    peak = peak_memory(lambda: engine.forward_backward(model, batch, _loss), device)
                    model.zero_grad(set_to_none=True)
                    progress.advance(task)
                rows.append(dict(base, engine=name, seconds=statistics.median(times[name]), times=times[name],
                                 cpu_seconds=statistics.median(cpu[name]) if device.type == "cpu" else None,
                                 peak_bytes=peak))
    # flat's micro-batch: packed rows, or one sequence per call for a model flat cannot pack (a hybrid)
    micro_batch = "flat-sequences" if "flat-packed" in text_refused else "flat-packed"
    order = {name: i for i, name in enumerate(config.engines)}
    rows.sort(key=lambda r: (list(batches).index(r["workload"]), order[r["engine"]]))
    for row in rows:
        same = {r["engine"]: r for r in rows if r["workload"] == row["workload"] and r["seconds"] is not None}
        flats = [same[name]["seconds"] for name in FLAT_LAYOUTS if name in same]
        dta, measured = same.get("dta"), row["seconds"] is not None
        row["speedup"] = min(flats) / row["seconds"] if flats and measured else None  # over the fastest flat layout
        row["of_ideal"] = row["speedup"] / row["ideal"] if row["speedup"] else None
        row["vs_dta"] = dta["seconds"] / row["seconds"] if dta and measured else None
        shown = row["vision_flops_flat"] > 0  # flat runs each sequence that shows images in its own call
        row["contract_bytes"] = contract_bytes(ENGINES[row["engine"]](), same, "flat-sequences" if shown else
                                               micro_batch) if measured else None
        row["over_contract"] = row["contract_bytes"] is not None and row["peak_bytes"] > row["contract_bytes"]
    return rows


def _refusals(names: list[str], model, probe: list[TokenSequence] | None = None) -> dict[str, str]:
    """The engines that refuse this model (a hybrid in packed rows, say), with their reason, from a 4-token try, or
    from `probe` (a workload's first sequence: images refused by the packing engines)."""
    vocab = model.get_input_embeddings().num_embeddings
    probe = probe or [TokenSequence(torch.arange(4) % vocab, fields={"advantages": torch.zeros(4),
                                                                    "loss_mask": torch.ones(4)})]
    refused = {}
    for name in names:
        try:
            ENGINES[name]().forward(model, probe)
        except UnsupportedModel as error:
            refused[name] = str(error)
    return refused


def contract_bytes(engine: Engine, same: dict[str, dict], micro_batch: str = "flat-packed") -> int | None:
    """The memory contract's figure for a DfsEngine row, from the peaks measured beside it: flat's micro-batch
    (the `micro_batch` row; or 1.5x the one-path walk, `dta`, where that is more) by default; 1.5x the one-path
    walk in one-path mode. None for other engines, explicit budgets, or when the peaks were not measured."""
    if not isinstance(engine, DfsEngine) or engine.memory_budget_tokens or engine.memory_budget_bytes:
        return None
    peak = lambda name: (same.get(name) or {}).get("peak_bytes")
    one_path = peak("dta")
    flat = peak(micro_batch) or (peak("flat") if micro_batch == "flat-sequences" else None)  # CPU's flat: sequences
    if one_path is None or engine.batch_tokens == 0 and engine.recompute == "always":  # dta: the reference itself
        return None
    if engine.memory == "one-path":
        return int(ONE_PATH_SLACK * one_path)
    return None if flat is None else max(flat, int(ONE_PATH_SLACK * one_path))


def _model_and_batches(config: BenchConfig) -> tuple[torch.nn.Module, dict[str, list[TokenSequence]]]:
    """The bench's model (random weights of `shape`) and each workload's batch; unknown engines refused first."""
    unknown = sorted(set(config.engines) - set(ENGINES))
    if unknown:
        raise ValueError(f"unknown engines {unknown}; known: {', '.join(ENGINES)}")
    if config.threads:
        torch.set_num_threads(config.threads)
    model = bench_model(config)
    vocab = model.get_input_embeddings().num_embeddings
    return model, {w: make_workload(w, config.scale, vocab, config.seed, model.config) for w in config.workloads}


def bench_model(config: BenchConfig) -> torch.nn.Module:
    """The model measured: the checkpoint at `model_path` (a real model), else random weights of `shape`."""
    if config.model_path:
        return build_model(path=config.model_path, dtype=getattr(torch, config.dtype), device=config.device).eval()
    return build_model(shape=config.shape, vocab_size=config.vocab_size, dtype=getattr(torch, config.dtype),
                       device=config.device, seed=config.seed)


def profile_engines(config: BenchConfig) -> list[dict]:
    """Where each engine's step time goes (treerl.bench.profile), after `warmup` unprofiled steps."""
    device = torch.device(config.device)
    model, batches = _model_and_batches(config)
    rows = []
    for workload, batch in batches.items():
        for name in config.engines:
            engine = ENGINES[name]()
            for _ in range(config.warmup):
                timed_step(engine, model, batch, device)
            step = lambda e=engine, b=batch: timed_step(e, model, b, device)
            rows.append(dict(workload=workload, engine=name, **profile_step(step, device)))
    return rows


MEMORY_ENGINES: dict[str, Callable[[], Engine]] = {
    "flat, whole batch at once": lambda: FlatEngine(layout="packed", max_tokens=1 << 40),
    "flat, 8192-token micro-batches": lambda: FlatEngine(layout="packed"),
    "dfs (default: micro-batch contract)": DfsEngine,
    "dfs, memory=one-path": lambda: DfsEngine(memory="one-path"),
    "dta (one node per call, recompute)": lambda: DfsEngine(batch_tokens=0, recompute="always"),
}


def memory_scaling(config: BenchConfig, groups: tuple[int, ...] = (1, 4, 16, 64)) -> list[dict]:
    """Peak memory of one step as G samples of one prompt grow: what each engine must hold."""
    if config.threads:
        torch.set_num_threads(config.threads)
    device = torch.device(config.device)
    model = bench_model(config)
    s = lambda n: max(2, round(n * config.scale))
    rows = []
    for g in groups:
        batch = grpo_groups(prompts=1, group_size=g, prompt_len=s(8192), response_len=s(4096),
                            vocab=model.config.vocab_size, seed=config.seed)
        for name, make in MEMORY_ENGINES.items():
            peak = peak_memory(lambda: make().forward_backward(model, batch, _loss), device)
            model.zero_grad(set_to_none=True)
            rows.append(dict(samples=g, sequence_tokens=len(batch[0]), flat_tokens=sum(map(len, batch)),
                             engine=name, peak_bytes=peak))
    return rows


def describe(config: BenchConfig) -> dict:
    """The run's settings and machine, stored beside the results."""
    device = torch.device(config.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU x{torch.get_num_threads()} threads"
    return dict(asdict(config), torch=torch.__version__, device_name=name)

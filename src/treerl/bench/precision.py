"""`treerl bench --precision`: one training step per precision, with LoRA and gradient checkpointing, flat vs dfs.

Beside the steps (docs/architecture.md): measures steps 5 and 6 in each precision.

Each variant builds the model as the trainer would (`trainer.precision`, `model.lora.rank`,
`model.gradient_checkpointing`) and runs one full step on G samples of one prompt: the engine's
forward_backward, then AdamW's step. Time is that step's wall time; peak memory is what the step
allocates above the weights (gradients, AdamW state created at the first step, activations,
autocast's bfloat16 weight copies), from torch's allocation events (CPU) or its peak counter (CUDA),
so time is taken under the memory profiler on CPU. Both engines see the same batch and a fresh
model and optimizer.
"""

from __future__ import annotations

import functools
import gc
import time
from dataclasses import asdict, dataclass, field

import torch

from treerl.bench.engines import _loss
from treerl.bench.peak import peak_memory
from treerl.bench.workloads import grpo_groups
from treerl.engine import AutocastEngine, DfsEngine, Engine, FlatEngine
from treerl.models import add_lora, build_model
from treerl.trainer.core.build import enable_gradient_checkpointing
from treerl.trainer.core.config import TrainerConfig
from treerl.trainer.core.optim import build_optimizer
from treerl.trainer.core.precision import autocast_dtype, parameter_dtype

# name -> (trainer.precision, LoRA on, gradient checkpointing on)
VARIANTS: dict[str, tuple[str, bool, bool]] = {
    "fp32": ("fp32", False, False),
    "bf16-mixed": ("bf16-mixed", False, False),
    "bf16": ("bf16", False, False),
    "bf16-mixed + LoRA": ("bf16-mixed", True, False),
    "bf16-mixed + checkpointing": ("bf16-mixed", False, True),
}


@dataclass
class PrecisionBenchConfig:
    """One step of G samples of one prompt on a random model of `shape`."""

    shape: str = "qwen3-0.6b"
    vocab_size: int | None = None  # None: the shape's own
    device: str = "cpu"
    prompt_tokens: int = 1024
    response_tokens: int = 32
    samples: int = 8
    lora_rank: int = 16
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    engines: list[str] = field(default_factory=lambda: ["flat", "dfs"])
    seed: int = 0


def _engine(name: str, sequence_tokens: int, compute: torch.dtype | None) -> Engine:
    """flat runs one sequence per micro-batch (its memory stays that of one sequence); dfs its defaults."""
    engine: Engine = FlatEngine(max_tokens=sequence_tokens) if name == "flat" else DfsEngine()
    return AutocastEngine(engine, compute) if compute is not None else engine


def _timed_step(engine: Engine, model: torch.nn.Module, batch: list, optimizer: torch.optim.Optimizer,
                seconds: list[float]) -> None:
    """One training step (forward_backward, then the optimizer's step); its wall time appended to `seconds`."""
    started = time.perf_counter()
    engine.forward_backward(model, batch, _loss)
    optimizer.step()
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds.append(time.perf_counter() - started)


def precision_rows(config: PrecisionBenchConfig) -> list[dict]:
    """One row per (variant, engine): parameters, step time, peak memory above the weights."""
    unknown = sorted(set(config.variants) - set(VARIANTS)) + sorted(set(config.engines) - {"flat", "dfs"})
    if unknown:
        raise ValueError(f"unknown variants or engines {unknown}; variants: {', '.join(VARIANTS)}; engines: flat, dfs")
    device = torch.device(config.device)
    rows = []
    for variant in config.variants:
        precision, lora, checkpointing = VARIANTS[variant]
        for name in config.engines:
            model = build_model(shape=config.shape, vocab_size=config.vocab_size, device=device, seed=config.seed,
                                dtype=getattr(torch, parameter_dtype(precision, None)))
            if checkpointing:
                enable_gradient_checkpointing(model)
            if lora:
                model = add_lora(model, config.lora_rank, 2.0 * config.lora_rank)
            batch = grpo_groups(prompts=1, group_size=config.samples, prompt_len=config.prompt_tokens,
                                response_len=config.response_tokens, vocab=model.config.vocab_size, seed=config.seed)
            engine = _engine(name, len(batch[0]), autocast_dtype(precision))
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = build_optimizer(trainable, TrainerConfig())
            seconds: list[float] = []
            peak = peak_memory(functools.partial(_timed_step, engine, model, batch, optimizer, seconds), device)
            rows.append(dict(
                variant=variant, engine=name, precision=precision, lora_rank=config.lora_rank if lora else 0,
                gradient_checkpointing=checkpointing, samples=config.samples, flat_tokens=sum(map(len, batch)),
                parameters=sum(p.numel() for p in model.parameters()), trainable=sum(p.numel() for p in trainable),
                weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                seconds=seconds[0], peak_bytes=peak,
            ))
            del model, optimizer, engine, trainable
            gc.collect()  # the next variant's model is built while this one's is gone
    return rows


def precision_markdown(rows: list[dict]) -> str:
    """A line per (variant, engine): weights, step time, peak memory above them, both against fp32 and flat."""
    lines = ["| variant | engine | trainable params | weights MiB | step (s) | peak MiB above weights | "
             "time vs fp32 | memory vs fp32 | dfs speedup vs flat |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fp32 = next((x for x in rows if x["variant"] == "fp32" and x["engine"] == r["engine"]), None)
        flat = next((x for x in rows if x["variant"] == r["variant"] and x["engine"] == "flat"), None)
        time_vs, memory_vs = (f"{r[key] / fp32[key]:.2f}x" if fp32 else "-" for key in ("seconds", "peak_bytes"))
        speedup = f"{flat['seconds'] / r['seconds']:.2f}x" if flat and r["engine"] != "flat" else "-"
        lines.append(f"| {r['variant']} | {r['engine']} | {r['trainable']:,} | {r['weight_bytes'] / 2**20:,.1f} | "
                     f"{r['seconds']:.1f} | {r['peak_bytes'] / 2**20:,.1f} | {time_vs} | {memory_vs} | {speedup} |")
    return "\n".join(lines)


def describe(config: PrecisionBenchConfig) -> dict:
    """The run's settings and machine, stored beside the results."""
    device = torch.device(config.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU x{torch.get_num_threads()} threads"
    return dict(asdict(config), torch=torch.__version__, device_name=name)

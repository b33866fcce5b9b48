"""`treerl bench`: engines side by side on the same trees; `--profile`: where each engine's time goes;
`--balance`: data-parallel assignment; `--async`: synchronous vs asynchronous RL training;
`--precision`: one training step per precision; `--rollout`: generation alone, the embedded sampler's padded path
against its shared-prefix path; `--weight-push URL`: what pushing weights to an inference server
costs; `--mismatch URL`: how far a server's log-probs are from the trainer's at the same weights; `--cp 1,2,4`: one long trajectory under context parallelism, and when CP pays on a GPU cluster; `--against trl`: treerl train
against TRL's GRPOTrainer on the same model, prompts and settings.

Beside the steps (docs/architecture.md): the benchmark's command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from treerl.bench.context_parallel import CpBenchConfig
from treerl.bench.engines import (
    DEFAULT_ENGINES,
    ENGINES,
    IMAGE_WORKLOADS,
    OPT_IN_ENGINES,
    BenchConfig,
    describe,
    memory_scaling,
    run_bench,
    workload_names,
)
from treerl.bench.precision import VARIANTS as PRECISION_VARIANTS
from treerl.bench.precision import PrecisionBenchConfig
from treerl.cli.options import check_among, check_existing, check_positive, integers
from treerl.errors import UserError
from treerl.gguf_checkpoint import PACKAGED_MODELS, local_checkpoint
from treerl.models import DTYPES, SHAPES, check_device
from treerl.rollout.config import check_server_url


def run_rollout_bench(shape: str, vocab_size: int, model_path: str | None, dtype: str, device: str,
                      threads: int | None, repeats: int, workloads: str | None, system_tokens: int, out: Path) -> None:
    """`--rollout`: its options checked in one line each, then the table, printed and written to
    out/rollout.{json,md} with the settings, the machine's load before and after, and CPU seconds."""
    import os

    from treerl.bench.rollout import WORKLOADS, RolloutBenchConfig, describe, rollout_markdown, rollout_rows

    chosen = (workloads or ",".join(WORKLOADS)).split(",")
    check_among("--workloads", chosen, WORKLOADS)
    check_among("--shape", [shape], tuple(SHAPES))
    check_among("--dtype", [dtype], DTYPES)
    check_device(device, "--device")
    check_positive({"--repeats": repeats, "--system-tokens": system_tokens,
                    **({"--threads": threads} if threads is not None else {})})
    if model_path not in PACKAGED_MODELS:
        check_existing("--model-path", model_path)
    if model_path is not None:
        model_path = local_checkpoint(model_path, key="--model-path")
    config = RolloutBenchConfig(shape=shape, vocab_size=vocab_size or None, model_path=model_path, dtype=dtype,
                                device=device, threads=threads, repeats=repeats, workloads=chosen,
                                system_tokens=system_tokens)
    load = os.getloadavg()
    rows = rollout_rows(config)
    settings = {**describe(config), "load_before": load, "load_after": os.getloadavg()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "rollout.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    table = rollout_markdown(rows)
    (out / "rollout.md").write_text(table + "\n")
    print(table)
    Console().print(f"written to {out}/rollout.{{json,md}} (load {load[0]:.1f} before, {settings['load_after'][0]:.1f} "
                    "after)")


def run_precision_bench(config: PrecisionBenchConfig, out: Path) -> None:
    """`--precision`: the table, printed and written to out/precision.{json,md}."""
    from treerl.bench.precision import describe as describe_precision
    from treerl.bench.precision import precision_markdown, precision_rows

    rows = precision_rows(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "precision.json").write_text(json.dumps({"settings": describe_precision(config), "rows": rows}, indent=1))
    table = precision_markdown(rows)
    (out / "precision.md").write_text(table + "\n")
    print(table)
    Console().print(f"written to {out}/precision.{{json,md}}")


def bench(
    shape: str = typer.Option("small-qwen3", help="model shape (treerl.models.SHAPES), random weights"),
    vocab_size: int = typer.Option(4096, help="vocabulary size; 0 keeps the shape's own"),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    dtype: str = typer.Option("float32", help="float32, bfloat16, float16, float64"),
    scale: float = typer.Option(1 / 16, help="workload lengths x scale (1.0: 16K-token agent context, 8K prompts)"),
    repeats: int = typer.Option(5, help="timed rounds (median per engine); each round runs every engine once, after one warm-up"),
    workloads: str | None = typer.Option(None, show_default=False,
                                         help=f"comma-separated, of: {', '.join(workload_names())} (default: all); "
                                              "--against trl: of short, long_system, multi_turn (default: short)"),
    engines: str = typer.Option(",".join(DEFAULT_ENGINES), show_default=False,
                                help=f"comma-separated, of: {', '.join(ENGINES)} (default: all but "
                                     f"{', '.join(OPT_IN_ENGINES)})"),
    memory: bool = typer.Option(True, help="also measure peak memory (one extra untimed run)"),
    scaling: bool = typer.Option(True, help="also the peak-memory table as G samples of one prompt grow"),
    profile: bool = typer.Option(False, "--profile", help="where each engine's step time goes (torch.profiler) instead"),
    balance: bool = typer.Option(False, "--balance", help="data-parallel balancer vs first-fit and LPT instead"),
    balance_scale: float = typer.Option(1.0, help="--balance: tau2-like episode lengths x scale"),
    compare_async: bool = typer.Option(False, "--async", help="sync vs async RL training: reward against wall time"),
    train_config: str | None = typer.Option(None, "--config", help="--async: packaged config name or YAML file "
                                            "(default: arithmetic); --against: the treerl config both trainers are "
                                            "matched to (default: smollm2)"),
    override: list[str] = typer.Option([], "--set", help="--async, --against: key=value override for both runs "
                                       "(repeatable)"),
    seeds: str = typer.Option("0", help="--async, --against: comma-separated seeds, one run of each mode or trainer"),
    target: float | None = typer.Option(None, help="--async: reward to reach (default: 0.9 x sync's final reward); "
                                        "--against: (default: 0.9 x TRL's final reward)"),
    against: str | None = typer.Option(None, "--against", help="trl: treerl train against TRL's GRPOTrainer, same "
                                       "model, prompts and settings, one after the other (docs/benchmarks.md)"),
    trl_python: str | None = typer.Option(None, "--trl-python", help="--against trl: a Python with trl 1.16 "
                                          "(default: the venv tools/trl-venv.sh builds)"),
    threads: int | None = typer.Option(None, help="torch threads (default: torch's own; --async: 1, the trainer's in both modes)"),
    rollout: bool = typer.Option(False, "--rollout", help="generation alone: the embedded sampler's padded path (each "
                                 "prompt prefilled whole) against its shared-prefix path (each shared prefix once, a "
                                 "prefix cache across calls), same calls, against their ideal (docs/benchmarks.md)"),
    system_tokens: int = typer.Option(1470, help="--rollout: tokens of the system prompt grpo_long_system and "
                                      "agent_tree share"),
    precision: bool = typer.Option(False, "--precision", help="one training step per precision, with LoRA and "
                                   "gradient checkpointing, flat vs dfs, on G samples of one prompt (--shape)"),
    variants: str = typer.Option(",".join(PRECISION_VARIANTS), help="--precision: comma-separated variants"),
    prompt_tokens: int = typer.Option(1024, help="--precision: tokens of the shared prompt"),
    response_tokens: int = typer.Option(32, help="--precision, --mismatch: tokens of each sample (at most)"),
    samples: int = typer.Option(8, help="--precision: samples G of the prompt; --mismatch: samples of each prompt"),
    lora_rank: int = typer.Option(16, help="--precision: rank of the LoRA variant"),
    weight_push: str | None = typer.Option(None, "--weight-push", help="URL of a running inference server: the time "
                                           "of one weight push (write + load) through /dev/shm and disk instead"),
    model_path: str | None = typer.Option(None, help="a checkpoint to measure instead of --shape: a local directory, a "
                                          "GGUF file or a packaged model (smollm2-135m-instruct, gemma3-270m); "
                                          "--weight-push, --mismatch: the model the server serves"),
    mismatch: str | None = typer.Option(None, "--mismatch", help="URL of a running inference server: its log-probs "
                                        "against the trainer's recomputation (--dtype) at the same weights instead "
                                        "(--model-path is pushed to it first, as version 0)"),
    prompts: int = typer.Option(8, help="--mismatch: chat prompts sampled"),
    temperature: float = typer.Option(1.0, help="--mismatch: sampling temperature"),
    server_model: str = typer.Option("policy", help="--weight-push, --mismatch: the server's model name"),
    cp: str | None = typer.Option(None, "--cp", help="context parallelism: comma-separated rank counts (e.g. 1,2,4): "
                                  "one long trajectory (--cp-tokens) over that many gloo processes, and the GPU model"),
    cp_tokens: int = typer.Option(32768, help="--cp: tokens of the trajectory"),
    cp_paths: str = typer.Option("sharded,replicated", help="--cp: the path's K/V layouts to measure (R > 1)"),
    cp_mixers: str = typer.Option("side-by-side", help="--cp: how a hybrid's mixer layers run their pieces, to "
                                  "measure (side-by-side,in-turn; R > 1)"),
    out: Path = typer.Option(Path("outputs/bench"), help="where JSON, markdown and PNG go"),
) -> None:
    """Measure what prefix sharing buys: time, memory and speedup over flat, against the FLOP ideal."""
    if against is not None:
        run_against(against, train_config, override, workloads or "short", integers("--seeds", seeds), trl_python,
                    threads or 1, target, out)
        return
    if rollout:
        run_rollout_bench(shape, vocab_size, model_path, dtype, device, threads, repeats, workloads, system_tokens, out)
        return
    workloads = workloads or ",".join(workload_names())
    check_options(shape, vocab_size, device, dtype, workloads, engines, variants, weight_push, model_path, {
        "--prompts": prompts, "--temperature": temperature, "--scale": scale, "--repeats": repeats, "--balance-scale": balance_scale, "--prompt-tokens": prompt_tokens,
        "--response-tokens": response_tokens, "--samples": samples, "--lora-rank": lora_rank, "--cp-tokens": cp_tokens,
        **({"--threads": threads} if threads is not None else {})})
    check_mismatch(mismatch, model_path, dtype)
    if model_path is not None:
        model_path = local_checkpoint(model_path, key="--model-path")
    config = BenchConfig(
        shape=shape, vocab_size=vocab_size or None, model_path=model_path, device=device, dtype=dtype, scale=scale,
        repeats=repeats,
        memory=memory, workloads=workloads.split(","), engines=engines.split(","), threads=threads,
    )
    if cp is not None:  # `--cp ''` too: refused as no rank counts, not taken for no --cp
        run_cp_bench(CpBenchConfig(shape=shape, vocab_size=vocab_size or None, tokens=cp_tokens,
                                   ranks=integers("--cp", cp, least=1), paths=cp_paths.split(","),
                                   mixers=cp_mixers.split(","), memory=memory),
                     out)
    elif weight_push:
        run_weight_push(weight_push, model_path, server_model, repeats, out)
    elif mismatch:
        run_mismatch(mismatch, model_path, server_model, dtype, prompts, samples, response_tokens, temperature, out)
    elif compare_async:
        run_async_compare(train_config or "arithmetic", override, integers("--seeds", seeds), target, threads or 1, out)
    elif profile:
        run_profile(config, out)
    elif precision:
        run_precision_bench(PrecisionBenchConfig(
            shape=shape, vocab_size=vocab_size or None, device=device, prompt_tokens=prompt_tokens,
            response_tokens=response_tokens, samples=samples, lora_rank=lora_rank, variants=variants.split(","),
            engines=[e for e in engines.split(",") if e in ("flat", "dfs")] or ["flat", "dfs"]), out)
    elif balance:
        run_balance(config, balance_scale, out)
    else:
        run_engine_bench(config, out, scaling)


def check_options(shape: str, vocab_size: int, device: str, dtype: str, workloads: str, engines: str, variants: str,
                  weight_push: str | None, model_path: str | None, positive: dict[str, float]) -> None:
    """Every option checked before a model is built or a process started, as `treerl train` checks its config: one
    line naming the option."""
    check_among("--shape", [shape], tuple(SHAPES))
    check_among("--dtype", [dtype], DTYPES)
    check_device(device, "--device")
    check_positive(positive)
    if vocab_size < 0:
        raise UserError(f"--vocab-size={vocab_size} must be >= 0 (0: the shape's own)")
    check_among("--workloads", workloads.split(","), [*workload_names(), *IMAGE_WORKLOADS])
    check_among("--engines", engines.split(","), ENGINES)
    check_among("--variants", variants.split(","), PRECISION_VARIANTS)
    if weight_push is not None:
        check_server_option("--weight-push", weight_push, model_path)
    if model_path not in PACKAGED_MODELS:
        check_existing("--model-path", model_path)


def check_server_option(option: str, url: str, model_path: str | None) -> None:
    """A server URL option: a URL, and --model-path naming what the server serves."""
    try:
        check_server_url(url, option)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not model_path:
        raise UserError(f"{option} needs --model-path, the directory of the model the server serves")


def check_mismatch(mismatch: str | None, model_path: str | None, dtype: str) -> None:
    """--mismatch: a server URL, its model, and a trainer dtype the trainer has (bfloat16: bf16-mixed)."""
    from treerl.bench.mismatch import TRAINER_PRECISION

    if mismatch is None:
        return
    check_server_option("--mismatch", mismatch, model_path)
    if dtype not in TRAINER_PRECISION:
        raise UserError(f"--mismatch --dtype={dtype}: the trainer recomputes in one of {', '.join(TRAINER_PRECISION)}")


def run_engine_bench(config: BenchConfig, out: Path, scaling: bool = True) -> None:
    """The default: engines side by side (and peak memory as G grows), printed and written to out/."""
    from treerl.bench.report import markdown, memory_markdown, write

    rows = run_bench(config)
    print(markdown(rows), flush=True)  # the engines' table first: the scaling table takes a while
    memory_rows = memory_scaling(config) if config.memory and scaling else []
    paths = write(rows, memory_rows, describe(config), out)
    if memory_rows:
        print("\nPeak memory (MiB) of one step, G samples of one prompt:\n")
        print(memory_markdown(memory_rows))
    Console().print(f"written to {', '.join(str(p) for p in paths.values())}")


def run_cp_bench(config: CpBenchConfig, out: Path) -> None:
    """`--cp`: per-rank memory, bytes and time of one long trajectory, and the GPU cluster model, printed and written
    to out/context_parallel.{json,md}."""
    from treerl.bench.context_parallel import (cluster_table, describe, lengths_for, markdown, measure, qwen3_5_text,
                                               qwen3_8b)

    measured = measure(config)
    predicted = {"Qwen3-8B": cluster_table(qwen3_8b(), lengths_for(config.tokens), [1, 2, 4, 8]),
                 "Qwen3.5 text (transformers' default sizes)": cluster_table(qwen3_5_text(), lengths_for(config.tokens),
                                                                             [1, 2, 4, 8])}
    out.mkdir(parents=True, exist_ok=True)
    (out / "context_parallel.json").write_text(json.dumps(
        {"settings": describe(config), "measured": measured, **{f"predicted ({k})": v for k, v in predicted.items()}},
        indent=1))
    table = markdown(measured, predicted)
    (out / "context_parallel.md").write_text(table + "\n")
    print(table)
    Console().print(f"written to {out}/context_parallel.{{json,md}}")


def run_weight_push(url: str, model_path: str, server_model: str, repeats: int, out: Path) -> None:
    """`--weight-push`: the push times, printed and written to out/weight_push.{json,md}."""
    from treerl.bench.weight_push import measure_weight_push, weight_push_markdown

    rows = measure_weight_push(url, model_path, server_model, repeats, out / "pushed")
    write_rows(out, "weight_push", rows, weight_push_markdown(rows))


def write_rows(out: Path, name: str, rows: list[dict], table: str) -> None:
    """A server measurement's rows and table, as out/<name>.json and .md, and on the console."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
    Console().print(f"written to {out}/{name}.{{json,md}}")


def run_mismatch(url: str, model_path: str, server_model: str, dtype: str, prompts: int, samples: int,
                 response_tokens: int, temperature: float, out: Path) -> None:
    """`--mismatch`: the server's log-probs against the trainer's, printed and written to out/mismatch.{json,md}."""
    from treerl.bench.mismatch import measure_mismatch, mismatch_markdown

    rows = [measure_mismatch(url, model_path, server_model, dtype, prompts, samples, response_tokens, temperature)]
    write_rows(out, "mismatch", rows, mismatch_markdown(rows))


def run_against(against: str, train_config: str | None, override: list[str], workloads: str, seeds: list[int],
                trl_python: str | None, threads: int, target: float | None, out: Path) -> None:
    """`--against trl`: TRL's GRPOTrainer then treerl train per workload and seed; the table printed and written to
    out/against_trl.{json,md,png}."""
    from treerl.bench.against_trl import compare, markdown

    if against != "trl":
        raise UserError(f"--against {against}: the one trainer measured against is trl")
    if threads < 1:
        raise UserError(f"--threads={threads} must be >= 1")
    result = compare(train_config, override, workloads.split(","), seeds, trl_python, threads, target, out)
    print(markdown(result["rows"], result["ratios"]))
    Console().print(f"TRL {result['setup']['trl']} against treerl; written to {out}/against_trl.{{json,md,png}}")


def run_async_compare(train_config: str, override: list[str], seeds: list[int], target: float | None, threads: int,
                      out: Path) -> None:
    """`--async`: sync vs async training runs, the table printed and written to out/async/."""
    from treerl.bench.async_compare import compare, markdown

    rows = compare(train_config, override, seeds, target, threads, out / "async")
    print(markdown(rows))
    Console().print(f"written to {out}/async/async_compare.{{json,md,png}}")


def run_profile(config: BenchConfig, out: Path) -> None:
    """`--profile`: where each engine's step time goes, printed and written to out/profile.{json,md}."""
    from treerl.bench.engines import profile_engines
    from treerl.bench.profile import profile_markdown

    rows = profile_engines(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps({"settings": describe(config), "rows": rows}, indent=1))
    (out / "profile.md").write_text(profile_markdown(rows) + "\n")
    print(profile_markdown(rows))
    Console().print(f"written to {out}/profile.{{json,md}}")


def run_balance(config: BenchConfig, balance_scale: float, out: Path) -> None:
    """`--balance`: the balancer against the baselines, printed and written to out/balance.{json,md}."""
    from treerl.bench.balance import balance_tables

    rows, table, fitted = balance_tables(config, balance_scale)
    out.mkdir(parents=True, exist_ok=True)
    (out / "balance.json").write_text(json.dumps({"cost_model": fitted.weights, "rows": rows}, indent=1))
    (out / "balance.md").write_text(table + "\n")
    console = Console()
    console.print(f"cost model {fitted.describe()}")
    print(table)
    console.print(f"written to {out}/balance.{{json,md}}")

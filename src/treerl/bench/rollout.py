"""`treerl bench --rollout`: generation alone, the embedded sampler's two paths side by side on the same calls.

Step 1 (docs/architecture.md), measured: what the sampler's prefix sharing buys.

    treerl bench --rollout --model-path smollm2-135m-instruct --threads 1 --repeats 3

Each workload is a sequence of `generate` calls, played once by the padded path (`prefix_sharing=False`: each prompt
prefilled whole in a left-padded batch, its cache repeated n-fold, what the sampler did before issue 54) and once by
the shared path (`prefix_sharing="always"`: each shared prefix computed once, a prefix cache across calls), each
with a fresh sampler, one after the other in the same process, every round (the median is reported). Replies are of
fixed length (no stop token), so both paths run the same calls whatever they sample; with the same seed they sample the same tokens
(`same_tokens`: the share of completions that agree). Workloads (random token ids; sizes as the issue measured):

- grpo_long_system: 4 prompts x 8 samples x 16 new tokens, each prompt a shared system prompt (--system-tokens,
  1,470 by default) and a 24-token question;
- agent_tree: 2 tasks x 4 samples, 4 model calls each, under the same system prompt: each call the episode's context
  so far (task, replies of 24 tokens, tool results of 48), one call per turn over every live episode;
- episode: 4 episodes x 2 samples of a 6-turn episode (a 96-token prompt, replies of 16 tokens, environment answers
  of 32), each turn's prompt the history so far.

The ideal of a workload is the tokens that must run at least once (unique prefill tokens + decoded tokens: the trie
of every call's prompts and prompt + reply but its last token), at the model's prefill speed (tokens a second of one
forward over `IDEAL_PROBE_TOKENS` tokens on this machine, in CPU time): `vs_ideal` is a path's wall time over that, the
table's `CPU vs ideal` its CPU time. Decoding runs a
call's rows one token at a time, which no sampler batches better; the floor counts them so: the unique prefill tokens
at prefill speed, and each decoding step at the time of one forward of that many one-token rows without any context
(`vs_floor`).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from treerl.bench.engines import bench_model
from treerl.rollout import EmbeddedSampler, SamplingParams
from treerl.rollout.sampling.sampler import Completion

WORKLOADS = ("grpo_long_system", "agent_tree", "episode")
PATHS = ("padded", "shared")
IDEAL_PROBE_TOKENS = 1024


@dataclass
class RolloutBenchConfig:
    """What to measure: a random-init `shape` or the checkpoint at `model_path`."""

    shape: str = "small-qwen3"
    vocab_size: int | None = 4096
    model_path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    repeats: int = 3
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    system_tokens: int = 1470
    seed: int = 0


Call = tuple[list[list[int]], SamplingParams, list[list[Completion]]]  # prompts, params, what they sampled
Generate = Callable[[list[list[int]], SamplingParams], list[list[Completion]]]


class _Tokens:
    """Random ordinary token ids (away from the vocabulary's ends, where special tokens sit), seeded."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.rng = vocab, random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        lo = min(100, self.vocab // 8)
        return [self.rng.randrange(lo, self.vocab - lo) for _ in range(n)]


def _played(generate: Generate) -> tuple[Generate, list[Call]]:
    """`generate`, recording each call."""
    calls: list[Call] = []

    def recorded(prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        groups = generate(prompts, params)
        calls.append((prompts, params, groups))
        return groups

    return recorded, calls


def grpo_long_system(generate: Generate, tokens: _Tokens, system: int) -> None:
    """4 prompts x 8 samples under one shared system prompt, 16 new tokens."""
    shared = tokens(system)
    generate([shared + tokens(24) for _ in range(4)], SamplingParams(n=8, max_new_tokens=16, seed=1))


def agent_tree(generate: Generate, tokens: _Tokens, system: int) -> None:
    """2 tasks x 4 samples, 4 calls each: the context grows by the reply and a tool result every call."""
    shared = tokens(system)
    tasks = [shared + tokens(64) for _ in range(2)]
    first = generate(tasks, SamplingParams(n=4, max_new_tokens=24, seed=2))
    contexts = [task + c.tokens + tokens(48) for task, group in zip(tasks, first) for c in group]
    for call in range(3):
        replies = generate(contexts, SamplingParams(n=1, max_new_tokens=24, seed=3 + call))
        contexts = [context + group[0].tokens + tokens(48) for context, group in zip(contexts, replies)]


def episode(generate: Generate, tokens: _Tokens, system: int) -> None:
    """4 episodes x 2 samples, 6 turns: each turn's prompt is the history and the environment's answer."""
    prompts = [tokens(96) for _ in range(4)]
    first = generate(prompts, SamplingParams(n=2, max_new_tokens=16, seed=4))
    histories = [prompt + c.tokens + tokens(32) for prompt, group in zip(prompts, first) for c in group]
    for turn in range(5):
        replies = generate(histories, SamplingParams(n=1, max_new_tokens=16, seed=5 + turn))
        histories = [h + group[0].tokens + tokens(32) for h, group in zip(histories, replies)]


PLAY: dict[str, Callable[[Generate, _Tokens, int], None]] = {
    "grpo_long_system": grpo_long_system, "agent_tree": agent_tree, "episode": episode}


def ideal_tokens(calls: list[Call]) -> int:
    """Tokens that must run at least once: every distinct prompt position (a trie over all calls' prompts) that no
    earlier decoding step ran, and every decoded token (a reply's but its last, which no forward runs)."""
    trie: dict = {}
    prompt_positions = decoded = 0
    for prompts, _, groups in calls:
        for prompt, group in zip(prompts, groups):
            node = trie
            for token in prompt:
                if token not in node:
                    node[token] = {}
                    prompt_positions += 1
                node = node[token]
            for completion in group:
                decoded += len(completion.tokens) - 1
                below = node
                for token in completion.tokens[:-1]:  # run by decoding: a later prompt through it prefills none
                    below = below.setdefault(token, {})
    return prompt_positions + decoded


def prefill_speed(model: torch.nn.Module, tokens: _Tokens, repeats: int = 3) -> float:
    """Tokens a CPU second of the model's own forward over one sequence of IDEAL_PROBE_TOKENS tokens (median; CPU
    time, as the paths are compared: what the process computed, not what it waited)."""
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([tokens(IDEAL_PROBE_TOKENS)], device=device)
    seconds = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            started = time.process_time()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            seconds.append(time.process_time() - started)
    return IDEAL_PROBE_TOKENS / statistics.median(seconds[1:])


def step_seconds(model: torch.nn.Module, rows: int, repeats: int = 3) -> float:
    """CPU seconds of one forward of `rows` one-token rows without context, their logits included (median): a
    decoding step's least."""
    device = model.get_input_embeddings().weight.device
    ids = torch.full((rows, 1), 7, device=device)
    seconds = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            started = time.process_time()
            model(input_ids=ids, use_cache=False)
            seconds.append(time.process_time() - started)
    return statistics.median(seconds[1:])


def floor_seconds(model: torch.nn.Module, calls: list[Call], prefill_tokens: int, speed: float,
                  steps: dict[int, float]) -> float:
    """The unique prefill tokens at prefill speed, and every decoding step of every call at `step_seconds` of its rows
    (`steps`: those measured so far, by row count)."""
    total = prefill_tokens / speed
    for _, params, groups in calls:
        rows = sum(len(group) for group in groups)
        if rows not in steps:
            steps[rows] = step_seconds(model, rows)
        total += (params.max_new_tokens - 1) * steps[rows]
    return total


def play(model: torch.nn.Module, workload: str, path: str, config: RolloutBenchConfig
         ) -> tuple[float, float, list[Call], EmbeddedSampler]:
    """One workload on a fresh sampler of `path`: wall and CPU seconds, the calls, the sampler (its counters)."""
    sampler = EmbeddedSampler(model, prefix_sharing="always" if path == "shared" else False)
    generate, calls = _played(sampler.generate)
    tokens = _Tokens(model.get_input_embeddings().num_embeddings, config.seed)
    started, cpu = time.perf_counter(), time.process_time()
    PLAY[workload](generate, tokens, config.system_tokens)
    return time.perf_counter() - started, time.process_time() - cpu, calls, sampler


def rollout_rows(config: RolloutBenchConfig) -> list[dict]:
    """One row per (workload, path): median seconds over the rounds, tokens run, against the ideal and each other."""
    unknown = sorted(set(config.workloads) - set(WORKLOADS))
    if unknown:
        raise ValueError(f"unknown rollout workloads {unknown}; known: {', '.join(WORKLOADS)}")
    if config.threads:
        torch.set_num_threads(config.threads)
    model = bench_model(config)  # type: ignore[arg-type]  (the same fields)
    vocab = model.get_input_embeddings().num_embeddings
    for path in PATHS:  # warm-up: kernels, and the shared path's probe of the model
        EmbeddedSampler(model, prefix_sharing="always" if path == "shared" else False).generate(
            [_Tokens(vocab, 1)(32)], SamplingParams(n=2, max_new_tokens=2, seed=0))
    speed = prefill_speed(model, _Tokens(vocab, config.seed))
    steps: dict[int, float] = {}
    rows = []
    for workload in config.workloads:
        seconds: dict[str, list[float]] = {p: [] for p in PATHS}
        cpu: dict[str, list[float]] = {p: [] for p in PATHS}
        played: dict[str, tuple[list[Call], EmbeddedSampler]] = {}
        for _ in range(config.repeats):
            for path in PATHS:
                wall, used, calls, sampler = play(model, workload, path, config)
                seconds[path].append(wall)
                cpu[path].append(used)
                played[path] = (calls, sampler)
        ideal = ideal_tokens(played["shared"][0])
        same = _same_share(played["padded"][0], played["shared"][0])
        for path in PATHS:
            calls, sampler = played[path]
            decoded = sum(len(c.tokens) - 1 for _, _, groups in calls for group in groups for c in group)
            floor = floor_seconds(model, calls, ideal - decoded, speed, steps)
            prompt_tokens = sum(len(p) for prompts, _, _ in calls for p in prompts)
            prefilled = sampler.counts.prefill_tokens if path == "shared" else prompt_tokens
            wall = statistics.median(seconds[path])
            rows.append({
                "workload": workload, "path": path, "calls": len(calls),
                "rows": sum(len(g) for _, _, gs in calls for g in gs), "prompt_tokens": prompt_tokens,
                "prefill_tokens": prefilled, "cached_tokens": sampler.counts.cached_tokens, "decoded_tokens": decoded,
                "model_tokens": prefilled + decoded, "ideal_tokens": ideal, "ideal_seconds": ideal / speed,
                "seconds": wall, "times": seconds[path], "cpu_seconds": statistics.median(cpu[path]),
                "vs_ideal": wall / (ideal / speed), "floor_seconds": floor, "vs_floor": wall / floor, "same_tokens": same,
                "unshared_calls": sampler.counts.unshared_calls})
        padded = statistics.median(seconds["padded"])
        for row in rows[-2:]:
            row["speedup"] = padded / row["seconds"]
    return rows


def _same_share(a: list[Call], b: list[Call]) -> float:
    """The share of completions both paths sampled alike."""
    pairs = [(x.tokens, y.tokens) for (_, _, ga), (_, _, gb) in zip(a, b) for xa, xb in zip(ga, gb)
             for x, y in zip(xa, xb)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def rollout_markdown(rows: list[dict]) -> str:
    """A line per (workload, path): calls, tokens run against the ideal's, time, CPU time, and on CPU time (what the
    process computed, whatever else the machine ran) against the ideal, the floor and the padded path."""
    lines = [("| workload | path | calls | rows | prompt tokens | prefilled | from cache | decoded | ideal tokens | "
              "time (s) | CPU (s) | CPU vs ideal | CPU vs floor | speedup (CPU) | same tokens |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        padded = next(x for x in rows if x["workload"] == r["workload"] and x["path"] == "padded")
        lines.append(f"| {r['workload']} | {r['path']} | {r['calls']} | {r['rows']} | {r['prompt_tokens']:,} | "
                     f"{r['prefill_tokens']:,} | {r['cached_tokens']:,} | {r['decoded_tokens']:,} | "
                     f"{r['ideal_tokens']:,} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} | "
                     f"{r['cpu_seconds'] / r['ideal_seconds']:.2f}x | {r['cpu_seconds'] / r['floor_seconds']:.2f}x | "
                     f"{padded['cpu_seconds'] / r['cpu_seconds']:.2f}x | {r['same_tokens']:.0%} |")
    return "\n".join(lines)


def describe(config: RolloutBenchConfig) -> dict:
    """The run's settings and machine, stored beside the results."""
    return {**asdict(config), "torch": torch.__version__, "threads": torch.get_num_threads()}

"""`treerl bench --mismatch URL`: how far a sampler's log-probs are from the trainer's at the same weights.

Beside the steps (docs/architecture.md): step 2's behaviour log-probs against step 3's recomputation, measured.

The server is told to load the model at `--model-path` (a weight push, as the trainer's first step does), samples
`samples` completions of each of a fixed set of chat prompts, and the trainer's engine (DfsEngine, in the trainer's
precision) recomputes every sampled token's log-prob at the same temperature. The measures are the trainer's own
`mismatch/*` (treerl.algo.mismatch, docs/mismatch.md) over all sampled tokens: what `treerl train` logs each step
against that server. These are not timings: load on the machine does not change them.
"""

from __future__ import annotations

import json
import math
import re
import urllib.request
from pathlib import Path
from typing import Any

import torch

from treerl.algo.mismatch import PREFIX, mismatch_metrics
from treerl.models import build_model
from treerl.rollout import Completion, CompletionsClient, Sampler, SamplingParams, load_tokenizer
from treerl.trainer.core.build import build_train_engine
from treerl.trainer.core.config import EngineConfig
from treerl.tree import TokenSequence

PROMPTS = (
    "What is 7 + 5? Answer with the number only.",
    "Name the capital of France.",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 3?",
    "Give a one-line tip for writing clean code.",
)
# trainer dtype (--dtype) -> (parameters, trainer.precision)
TRAINER_PRECISION = {"float32": (torch.float32, "fp32"), "float64": (torch.float64, "fp32"),
                     "bfloat16": (torch.float32, "bf16-mixed")}


def chat_prompts(model_path: str, count: int) -> list[list[int]]:
    """The first `count` of PROMPTS as the model's chat template renders a user turn (cycled when more are asked)."""
    tokenizer = load_tokenizer(model_path)
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          return_dict=False) for text in texts]


def sampled_sequences(prompts: list[list[int]], groups: list[list[Completion]]) -> list[TokenSequence]:
    """One sequence per completion: prompt + reply, the sampler's log-probs as `old_logprobs` on the reply (0 on the
    prompt, which is not measured), `loss_mask` 1 on the reply."""
    sequences = []
    for prompt, group in zip(prompts, groups):
        for completion in group:
            reply = len(completion.tokens)
            mask = torch.cat([torch.zeros(len(prompt)), torch.ones(reply)])
            behaviour = torch.cat([torch.zeros(len(prompt), dtype=torch.float64),
                                   torch.tensor(completion.logprobs, dtype=torch.float64)])
            sequences.append(TokenSequence(torch.tensor(prompt + completion.tokens),
                                           fields={"loss_mask": mask, "old_logprobs": behaviour}))
    return sequences


def served_dtype(url: str) -> str:
    """The dtype a vLLM server computes in, from its /server_info (VLLM_SERVER_DEV_MODE=1); '?' where unsaid."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/server_info", timeout=10) as answer:
            config = json.dumps(json.load(answer).get("vllm_config", ""))
    except (OSError, ValueError):
        return "?"
    found = re.search(r"\bdtype=torch\.(\w+)", config)
    return found.group(1) if found else "?"


def measure_sampler(sampler: Sampler, model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams,
                    precision: str = "fp32") -> dict[str, float]:
    """`mismatch/*` of `sampler`'s completions against `model`'s recomputation by the trainer's engine (DfsEngine,
    `precision` as trainer.precision, softmax(logits / params.temperature)), over every sampled token."""
    sequences = sampled_sequences(prompts, sampler.generate(prompts, params))
    engine = build_train_engine(EngineConfig(), params.temperature, precision=precision)
    train = [out["logprobs"] for out in engine.forward(model, sequences)]
    return mismatch_metrics(train, [s.fields["old_logprobs"] for s in sequences],
                            [s.fields["loss_mask"] > 0 for s in sequences])


def measure_mismatch(url: str, model_path: str, server_model: str, dtype: str, prompts: int, samples: int,
                     max_new_tokens: int, temperature: float, seed: int = 0) -> dict[str, Any]:
    """One row: the server at `url` serving `model_path` against the trainer's `dtype` recomputation."""
    client = CompletionsClient(url, model=server_model, setting="--mismatch", model_setting="--server-model")
    [info] = client.connect()  # before the model loads: a server that is not there is said at once
    client.push_weights(str(Path(model_path).resolve()), version=0)  # the weights measured are the server's
    parameters, precision = TRAINER_PRECISION[dtype]
    model = build_model(path=model_path, dtype=parameters).eval()
    params = SamplingParams(n=samples, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    metrics = measure_sampler(client, model, chat_prompts(model_path, prompts), params, precision)
    return {"server": f"{info.kind} {info.release} {served_dtype(url)}", "model": Path(model_path).name,
            "parameters_m": model.num_parameters() / 1e6, "trainer": f"{dtype} ({precision})",
            "temperature": temperature, "sequences": prompts * samples,
            **{key.removeprefix(PREFIX): value for key, value in metrics.items()}}


def _number(value: float) -> str:
    """Three significant digits, scientific below 1e-3 (k3 per token is often ~1e-6)."""
    return "0" if value == 0 else f"{value:.2e}" if abs(value) < 1e-3 or not math.isfinite(value) else f"{value:.3g}"


def mismatch_markdown(rows: list[dict[str, Any]]) -> str:
    """The table docs/benchmarks.md shows: one row per model measured."""
    header = ("| model | parameters | server | trainer | T | tokens | mean abs d | max abs d | KL k1 | KL k3 | "
              "ratio p01 | ratio p99 | ratio min | ratio max | outside [1/2, 2] | seq geo ratio min / max |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [_number(r[k]) for k in ("abs_logprob_diff_mean", "abs_logprob_diff_max", "kl_k1", "kl_k3",
                                         "ratio_p01", "ratio_p99", "ratio_min", "ratio_max", "ratio_outside_half_two")]
        lines.append(f"| {r['model']} | {r['parameters_m']:.1f} M | {r['server']} | {r['trainer']} | {r['temperature']:g} | "
                     f"{r['tokens']:.0f} | {' | '.join(cells)} | "
                     f"{r['seq_geo_ratio_min']:.4f} / {r['seq_geo_ratio_max']:.4f} |")
    return "\n".join(lines)

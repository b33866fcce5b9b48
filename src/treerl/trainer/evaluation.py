"""`treerl eval`: a model's held-out evaluation, alone or side by side with another model on the same items.

Beside the steps (docs/architecture.md): steps 1 and 2 for a model that is not trained.

    report = evaluate(config, compare="smollm2-135m-instruct")    # eval.json's content; table on stdout

The model (`model.path`) is a run's checkpoint (a checkpoint directory, or a run's output_dir: its newest complete
checkpoint; LoRA adapters merged), a transformers directory, a GGUF file or a packaged model; with `rollout.server_url`
it is what the server serves (model.path gives the tokenizer). It answers `trainer.eval_prompts` prompts of the task's
held-out items (`held_out_prompts`: the items a training run of the same config never draws), `eval.samples`
independent samples each (multi-turn episodes are not branched), `eval.prompts_per_call` prompts a sampler call, each
call with its own seed from `rollout.seed`. `compare` runs a second model the same way on the same prompts and seeds.
Scores: `treerl.rollout.rewards.scores`. Outputs, in `trainer.output_dir`: eval.json and eval_samples.jsonl (every
trajectory, and every dropped sample the rollout kept, with its reason).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from treerl.errors import UserError
from treerl.gguf_checkpoint import PACKAGED_MODELS, local_checkpoint
from treerl.models import check_device
from treerl.rollout import Rollout, RolloutStats, build_sampler
from treerl.rollout.conversations.images import image_processor
from treerl.rollout.rewards.scores import PromptScore, by_environment, paired, prompt_scores, summarise
from treerl.rollout.tasks.base import Prompt, rng_for
from treerl.rollout.tasks.heldout import HeldOut
from treerl.rollout.workflows.trajectories import sample_rows
from treerl.trainer.core.build import load_policy, policy_images, policy_tokenizer
from treerl.trainer.core.checkpoint import CONFIG_FILE, MANIFEST, latest_checkpoint, step_dirs
from treerl.trainer.core.config import Config, ConfigError, load_config
from treerl.trainer.core.export import checkpoint_policy
from treerl.trainer.core.inputs import check_writable_dir
from treerl.trainer.core.metrics import json_number
from treerl.trainer.core.precision import autocast_dtype
from treerl.trainer.core.run import set_threads
from treerl.tree import TokenSequence

EVAL_FILE = "eval.json"
SAMPLES_FILE = "eval_samples.jsonl"


@dataclass(frozen=True)
class ModelSource:
    """What `model.path` (or --compare) names: the checkpoint to load (a run's), or a path load_policy reads."""

    given: str | None  # as the user wrote it (None: the random-init model.shape)
    checkpoint: Path | None = None  # a treerl checkpoint: loaded with its run's own config (LoRA merged)

    @property
    def kind(self) -> str:
        if self.checkpoint is not None:
            return "checkpoint"
        if self.given is None:
            return "shape"
        if self.given in PACKAGED_MODELS:
            return "packaged"
        return "gguf" if self.given.lower().endswith(".gguf") or not (Path(self.given) / "config.json").exists() \
            else "transformers"


def model_source(path: str | None, key: str = "model.path") -> ModelSource:
    """`path` resolved: a run's output_dir means its newest complete checkpoint; a checkpoint directory is a run's
    checkpoint; anything else (a packaged name, a GGUF file, a transformers directory) is loaded as it is. A path that
    does not exist is a UserError naming `key`."""
    if path is None or path in PACKAGED_MODELS:
        return ModelSource(path)
    given = Path(path)
    if not given.exists():
        raise UserError(f"{key}={path!r} does not exist (a run's output_dir or checkpoint, a transformers directory, "
                        f"a GGUF file, or a packaged model: {', '.join(PACKAGED_MODELS)})")
    if (given / MANIFEST).is_file():
        return ModelSource(path, given)
    if (given / "checkpoints").is_dir():
        newest = latest_checkpoint(given)
        if newest is None:
            found = len(step_dirs(given))
            raise UserError(f"{key}={path!r}: a run's output_dir with no complete checkpoint ({found} incomplete)")
        return ModelSource(path, newest)
    return ModelSource(path)


def config_of_run(path: str, overrides: list[str]) -> Config | None:
    """A run's own config when `path` is a run's output_dir or checkpoint (its newest checkpoint's config.yaml), with
    `overrides` and model.path set to that checkpoint; None for anything else (a YAML file, a packaged config)."""
    if not Path(path).is_dir():
        return None
    source = model_source(path, "CONFIG")
    if source.checkpoint is None:
        return None
    return load_config(source.checkpoint / CONFIG_FILE, [f"model.path={source.checkpoint}", *overrides])


@dataclass
class Evaluated:
    """One model's evaluation: its label, each prompt's score, the rollout's counters and the trajectories' rows."""

    label: str
    kind: str
    scores: list[PromptScore]
    stats: RolloutStats
    held_out: HeldOut
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self, ks: list[int]) -> dict[str, Any]:
        """eval.json's entry for this model."""
        return {"model": self.label, "kind": self.kind, **summarise(self.scores, ks),
                "environments": by_environment(self.scores, ks), "dropped": dict(self.stats.dropped),
                "seconds": round(self.seconds, 1)}


def check_eval_config(config: Config, compare: str | None) -> ModelSource | None:
    """Everything `treerl eval` can refuse before a model is loaded: the config, the model paths, output_dir, the
    prompt count; the --compare model (resolved)."""
    config.check()
    if config.trainer.eval_prompts < 1:
        raise ConfigError("treerl eval asks trainer.eval_prompts held-out prompts: set it to 1 or more")
    model_source(config.model.path)
    if config.model.tokenizer_path is not None and config.model.tokenizer_path not in PACKAGED_MODELS \
            and not Path(config.model.tokenizer_path).exists():
        raise ConfigError(f"model.tokenizer_path={config.model.tokenizer_path!r} does not exist")
    check_writable_dir(Path(config.trainer.output_dir), "trainer.output_dir")
    if compare is None:
        return None
    if config.rollout.server_urls:
        raise UserError("--compare samples both models in this process: drop rollout.server_url (or evaluate each "
                        "model on its own server and compare their eval.json)")
    return model_source(compare, "--compare")


def evaluate(config: Config, compare: str | None = None) -> dict[str, Any]:
    """Evaluate `model.path` (and `compare`) on the held-out prompts; print the table, write eval.json and
    eval_samples.jsonl into trainer.output_dir; return eval.json's content."""
    other = check_eval_config(config, compare)
    device = check_device(config.model.device, "model.device") if config.model.device != "auto" else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    before, chosen = set_threads(config.trainer, device, on_servers=bool(config.rollout.server_urls))
    try:
        if chosen is not None:
            tqdm.write(chosen)
        first = evaluate_one(config, model_source(config.model.path), device)
        results = [first]
        if other is not None:
            results.append(evaluate_one(config, other, device))
    finally:
        torch.set_num_threads(before)
    report = write_report(config, results)
    tqdm.write(table(config, results))
    return report


def evaluate_one(config: Config, source: ModelSource, device: torch.device) -> Evaluated:
    """One model's samples of the held-out prompts, with a progress bar."""
    model, tokenizer = load_model(config, source, device)
    label = f"{config.rollout.server_urls[0]} ({config.rollout.server_model})" if config.rollout.server_urls else \
        source.given or f"{config.model.shape} (random init, seed {config.model.seed})"
    settings = replace(config.rollout, group_size=config.eval.samples, branch_at=[],
                       prompts_per_step=config.eval.prompts_per_call)
    sampler = build_sampler(settings, model, autocast=autocast_dtype(config.trainer.precision))
    images = policy_images(config.model, len(tokenizer)) if model is None else image_processor(
        model.config, str(source.checkpoint) if source.checkpoint is not None else
        local_checkpoint(source.given, config.model.gguf_file) if source.given is not None else None)
    rollout = Rollout(settings, tokenizer, sampler, images, held_out=True)
    started = time.perf_counter()
    try:
        prompts = rollout.task.held_out_prompts(config.trainer.eval_prompts)
        task = config.rollout.env if config.rollout.task == "env" else config.rollout.task
        tqdm.write(f"{label}: {len(prompts)} prompts of {task} x {config.eval.samples} samples; the prompts ask "
                   f"{rollout.task.held_out.how}")
        sequences, stats = sample_prompts(rollout, prompts, config, label)
    finally:
        rollout.close()
        close_task(rollout.task)
    scores = prompt_scores(sequences, config.eval.samples, config.eval.pass_reward, [(p.id, p.env) for p in prompts])
    return Evaluated(label, "server" if config.rollout.server_urls else source.kind, scores, stats,
                     rollout.task.held_out, sample_rows(sequences, stats, tokenizer), time.perf_counter() - started)


def load_model(config: Config, source: ModelSource, device: torch.device) -> tuple[Any, Any]:
    """The model (None with a server: it samples) and its tokenizer."""
    if config.rollout.server_urls:
        return None, policy_tokenizer(config.model)
    if source.checkpoint is not None:
        model, tokenizer = checkpoint_policy(source.checkpoint, device)
    else:
        model, tokenizer = load_policy(replace(config.model, path=source.given, lora=replace(config.model.lora, rank=0)),
                                       device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def sample_prompts(rollout: Rollout, prompts: list[Prompt], config: Config, label: str
                   ) -> tuple[list[TokenSequence], RolloutStats]:
    """Every prompt's samples, `eval.prompts_per_call` prompts a call (each call's seed from rollout.seed and its
    index), with a progress bar over the prompts; the counters of all calls together."""
    per_call = config.eval.prompts_per_call
    sequences: list[TokenSequence] = []
    stats = RolloutStats()
    show = config.trainer.progress
    with tqdm(total=len(prompts), desc=f"eval {label}"[:60], unit="prompt", disable=not show, dynamic_ncols=True) as bar:
        for call, start in enumerate(range(0, len(prompts), per_call)):
            chunk = prompts[start: start + per_call]
            batch = rollout.sample(chunk, rng_for("eval", config.rollout.seed, call).getrandbits(62))
            sequences += batch.sequences
            add_stats(stats, batch.stats)
            bar.update(len(chunk))
            bar.set_postfix(reward=f"{stats.reward_mean:.3f}", refresh=False)
    return sequences, stats


def add_stats(total: RolloutStats, part: RolloutStats) -> None:
    """Add one call's counters to the evaluation's."""
    for name in ("prompts", "samples", "sequences", "model_calls", "generated_tokens", "truncated_replies",
                 "context_limit", "seconds"):
        setattr(total, name, getattr(total, name) + getattr(part, name))
    total.rewards += part.rewards
    total.dropped.update(part.dropped)
    total.dropped_samples += part.dropped_samples


def close_task(task: Any) -> None:
    """Stop what an environment's task started (a verifiers worker), if it has anything to stop."""
    for member in getattr(task, "members", {}).values():
        if callable(getattr(member.task, "close", None)):
            member.task.close()


def write_report(config: Config, results: list[Evaluated]) -> dict[str, Any]:
    """eval.json (and eval_samples.jsonl: every model's rows, each with its model) in trainer.output_dir."""
    ks = list(config.eval.k)
    report: dict[str, Any] = {
        "task": config.rollout.env if config.rollout.task == "env" else config.rollout.task,
        "held_out": results[0].held_out.summary(config.trainer.eval_prompts),
        "samples_per_prompt": config.eval.samples, "k": ks, "pass_reward": config.eval.pass_reward,
        "temperature": config.rollout.temperature, "seed": config.rollout.seed,
        "models": [r.summary(ks) for r in results],
    }
    if len(results) == 2:
        report["compare"] = paired(results[0].scores, results[1].scores, ks)
    out = Path(config.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / EVAL_FILE).write_text(json.dumps(plain(report), indent=2) + "\n")
    with open(out / SAMPLES_FILE, "w") as f:
        for result in results:
            f.writelines(json.dumps(plain({"model": result.label, **row})) + "\n" for row in result.rows)
    return report


def plain(value: Any) -> Any:
    """`value` for JSON: NaN and infinities as null, nested."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return json_number(value) if isinstance(value, float) else value


def cell(mean: float, error: float | None = None, signed: bool = False) -> str:
    """A figure for the table: "0.512 ± 0.041" ("-" when there is none)."""
    if mean is None or math.isnan(mean):
        return "-"
    text = f"{mean:+.3f}" if signed else f"{mean:.3f}"
    return text if error is None or math.isnan(error) else f"{text} ± {error:.3f}"


def table(config: Config, results: list[Evaluated]) -> str:
    """The figures of each model (and each environment, when there are several), and with two models their
    difference with its standard error, as aligned text."""
    ks = list(config.eval.k)
    names = ["reward_mean", f"mean@{config.eval.samples}", *[f"pass@{k}" for k in ks]]
    headers = ["model", "prompts", "kept", *names]
    lines: list[list[str]] = []
    for result in results:
        whole = summarise(result.scores, ks)
        lines.append([result.label, str(whole["prompts"]), f"{whole['kept']}/{whole['samples']}",
                      *[cell(whole[n], whole[f"{n}_se"]) for n in names]])
        envs = by_environment(result.scores, ks)
        if len(envs) > 1:
            for env, part in envs.items():
                lines.append([f"  {env}", str(part["prompts"]), f"{part['kept']}/{part['samples']}",
                              *[cell(part[n], part[f"{n}_se"]) for n in names]])
    if len(results) == 2:
        diff = paired(results[0].scores, results[1].scores, ks)
        lines.append(["difference (first - second)", "", "", *[cell(diff[n]["diff"], diff[n]["se"], True)
                                                               for n in names]])
    widths = [max(len(row[i]) for row in [headers, *lines]) for i in range(len(headers))]
    text = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    text += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines]
    for result in results:
        metrics = summarise(result.scores, ks)["metrics"]
        if metrics:
            text.append(f"{result.label}: " + ", ".join(f"{name} {value:.3f}" for name, value in metrics.items()))
        if result.stats.dropped:
            text.append(f"{result.label}: dropped {dict(result.stats.dropped)} (counted as failing; reasons in "
                        f"{Path(config.trainer.output_dir) / SAMPLES_FILE})")
    return "\n".join(text)

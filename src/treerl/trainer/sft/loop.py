"""Supervised fine-tuning on tree-shaped trajectories: every path of a branching conversation is a sequence.

Steps 2 to 6 (docs/architecture.md) for SFT: no sampling, no advantages.

    for step in steps:
        batch = data.batch(step)                  # all paths of `sft.conversations_per_step` conversations
        update(run, batch, step, sft_loss)        # the tree engine computes each shared prefix once

The loss is algo.loss=sft (token-mean negative log-likelihood of the assistant tokens, over the
whole global batch). The mean loss on the first `sft.eval_conversations` conversations is
printed before the first step and after the last.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from treerl.algo import LossNormalizer, build_loss
from treerl.trainer.core.config import Config, ConfigError
from treerl.trainer.core.metrics import tree_metrics
from treerl.trainer.core.run import Run
from treerl.trainer.core.update import update
from treerl.trainer.sft.data import SFTData, chat_format, example_path, load_conversations
from treerl.tree import PrefixTree, TokenSequence

# `treerl sft`'s own defaults, applied under the user's config.
SFT_DEFAULTS = ("algo.loss=sft", "algo.entropy_coef=0.0", "trainer.output_dir=runs/sft", "trainer.eval_prompts=0")


@dataclass
class SFTResult:
    """What `treerl sft` reports at the end (also written to output_dir/summary.json)."""

    loss_start: float  # mean loss on the evaluation conversations before training (NaN without them)
    loss_end: float  # ... after training
    train_loss_first: float  # the first step's training loss
    train_loss_last: float  # the last step's training loss
    steps: int  # steps done (fewer than trainer.steps if a signal stopped the run)
    seconds: float
    output_dir: str
    nonfinite_skipped: int = 0  # optimizer steps skipped for a NaN/inf loss or gradient (trainer.nonfinite=skip)
    stopped_by: str | None = None  # "SIGINT" / "SIGTERM": stopped early, after a checkpoint


def sft(config: Config) -> SFTResult:
    """Fine-tune as configured; returns the loss before and after."""
    if config.algo.loss != "sft":
        raise ConfigError(f"treerl sft trains with algo.loss=sft, not {config.algo.loss!r}")
    started = time.perf_counter()
    run = Run.start(config)
    try:
        chat = chat_format(run.tokenizer, config.sft.chat_format, run.images)
        conversations = load_conversations(config.sft.data_path or example_path(), chat, config.sft.max_line_bytes)
        data = SFTData(conversations, config.sft.conversations_per_step, config.trainer.seed, config.sft.shuffle)
        held = [s for c in conversations[: config.sft.eval_conversations] for s in c.sequences]
        stats = PrefixTree.build([s for c in conversations for s in c.counted]).stats()
        run.report.print(f"{len(conversations)} conversations, {stats.sequences} paths, {stats.flat_tokens} tokens "
                  f"({stats.compression:.2f}x shared as a tree)")
        run.check_model(max(len(s) for c in conversations for s in c.counted), setting=None)
        loss_start = evaluate(run, held, run.start_step, "start")
        losses = []
        for step in run.steps():
            step_started = time.perf_counter()
            batch = data.batch(step)
            metrics = tree_metrics(batch)
            metrics.update(update(run, batch, step, lambda minibatch: sft_loss(config, minibatch)))
            metrics["time/step"] = time.perf_counter() - step_started
            losses.append(metrics["train/loss"])
            run.end_step(step, metrics, {"loss": metrics["train/loss"]})
        nan = float("nan")
        loss_end = nan if run.stopped_by else evaluate(run, held, config.trainer.steps, "end")
        result = SFTResult(loss_start, loss_end, losses[0] if losses else nan, losses[-1] if losses else nan,
                           run.steps_done, time.perf_counter() - started, config.trainer.output_dir,
                           run.loop_state.nonfinite_skipped, run.stopped_by)
        run.report.summarise(asdict(result), f"training loss: first step {result.train_loss_first:.4f} -> "
                      f"last step {result.train_loss_last:.4f}")
        return result
    finally:
        run.finish()


def sft_loss(config: Config, minibatch: list[TokenSequence]):
    """Token-mean NLL of the assistant tokens, normalised over the whole (global) minibatch."""
    return build_loss(config.algo, LossNormalizer.from_sequences(minibatch))


def evaluate(run: Run, sequences: list[TokenSequence], step: int, label: str) -> float:
    """Mean NLL per trained token of `sequences` under the current policy (no gradients); logged and printed."""
    if not sequences:
        return float("nan")
    with run.actor.dp.gathered() as policy, torch.no_grad():
        outputs = run.actor.engine.forward(policy, sequences)
    total = sum(float((-out["logprobs"] * seq.fields["loss_mask"].to(out["logprobs"])).sum())
                for seq, out in zip(sequences, outputs))
    loss = total / float(sum(seq.fields["loss_mask"].sum() for seq in sequences))
    run.report.log(step, {"eval/loss": loss})
    run.report.print(f"mean loss at {label}: {loss:.4f} per assistant token ({len(sequences)} paths)")
    return loss

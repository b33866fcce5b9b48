"""What was sampled, as people read it: each trajectory's prompt, reply (or turns), reward and named metrics, and the
dropped samples with their reason; the rows of a run's samples.jsonl (`trainer.log_samples`) and of `treerl eval`'s.

After step 2 (docs/architecture.md): a step's samples, for people.

    rows = sample_rows(batch.sequences, batch.stats, tokenizer, limit=4)   # [{"group", "trajectory", "prompt", ...}]

A trajectory's text is decoded from the tokens the model saw and wrote (special tokens kept: the chat template's
markers show where each message starts): its `prompt` (the first call's context), then its `reply` (one model
call) or its `turns` (several: each turn's `reply`, and from the second on what the environment or agent `shown`
before it, i.e. the context the call added to the previous one; a call whose context does not extend the previous
call's shows its whole context).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from typing import Any

from transformers import PreTrainedTokenizerBase

from treerl.rollout.workflows.stats import RolloutStats
from treerl.tree import TokenSequence


def trajectories(sequences: list[TokenSequence]) -> dict[str, list[TokenSequence]]:
    """Each trajectory's sequences (one per model call), in turn order, trajectories in the order they came."""
    out: dict[str, list[TokenSequence]] = defaultdict(list)
    for seq in sequences:
        out[seq.info.get("trajectory", seq.name)].append(seq)
    return {name: sorted(calls, key=lambda seq: seq.info.get("turn", 0)) for name, calls in out.items()}


def reply_start(seq: TokenSequence) -> int:
    """Where a model call's reply starts: its first trained token (the context is never trained)."""
    trained = seq.fields["loss_mask"].nonzero()
    return int(trained[0]) if len(trained) else len(seq.tokens)


def trajectory_row(calls: list[TokenSequence], tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """One trajectory as a row: ids, environment, reward, named metrics, prompt and reply or turns."""
    first, last = calls[0], calls[-1]

    def text(tokens: Any) -> str:
        return tokenizer.decode(tokens.tolist(), skip_special_tokens=False)

    row: dict[str, Any] = {"group": first.info.get("group"), "trajectory": first.info.get("trajectory", first.name),
                           "env": first.info.get("env"), "reward": last.info.get("reward"),
                           "metrics": dict(last.info.get("env_metrics", {})),
                           "prompt": text(first.tokens[: reply_start(first)])}
    if len(calls) == 1:
        row["reply"] = text(first.tokens[reply_start(first):])
        row["finish_reason"] = first.info.get("finish_reason")
        return row
    turns = []
    for k, call in enumerate(calls):
        start = reply_start(call)
        turn: dict[str, Any] = {}
        if k:
            before = calls[k - 1].tokens
            extends = len(before) <= start and call.tokens[: len(before)].equal(before)
            turn["shown"] = text(call.tokens[len(before) if extends else 0: start])
        turn["reply"] = text(call.tokens[start:])
        turns.append(turn)
    row["turns"] = turns
    return row


def spread(names: list[str], groups: list[str], limit: int | None) -> list[str]:
    """`limit` of the trajectories `names` (all: None), taken round-robin over their groups (each prompt's first
    sample, then each one's second, ...) so that the rows show as many prompts as they can."""
    by_group: dict[str, list[str]] = defaultdict(list)
    for name, group in zip(names, groups):
        by_group[group].append(name)
    ordered = [g[k] for k in range(max(map(len, by_group.values()), default=0)) for g in by_group.values() if k < len(g)]
    return ordered if limit is None else ordered[:limit]


def sample_rows(sequences: list[TokenSequence], stats: RolloutStats, tokenizer: PreTrainedTokenizerBase,
                limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of `limit` kept trajectories (None: all), spread over the prompts, then every dropped sample the stats
    kept (`RolloutStats.dropped_samples`, with its text and reason)."""
    calls = trajectories(sequences)
    chosen = spread(list(calls), [c[0].info.get("group", "") for c in calls.values()], limit)
    rows = [trajectory_row(calls[name], tokenizer) for name in chosen]
    rows += [{"dropped": sample.reason, **{k: v for k, v in asdict(sample).items() if k != "reason"}}
             for sample in stats.dropped_samples]
    return rows

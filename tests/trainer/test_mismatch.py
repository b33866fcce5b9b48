"""Mismatch metrics in a run (sampler against trainer at the same weights) and the correction presets in treerl train."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import FAST
from support import free_port, treerl_serve
from test_rl import metrics_rows

from treerl.distributed import close_distributed, exit_process
from treerl.rollout import Rollout, build_sampler
from treerl.trainer import ConfigError, load_config, train
from treerl.trainer.core.run import Run
from treerl.trainer.rl.learn import collect, learn

MEASURES = ("tokens", "abs_logprob_diff_mean", "abs_logprob_diff_max", "kl_k1", "kl_k3", "ratio_p01", "ratio_p05",
            "ratio_p50", "ratio_p95", "ratio_p99", "ratio_min", "ratio_max", "ratio_outside_half_two",
            "seq_geo_ratio_mean", "seq_geo_ratio_min", "seq_geo_ratio_max")


def trained_rows(output_dir: Path) -> list[dict]:
    return [row for row in metrics_rows(output_dir) if "train/loss" in row]


@pytest.mark.parametrize("recompute", ["false", "true"])
def test_a_run_measures_the_embedded_sampler_against_the_trainer_every_step(tiny_config, tmp_path, recompute):
    """trainer.mismatch_metrics=true: every step logs each measure over its trained tokens (against a pass of its own,
    or the recomputed old_logprobs); the embedded float32 sampler and the tree engine agree to rounding; summary.json
    holds the run's summary."""
    train(tiny_config("trainer.steps=2", "trainer.mismatch_metrics=true", f"trainer.recompute_logprobs={recompute}"))
    rows = trained_rows(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        assert {f"mismatch/{m}" for m in MEASURES} <= row.keys()
        assert row["mismatch/tokens"] == row["batch/trained_tokens"] > 0
        assert row["mismatch/abs_logprob_diff_max"] < 1e-3 and row["mismatch/ratio_outside_half_two"] == 0.0
        assert row["mismatch/ratio_min"] <= row["mismatch/ratio_p01"] <= row["mismatch/ratio_p50"] <= row[
            "mismatch/ratio_p99"] <= row["mismatch/ratio_max"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["mismatch"]
    assert summary["steps"] == 2 and summary["tokens"] == sum(row["mismatch/tokens"] for row in rows)
    assert summary["abs_logprob_diff_max"] == max(row["mismatch/abs_logprob_diff_max"] for row in rows)


def test_a_run_without_servers_or_a_preset_measures_nothing(tiny_config, tmp_path):
    train(tiny_config("trainer.steps=1"))
    assert not any(key.startswith("mismatch/") for key in trained_rows(tmp_path / "run")[0])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["mismatch"] == {}


@pytest.mark.parametrize("loss", ["grpo", "gspo", "decoupled_ppo"])
def test_a_preset_trains_and_says_what_it_did(tiny_config, tmp_path, loss):
    """A decoupled preset on a loss without a proximal pass of its own gets one; its weights on an on-policy float32
    batch are all but 1."""
    train(tiny_config("trainer.steps=1", f"algo.loss={loss}", "algo.rollout_correction=decoupled_token_rs"))
    row = trained_rows(tmp_path / "run")[0]
    assert row["rollout_correction/dropped"] == 0.0 and row["rollout_correction/weight_mean"] == 1.0
    assert row["mismatch/tokens"] > 0


def test_recomputed_old_log_probs_leave_a_preset_nothing_to_correct(tiny_config):
    with pytest.raises(ConfigError, match="algo.rollout_correction=decoupled_token_is corrects the sampler's log-probs, "
                                          "which trainer.recompute_logprobs=true replaces"):
        tiny_config("algo.rollout_correction=decoupled_token_is", "trainer.recompute_logprobs=true")


@pytest.mark.slow
def test_a_bfloat16_server_against_a_float32_trainer_is_a_measured_mismatch(tiny_config, tmp_path):
    """`treerl serve --dtype bfloat16` samples for a float32 trainer of the same weights: the measures see it, far above
    the float32 server's rounding."""
    kl = {}
    for dtype in ("float32", "bfloat16"):
        with treerl_serve("--seed", "0", "--dtype", dtype) as url:
            train(tiny_config(f"rollout.server_url={url}", "trainer.steps=1",
                              f"rollout.weights_dir={tmp_path / 'pushed' / dtype}", name=dtype))
        kl[dtype] = trained_rows(tmp_path / dtype)[0]["mismatch/kl_k3"]
    assert kl["float32"] < 1e-10 and kl["bfloat16"] > 1e-8, kl  # ~4e-14 and ~4e-7 on a tiny random-init model


NOISE = 0.5  # the sampler's log-probs are moved down by up to this: a real mismatch, as another precision gives


def learn_with_a_mismatch(output_dir: str, *overrides: str, batch_out: list | None = None
                          ) -> tuple[dict[str, float], list[float]]:
    """One sampled batch learnt as the asynchronous loop's single update does (`proximal_in_loss`: the trainer's
    log-probs come from the update's own forward), its behaviour log-probs moved by a seeded noise on every rank alike;
    the step's metrics and each trained token's log pi_train - log pi_behav by construction (the batch's sequences are
    added to `batch_out`)."""
    config = load_config(None, [*FAST, "trainer.steps=1", "trainer.mismatch_metrics=true",
                                f"trainer.output_dir={output_dir}", *overrides])
    run = Run.start(config)
    rollout = Rollout(config.rollout, run.tokenizer, build_sampler(config.rollout, run.policy), run.images)
    try:
        batch = collect(run, rollout, 0)
        moved = []
        for i, seq in enumerate(batch.sequences):
            shift = NOISE * torch.rand(len(seq), generator=torch.Generator().manual_seed(i))
            seq.fields["old_logprobs"] = seq.fields["old_logprobs"] - shift.to(seq.fields["old_logprobs"].dtype)
            moved += shift[seq.fields["loss_mask"] > 0].tolist()
        if batch_out is not None:
            batch_out += batch.sequences
        return learn(run, batch, None, 0, proximal_in_loss=True), moved
    finally:
        rollout.close()
        run.finish()


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    metrics, _ = learn_with_a_mismatch(os.path.join(out_dir, "ranks"), "algo.loss=decoupled_ppo",
                                       "trainer.data_parallel=ddp")
    if rank == 0:
        Path(out_dir, "ranks.json").write_text(json.dumps(metrics))
    assert close_distributed() == "gloo"
    exit_process(0)  # a spawned rank's end, as the CLI's


@pytest.mark.slow
def test_two_ranks_measure_every_ranks_tokens(tmp_path):
    """2 gloo ranks, each updating on its half of the batch: the mismatch measures count the other rank's tokens with
    their own gap (the ranks share the trainer's log-probs their updates computed), as one process does, and equal the
    noise put in (to the sampler's rounding against the trainer's)."""
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    single, moved = learn_with_a_mismatch(str(tmp_path / "single"), "algo.loss=decoupled_ppo")
    assert ranks["mismatch/tokens"] == single["mismatch/tokens"] == len(moved) > 0
    assert ranks["mismatch/abs_logprob_diff_mean"] == pytest.approx(sum(moved) / len(moved), rel=1e-4)
    assert ranks["mismatch/ratio_min"] == pytest.approx(math.exp(min(moved)), rel=1e-4)
    for key, value in single.items():
        if key.startswith("mismatch/"):
            assert ranks[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_a_preset_in_the_single_update_takes_the_proximal_pass(tmp_path):
    """A decoupled preset fixes its weights and rejections before the update, so the asynchronous loop's single update
    runs a proximal pass for it: the rejection sees the real gap, not the sampler's own log-probs copied."""
    metrics, moved = learn_with_a_mismatch(str(tmp_path), "algo.loss=grpo",
                                           "algo.rollout_correction=decoupled_token_rs", "algo.rollout_rs_threshold=1.2")
    outside = sum(1 for shift in moved if shift > math.log(1.2)) / len(moved)
    assert 0 < outside < 1 and metrics["rollout_correction/dropped"] == pytest.approx(outside)


def test_a_sequence_level_preset_weighs_each_branch_of_a_multi_turn_episode_as_one_sequence(tmp_path):
    """guess_number's episodes fork at turn 1: each branch (`info["trajectory"]`, carrying its copy of the call before
    the fork) gets the weight of all its calls' tokens together, the same on every call, as verl weighs one multi-turn
    sequence; the copies of one call in two branches get their branches' weights."""
    batch: list = []
    learn_with_a_mismatch(str(tmp_path), "rollout.task=guess_number", "rollout.group_size=2", "algo.loss=grpo",
                          "algo.rollout_correction=decoupled_seq_is", "algo.rollout_is_threshold=1e6",
                          batch_out=batch)
    branches: dict = {}
    for seq in batch:
        branches.setdefault((seq.info["group"], seq.info["trajectory"]), []).append(seq)
    assert max(len(calls) for calls in branches.values()) >= 2  # a multi-turn trajectory to weigh
    weights = set()
    for calls in branches.values():
        log_r = sum(float(((seq.fields["prox_logprobs"] - seq.fields["old_logprobs"]).double()
                           * seq.fields["loss_mask"]).sum()) for seq in calls)
        for seq in calls:
            trained = seq.fields["loss_mask"] > 0
            assert seq.fields["rollout_weight"][trained].double().tolist() == pytest.approx(
                [math.exp(log_r)] * int(trained.sum()), rel=1e-5)
        weights.add(round(math.exp(log_r), 6))
    assert len(weights) == len(branches)  # the branches' weights differ: a copy of a shared call is weighed twice

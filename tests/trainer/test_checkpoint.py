"""Checkpoints and resuming: one verified directory per step (policy, critic, state), read without unpickling code;
resume=auto skips a broken newest one; pruning touches only this run's; new settings on resume take effect."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from treerl.errors import CheckpointError
from treerl.trainer import train
from treerl.trainer.core import checkpoint
from treerl.trainer.core.checkpoint import (
    MANIFEST,
    checkpoint_dir,
    prune_checkpoints,
    read_state,
    step_dirs,
    verify_checkpoint,
)
from treerl.trainer.core.loop_state import LoopState
from treerl.trainer.core.run import Run


def rows(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_checkpoint_is_one_verified_directory_with_policy_critic_state_and_eos(tiny_config, tmp_path):
    train(tiny_config("trainer.steps=1", "algo.loss=ppo"))
    step = checkpoint_dir(tmp_path / "run", 1)
    manifest = verify_checkpoint(step)
    assert manifest["step"] == 1 and manifest["parts"] == ["", "critic"] and manifest["run_id"]
    for name in ("model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt", "config.yaml",
                 "critic/model.safetensors", "critic/trainer_state.pt"):
        assert name in manifest["files"] and len(manifest["files"][name]["sha256"]) == 64, name
    state = torch.load(step / "trainer_state.pt", weights_only=True)  # tensors and plain values only
    assert state["step"] == 1 and set(state) == {"step", "optimizer", "scheduler", "rng", "loop"}
    assert set(read_state(step / "critic" / "trainer_state.pt")) == {"step", "optimizer", "scheduler"}
    eos = json.loads((step / "tokenizer_config.json").read_text())["eos_token"]
    eos_id = json.loads((step / "tokenizer.json").read_text())["model"]["vocab"][eos]
    assert json.loads((step / "config.json").read_text())["eos_token_id"] == eos_id  # generate stops at <eos>
    assert json.loads((step / "generation_config.json").read_text())["eos_token_id"] == eos_id
    assert not list((tmp_path / "run" / "checkpoints").glob(".*"))  # no temporary directory left


def test_the_loop_state_is_written_as_plain_values_and_older_ones_still_load(tmp_path):
    """On disk the loop state is the dict of its fields (loadable with weights_only=True); a checkpoint of an older
    treerl (a field missing, a key no longer known) loads with the missing field at its default."""
    state = LoopState(skipped_steps=2, nonfinite_skipped=1, cost_samples=[([1.0, 2.0, 3.0], 0.5)], lora_base=[0.25])
    torch.save({"loop": state.to_dict()}, tmp_path / "state.pt")
    assert LoopState.from_dict(torch.load(tmp_path / "state.pt", weights_only=True)["loop"]) == state
    older = {"skipped_steps": 3, "cost_samples": [], "retired_counter": 7}
    assert LoopState.from_dict(older) == LoopState(skipped_steps=3)
    shared = LoopState()
    held = shared  # what the balancer and the non-finite guard hold
    shared.update(state)
    assert held == state and held is shared


def test_a_kill_while_a_checkpoint_replaces_its_step_keeps_the_previous_copy(tiny_config, tmp_path, monkeypatch):
    """A step's checkpoint written again (a resumed run saving over a broken one): killed just before the new copy
    is renamed into place, the previous copy survives and the next run resumes from it."""
    run = Run.start(tiny_config("trainer.steps=2"))
    try:
        run.save(1)
        rename = os.replace

        def killed_before_the_new_copy_lands(source, target):
            if Path(source).name.startswith(".tmp-"):
                raise KeyboardInterrupt("SIGKILL")
            rename(source, target)

        monkeypatch.setattr(checkpoint.os, "replace", killed_before_the_new_copy_lands)
        with pytest.raises(KeyboardInterrupt):
            run.save(1)
        monkeypatch.setattr(checkpoint.os, "replace", rename)
    finally:
        run.finish()
    resumed = Run.start(tiny_config("trainer.steps=2", "trainer.resume=auto"))
    resumed.finish()
    assert resumed.start_step == 1
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_000001"]


def test_resume_auto_skips_a_broken_newest_checkpoint_naming_it(tiny_config, tmp_path, caplog):
    train(tiny_config("trainer.steps=2", "trainer.save_every=1", "trainer.keep_checkpoints=0"))
    newest = checkpoint_dir(tmp_path / "run", 2)
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])
    with caplog.at_level(logging.WARNING):
        run = Run.start(tiny_config("trainer.steps=3", "trainer.resume=auto"))
    run.finish()
    assert run.start_step == 1
    assert f"skipping checkpoint {newest}: model.safetensors has" in caplog.text


def test_pruning_deletes_only_this_runs_older_checkpoints(tmp_path):
    for step, run_id in ((1, "other"), (2, "mine"), (3, "mine"), (4, "mine"), (9, "other")):
        folder = checkpoint_dir(tmp_path, step)
        folder.mkdir(parents=True)
        (folder / MANIFEST).write_text(json.dumps({"step": step, "run_id": run_id, "files": {}}))
    prune_checkpoints(tmp_path, keep=2, run_id="mine")
    assert [s for s, _ in step_dirs(tmp_path)] == [1, 3, 4, 9]


def test_resuming_with_a_new_learning_rate_uses_it_and_says_so(tiny_config, tmp_path, caplog):
    """trainer.lr, betas and critic.lr from the new config: in the optimizer, the schedule and the logged lr."""
    common = ["algo.loss=ppo", "trainer.save_every=1"]
    train(tiny_config("trainer.steps=1", "trainer.lr=0.001", *common))
    with caplog.at_level(logging.WARNING):
        train(tiny_config("trainer.steps=2", "trainer.resume=auto", "trainer.lr=0.005", "trainer.betas=[0.8,0.99]",
                          "critic.lr=0.002", *common))
    assert "trainer.lr: 0.001 -> 0.005" in caplog.text and "critic.lr: None -> 0.002" in caplog.text
    (first,), (second,) = ([r for r in rows(tmp_path / "run") if r["step"] == s and "train/lr" in r] for s in (0, 1))
    assert first["train/lr"] == 0.001 and second["train/lr"] == 0.005 and second["critic/lr"] == 0.002
    run = Run.start(tiny_config("trainer.steps=3", "trainer.resume=auto", "trainer.lr=0.005",
                                "trainer.betas=[0.8,0.99]", "critic.lr=0.002", *common))
    run.finish()
    group = run.actor.optimizer.param_groups[0]
    assert group["lr"] == 0.005 and group["betas"] == (0.8, 0.99) and run.actor.scheduler.base_lrs == [0.005]
    assert run.critic.optimizer.param_groups[0]["lr"] == 0.002


def test_resume_lists_exactly_the_settings_that_changed(tiny_config, caplog):
    train(tiny_config("trainer.steps=1"))
    with caplog.at_level(logging.WARNING):
        run = Run.start(tiny_config("trainer.steps=2", "trainer.resume=auto"))
    run.finish()
    assert run.start_step == 1 and "(they are used from now on): trainer.steps: 1 -> 2\n" in caplog.text


def test_overwrite_replaces_the_earlier_run_and_keeps_other_files(tiny_config, tmp_path):
    train(tiny_config("trainer.steps=2", "trainer.save_every=1", "trainer.keep_checkpoints=0"))
    (tmp_path / "run" / "notes.txt").write_text("mine")
    result = train(tiny_config("trainer.steps=1", "trainer.overwrite=true"))
    assert result.steps == 1 and [s for s, _ in step_dirs(tmp_path / "run")] == [1]
    assert [r["step"] for r in rows(tmp_path / "run") if "train/loss" in r] == [0]
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_resume_auto_without_any_checkpoint_starts_afresh(tiny_config, tmp_path, caplog):
    """The earlier attempt died before its first checkpoint: there is nothing to lose but its metrics."""
    train(tiny_config("trainer.steps=1", "trainer.save_final=false"))
    with caplog.at_level(logging.WARNING):
        result = train(tiny_config("trainer.steps=1", "trainer.resume=auto"))
    assert result.steps == 1 and "holds no checkpoint" in caplog.text
    assert [r["step"] for r in rows(tmp_path / "run") if "train/loss" in r] == [0]


def test_summary_has_no_nan(tiny_config, tmp_path):
    """JSON has no NaN: a value without a number (no evaluation here) is null."""
    train(tiny_config("trainer.steps=1"))
    text = (tmp_path / "run" / "summary.json").read_text()
    summary = json.loads(text)
    assert "NaN" not in text and summary["reward_start"] is None and summary["stopped_by"] is None
    assert all(not isinstance(v, float) or math.isfinite(v) for v in summary.values())


def test_a_thread_setting_applies_and_is_given_back(tiny_config, caplog):
    before = torch.get_num_threads()
    run = Run.start(tiny_config("trainer.threads=1"))
    assert torch.get_num_threads() == 1
    run.finish()
    assert torch.get_num_threads() == before
    with caplog.at_level(logging.WARNING):
        Run.start(tiny_config("trainer.threads=64", name="many")).finish()
    assert "64 torch threads x 1 local ranks" in caplog.text and "lower trainer.threads" in caplog.text


@pytest.mark.parametrize("change", ["model.dtype=float64", "algo.loss=grpo", "model.shape=tiny-llama",
                                    "model.path={another_model}"])
def test_a_refused_resume_writes_nothing(tiny_config, tmp_path, change):
    """Settings the weights only make sense with are refused by name, even where the weights would load: another
    model.path of the same architecture (here: another run's checkpoint of the run's own shape)."""
    if "{another_model}" in change:
        train(tiny_config("trainer.steps=1", name="another"))
        change = change.format(another_model=checkpoint_dir(tmp_path / "another", 1))
    train(tiny_config("trainer.steps=1"))
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    key = change.split("=")[0]
    with pytest.raises(ValueError, match=f"cannot resume from .*{key}: "):
        train(tiny_config("trainer.steps=2", "trainer.resume=auto", change))
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before


def test_a_manifest_path_that_leaves_the_checkpoint_is_refused(tiny_config, tmp_path):
    """A crafted manifest naming a file outside the checkpoint (`..`, an absolute path, a link that leads out),
    with that file's true size and sha256, must not make resume read and hash it: the checkpoint is refused."""
    train(tiny_config("trainer.steps=1"))
    original = checkpoint_dir(tmp_path / "run", 1)
    secret = tmp_path / "run" / "secret.txt"
    secret.write_text("not the checkpoint's")
    entry = {"bytes": secret.stat().st_size, "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}

    def crafted(name: str | None, link: str | None = None) -> Path:
        """A copy of the checkpoint whose manifest lists `name` with the secret's size and sha256, and whose file
        `link` (listed or not) is a link to the secret."""
        step = tmp_path / "crafted" / original.name
        shutil.rmtree(step.parent, ignore_errors=True)
        shutil.copytree(original, step)
        if link is not None:
            (step / link).unlink(missing_ok=True)
            (step / link).symlink_to(secret)
        if name is not None:
            manifest = json.loads((step / MANIFEST).read_text())
            manifest["files"][name] = entry
            (step / MANIFEST).write_text(json.dumps(manifest))
        return step

    cases = [(("../../secret.txt",), r"names '\.\./\.\./secret.txt', a path outside the checkpoint"),
             ((str(secret),), r"names '/.*secret.txt', a path outside the checkpoint"),
             (("model.safetensors", "model.safetensors"), r"model.safetensors is a link to .*secret.txt"),
             ((None, "special_tokens_map.json"), r"special_tokens_map.json is a link to .*secret.txt")]
    for how, message in cases:
        step = crafted(*how)
        with pytest.raises(CheckpointError, match=message):
            verify_checkpoint(step)
        with pytest.raises(CheckpointError, match=f"trainer.resume='{step}'.*{message}"):
            Run.start(tiny_config("trainer.steps=2", f"trainer.resume={step}", name="resumed"))
    verify_checkpoint(original)  # the untouched checkpoint still verifies

"""LoRA (model.lora.*): only the adapters train, the reference policy is the base with the adapters off,
checkpoints hold the adapters and resume exactly, and `treerl export` merges them into a loadable model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from treerl.cli.main import app
from treerl.engine import FlatEngine
from treerl.models import ADAPTER_FILE
from treerl.rollout import Rollout, build_sampler
from treerl.testing import model_outputs
from treerl.trainer import train
from treerl.trainer.core.build import load_policy
from treerl.trainer.core.checkpoint import checkpoint_dir, load_weights
from treerl.trainer.core.run import Run
from treerl.trainer.rl.learn import load_reference, policy_loss, prepare
from treerl.tree import TokenSequence

pytest.importorskip("peft")

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "trainer.lr=0.05", "algo.loss=grpo"]


def _logprobs(model, sequences: list[TokenSequence]) -> torch.Tensor:
    return torch.cat([o["logprobs"] for o in FlatEngine().forward(model, sequences)])


def test_only_the_adapters_train_and_the_reference_is_the_base_without_them(tiny_config):
    config = tiny_config(*LORA, "algo.kl_coef=0.1")
    run = Run.start(config, temperature=config.rollout.temperature)
    adapters = {n for n, p in run.policy.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert {id(p) for g in run.actor.optimizer.param_groups for p in g["params"]} == {
        id(p) for n, p in run.policy.named_parameters() if n in adapters}
    before = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
    reference = load_reference(config, run)
    assert reference.copy is None  # no second model in memory
    batch = Rollout(config.rollout, run.tokenizer, build_sampler(config.rollout, run.policy)).collect(0).sequences
    for _ in range(2):
        step = copy.deepcopy(batch)
        prepare(run, step, reference)
        run.actor.update(step, policy_loss(config.algo.resolved(), step), step=0)
    changed = {n for n, p in run.policy.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n in adapters if "lora_B" in n} | {n for n in adapters if "lora_A" in n}
    base, _ = load_policy(tiny_config(name="base").model, torch.device("cpu"))  # the same seed, no adapters
    with reference.model() as model:
        assert torch.equal(_logprobs(model, batch), _logprobs(base, batch))
    assert not torch.allclose(_logprobs(run.policy, batch), _logprobs(base, batch), atol=1e-4)  # adapters are on again
    run.finish()


def test_adapter_checkpoints_resume_exactly(tiny_config, tmp_path):
    common = [*LORA, "trainer.steps=3", "trainer.minibatches=2"]
    train(tiny_config(*common, "trainer.save_every=2", "trainer.keep_checkpoints=0", name="straight"))
    saved = checkpoint_dir(tmp_path / "straight", 2)
    assert (saved / ADAPTER_FILE).is_file() and not (saved / "model.safetensors").exists()  # the adapters alone
    train(tiny_config(*common, f"trainer.resume={saved}", name="resumed"))
    rows = [next(r for r in _rows(tmp_path / name) if r["step"] == 2 and "train/loss" in r)
            for name in ("straight", "resumed")]
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
        assert rows[0][key] == rows[1][key], key
    a = _adapters(checkpoint_dir(tmp_path / "straight", 3))
    b = _adapters(checkpoint_dir(tmp_path / "resumed", 3))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    start = _adapters(saved)
    assert any(not torch.equal(start[k], a[k]) for k in a)


def test_export_merges_the_adapters_into_a_model_from_pretrained_loads(tiny_config, tmp_path):
    config = tiny_config(*LORA, "trainer.steps=2", "trainer.save_every=2")
    train(config)
    saved = checkpoint_dir(tmp_path / "run", 2)
    result = CliRunner().invoke(app, ["export", str(saved), str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    trained, _ = load_policy(config.model, torch.device("cpu"))
    load_weights(saved, trained)
    base, _ = load_policy(tiny_config(name="base").model, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    sequence = TokenSequence(torch.randint(0, merged.config.vocab_size, (12,), generator=g))
    want, got = model_outputs(trained, sequence)["logprobs"], model_outputs(merged, sequence)["logprobs"]
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(model_outputs(base, sequence)["logprobs"], want, atol=1e-4)  # the adapters trained
    again = CliRunner().invoke(app, ["export", str(saved), str(tmp_path / "merged")])
    assert again.exit_code != 0 and "already exists" in again.output


def _rows(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _adapters(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / ADAPTER_FILE)

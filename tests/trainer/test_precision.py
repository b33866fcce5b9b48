"""trainer.precision and model.gradient_checkpointing: bf16-mixed trains like fp32 within bfloat16's rounding on
float32 master weights; the on-policy ratio is 1; checkpointing is exact with every engine."""

from __future__ import annotations

import copy

import pytest
import torch

from treerl.rollout import Rollout, build_sampler
from treerl.testing import compare_runs, relative_error, run_engine
from treerl.trainer import ConfigError
from treerl.trainer.core.build import build_train_engine, load_policy
from treerl.trainer.core.run import Run
from treerl.trainer.rl.learn import policy_loss, prepare
from treerl.tree import TokenSequence

COMMON = ["algo.kl_coef=0.0", "algo.loss=grpo", "trainer.recompute_logprobs=true", "trainer.lr=1e-2"]


def _batch(config) -> list:
    """One rollout batch, sampled once in float32, for every run below to train on."""
    run = Run.start(config, temperature=config.rollout.temperature)
    batch = Rollout(config.rollout, run.tokenizer, build_sampler(config.rollout, run.policy)).collect(0).sequences
    run.finish()
    return batch


def _update(config, batch) -> dict:
    """One update on a copy of `batch`: the gradient it applied, the weights before and after, the metrics."""
    run = Run.start(config, temperature=config.rollout.temperature)
    grads: dict[str, torch.Tensor] = {}
    run.actor.optimizer.register_step_pre_hook(lambda *_: grads.update(
        {n: p.grad.clone() for n, p in run.policy.named_parameters() if p.grad is not None}))
    before = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
    batch = copy.deepcopy(batch)
    prepare(run, batch, None)
    metrics = run.actor.update(batch, policy_loss(config.algo.resolved(), batch), step=0)
    after = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
    state_dtypes = {t.dtype for s in run.actor.optimizer.state.values() for t in s.values() if t.numel() > 1}
    run.finish()
    return {"grads": grads, "before": before, "after": after, "metrics": metrics, "state_dtypes": state_dtypes}


def test_bf16_mixed_steps_equal_fp32_within_bfloat16_rounding_on_float32_master_weights(tiny_config):
    fp32_config = tiny_config(*COMMON, name="fp32")
    batch = _batch(fp32_config)
    fp32 = _update(fp32_config, batch)
    mixed = _update(tiny_config(*COMMON, "trainer.precision=bf16-mixed", name="mixed"), batch)
    assert {p.dtype for p in mixed["after"].values()} == {torch.float32}  # the master weights
    assert {g.dtype for g in mixed["grads"].values()} == {torch.float32}
    assert mixed["state_dtypes"] == {torch.float32}  # AdamW's moments
    assert set(mixed["grads"]) == set(fp32["grads"]) and len(fp32["grads"]) > 10
    assert all(torch.equal(fp32["before"][n], mixed["before"][n]) for n in fp32["before"])  # same start
    errors = {n: relative_error(mixed["grads"][n], fp32["grads"][n]) for n in fp32["grads"]}
    assert max(errors.values()) < 0.05, max(errors, key=errors.get)
    assert max(errors.values()) > 1e-4  # bfloat16 compute really happened
    assert mixed["metrics"]["train/loss"] == pytest.approx(fp32["metrics"]["train/loss"], rel=0.05, abs=1e-3)
    # AdamW's first step is about lr * sign(gradient), so a tiny gradient component rounded across zero flips its
    # update: compare the update of the whole model, not of the smallest tensors
    moved = [torch.cat([(run["after"][n] - run["before"][n]).flatten() for n in sorted(fp32["after"])])
             for run in (mixed, fp32)]
    assert relative_error(*moved) < 0.2
    # the old log-probs are filled by the same engine under the same autocast: the first update is on-policy
    assert mixed["metrics"]["train/approx_kl"] == 0.0 and fp32["metrics"]["train/approx_kl"] == 0.0


def test_pure_bf16_keeps_parameters_and_optimizer_state_in_bfloat16(tiny_config):
    config = tiny_config(*COMMON, "trainer.precision=bf16")
    assert config.model.dtype == "bfloat16"
    pure = _update(config, _batch(tiny_config(*COMMON, name="sample")))
    assert {p.dtype for p in pure["after"].values()} == {torch.bfloat16} and pure["state_dtypes"] == {torch.bfloat16}


def test_precision_names_aliases_and_dtype_conflicts(tiny_config):
    assert tiny_config("trainer.precision=bf16-true").trainer.precision == "bf16"
    assert tiny_config("trainer.precision=32-true").model.dtype == "float32"
    assert tiny_config("trainer.precision=fp32", "model.dtype=float64").model.dtype == "float64"
    with pytest.raises(ConfigError, match="trainer.precision='fp16' is not one of: fp32, bf16-mixed, bf16"):
        tiny_config("trainer.precision=fp16")
    with pytest.raises(ConfigError, match="model.dtype=bfloat16 does not go with trainer.precision=bf16-mixed"):
        tiny_config("trainer.precision=bf16-mixed", "model.dtype=bfloat16")
    with pytest.raises(ConfigError, match="model.dtype=bfloat16 does not go with trainer.precision=fp32"):
        tiny_config("model.dtype=bfloat16")


def _loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum() - 0.1 * view.entropy.sum()


@pytest.mark.parametrize("engine", ["flat", "dfs", "packed"])
def test_gradient_checkpointing_switch_recomputes_and_is_exact_with_every_engine(tiny_config, engine):
    overrides = ["model.dtype=float64", f"engine.name={engine}", "engine.chunk_tokens=5",
                 "engine.head_rows=all"]  # the loss reads every position
    config = tiny_config(*overrides, "model.gradient_checkpointing=true")
    model, _ = load_policy(config.model, torch.device("cpu"))
    plain, _ = load_policy(tiny_config(*overrides, name="plain").model, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (8,), generator=g)
    batch = [TokenSequence(torch.cat([prompt, torch.randint(0, model.config.vocab_size, (n,), generator=g)]),
                      fields={"advantages": torch.randn(8 + n, generator=g, dtype=torch.float64)}) for n in (3, 5, 4)]
    calls = {"checkpointed": 0, "plain": 0}
    for name, m in (("checkpointed", model), ("plain", plain)):  # count the MLP's runs (hooks skip recomputation)
        mlp = m.model.layers[0].mlp
        mlp.forward = lambda *a, _forward=mlp.forward, name=name: calls.__setitem__(name, calls[name] + 1) or _forward(*a)
    ours = run_engine(build_train_engine(config.engine), model, batch, _loss)
    reference = run_engine(build_train_engine(config.engine), plain, batch, _loss)
    errors = compare_runs(ours, reference)
    assert max(errors.values()) < 1e-10, max(errors, key=errors.get)
    assert calls["checkpointed"] > calls["plain"]  # the layer really ran again in backward

"""The NaN/inf guard: a non-finite loss or gradient norm never reaches the weights, and no checkpoint holds one."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from treerl.cli.main import app
from treerl.errors import ModelPathError, TrainingStopped
from treerl.models import build_model, first_nonfinite, read_weights
from treerl.rollout import builtin_tokenizer
from treerl.trainer import SFT_DEFAULTS, sft
from treerl.trainer.core.checkpoint import checkpoint_dir, step_dirs, verify_checkpoint
from treerl.trainer.core.learner import Learner
from treerl.trainer.core.run import Run
from treerl.trainer.rl.learn import policy_loss
from treerl.tree import TokenSequence


@pytest.fixture
def nan_model(tmp_path):
    """A local checkpoint with one NaN weight."""
    tokenizer = builtin_tokenizer()
    model = build_model(shape="tiny-qwen3", vocab_size=len(tokenizer))
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan_model")
    tokenizer.save_pretrained(tmp_path / "nan_model")
    return tmp_path / "nan_model"


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_model_with_a_nan_weight_is_refused_when_loaded(tiny_config, nan_model):
    with pytest.raises(ModelPathError, match=r"weight model.layers.0.mlp.up_proj.weight holds NaN or inf"):
        sft(tiny_config(f"model.path={nan_model}", base=SFT_DEFAULTS))


def test_sft_stops_at_the_first_non_finite_loss_and_its_checkpoints_are_finite(tiny_config, tmp_path):
    """lr=1e30: the first step makes the weights huge (finite), the second one's loss is NaN: stop before it."""
    config = tiny_config("trainer.lr=1e30", "trainer.steps=3", "trainer.save_every=1", "sft.eval_conversations=0",
                         base=SFT_DEFAULTS)
    with pytest.raises(TrainingStopped, match=r"non-finite policy loss (nan|inf), gradient norm \S+ at step 1: "
                                              r"stopped before the optimizer step"):
        sft(config)
    assert [s for s, _ in step_dirs(tmp_path / "run")] == [1]
    verify_checkpoint(checkpoint_dir(tmp_path / "run", 1))
    assert first_nonfinite(read_weights(checkpoint_dir(tmp_path / "run", 1))) is None


@pytest.mark.parametrize("part", ["policy", "critic"])
def test_a_checkpoint_of_non_finite_weights_is_never_written(tiny_config, tmp_path, part):
    """Weights that turned NaN (say, a bfloat16 overflow): saving is refused, naming the tensor; nothing written."""
    run = Run.start(tiny_config("algo.loss=ppo"))
    try:
        model = run.policy if part == "policy" else run.critic.model
        with torch.no_grad():
            model.model.norm.weight[3] = float("inf")
        with pytest.raises(TrainingStopped, match=rf"not writing checkpoint .*step_000001: the {part} weight "
                                                  r"model.norm.weight is NaN or inf \(after 1 steps\)"):
            run.save(1)
    finally:
        run.finish()
    assert not list((tmp_path / "run").glob("checkpoints/*"))


def test_rl_stops_when_the_policy_samples_nan(tmp_path):
    """RL meets NaN weights first in the sampler: the same stop, exit code 3 on the command line, one line."""
    result = CliRunner().invoke(app, ["train", "trainer.lr=1e30", "trainer.steps=3", "trainer.eval_prompts=0",
                                      "trainer.warmup_steps=0", "rollout.prompts_per_step=2", "rollout.group_size=2",
                                      "trainer.progress=false", f"trainer.output_dir={tmp_path / 'out'}"])
    assert result.exit_code == 3, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and ("logits are NaN or inf while sampling" in errors[0]
                                 or "non-finite policy loss" in errors[0]), result.output
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_skipped_step_leaves_weights_and_optimizer_untouched(tiny_config, monkeypatch):
    """One update whose gradient norm comes out NaN: with skip, nothing moves and the count goes up; the next
    update steps as usual."""
    run = Run.start(tiny_config("trainer.nonfinite=skip", "model.dtype=float64"))
    try:
        mask = torch.tensor([0.0] + [1.0] * 8)
        batch = [TokenSequence(list(range(3, 12)), {"loss_mask": mask, "advantages": torch.ones(9),
                                               "old_logprobs": torch.zeros(9)}, {"group": "g"})]
        loss = policy_loss(run.config.algo.resolved(), batch)
        before = snapshot(run.policy)
        norms = iter([float("nan")])
        original = Learner.clip_gradients
        monkeypatch.setattr(Learner, "clip_gradients", lambda self: next(norms, None) or original(self))
        skipped = run.actor.update(batch, loss, step=0)
        assert skipped["train/nonfinite_skipped"] == 1.0 and run.loop_state.nonfinite_skipped == 1
        assert all(torch.equal(before[k], v) for k, v in run.policy.state_dict().items())
        assert not run.actor.optimizer.state and all(p.grad is None for p in run.policy.parameters())
        stepped = run.actor.update(batch, loss, step=0)
        assert stepped["train/nonfinite_skipped"] == 0.0 and run.actor.optimizer.state
        assert any(not torch.equal(before[k], v) for k, v in run.policy.state_dict().items())
    finally:
        run.finish()


def test_the_critic_is_guarded_too(tiny_config):
    run = Run.start(tiny_config("algo.loss=ppo", "algo.kl_coef=0.0"))
    try:
        batch = [TokenSequence(list(range(3, 12)), {"loss_mask": torch.tensor([0.0] + [1.0] * 8)}, {"group": "g"})]
        before = snapshot(run.critic.model)

        def nan_loss(view):
            return view.values.sum() * float("nan"), {}

        with pytest.raises(TrainingStopped, match=r"non-finite critic loss nan"):
            run.critic.update(batch, nan_loss, step=0)
        assert all(torch.equal(before[k], v) for k, v in run.critic.model.state_dict().items())
    finally:
        run.finish()

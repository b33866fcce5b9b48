"""The RL loop: exact resume, DFS == flat, failing rewards, compression of multi-turn batches, bad setups."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
from support import treerl_serve
from typer.testing import CliRunner

from treerl.cli.main import app
from treerl.errors import CheckpointError, TrainingStopped, UserError
from treerl.rollout import CompletionsClient, Rollout, SamplingParams, build_sampler
from treerl.rollout.sampling.prefix_cache import PrefixCache
from treerl.testing import relative_error
from treerl.trainer import ConfigError, train
from treerl.trainer.core.checkpoint import checkpoint_dir, latest_checkpoint, read_weights
from treerl.trainer.core.run import Run
from treerl.trainer.rl.learn import policy_loss, prepare, update_critic


def metrics_rows(output_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def step_row(output_dir: str | Path, step: int) -> dict:
    return next(r for r in metrics_rows(output_dir) if r["step"] == step and "train/loss" in r)


def test_resume_repeats_the_next_step_exactly(tiny_config, tmp_path):
    """3 steps straight vs 2 steps, checkpoint, resume in a fresh run: the same 3rd step, bit for bit."""
    straight = tiny_config("trainer.steps=3", "trainer.save_every=2", "trainer.keep_checkpoints=0",
                           "trainer.minibatches=2", "trainer.ppo_epochs=2", "trainer.lr_schedule=cosine",
                           "trainer.warmup_steps=1", "trainer.min_lr_ratio=0.5", name="straight")
    train(straight)
    resumed = tiny_config("trainer.steps=3", f"trainer.resume={checkpoint_dir(tmp_path / 'straight', 2)}",
                          "trainer.minibatches=2", "trainer.ppo_epochs=2", "trainer.lr_schedule=cosine",
                          "trainer.warmup_steps=1", "trainer.min_lr_ratio=0.5", name="resumed")
    train(resumed)
    want, got = step_row(tmp_path / "straight", 2), step_row(tmp_path / "resumed", 2)
    for key in ("train/loss", "train/grad_norm", "train/lr", "rollout/reward_mean", "batch/flat_tokens"):
        assert got[key] == want[key], key
    final_a = read_weights(checkpoint_dir(tmp_path / "straight", 3))
    final_b = read_weights(checkpoint_dir(tmp_path / "resumed", 3))
    assert set(final_a) == set(final_b)
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    # The optimizer moved (the test is not comparing two untouched models).
    start = read_weights(checkpoint_dir(tmp_path / "straight", 2))
    assert any(not torch.equal(start[k], final_a[k]) for k in start)


def test_resume_auto_takes_the_latest_checkpoint_or_starts_fresh(tiny_config, tmp_path):
    config = tiny_config("trainer.steps=2", "trainer.save_every=1", "trainer.resume=auto")
    train(config)  # nothing to resume: a fresh start
    assert latest_checkpoint(tmp_path / "run") == checkpoint_dir(tmp_path / "run", 2)
    assert len(list((tmp_path / "run" / "checkpoints").iterdir())) == 2  # keep_checkpoints=2
    longer = tiny_config("trainer.steps=3", "trainer.resume=auto")
    train(longer)
    steps = [r["step"] for r in metrics_rows(tmp_path / "run") if "train/loss" in r]
    assert steps == [0, 1, 2]  # the resumed run appended step 2 only
    with pytest.raises(CheckpointError, match="resume='/no/such/checkpoint': checkpoint /no/such/checkpoint: does not"):
        train(tiny_config("trainer.resume=/no/such/checkpoint", name="other"))


def _gradients(config) -> tuple[dict[str, torch.Tensor], float, dict]:
    """The gradient of the first update of step 0 (captured before the optimizer applies it)."""
    run = Run.start(config, temperature=config.rollout.temperature)
    captured: dict[str, torch.Tensor] = {}
    run.actor.optimizer.register_step_pre_hook(
        lambda *_: captured.update({n: p.grad.clone() for n, p in run.policy.named_parameters() if p.grad is not None})
    )
    rollout = Rollout(config.rollout, run.tokenizer, build_sampler(config.rollout, run.policy))
    batch = rollout.collect(0).sequences
    prepare(run, batch, None)
    metrics = run.actor.update(batch, policy_loss(config.algo.resolved(), batch), step=0)
    run.finish()
    return captured, metrics["train/loss"], metrics


@pytest.mark.parametrize("task", ["arithmetic", "guess_number"])
@pytest.mark.parametrize("engine", ["dfs", "packed"])
def test_a_training_step_with_a_tree_engine_equals_flat(tiny_config, task, engine):
    """Same batch, same loss, same gradient (float64; transformers' float32 RMSNorm sets the 1e-6 bound)."""
    common = ["model.dtype=float64", f"rollout.task={task}", "algo.kl_coef=0.0", "algo.loss=grpo",
              "trainer.recompute_logprobs=true", "rollout.prompts_per_step=3"]
    dfs, dfs_loss, dfs_metrics = _gradients(tiny_config(*common, f"engine.name={engine}", "engine.chunk_tokens=7"))
    flat, flat_loss, flat_metrics = _gradients(tiny_config(*common, "engine.name=flat", name="flat"))
    assert dfs_loss == pytest.approx(flat_loss, rel=1e-6, abs=1e-9)
    assert set(dfs) == set(flat) and len(flat) > 10
    for name in flat:
        assert relative_error(dfs[name], flat[name]) <= 1e-6, name
    for key in ("train/entropy", "train/policy_loss", "train/approx_kl"):
        assert dfs_metrics[key] == pytest.approx(flat_metrics[key], rel=1e-6, abs=1e-9)


def test_a_hybrid_model_trains_on_the_tree_like_flat(tiny_config):
    """Qwen3.5-style Gated DeltaNet + attention through the whole RL step: DfsEngine's gradient equals flat's
    (as one vector: the delta rule computes in float32 inside the float64 model, ~1e-7 noise per parameter)."""
    common = ["model.shape=tiny-qwen3.5", "model.dtype=float64", "rollout.task=arithmetic", "algo.kl_coef=0.0",
              "algo.loss=grpo", "trainer.recompute_logprobs=true", "rollout.prompts_per_step=3"]
    dfs, dfs_loss, _ = _gradients(tiny_config(*common, "engine.name=dfs", "engine.chunk_tokens=7"))
    flat, flat_loss, _ = _gradients(tiny_config(*common, "engine.name=flat", name="flat"))
    assert dfs_loss == pytest.approx(flat_loss, rel=1e-6, abs=1e-9)
    assert set(dfs) == set(flat) and any("linear_attn" in name for name in flat)
    names = sorted(flat)
    whole = lambda grads: torch.cat([grads[name].flatten() for name in names])
    assert relative_error(whole(dfs), whole(flat)) <= 1e-6


def _critic_gradients(config) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """PPO with a critic, step 0: the policy's and the critic's first gradients, and the batch's GAE fields."""
    run = Run.start(config, temperature=config.rollout.temperature)
    assert run.critic is not None
    grads: dict[str, dict[str, torch.Tensor]] = {"policy": {}, "critic": {}}
    for name, model, optimizer in (("policy", run.policy, run.actor.optimizer),
                                   ("critic", run.critic.model, run.critic.optimizer)):
        optimizer.register_step_pre_hook(lambda *_, name=name, model=model: grads[name].update(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    rollout = Rollout(config.rollout, run.tokenizer, build_sampler(config.rollout, run.policy))
    batch = rollout.collect(0).sequences
    prepare(run, batch, None)
    algo = config.algo.resolved()
    run.actor.update(batch, policy_loss(algo, batch), step=0)
    metrics = update_critic(run, batch, 0, algo)
    run.finish()
    fields = {k: torch.cat([s.fields[k] for s in batch]) for k in ("values", "advantages", "returns")}
    return grads["policy"], grads["critic"], fields | {"value_loss": metrics["critic/value_loss"]}


@pytest.mark.parametrize("task", ["arithmetic", "guess_number"])
def test_ppo_with_a_critic_on_the_tree_equals_flat(tiny_config, task):
    """Values, GAE advantages and returns, the policy's and the critic's gradients: DfsEngine == FlatEngine."""
    common = ["model.dtype=float64", f"rollout.task={task}", "algo.loss=ppo", "rollout.prompts_per_step=3"]
    dfs_policy, dfs_critic, dfs = _critic_gradients(tiny_config(*common, "engine.chunk_tokens=7"))
    flat_policy, flat_critic, flat = _critic_gradients(tiny_config(*common, "engine.name=flat", name="flat"))
    assert dfs["values"].abs().sum() > 0 and dfs["returns"].abs().sum() > 0
    for key in ("values", "advantages", "returns"):
        assert relative_error(dfs[key], flat[key]) <= 1e-6, key
    assert dfs["value_loss"] == pytest.approx(flat["value_loss"], rel=1e-6)
    for want, got in ((flat_policy, dfs_policy), (flat_critic, dfs_critic)):
        assert set(got) == set(want) and len(want) > 10
        for name in want:
            assert relative_error(got[name], want[name]) <= 1e-6, name
    assert "score.weight" in flat_critic


def test_ppo_with_a_critic_resumes_exactly(tiny_config, tmp_path):
    """The critic, its optimizer and schedule are checkpointed too: step 2 after a resume == straight through."""
    common = ["trainer.steps=3", "algo.loss=ppo", "trainer.minibatches=2", "critic.lr=0.01"]
    train(tiny_config(*common, "trainer.save_every=2", "trainer.keep_checkpoints=0", name="straight"))
    train(tiny_config(*common, f"trainer.resume={checkpoint_dir(tmp_path / 'straight', 2)}", name="resumed"))
    want, got = step_row(tmp_path / "straight", 2), step_row(tmp_path / "resumed", 2)
    for key in ("train/loss", "train/grad_norm", "critic/value_loss", "critic/grad_norm", "critic/lr"):
        assert got[key] == want[key], key
    critic_a = read_weights(checkpoint_dir(tmp_path / "straight", 3) / "critic")
    critic_b = read_weights(checkpoint_dir(tmp_path / "resumed", 3) / "critic")
    assert all(torch.equal(critic_a[k], critic_b[k]) for k in critic_a)
    start = read_weights(checkpoint_dir(tmp_path / "straight", 2) / "critic")
    assert not torch.equal(start["score.weight"], critic_a["score.weight"])  # the critic did train
    train(tiny_config("trainer.steps=1", name="grpo"))
    with pytest.raises(CheckpointError, match=r"algo.loss: 'dr_grpo' in the checkpoint, 'ppo' now; algo.advantage: "
                                              r"'group_mean' in the checkpoint, 'gae' now"):
        train(tiny_config(*common, f"trainer.resume={checkpoint_dir(tmp_path / 'grpo', 1)}", name="bad"))


def test_multi_turn_batches_share_prefixes(tiny_config, tmp_path):
    result = train(tiny_config("trainer.steps=1", "rollout.task=guess_number", "trainer.eval_prompts=2"))
    row = step_row(tmp_path / "run", 0)
    assert row["batch/compression"] > 1.5 and row["batch/sequences"] > row["rollout/kept"]
    # The result reports the evaluations before and after the step, not a training batch's reward.
    evaluations = {r["step"]: r["eval/reward_mean"] for r in metrics_rows(tmp_path / "run") if "eval/reward_mean" in r}
    assert evaluations == {0: result.reward_start, 1: result.reward_end}
    assert result.train_reward_first == result.train_reward_last == row["rollout/reward_mean"]


@pytest.mark.parametrize("task, stores", [("arithmetic", False), ("guess_number", True)])
def test_a_single_turn_step_stores_nothing_in_the_prefix_cache_a_multi_turn_one_does(tiny_config, tmp_path, monkeypatch,
                                                                                      task, stores):
    """Synchronous training empties the cache after each rollout: a single-turn rollout's one call stores nothing
    (nothing reads it), a multi-turn episode's turns store what the next turn reads."""
    inserts = []
    insert = PrefixCache.insert
    monkeypatch.setattr(PrefixCache, "insert", lambda self, tokens, *a, **k: (inserts.append(tokens),
                                                                                insert(self, tokens, *a, **k))[1])
    train(tiny_config("trainer.steps=1", f"rollout.task={task}"))
    row = step_row(tmp_path / "run", 0)
    assert bool(inserts) == stores and (row["rollout/cached_tokens"] > 0) == stores


REWARDS = '''
import math

def flaky(prompt, completion, answer):
    """Raises on some replies, returns NaN on others: the run must go on."""
    kind = sum(map(ord, completion)) % 3
    if kind == 0:
        raise ValueError(f"cannot parse {completion!r}")
    if kind == 1:
        return math.nan
    return 1.0

def broken(prompt, completion, answer):
    raise RuntimeError("reward server down")

def down_at_first(prompt, completion, answer):
    """Raises on its first 8 calls (step 0's samples) in the current directory, then returns 1."""
    from pathlib import Path
    calls = Path("reward_calls")
    done = int(calls.read_text()) if calls.exists() else 0
    calls.write_text(str(done + 1))
    if done < 8:
        raise RuntimeError("reward server down")
    return 1.0

def exits(prompt, completion, answer):
    raise SystemExit(f"exit called on {completion!r}")

def hangs(prompt, completion, answer):
    import time
    time.sleep(3600)

def huge(prompt, completion, answer):
    return 1e308
'''


@pytest.fixture
def user_task(tmp_path, monkeypatch):
    """A user's JSONL prompts and reward module on disk (the current directory is importable)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards_for_trainer_test.py").write_text(textwrap.dedent(REWARDS))
    rows = [{"prompt": f"{a}+{a}=", "answer": 2 * a} for a in range(5)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["rollout.task=dataset", f"rollout.data_path={tmp_path / 'data.jsonl'}", "rollout.max_new_tokens=4"]


def test_failing_rewards_are_dropped_reported_and_counted(tiny_config, tmp_path, user_task):
    config = tiny_config(*user_task, "rollout.reward_fn=my_rewards_for_trainer_test:flaky", "trainer.steps=2",
                         "rollout.group_size=8")
    result = train(config)
    rows = [r for r in metrics_rows(tmp_path / "run") if "rollout/dropped" in r]
    raised = sum(r.get("rollout/dropped_reward_raised", 0) for r in rows)
    not_finite = sum(r.get("rollout/dropped_reward_not_finite", 0) for r in rows)
    assert raised > 0 and not_finite > 0 and result.dropped_samples == raised + not_finite
    assert all(r["rollout/kept"] + r["rollout/dropped"] == r["rollout/samples"] for r in rows)
    reported = [json.loads(line) for line in (tmp_path / "run" / "dropped.jsonl").read_text().splitlines()]
    assert any("raised ValueError: cannot parse" in r["reason"] and r["prompt"].endswith("=") for r in reported)
    assert any("returned nan" in r["reason"] for r in reported)


def test_a_step_whose_samples_all_fail_is_skipped_not_fatal(tiny_config, tmp_path, user_task):
    """Step 0's every sample fails: it is skipped and counted; step 1 trains, and the run ends as usual."""
    config = tiny_config(*user_task, "rollout.reward_fn=my_rewards_for_trainer_test:down_at_first", "trainer.steps=2",
                         "trainer.save_final=false")
    result = train(config)
    assert result.skipped_steps == 1 and result.train_reward_first == result.train_reward_last == 1.0
    rows = [r for r in metrics_rows(tmp_path / "run") if "trainer/skipped_steps" in r]
    assert [r["trainer/skipped_steps"] for r in rows] == [1, 1] and "train/loss" in rows[1]


def test_the_skipped_step_count_goes_on_after_a_resume(tiny_config, tmp_path, user_task):
    """The loop state (here: skipped steps) is saved with the checkpoint and restored from it; a run that trains no
    step writes no checkpoint (its weights are those it started from)."""
    train(tiny_config(*user_task, "rollout.reward_fn=my_rewards_for_trainer_test:down_at_first", "trainer.steps=2"))
    broken = (*user_task, "rollout.reward_fn=my_rewards_for_trainer_test:broken")
    with pytest.raises(TrainingStopped, match="no step of this run trained: every sample of step 2 was dropped"):
        train(tiny_config(*broken, "trainer.steps=3", "trainer.resume=auto"))
    (row,) = [r for r in metrics_rows(tmp_path / "run") if r["step"] == 2 and "trainer/skipped_steps" in r]
    assert row["trainer/skipped_steps"] == 2
    assert latest_checkpoint(tmp_path / "run") == checkpoint_dir(tmp_path / "run", 2)


@pytest.mark.parametrize("reward, reason, text", [("exits", "reward_raised", "raised SystemExit: exit called on"),
                                                  ("hangs", "reward_timeout", "did not return within 0.2 s")])
def test_a_reward_that_exits_or_hangs_drops_its_sample_and_the_run_goes_on(tiny_config, tmp_path, user_task, reward,
                                                                           reason, text):
    """Synchronous training: sys.exit() in a reward, or a reward past rollout.reward_timeout, is a dropped sample (and
    a run whose every sample is dropped stops, naming the reason and what to change)."""
    remedy = "raise rollout.reward_timeout" if reason == "reward_timeout" else "fix the reward (rollout.reward_fn"
    expected = rf"every sample of step 0 was dropped \({reason}: 8\): {re.escape(remedy)}"
    with pytest.raises(TrainingStopped, match=expected):
        train(tiny_config(*user_task, f"rollout.reward_fn=my_rewards_for_trainer_test:{reward}", "trainer.steps=1",
                          "rollout.reward_timeout=0.2", "trainer.save_final=false"))
    (row,) = [r for r in metrics_rows(tmp_path / "run") if "rollout/dropped" in r]
    assert row[f"rollout/dropped_{reason}"] == row["rollout/dropped"] == 8 and row["trainer/skipped_steps"] == 1
    assert text in (tmp_path / "run" / "dropped.jsonl").read_text()


def test_a_reward_too_large_to_train_on_drops_its_sample(tiny_config, tmp_path, user_task):
    """1e308 (it made the reward statistics raise OverflowError) is a dropped sample, reason reward_too_large."""
    with pytest.raises(TrainingStopped, match=r"every sample of step 0 was dropped \(reward_too_large: 8\)"):
        train(tiny_config(*user_task, "rollout.reward_fn=my_rewards_for_trainer_test:huge", "trainer.steps=1",
                          "trainer.save_final=false"))
    (row,) = [r for r in metrics_rows(tmp_path / "run") if "rollout/dropped" in r]
    assert row["rollout/dropped_reward_too_large"] == row["rollout/dropped"] == 8 and row["trainer/skipped_steps"] == 1
    assert "returned 1e+308; rewards must be within +-1e+09" in (tmp_path / "run" / "dropped.jsonl").read_text()


def test_a_run_whose_every_sample_keeps_failing_stops_naming_the_first_failure(tmp_path, user_task):
    """trainer.max_failed_steps steps in a row with every sample dropped: exit code 3 and one line naming the reasons,
    what to change and the first failure (not exit 0 with a NaN reward); the failed steps are logged, no checkpoint is
    written."""
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", *user_task, "rollout.reward_fn=my_rewards_for_trainer_test:broken",
                                      "trainer.steps=10", "trainer.max_failed_steps=2", "trainer.eval_prompts=0",
                                      "trainer.progress=false", "trainer.tensorboard=false",
                                      "rollout.prompts_per_step=2", "rollout.group_size=2", f"trainer.output_dir={out}"])
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == TrainingStopped.exit_code and len(errors) == 1, result.output
    assert re.fullmatch(r"error: every sample of 2 steps in a row \(steps 0-1\) was dropped \(reward_raised: 8; "
                        r"trainer.max_failed_steps=2\): fix the reward \(rollout.reward_fn, or what the agent or "
                        r"environment returns\); the first failure: \[s0/p0\S*\] reward function raised RuntimeError: "
                        r"reward server down; all of them in .*dropped.jsonl", errors[0]), errors[0]
    assert [r["step"] for r in metrics_rows(out) if "rollout/dropped" in r] == [0, 1]
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize("settings", [["trainer.steps=2"], ["trainer.steps=3", "trainer.max_failed_steps=0"]],
                         ids=["fewer steps than max_failed_steps", "max_failed_steps=0"])
def test_a_run_none_of_whose_steps_trained_exits_3_naming_why(tmp_path, settings):
    """Every prompt (8 tokens) with its reply budget (3) is over rollout.max_context_tokens=8, so every sample of
    every step is dropped, in fewer steps than trainer.max_failed_steps or with it 0: exit code 3 and one line with
    the counts by reason and the setting to change (it was exit 0, a NaN reward and a summary.json)."""
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", *settings, "rollout.max_context_tokens=8", "trainer.eval_prompts=0",
                                      "trainer.progress=false", "trainer.tensorboard=false",
                                      "rollout.prompts_per_step=2", "rollout.group_size=2",
                                      f"trainer.output_dir={out}"])
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == TrainingStopped.exit_code and len(errors) == 1, result.output
    steps = int(settings[0].split("=")[1])
    assert re.fullmatch(rf"error: no step of this run trained: every sample of steps 0-{steps - 1} was dropped "
                        rf"\(context_limit: {4 * steps}\): raise rollout.max_context_tokens \(a prompt and its reply "
                        r"budget, rollout.max_new_tokens, must fit in it\); the first failure: \[s0/p0/0\] the prompt "
                        r"has 8 tokens; with max_new_tokens 3 it exceeds rollout.max_context_tokens=8; all of them in "
                        r".*dropped.jsonl", errors[0]), errors[0]
    assert not (out / "summary.json").exists()


def test_bad_setups_are_clear_errors(tiny_config, tmp_path):
    with pytest.raises(UserError, match="model.path='/no/such/model' does not exist"):
        train(tiny_config("model.path=/no/such/model"))
    with pytest.raises(ValueError, match="reward function 'no_such_module:f': cannot import"):
        train(tiny_config("rollout.task=dataset", f"rollout.data_path={tmp_path}", "rollout.reward_fn=no_such_module:f"))
    with pytest.raises(ConfigError, match="trains a critic"):
        tiny_config("algo.loss=ppo", "trainer.mode=async")


def test_a_checkpoint_is_a_local_model_path_for_a_users_data(tiny_config, tmp_path, user_task):
    """model.path loads weights and tokenizer from a local directory (here: a previous run's checkpoint)."""
    train(tiny_config("trainer.steps=1", name="first"))
    checkpoint = checkpoint_dir(tmp_path / "first", 1)
    config = tiny_config(f"model.path={checkpoint}", *user_task, "rollout.reward_fn=my_rewards_for_trainer_test:flaky",
                         "trainer.steps=1", "trainer.overwrite=true", name="second")
    run = Run.start(config)
    saved = read_weights(checkpoint)
    assert all(torch.equal(run.policy.state_dict()[k], v) for k, v in saved.items())
    assert run.tokenizer.chat_template is not None and len(run.tokenizer) == run.policy.config.vocab_size
    run.finish()
    assert train(config).steps == 1


@pytest.mark.slow
@pytest.mark.parametrize("protocol, mode", [("vllm", "sync"), ("sglang", "async")])
def test_training_with_an_inference_server_pushes_the_new_weights(tiny_config, tmp_path, protocol, mode):
    """rollout.server_url: samples come from `treerl serve` (either protocol, either training mode); each new version
    is pushed before it samples, through rollout.weights_dir, and the last one when the run ends."""
    with treerl_serve("--seed", "0", "--protocol", protocol) as url:  # the trainer's initial model: tiny-qwen3, seed 0
        result = train(tiny_config(f"rollout.server_url={url}", "trainer.steps=2", f"trainer.mode={mode}",
                                   f"rollout.weights_dir={tmp_path / 'pushed'}"))
        assert result.steps == 2
        rows = [r for r in metrics_rows(tmp_path / "run") if "rollout/model_calls" in r or "async/trained" in r]
        assert len(rows) == 2 and all("time/weight_push" in r for r in rows)
        (group,) = CompletionsClient(url).generate([[1, 2, 3]], SamplingParams(n=1, max_new_tokens=2, seed=0))
        assert group[0].versions == [2] * len(group[0].tokens)  # the server runs the weights of step 2
    [own] = (tmp_path / "pushed").iterdir()  # treerl-<run id>: a directory of the run's own
    served = read_weights(own / "weights")
    final = read_weights(checkpoint_dir(tmp_path / "run", 2))
    assert all(torch.equal(served[k], final[k]) for k in final)

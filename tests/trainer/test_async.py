"""Asynchronous RL: staleness bound, counters that add up, worker crashes and hangs, interrupted generation,
weights shared with the workers, and max_staleness = 0 being the synchronous loop."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from treerl.algo.config import decoupled
from treerl.engine import FlatEngine, PolicyHead
from treerl.errors import TrainingStopped
from treerl.models import build_model
from treerl.rollout import EmbeddedSampler, RolloutStats, SamplingParams
from treerl.rollout.tasks import build_task
from treerl.trainer import ConfigError, train
from treerl.trainer.asynchronous import pool as pool_module
from treerl.trainer.asynchronous import worker_set
from treerl.trainer.asynchronous.interruptible import InterruptibleSampler
from treerl.trainer.asynchronous.pool import RolloutPool
from treerl.trainer.asynchronous.weights import SharedWeights
from treerl.trainer.asynchronous.workers import GroupResult
from treerl.trainer.core.build import load_policy
from treerl.tree import TokenSequence

ASYNC = ["trainer.mode=async", "rollout.group_size=2"]


def train_rows(output_dir: str | Path) -> list[dict]:
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def check_behaviour_logprobs(seq: TokenSequence, snapshots: dict[int, dict], model: torch.nn.Module) -> None:
    """Each generated token's behaviour log-prob is that of the weights of the version it is tagged with."""
    versions = seq.fields["versions"]
    for version in versions[versions >= 0].unique().tolist():
        model.load_state_dict(snapshots[version])
        [out] = FlatEngine(head=PolicyHead()).forward(model, [seq])
        at = versions == version
        torch.testing.assert_close(out["logprobs"][at].double(), seq.fields["old_logprobs"][at], atol=1e-6, rtol=0)


def test_shared_weights_reach_a_model_once_per_version():
    a, b = build_model(seed=0, dtype=torch.float64), build_model(seed=1, dtype=torch.float64)
    shared = SharedWeights.of(a, version=3)
    assert all(t.is_shared() for t in shared.tensors.values())
    assert shared.pull(b, have=-1) == 3
    assert all(torch.equal(b.state_dict()[k], v) for k, v in a.state_dict().items())
    with torch.no_grad():
        for p in a.parameters():
            p.add_(1.0)
    assert shared.pull(b, have=3) == 3 and not torch.equal(b.lm_head.weight, a.lm_head.weight)  # nothing new yet
    shared.publish(a, version=4)
    assert shared.pull(b, have=3) == 4 and torch.equal(b.lm_head.weight, a.lm_head.weight)


def test_an_interrupted_reply_resumes_on_the_new_weights_with_per_token_versions():
    """Decoded 3 tokens at a time; new weights arrive after the first segment: later tokens are theirs."""
    old, new = build_model(seed=0, dtype=torch.float64), build_model(seed=1, dtype=torch.float64)
    snapshots = {0: snapshot(old), 1: snapshot(new)}
    embedded = EmbeddedSampler(build_model(seed=0, dtype=torch.float64), version=0)
    refreshes = []

    def refresh() -> None:
        refreshes.append(embedded.version)
        if len(refreshes) == 2:  # the first look is before the first segment; the update lands after it
            embedded.model.load_state_dict(snapshots[1])
            embedded.version = 1

    sampler = InterruptibleSampler(embedded, refresh, segment_tokens=3)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    groups = sampler.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=0))
    assert [len(g) for g in groups] == [2, 2]
    for prompt, group in zip(prompts, groups):
        for completion in group:
            assert completion.finish_reason == "length" and len(completion.tokens) == 8  # no stop tokens: full budget
            assert completion.versions == [0] * 3 + [1] * 5
            seq = TokenSequence(prompt + completion.tokens, {
                "old_logprobs": torch.tensor([0.0] * len(prompt) + completion.logprobs, dtype=torch.float64),
                "versions": torch.tensor([-1] * len(prompt) + completion.versions)})
            check_behaviour_logprobs(seq, snapshots, build_model(seed=2, dtype=torch.float64))
    assert len(refreshes) == 3  # before segments 1, 2 and 3 (8 tokens = 3 + 3 + 2)


def test_a_rollout_workers_sequences_reach_the_trainer_with_their_images():
    """A worker ships its sequences as arrays: the images travel with them (pixels, grid, place), the same image (by
    digest) on the trainer's side; and an interrupted reply resumes on its prompt's images, each token's behaviour
    log-prob the one the engine recomputes on the sequence as sampled."""
    from vision_models import sequence, vl_model

    from treerl.engine import DfsEngine

    model = vl_model("qwen2_5_vl")
    prompts = [sequence([[1, 5, 6], (0, 4, 4), [7]]), sequence([[1], (1, 4, 6), [8, 9], (2, 2, 4), [10]])]
    embedded = EmbeddedSampler(model)
    sampler = InterruptibleSampler(embedded, lambda: None, segment_tokens=2)
    groups = sampler.generate([p.tokens.tolist() for p in prompts], SamplingParams(n=2, max_new_tokens=5, seed=0),
                              images=[p.images for p in prompts])
    sent = [TokenSequence(torch.cat([p.tokens, torch.tensor(c.tokens)]),
                          {"old_logprobs": torch.tensor([0.0] * len(p) + c.logprobs, dtype=torch.float64)},
                          images=p.images) for p, g in zip(prompts, groups) for c in g]
    received = GroupResult.of(0, sent, version=0).sequences()
    for a, b in zip(sent, received):
        assert [(i.start, i.length, i.digest) for i in a.images] == [(i.start, i.length, i.digest) for i in b.images]
        assert all(torch.equal(i.pixel_values, j.pixel_values) and torch.equal(i.grid_thw, j.grid_thw)
                   for i, j in zip(a.images, b.images))
    for seq, out in zip(received, DfsEngine().forward(model, received)):
        reply = seq.fields["old_logprobs"] != 0
        torch.testing.assert_close(out["logprobs"][reply], seq.fields["old_logprobs"][reply], atol=1e-9, rtol=0)


@pytest.fixture
def one_thread():
    """Both modes' trainers on one torch thread (async gives its workers the rest), so float sums agree bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # rollout workers: ~8 s on 2 cores
def test_zero_staleness_trains_what_the_synchronous_loop_trains(tiny_config, tmp_path, one_thread):
    """max_staleness = 0, one worker, the loss left as configured: the same samples, losses and gradients."""
    common = ["trainer.steps=3", "trainer.decoupled_loss=false"]
    train(tiny_config(*common, name="sync"))
    result = train(tiny_config(*common, *ASYNC[:1], "trainer.max_staleness=0", name="async"))
    sync_rows, async_rows = train_rows(tmp_path / "sync"), train_rows(tmp_path / "async")
    for want, got in zip(sync_rows, async_rows, strict=True):
        for key in ("rollout/reward_mean", "batch/flat_tokens"):  # the same samples
            assert got[key] == want[key], key
        for key in ("train/loss", "train/grad_norm"):  # the same update (float32: summation order may differ)
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
        assert got["async/lag_max"] == 0
    assert result.counters["admitted"] == result.counters["trained"] == 3 * 2  # nothing sampled ahead
    assert result.counters["dropped_stale"] == 0


@pytest.mark.slow  # ~14 s on 2 cores
def test_two_workers_bound_staleness_and_survive_a_crash_and_a_hang(tiny_config):
    """Weights change every version; a worker is SIGKILLed holding work, another SIGSTOPped (a hang)."""
    config = tiny_config(*ASYNC, "trainer.rollout_workers=2", "trainer.max_staleness=1", "model.dtype=float64",
                         "trainer.worker_timeout=2", "rollout.reward_timeout=1")
    model, _ = load_policy(config.model, torch.device("cpu"))
    checker, _ = load_policy(config.model, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    weights = SharedWeights.of(model, version=0)
    snapshots = {0: snapshot(model)}
    pool = RolloutPool(config, build_task(config.rollout), weights, version=0)
    trained: list[int] = []
    lost: list[int] = []
    version = 0

    def step() -> None:
        nonlocal version
        batch = pool.next_batch(version)
        assert len(batch.groups) == 2 and max(batch.lags) <= 1
        for group in batch.groups:
            assert all(version - v <= 1 for s in group.sequences for v in s.fields["versions"].tolist() if v >= 0)
            trained.append(group.job.index)
        check_behaviour_logprobs(batch.sequences[0], snapshots, checker)
        with torch.no_grad():  # a new policy version
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
        version += 1
        weights.publish(model, version)
        snapshots[version] = snapshot(model)

    def step_until(condition) -> None:
        deadline = time.monotonic() + 60
        while not condition() and time.monotonic() < deadline:
            step()

    try:
        for _ in range(3):
            step()
        victim = pool.workers[0]  # a crash: stopped, so what it holds two steps later is unfinished; then killed
        os.kill(victim.process.pid, signal.SIGSTOP)
        for _ in range(2):
            step()
        step_until(lambda: victim.outstanding)
        lost = [job.index for job in victim.outstanding.values()]
        os.kill(victim.process.pid, signal.SIGKILL)
        step_until(lambda: pool.counters.restarts == 1)
        assert 1 <= pool.counters.lost_to_crash <= len(lost)
        for _ in range(2):
            step()
        hung = pool.workers[1]  # a hang: alive, holding work, no model forward for worker_timeout seconds
        os.kill(hung.process.pid, signal.SIGSTOP)
        step_until(lambda: pool.counters.restarts == 2)
        for _ in range(2):
            step()
    finally:
        pool.close()
    counters = pool.counters
    counters.check()
    assert counters.restarts == 2 and counters.lost_to_crash >= 1
    assert counters.requeued == counters.lost_to_crash
    assert len(trained) == len(set(trained)) == counters.trained + counters.dropped_failed
    assert set(lost) <= set(trained)  # the crashed worker's prompts were sampled again and trained


class SlowWorkers:
    """Stands in for WorkerSet, in process: a chunk is sampled with the weights of the version it was sent at and
    comes back once the trainer has reached that version + the chunk's delay (`delays`, in order; then 0)."""

    def __init__(self, config, weights):
        self.delays: list[int] = []
        self.trainer_version = 0
        self.chunks: list[tuple[list, int, int]] = []  # (jobs, version sent at, version it comes back at)

    def send(self, jobs, version):
        self.chunks.append((jobs, version, version + (self.delays.pop(0) if self.delays else 0)))

    def receive(self, wait):
        done = [chunk for chunk in self.chunks if chunk[2] <= self.trainer_version]
        self.chunks = [chunk for chunk in self.chunks if chunk[2] > self.trainer_version]
        sample = lambda v: TokenSequence(torch.tensor([1, 2, 3]), {"versions": torch.tensor([-1, v, v])}, {"reward": 1.0})
        return [worker_set.Finished([(job, GroupResult.of(job.id, [sample(v)], v)) for job in jobs], RolloutStats())
                for jobs, v, _ in done]

    def in_flight(self):
        return sum(len(jobs) for jobs, _, _ in self.chunks)

    def failed(self):
        return []

    def close(self):
        pass


@pytest.mark.parametrize("delay", [1, 2])
def test_a_group_is_trained_at_max_staleness_versions_old_and_dropped_later(tiny_config, monkeypatch, delay):
    """max_staleness = 1, two groups a step: the second chunk of step 0 comes back `delay` versions late."""
    monkeypatch.setattr(pool_module, "WorkerSet", SlowWorkers)
    config = tiny_config(*ASYNC, "trainer.max_staleness=1")
    pool = RolloutPool(config, build_task(config.rollout), weights=None, version=0)
    pool.workers.delays = [0, delay]  # step 0 admits (1 + 1) x 2 groups in two chunks of 2 (prompts 0, 1 and 2, 3)
    trained, lags = set(), []
    for version in range(4):
        pool.workers.trainer_version = version
        batch = pool.next_batch(version)
        trained |= {group.job.index for group in batch.groups}
        lags += batch.lags
    assert max(lags) <= 1
    late = {2, 3}
    if delay == 1:  # one version old at max_staleness = 1: trained
        assert late <= trained and 1 in lags and pool.counters.dropped_stale == 0
    else:  # two versions old: dropped, never trained
        assert not late & trained and pool.counters.dropped_stale == 2


@pytest.mark.slow  # ~9 s on 2 cores
def test_train_async_with_a_worker_killed_mid_run(tiny_config, tmp_path, monkeypatch):
    """`trainer.mode=async` end to end, two workers, interrupted generation; a worker is SIGKILLed after step 2."""
    pools: list[RolloutPool] = []
    original = RolloutPool.__init__

    def capture(self, *args, **kwargs):
        original(self, *args, **kwargs)
        pools.append(self)

    monkeypatch.setattr(pool_module.RolloutPool, "__init__", capture)

    def kill_after_two_steps() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            path = tmp_path / "run" / "metrics.jsonl"
            if path.exists() and len(train_rows(tmp_path / "run")) >= 2:
                os.kill(pools[0].workers[1].process.pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_after_two_steps, daemon=True)
    killer.start()
    config = tiny_config(*ASYNC, "trainer.steps=8", "trainer.rollout_workers=2", "trainer.max_staleness=2",
                         "trainer.on_update=interrupt", "trainer.interrupt_tokens=1", "trainer.eval_prompts=4")
    result = train(config)
    killer.join()
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(8))
    assert all(r["async/lag_max"] <= 2 for r in rows)
    counters = result.counters
    assert counters["restarts"] == 1 and counters["requeued"] == counters["lost_to_crash"]
    assert counters["admitted"] == counters["produced"] + counters["lost_to_crash"] + counters["in_flight"]
    assert counters["produced"] == (counters["trained"] + counters["dropped_stale"] + counters["dropped_failed"]
                                    + counters["pending"])
    assert counters["trained"] + counters["dropped_failed"] == 8 * 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    evaluations = {r["step"]: r["eval/reward_mean"] for r in map(json.loads, lines) if "eval/reward_mean" in r}
    assert summary["async"] == counters and evaluations == {0: result.reward_start, 8: result.reward_end}
    assert (summary["reward_start"], summary["reward_end"]) == (result.reward_start, result.reward_end)


def test_async_trains_the_configured_loss_as_decoupled_ppo(tiny_config):
    algo = tiny_config().algo
    assert algo.loss == "dr_grpo"
    decoupled_algo = decoupled(algo)
    resolved = algo.resolved()
    assert decoupled_algo.loss == "decoupled_ppo"
    assert (decoupled_algo.advantage, decoupled_algo.aggregation, decoupled_algo.entropy_coef) == (
        resolved.advantage, resolved.aggregation, resolved.entropy_coef)
    gspo = tiny_config("algo.loss=gspo").algo
    assert decoupled(gspo) is gspo  # a sequence-level ratio has no decoupled form here


@pytest.mark.parametrize("overrides, message", [
    (["trainer.on_update=never"], r"trainer.on_update='never' is not one of: finish, interrupt"),
    (["trainer.max_staleness=-1"], r"trainer.max_staleness=-1 must be >= 0"),
    (["trainer.rollout_workers=0"], r"trainer.rollout_workers=0 must be > 0"),
])
def test_bad_async_settings_are_clear_errors(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(*overrides)


REWARDS = '''
import os

def broken(prompt, completion, answer):
    raise RuntimeError("reward server down")

def exits(prompt, completion, answer):
    os._exit(3)

def interrupts(prompt, completion, answer):
    raise SystemExit("the reward function called exit()")

def hangs(prompt, completion, answer):
    import time
    time.sleep(3600)
'''


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    """A user's prompts and reward module (the workers import it from the current directory)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "async_test_rewards.py").write_text(REWARDS)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": 2 * a}) + "\n"
                                                 for a in range(5)))
    return lambda name: ["rollout.task=dataset", f"rollout.data_path={tmp_path / 'data.jsonl'}",
                         "rollout.max_new_tokens=3", f"rollout.reward_fn=async_test_rewards:{name}", *ASYNC]


@pytest.mark.slow  # ~9 s on 2 cores
def test_groups_whose_samples_all_failed_are_counted_and_their_steps_skipped(tiny_config, rewards, tmp_path):
    """Groups whose every sample failed are counted and their steps skipped; then the run, none of whose steps
    trained, stops naming why (exit code 3 from the CLI)."""
    with pytest.raises(TrainingStopped, match=r"no step of this run trained: every sample of steps 0-1 was dropped "
                                              r"\(reward_raised: 8\): fix the reward"):
        train(tiny_config(*rewards("broken"), "trainer.steps=2", "trainer.save_final=false"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [row for row in rows if "async/trained" in row][-1]
    assert last["trainer/skipped_steps"] == 2 and sum(row.get("rollout/dropped", 0) for row in rows) == 2 * 2 * 2
    assert last["async/dropped_failed"] == 2 * 2 and last["async/trained"] == 0


@pytest.mark.slow
def test_a_worker_that_keeps_dying_stops_the_run_with_the_reason(tiny_config, rewards):
    with pytest.raises(RuntimeError, match=r"restarted 2 times \(trainer.max_worker_restarts=1\).*exited with code 3"):
        train(tiny_config(*rewards("exits"), "trainer.steps=2", "trainer.max_worker_restarts=1"))
    with pytest.raises(RuntimeError, match=r"restarted 2 times .*made no progress for 2 s"):  # no reward time limit
        train(tiny_config(*rewards("hangs"), "trainer.steps=2", "trainer.max_worker_restarts=1",
                          "trainer.worker_timeout=2", "rollout.reward_timeout=null", name="hangs"))


@pytest.mark.slow
def test_rewards_that_exit_or_hang_are_dropped_samples_in_async_mode(tiny_config, rewards, tmp_path):
    """sys.exit() in a reward, or a reward past rollout.reward_timeout: the sample is dropped with its reason (and a
    run none of whose steps trained stops saying why, with no worker restarted on the way)."""
    for name, reason in (("interrupts", "reward_raised"), ("hangs", "reward_timeout")):
        with pytest.raises(TrainingStopped, match=rf"no step of this run trained: .*\({reason}: 8\)"):
            train(tiny_config(*rewards(name), "trainer.steps=2", "trainer.save_final=false",
                              "rollout.reward_timeout=0.2", name=name))
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert sum(r.get(f"rollout/dropped_{reason}", 0) for r in rows) == 8
        assert rows[-1]["async/restarts"] == 0
        dropped = (tmp_path / name / "dropped.jsonl").read_text()
        assert ("SystemExit: the reward function called exit()" if name == "interrupts" else "did not return") in dropped


@pytest.mark.slow  # ~12 s a case on 2 cores
@pytest.mark.parametrize("when, reason", [
    ("spawned", "has been stopped (SIGSTOP or a debugger) for 2 s"),  # still importing: /proc says it is stopped
    ("pulsing", "showed no sign of life for 2 s"),  # its code runs (no /proc here: the pulse tells)
])
def test_a_stopped_worker_is_flagged_even_before_it_is_ready(tiny_config, caplog, monkeypatch, when, reason):
    """SIGSTOP while the worker starts: it is killed and restarted after worker_timeout, not after the 600 s a
    worker may take to build its model; the other worker samples meanwhile."""
    if when == "pulsing":
        monkeypatch.setattr(worker_set, "process_stopped", lambda pid: False)
    config = tiny_config(*ASYNC, "trainer.rollout_workers=2", "trainer.worker_timeout=2", "rollout.reward_timeout=1")
    model, _ = load_policy(config.model, torch.device("cpu"))
    weights = SharedWeights.of(model, version=0)
    pool = RolloutPool(config, build_task(config.rollout), weights, version=0)
    try:
        deadline = time.monotonic() + 120
        while when == "pulsing" and pool.workers.pulses[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pool.workers[0].process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        version = 0
        while pool.counters.restarts == 0 and time.monotonic() < deadline:
            assert len(pool.next_batch(version).groups) == 2
            version += 1
            weights.publish(model, version)
        flagged = time.monotonic() - stopped
        for _ in range(2):  # the restarted worker and the other one go on
            pool.next_batch(version)
            version += 1
            weights.publish(model, version)
    finally:
        pool.close()
    assert pool.counters.restarts == 1 and flagged < 60
    assert "rollout worker 0" in caplog.text and reason in caplog.text
    pool.counters.check()

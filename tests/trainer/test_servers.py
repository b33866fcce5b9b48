"""The trainer with inference servers (treerl.trainer.core.servers), against a recording stand-in for the client: every
policy version is pushed before its first sample, a resumed run pushes its own weights first, the servers end with
the trained policy, and a server that fails mid-run leaves the last complete step checkpointed and says where."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
import torch
from stub_servers import stub_server, vllm_stub
from support import child_log, read_log, treerl_serve, treerl_serve_process

from treerl.errors import ServerError
from treerl.models import read_weights
from treerl.rollout import Completion, EmbeddedSampler, SamplingParams
from treerl.rollout.sampling.client import Server
from treerl.trainer import train
from treerl.trainer.core import checkpoint
from treerl.trainer.core.build import load_policy
from treerl.trainer.core.config import ConfigError
from treerl.trainer.core.servers import connect_servers
from treerl.trainer.rl import sync


@dataclass
class RecordingServers:
    """A stand-in for `CompletionsClient` on one loopback server: samples with a model of its own, into which each
    push loads the pushed weights, and records the versions pushed; `fail_at` makes its n-th generate call fail."""

    model: object
    servers: list = field(default_factory=lambda: [Server("http://127.0.0.1:1")])
    version: int = 0
    pushes: list = field(default_factory=list)
    calls: int = 0
    fail_at: int | None = None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ServerError("POST http://127.0.0.1:1/inference/v1/generate (rollout.server_type=vllm): no answer "
                              "(connection refused)")
        return EmbeddedSampler(self.model, version=self.version).generate(prompts, params)

    def push_weights(self, path: str, version: int, pause: str = "wait") -> None:
        self.model.load_state_dict(read_weights(path), strict=False)
        self.version = version
        self.pushes.append(version)


@pytest.fixture
def servers(tiny_config, monkeypatch):
    """The stand-in, handed to the synchronous loop in place of the connected client."""
    model, _ = load_policy(tiny_config().model, torch.device("cpu"))
    stand_in = RecordingServers(model)
    monkeypatch.setattr(sync, "connect_servers", lambda config: stand_in)
    return stand_in


def test_each_version_is_pushed_once_before_it_samples_and_a_resumed_run_pushes_first(tiny_config, servers):
    """3 steps: the start's version 0, then 1 and 2 before the steps that sample with them, and 3 at the end; a run
    resumed at step 3 pushes 3 before its first sample (the servers may hold anything after a restart)."""
    train(tiny_config("trainer.steps=3", "trainer.save_every=1"))
    assert servers.pushes == [0, 1, 2, 3]
    servers.pushes.clear()
    servers.version = 0  # a restarted server: the base model again
    train(tiny_config("trainer.steps=4", "trainer.resume=auto"))
    assert servers.pushes == [3, 4]


def test_a_server_failing_mid_run_checkpoints_the_last_complete_step(tiny_config, servers, tmp_path):
    """The 3rd sampling call fails (steps 0 and 1 trained, checkpoints only at the end): the ServerError says the run
    stopped after step 2 and where its checkpoint is, and that checkpoint is whole."""
    servers.fail_at = 3
    with pytest.raises(ServerError, match=r"no answer \(connection refused\); stopped after step 2 of 5; checkpoint "
                                          r"(\S+) \(continue with trainer.resume=auto") as error:
        train(tiny_config("trainer.steps=5"))
    path = checkpoint.checkpoint_dir(tmp_path / "run", 2)
    assert str(path) in str(error.value)
    checkpoint.verify_checkpoint(path)


def test_a_server_failing_before_any_step_trains_writes_nothing(tiny_config, servers, tmp_path):
    servers.fail_at = 1
    with pytest.raises(ServerError, match=r"; nothing was trained$"):
        train(tiny_config("trainer.steps=5"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_async_training_refuses_a_server_that_cannot_say_which_weights_sampled_a_token(tiny_config):
    """vLLM without --enable-scale-out samples through /v1/completions, which does not tag tokens with versions:
    asynchronous training (staleness is counted per token) refuses it before anything is built; synchronous takes it."""
    with stub_server(vllm_stub(["default"], scale_out=False)) as url:
        with pytest.raises(ConfigError, match=r"does not say which weights sampled each token \(its /v1/completions "
                                              r"route\): start vLLM with --enable-scale-out"):
            connect_servers(tiny_config(f"rollout.server_url={url}", "trainer.mode=async"))
        assert connect_servers(tiny_config(f"rollout.server_url={url}")) is not None


def test_a_server_failing_in_a_mid_run_evaluation_leaves_the_finished_step_checkpointed(tiny_config, servers,
                                                                                      tmp_path):
    """trainer.eval_every=1: the evaluation after step 1 fails (calls: the start's evaluation, step 0, its evaluation,
    step 1, its evaluation). The evaluation runs after the step is complete, so the run stopped after 2 steps, and
    its checkpoint is the one a clean 2-step run writes (it was named step 1 and held step 2's weights)."""
    settings = ["trainer.eval_prompts=2", "trainer.eval_every=1"]
    servers.fail_at = 5
    with pytest.raises(ServerError, match=r"stopped after step 2 of 3; checkpoint"):
        train(tiny_config("trainer.steps=3", *settings))
    failed = read_weights(checkpoint.checkpoint_dir(tmp_path / "run", 2))
    clean_servers = RecordingServers(load_policy(tiny_config().model, torch.device("cpu"))[0])
    sync.connect_servers = lambda config: clean_servers  # the fixture's monkeypatch puts it back
    train(tiny_config("trainer.steps=2", *settings, name="clean"))
    clean = read_weights(checkpoint.checkpoint_dir(tmp_path / "clean", 2))
    assert all(torch.equal(failed[k], clean[k]) for k in clean)


@pytest.mark.slow
def test_a_server_killed_during_async_training_stops_the_run_with_one_line_and_a_checkpoint(tmp_path):
    """trainer.mode=async on `treerl serve`, the server killed by PID after two steps: the rollout workers' failed
    requests (or the trainer's next push) reach the trainer as one line naming the server (exit code 4, no traceback), after the last complete
    step is checkpointed whole."""
    out = tmp_path / "run"
    with treerl_serve_process("--seed", "0") as (server, url):
        command = [sys.executable, "-m", "treerl.cli.main", "train", "trainer.mode=async", f"rollout.server_url={url}",
                   "trainer.steps=200", "trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_prompts=0",
                   "rollout.prompts_per_step=2", "rollout.group_size=2", f"trainer.output_dir={out}",
                   "rollout.request_timeout=30"]
        log = child_log()
        trainer = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert trainer.poll() is None, read_log(log)
            assert time.monotonic() < deadline, "the run did not train two steps in 120 s"
            time.sleep(0.1)
        server.kill()
        trainer.wait(timeout=120)
        stderr = read_log(log, None)
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert trainer.returncode == ServerError.exit_code and len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert url in errors[0] and "continue with trainer.resume=auto" in errors[0]  # a worker's request or the push:
    # whichever meets the dead server first
    saved = sorted((out / "checkpoints").iterdir())
    assert saved and all(checkpoint.verify_checkpoint(c) is not None for c in saved)


@pytest.mark.slow
@pytest.mark.parametrize("protocol, error, says", [
    ("sglang", "UserError", r"a prompt shows an image: treerl sends images to vLLM's token-in/token-out route only"),
    ("vllm", "ServerError", r"the server answered without placing the prompt's images \(no mm_placeholders\)"),
])
def test_a_vision_language_run_on_treerl_serve_reaches_the_image_refusal_of_its_protocol(tmp_path, protocol, error,
                                                                                       says):
    """`treerl serve --model-path VL` (a `treerl export --shape tiny-qwen2.5-vl`) loads the run's first push, the very
    checkpoint it serves (its weights in Qwen-VL's layout once failed the name check); then the shapes task's first
    sample meets what each protocol does with images: SGLang's route takes none (refused before the request), the
    look-alike vLLM route answers without placing them (the check of vLLM's expansion stops the run)."""
    from treerl.errors import UserError
    from treerl.trainer.core.config import load_config
    from treerl.trainer.core.export import export_shape

    model = export_shape("tiny-qwen2.5-vl", tmp_path / "vl")
    with treerl_serve("--model-path", str(model), "--protocol", protocol, "--served-model-name", "policy") as url:
        config = load_config("shapes", [
            f"model.path={model}", f"rollout.server_url={url}", "rollout.server_model=policy", "trainer.steps=1",
            "trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_prompts=0", "rollout.prompts_per_step=1",
            "rollout.group_size=2", f"trainer.output_dir={tmp_path / 'run'}"])
        with pytest.raises({"UserError": UserError, "ServerError": ServerError}[error], match=says):
            train(config)

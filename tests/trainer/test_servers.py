"""The trainer with inference servers (treerl.trainer.core.servers), against a recording stand-in for the client: every
policy version is pushed before its first sample, a resumed run pushes its own weights first, the servers end with
the trained policy, and a server that fails mid-run leaves the last complete step checkpointed and says where."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from stub_servers import stub_server, vllm_stub

from treerl.errors import ServerError
from treerl.models import read_weights
from treerl.rollout import Completion, EmbeddedSampler, SamplingParams
from treerl.rollout.client import Server
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

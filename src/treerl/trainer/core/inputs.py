"""The files and directories a run reads and writes: every config key that holds a path, checked in one table when
the run starts, before its output directory is claimed or anything is built.

Before step 1 (docs/architecture.md): the run's paths.

    check_paths(config)     # Run.start: after config.check(), before choose_start

Not part of `Config.check`: a checkpoint's config.yaml is loaded again to export or resume it, long after the data
it trained on may have moved. A path read must exist (treerl reads local files only; a packaged model is named, not
a path); a directory written must be one, or not exist yet under directories this process can write into.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from pathlib import Path

from treerl.gguf_checkpoint import PACKAGED_MODELS
from treerl.trainer.core.config import Config, ConfigError, get

READ = ("model.path", "model.tokenizer_path", "critic.path", "rollout.data_path", "sft.data_path")
WRITTEN = ("trainer.output_dir", "rollout.weights_dir")


def check_paths(config: Config) -> None:
    """Every path of READ exists, every directory of WRITTEN can be one; a ConfigError naming the key."""
    for key in READ:
        value = get(config, key)
        if value is not None and value not in PACKAGED_MODELS and not Path(value).exists():
            raise ConfigError(f"{key}={value!r} does not exist (treerl only reads local files){packaged_hint(value)}")
    for key in WRITTEN:
        if get(config, key) is not None:
            check_writable_dir(Path(get(config, key)), key)


def packaged_hint(value: str) -> str:
    """"; did you mean the packaged model '...'?" where `value` is close to a packaged model's name, else ""."""
    close = difflib.get_close_matches(value.lower(), list(PACKAGED_MODELS), n=1, cutoff=0.6)
    return f"; did you mean the packaged model {close[0]!r}?" if close else ""


def check_writable_dir(path: Path, key: str) -> None:
    """`path` must be (or become) a directory this process can write: not a file, nor under one. Tried by making
    (and removing) a directory in the nearest one that exists: permission bits do not tell root (or a read-only
    file system such as /sys) what a write would do."""
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "is a file" if folder == path else f"is under {str(folder)!r}, a file"
                raise ConfigError(f"{key}={str(path)!r} {where}: it must be a directory (or not exist yet)")
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".treerl-write-check-", dir=folder))
            except OSError as e:
                raise ConfigError(f"{key}={str(path)!r}: cannot write into {str(folder)!r} ({e.strerror or e}); "
                                  f"choose another {key.split('.')[-1]}") from None
            return

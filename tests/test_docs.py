"""Every command and snippet in README.md and docs/*.md runs as written; every link and table holds.

What runs, and how:
- A fenced ```python block runs as it is, in a fresh interpreter, in an empty directory.
- A fenced ```bash block runs command by command (a line ending in `\\` continues; `# ...` comments
  are dropped; `a && b` is two commands), in a fresh directory holding the repository's `configs/`
  and `examples/` (what a user has after cloning, nothing more: a command that reads a file names one
  the repository ships). `treerl ...` runs as `python -m treerl.cli.main ...` from this checkout.
- Shrunk, not changed: commands that train or benchmark get overrides appended, so they run in
  seconds (later overrides win): `treerl train` / `treerl sft` get TRAIN_SHRINK (2 steps, 2 prompts
  of 2 samples, a 2-prompt evaluation), `treerl bench` gets BENCH_SHRINK / BALANCE_SHRINK (every
  workload and engine, on a tiny model and short trees) / ASYNC_SHRINK (one seed) / PRECISION_SHRINK
  (every variant). Everything else runs exactly as written. Commands that shrink to the same run
  (the same options once later ones win, wherever they write: `trainer.output_dir`) run once. They
  run in this interpreter (`run_in_process`: typer's CliRunner, in the fresh directory, one torch
  thread, torch's threads and the environment put back after), which has torch and transformers
  imported already: a fresh `python -m treerl.cli.main` spends ~4 s importing them, a fifth of
  this file's time; processes a command starts (async workers, context-parallel ranks) start as
  they would for a user.
- Checked, not run: `pip install ...` (no network in CI: the extras it names must exist in
  pyproject.toml and a pinned torch must be the installed one) and `python -m pytest` (the suite
  running this test).
- Skipped: a block right after a line `<!-- not run: REASON -->` (a real model path, several
  processes, your own files); the reason is in the doc for readers, and NOT_RUN_LIMIT keeps that
  list short. A command naming `--device cuda` runs only where CUDA is available.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treerl.bench.engines import IMAGE_WORKLOADS
from treerl.bench.precision import VARIANTS as PRECISION_VARIANTS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CONTRIBUTING.md"]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
NOT_RUN_LIMIT = 17  # 14: a verifiers taskset of your own (its venv; the tests run in-memory ones); 15: treerl bench --against trl (minutes a TRL step; tests/bench/test_against_trl.py runs one); 16: the reasoning-gym
# recipe (README: its steps build on each other; tests/cli/test_eval_cmd.py runs them cut short); 17: issue 54's
# long-system-prompt step with engine.head_rows both ways (four ~90 s runs of the real model; tests/trainer/
# test_head_rows_train.py runs the two settings on the tiny model)

TRAIN_SHRINK = ["trainer.steps=2", "trainer.eval_prompts=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                "sft.conversations_per_step=2", "sft.eval_conversations=2", "trainer.progress=false"]
TINY_MODEL = ["--shape", "tiny-qwen3", "--vocab-size", "128"]
# One thread: commands that differ only in --threads (the threads table, the real model's) run once.
BENCH_SHRINK = ["--scale", "0.001", "--repeats", "1", "--no-memory", "--threads", "1", *TINY_MODEL]
BALANCE_SHRINK = ["--balance-scale", "0.02", "--scale", "0.004", *TINY_MODEL]
ASYNC_SHRINK = ["--seeds", "0", *(f"--set={o}" for o in TRAIN_SHRINK)]
PROFILE_SHRINK = ["--workloads", "grpo", "--engines", "flat,dfs", *BENCH_SHRINK]  # the profiler is slow
PRECISION_SHRINK = ["--prompt-tokens", "24", "--response-tokens", "4", "--samples", "2", "--variants",
                    ",".join(PRECISION_VARIANTS), *TINY_MODEL]
ROLLOUT_SHRINK = ["--workloads", "grpo_long_system", "--system-tokens", "32", "--repeats", "1", "--threads", "1",
                  *TINY_MODEL]  # a --model-path given stays: the real model, on the small workload
CP_SHRINK = ["--cp", "2", "--cp-tokens", "256", "--cp-paths", "sharded", "--cp-mixers", "side-by-side", "--no-memory",
             *TINY_MODEL]  # last wins


@dataclasses.dataclass
class Block:
    """One fenced code block of a doc."""

    path: Path
    line: int
    language: str
    text: str
    not_run: str | None  # the reason given in `<!-- not run: ... -->`, or None

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of `path`, each with the not-run reason written just before it (if any)."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, language = i, lines[i][3:].strip()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            reason = NOT_RUN.search(before)
            out.append(Block(path, start + 1, language, "\n".join(lines[start + 1:end]) + "\n",
                             reason.group(1) if reason else None))
            i = end
        i += 1
    return out


ALL_BLOCKS = [b for path in DOCS if path.exists() for b in blocks(path)]
PYTHON = [b for b in ALL_BLOCKS if b.language == "python" and not b.not_run]


def commands(block: Block) -> list[str]:
    """The shell commands of a bash block: continuations joined, comments dropped, `a && b` split."""
    out: list[list[str]] = []
    for line in block.text.replace("\\\n", " ").splitlines():
        out.append([])
        for word in shlex.split(line, comments=True):
            if word == "&&":
                out.append([])
            else:
                out[-1].append(word)
    return [shlex.join(words) for words in out if words]


def _runnable_commands() -> list[tuple[str, str]]:
    """(command, where it is written) for every command of every bash block not marked `not run`, once for each run
    it shrinks to (`same_run`)."""
    seen: dict[tuple, tuple[str, str]] = {}
    for block in ALL_BLOCKS:
        if block.language == "bash" and not block.not_run:
            for command in commands(block):
                words = shlex.split(command)
                key = same_run(shrunk(words)) if words[0] == "treerl" else (command,)
                seen.setdefault(key, (command, str(block)))
    return list(seen.values())


def same_run(words: list[str]) -> tuple:
    """What a shrunk command runs: its positional words in order, then each option and `key=value` override with its
    last value (`--set`, which accumulates, with all of them), and not where it writes (`trainer.output_dir`)."""
    positional, options, sets = [], {}, []
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--"):
            name, _, value = word.partition("=")
            if not value and i + 1 < len(words) and not words[i + 1].startswith("--"):
                value, i = words[i + 1], i + 1
            if name == "--set":
                sets.append(value)
            else:
                options[name] = value
        elif "=" in word:
            key, _, value = word.partition("=")
            if key != "trainer.output_dir":
                options[key] = value
        else:
            positional.append(word)
        i += 1
    return tuple(positional), tuple(sorted(options.items())), tuple(sets)



def environment() -> dict[str, str]:
    """This checkout's package first on the path; one torch thread (the CI machine has 2 cores)."""
    src = str(ROOT / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def user_directory(tmp_path: Path) -> Path:
    """A fresh directory with what a user has next to the commands after cloning: the repository's configs and
    examples."""
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def shrunk(words: list[str]) -> list[str]:
    """A `treerl` command as `python -m treerl.cli.main`, with the overrides that make it run in seconds (the
    arguments after `-m treerl.cli.main` are what `run_in_process` gives the app)."""
    command, rest = words[1] if len(words) > 1 else "", words[1:]
    if command in ("train", "sft"):
        rest = rest + TRAIN_SHRINK
    elif command == "bench":
        shrink = {"--async": ASYNC_SHRINK, "--balance": BALANCE_SHRINK, "--profile": PROFILE_SHRINK,
                  "--precision": PRECISION_SHRINK, "--cp": CP_SHRINK, "--rollout": ROLLOUT_SHRINK}
        options = next((options for flag, options in shrink.items() if flag in rest), BENCH_SHRINK)
        if any(w in " ".join(rest) for w in IMAGE_WORKLOADS):  # images need a vision-language shape: the tiny one
            options = options[: -len(TINY_MODEL)] + ["--shape", "tiny-qwen2.5-vl"] \
                if options[-len(TINY_MODEL) :] == TINY_MODEL else options
        rest = rest + options
    return [sys.executable, "-m", "treerl.cli.main", *rest]


COMMANDS = _runnable_commands()


def check_pip_install(words: list[str]) -> None:
    """`pip install torch==X` must name the installed torch; `-e ".[a,b]"` extras must exist in pyproject.toml; a
    package pinned `NAME==X` (installed `--no-deps`: the real model's) must be installed at X."""
    import importlib.metadata
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for word in words[2:]:
        if word.startswith("torch=="):
            assert torch.__version__.split("+")[0] == word.removeprefix("torch=="), (word, torch.__version__)
        elif match := re.fullmatch(r"\.\[([\w,-]+)\]", word):
            missing = set(match.group(1).split(",")) - set(extras)
            assert not missing, f"pip install {word}: no extra {missing} in pyproject.toml"
        elif match := re.fullmatch(r"([\w-]+)==([\w.]+)", word):
            assert importlib.metadata.version(match.group(1)) == match.group(2), word
        else:
            assert word in ("-e", ".", "--no-deps"), f"pip install {word}: not checked by this test"


def test_not_run_blocks_say_why_and_are_few():
    skipped = [b for b in ALL_BLOCKS if b.not_run]
    assert len(skipped) <= NOT_RUN_LIMIT, [f"{b}: {b.not_run}" for b in skipped]
    assert PYTHON and COMMANDS
    for b in ALL_BLOCKS:
        assert b.language in ("bash", "python", "json", "yaml", ""), f"{b}: a ```{b.language} block: run it here"


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_python_snippet_runs_as_written(block, tmp_path):
    result = subprocess.run([sys.executable, "-c", block.text], check=False, cwd=tmp_path, env=environment(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{block}:\n{result.stdout}\n{result.stderr[-4000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("command, where", COMMANDS, ids=[c for c, _ in COMMANDS])
def test_shell_command_runs(command, where, tmp_path):
    words = shlex.split(command)
    if words[:2] == ["pip", "install"]:
        return check_pip_install(words)
    if words[:3] == ["python", "-m", "pytest"]:
        return  # the suite this test is part of
    assert words[0] == "treerl", f"{where}: `{command}`: only treerl, pip and pytest commands are run here"
    if "cuda" in words and not torch.cuda.is_available():
        pytest.skip(f"{where}: `{command}` names --device cuda; no GPU here")
    result = run_in_process(shrunk(words)[3:], user_directory(tmp_path))
    assert result.returncode == 0, f"{where}: `{command}`:\n{result.stdout[-3000:]}\n{result.stderr[-4000:]}"
    if "--print-config" in words:
        assert result.stdout.startswith("model:\n"), f"{where}: `{command}` printed no config:\n{result.stdout[:500]}"
        return
    positional = tuple(w for w in words[1:] if "=" not in w and not w.startswith("-"))
    for label in PRINTED.get(positional, ()):
        assert label in result.stdout, f"{where}: `{command}` did not print {label!r} (docs/training.md promises it)"


def run_in_process(arguments: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python -m treerl.cli.main ARGUMENTS` run in `cwd` by this interpreter (see the module's docstring): its exit
    code and output; the working directory, environment and torch's threads are put back after."""
    from typer.testing import CliRunner

    from treerl.cli.main import app

    before, threads, environ = Path.cwd(), torch.get_num_threads(), dict(os.environ)
    os.environ.update(environment())  # what the processes it starts see
    torch.set_num_threads(1)
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, arguments)
    finally:
        os.chdir(before)
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
    stderr = result.stderr if result.stderr_bytes is not None else ""
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(arguments, result.exit_code, result.stdout, stderr)


# What the first table of docs/training.md says these commands print.
PRINTED = {
    ("train",): ("mean reward at start:", "mean reward at end:", "training reward: first"),
    ("train", "guess_number"): ("mean reward at start:", "mean reward at end:"),
    ("sft",): ("shared as a tree", "mean loss at start:", "mean loss at end:"),
}


# ---------------------------------------------------------------------------- links, tables, citations
def anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of a markdown file."""
    out = set()
    for line in path.read_text().splitlines():
        if match := re.match(r"#+ (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_every_relative_link_reaches_a_file_and_heading():
    for doc in DOCS:
        if not doc.exists():
            continue
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            assert path.exists(), f"{doc.relative_to(ROOT)}: link to {target}: no such file"
            if anchor:
                assert anchor in anchors(path), f"{doc.relative_to(ROOT)}: link to {target}: no such heading"


def test_every_table_row_has_the_headers_cells():
    """A cell value with a newline or an unescaped `|` breaks a markdown table (docs/config.md is generated)."""
    for doc in DOCS:
        if not doc.exists():
            continue
        width = None
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if not line.startswith("|"):
                width = None
                continue
            cells = len(re.split(r"(?<!\\)\|", line.strip())) - 2
            if width is None:
                width = cells
            assert cells == width and line.rstrip().endswith("|"), f"{doc.relative_to(ROOT)}:{number}: {line[:80]}"


# Written by treerl itself (bench outputs, tests/zoo.py's table), not documents to read.
OUTPUT_FILES = {"bench.md", "balance.md", "async_compare.md", "precision.md", "profile.md", "table.md", "weight_push.md",
                "context_parallel.md", "against_trl.md", "rollout.md"}


def test_every_cited_document_exists():
    """Source, tests and docs name .md files (docs/design.md, "see training.md"): each must be in the repository."""
    files = [*DOCS, *(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "src").rglob("*.yaml")]
    for path in files:
        if not path.exists() or path == Path(__file__).resolve():
            continue
        where = str(path.relative_to(ROOT))
        for name in set(re.findall(r"[\w./-]*\w\.md\b", path.read_text())):
            if Path(name).name in OUTPUT_FILES:
                continue
            candidates = [ROOT / name, ROOT / "docs" / name, path.parent / name]
            assert any(c.exists() for c in candidates), f"{where} cites {name}, which is not in the repository"


def test_algo_defaults_differ_from_treerl_trains_only_where_algorithms_md_says():
    from treerl.algo import AlgoConfig
    from treerl.trainer.core.config import Config

    library, demo = dataclasses.asdict(AlgoConfig()), dataclasses.asdict(Config().algo)
    differing = {key for key in library if library[key] != demo[key]}
    text = (ROOT / "docs" / "algorithms.md").read_text()
    said = set(re.findall(r"`algo\.(\w+)=[^`]+`", text.split("## `AlgoConfig` keys")[1].split("| key |")[0]))
    assert differing == said, f"AlgoConfig() and treerl train differ in {differing}; algorithms.md names {said}"

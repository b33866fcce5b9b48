#!/usr/bin/env bash
# Build, once, a virtual environment holding verifiers 0.4.0, apart from treerl's own environment, and print the
# path of its python. verifiers 0.4 pins openai<3 and mcp==2.0.0 (treerl's agents extra allows openai 3, the
# openenv distribution pins mcp<2), so it runs in a venv of its own beside the trainer, as prime-rl runs it:
# `rollout.env=verifiers:ID` starts src/treerl/rollout/environments/verifiers_worker.py with this venv's python
# (docs/environments.md, "verifiers"), and tests/rollout/environments/test_verifiers_env.py runs against it.
#
#   tools/verifiers-venv.sh            # ~/.cache/treerl/verifiers-0.4.0 (or $TREERL_VERIFIERS_VENV)
#   tools/verifiers-venv.sh DIR        # that directory
#
# Besides verifiers, the venv gets uv from PyPI (verifiers installs its harness programs with `uv sync --script`;
# without uv on the PATH it would download uv's installer from astral.sh), and the `null` chat program's own
# environment is prepared once here and locked (`uv lock --script`: verifiers' `uv sync --script`, run once per
# worker process, then resolves from the lock, offline), so an episode downloads nothing. The script and its lock
# live in verifiers' cache (~/.cache/verifiers): without them a worker prepares the program again, from PyPI.
# A finished venv holds the file .treerl-complete with this script's REVISION; one without it is built again.
# Two calls at once (CI starts one in the background, a test may call it meanwhile) take turns on a lock file.
set -euo pipefail

VERIFIERS_VERSION=0.4.0
UV_VERSION=0.13.9
REVISION=2  # 2: the chat program's lock file (an episode's uv sync then needs no index)
venv="${1:-${TREERL_VERIFIERS_VENV:-$HOME/.cache/treerl/verifiers-$VERIFIERS_VERSION}}"

source "$(dirname "$0")/venv-once.sh"
venv_once "$venv" "$REVISION"  # prints the python and exits if built already
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "verifiers==$VERIFIERS_VERSION" "uv==$UV_VERSION"

# The null harness's chat program (a PEP 723 script): its environment, built now by verifiers' own code.
PATH="$venv/bin:$PATH" UV_PYTHON_DOWNLOADS=never "$venv/bin/python" - <<'PY'
import asyncio

from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime


async def prepare() -> None:
    runtime = SubprocessRuntime(SubprocessConfig())
    await runtime.start()
    try:
        script = (await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE))[-1]
        locked = await runtime.run(["uv", "lock", "--script", script, "-q", "--no-config"], {})
        if locked.exit_code:
            raise RuntimeError(f"uv lock --script {script}: {locked.stderr}")
    finally:
        await runtime.teardown()


asyncio.run(prepare())
PY
venv_done

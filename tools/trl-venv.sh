#!/usr/bin/env bash
# Build, once, a virtual environment holding TRL 1.16 (GRPOTrainer), apart from treerl's own environment, and print
# the path of its python. `treerl bench --against trl` trains the same model on the same prompts with TRL's
# GRPOTrainer in this venv (src/treerl/bench/trl_runner.py, run by its python) and with `treerl train` in treerl's
# own, one after the other (docs/benchmarks.md, "Against TRL"); tests/bench/test_against_trl.py runs one step of each.
# TRL lives apart so that its pins (accelerate, datasets ...) never move treerl's environment.
#
#   tools/trl-venv.sh            # ~/.cache/treerl/trl-1.16 (or $TREERL_TRL_VENV)
#   tools/trl-venv.sh DIR        # that directory
#
# torch's CPU build goes in first (pip finds the local CPU wheel where the machine has one, as for treerl's own
# environment), then TRL with the transformers treerl is tested with, so the two trainers run the same model code.
# Nothing downloads at run time: the runner is started with HF_HUB_OFFLINE=1 and loads a local checkpoint.
# A finished venv holds the file .treerl-complete with this script's REVISION; one without it is built again.
# Two calls at once (CI starts one in the background, a test's fixture may call it meanwhile) take turns on a lock.
set -euo pipefail

TRL_VERSION=1.16.0
TORCH_VERSION=2.13.0
TRANSFORMERS_VERSION=5.24.0
REVISION=1
venv="${1:-${TREERL_TRL_VENV:-$HOME/.cache/treerl/trl-1.16}}"

source "$(dirname "$0")/venv-once.sh"
venv_once "$venv" "$REVISION"  # prints the python and exits if built already
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" "torch==$TORCH_VERSION"
"${pip[@]}" "trl==$TRL_VERSION" "transformers==$TRANSFORMERS_VERSION" "torch==$TORCH_VERSION" jmespath
HF_HUB_OFFLINE=1 "$venv/bin/python" -c "import trl, transformers, torch; assert trl.__version__ == '$TRL_VERSION', \
trl.__version__; assert transformers.__version__ == '$TRANSFORMERS_VERSION'; assert torch.__version__.startswith('$TORCH_VERSION')"
venv_done

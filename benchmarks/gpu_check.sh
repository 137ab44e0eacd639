#!/usr/bin/env bash
# One-command GPU check for a single NVIDIA GPU with nothing reachable from it.
#
#   bash benchmarks/gpu_check.sh [--wheels DIR] [--out FILE]
#
# Runs every test marked `gpu` (tests that need CUDA: the engine on CUDA against HF
# transformers, Transformer Engine against local layers, offload/onload, CUDA IPC and
# NCCL weight sync) plus the quick CPU tests that pin megatron-core's API (layer-spec
# names, engine imports), then writes the results as JSON (default gpu_check.json),
# prints which tests ran and which were skipped and why, and exits non-zero on any
# failure, or when CUDA is missing. It finishes in a few minutes (pytest is stopped
# after 330 s).
#
# The machine needs Python 3.12 and torch with CUDA (its image has torch, transformers,
# triton, safetensors and pytest). megatron-core and the small packages megarl imports
# travel as wheels in DIR (default: ./gpu_wheels); build DIR where a package index is
# reachable, with any local Python: the wheels are chosen for the GPU machine's
# (CPython 3.12, x86_64 manylinux2014 or manylinux_2_28; GPU_PYTHON=3.x picks another version):
#
#   bash benchmarks/gpu_check.sh --download gpu_wheels      # ~12 MB, no torch
#
# ray, sglang and transformer-engine cannot travel (too large): the tests that need
# them are skipped, and the JSON and the summary say which and why (NCCL also needs
# a second GPU: it refuses two ranks of one communicator on one GPU).
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=gpu_wheels
OUT=gpu_check.json
# Imported by megarl's engines, config and CPU engine, absent from a bare torch image.
# megatron-core installs without its declared deps (torch, numpy, packaging: in the image).
PACKAGES="pydantic pyyaml fastapi uvicorn aiohttp psutil"
GPU_TESTS="tests/test_gpu_engine.py tests/test_gpu_lora.py tests/test_gpu_weightsync.py tests/test_engine_offload.py"
API_TESTS="tests/test_sharded_loading.py tests/test_engine_protocol.py"

while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --download)
            # For the GPU machine's Python, not this one's: megatron-core >= 0.17 needs 3.12, and
            # compiled wheels (pydantic-core, pyyaml, aiohttp) are built per Python version.
            # megatron-core's wheels are tagged manylinux_2_28 only: with manylinux2014 alone pip
            # silently falls back to megatron-core 0.3.0 (2023, pure Python), hence the second
            # platform (torch's CUDA wheels need glibc 2.28 too) and the version floor.
            target="--python-version ${GPU_PYTHON:-3.12} --platform manylinux2014_x86_64"
            target="$target --platform manylinux_2_28_x86_64 --only-binary=:all:"
            python3 -m pip download --dest "$2" --no-deps $target "megatron-core>=0.16" || exit 1
            python3 -m pip download --dest "$2" $target $PACKAGES || exit 1
            echo "wheels for CPython ${GPU_PYTHON:-3.12} (x86_64 manylinux) in $2: carry the dir along"
            exit 0 ;;
        *) echo "usage: $0 [--wheels DIR] [--out FILE] | --download DIR" >&2; exit 2 ;;
    esac
done

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch does not see a CUDA device" >&2
    exit 1
fi
missing=$(python3 - <<'EOF'
import importlib.util
modules = {"megatron.core": "megatron-core", "pydantic": "pydantic", "yaml": "pyyaml", "fastapi": "fastapi",
           "uvicorn": "uvicorn", "aiohttp": "aiohttp", "psutil": "psutil"}
print(" ".join(p for m, p in modules.items() if importlib.util.find_spec(m.split(".")[0]) is None
               or (m == "megatron.core" and importlib.util.find_spec(m) is None)))
EOF
)
if [ -n "$missing" ]; then
    if [ ! -d "$WHEELS" ]; then
        echo "gpu_check: missing $missing and no wheel dir $WHEELS (see --download)" >&2
        exit 1
    fi
    for package in $missing; do
        flags=""
        [ "$package" = megatron-core ] && flags="--no-deps"
        python3 -m pip install --quiet --no-index --find-links "$WHEELS" $flags "$package" || exit 1
    done
fi

export PYTHONPATH=$PWD OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
timeout 330 python3 -m pytest $API_TESTS $GPU_TESTS -p no:cacheprovider -rA \
    -m "gpu or not (dist or slow or e2e)" --junitxml="$work/junit.xml" | tee "$work/pytest.log"
rc=${PIPESTATUS[0]}
python3 benchmarks/gpu_report.py "$work/junit.xml" "$OUT" "$rc" "$(( $(date +%s) - start ))"
